"""A small Hub-compatible HTTP server on 127.0.0.1, storing repos on disk (test infrastructure).

It speaks the subset of the Hugging Face Hub API that huggingface_hub 1.33 calls to
create a model repo, commit a folder (preupload, LFS batch + basic PUT, NDJSON commit),
tag it, list it and download it back. Storage is content-addressed and every write is
atomic (temp + rename), so a server killed with SIGKILL mid-upload restarts on the same
directory with no half-written object visible; stale temp files are removed at start.

    python -m tests.hubserver --root DIR --port N [--token-env VAR] [--slow-put S] [--trace FILE] [--die-on TEXT]

In-process: `srv = HubServer(root).start(); srv.url; srv.stop()`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import os
import re
import signal
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from pipeline.core.io import TMP_PREFIX, atomic_write_bytes, atomic_write_json, dumps_json

_REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".png", ".jpg", ".npz", ".npy", ".gguf", ".h5")
_LFS_MIN_BYTES = 10 * 1024 * 1024  # the Hub stores files above 10 MB in LFS whatever their name
_CHUNK = 64 * 1024


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra or {}


class Store:
    """Repos, commits and objects under one directory. Refs change only under `lock`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        for sub in ("repos", "commits", "lfs", "blobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        for p in self.root.rglob(TMP_PREFIX + "*"):  # half-written uploads of a killed server
            with contextlib.suppress(OSError):
                p.unlink()

    # -- repos and refs
    def _repo_file(self, repo_id: str) -> Path:
        """The one place a repo id becomes a path: anything but `<owner>/<name>` is "not found" on every route
        (never a path outside the storage root, and no 400-vs-404 hint that some file exists)."""
        if not _REPO_ID.match(repo_id) or ".." in repo_id:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return self.root / "repos" / f"{repo_id}.json"

    def repo(self, repo_id: str) -> dict:
        p = self._repo_file(repo_id)
        if not p.is_file():
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return json.loads(p.read_text())

    def create_repo(self, repo_id: str, private: bool) -> bool:
        with self.lock:
            if self._repo_file(repo_id).is_file():
                return False
            initial = self._write_commit(repo_id, None, {}, "initial commit", "")
            atomic_write_json(self._repo_file(repo_id), {"id": repo_id, "private": private,
                                                          "branches": {"main": initial}, "tags": {}})
            return True

    def resolve(self, repo_id: str, rev: str) -> str:
        meta = self.repo(repo_id)
        if rev in meta["branches"]:
            return meta["branches"][rev]
        if rev in meta["tags"]:
            return meta["tags"][rev]
        if _HEX40.match(rev) and (self.root / "commits" / f"{rev}.json").is_file():
            if self.commit(rev).get("repo") == repo_id:
                return rev
        raise HubError(404, f"Revision {rev} not found in {repo_id}", "RevisionNotFound")

    def commit(self, oid: str) -> dict:
        return json.loads((self.root / "commits" / f"{oid}.json").read_text())

    def _write_commit(self, repo_id, parent, files, summary, description) -> str:
        body = {"repo": repo_id, "parent": parent, "files": files, "summary": summary,
                "description": description}
        oid = hashlib.sha1(dumps_json(body).encode()).hexdigest()
        path = self.root / "commits" / f"{oid}.json"
        if not path.is_file():
            atomic_write_json(path, {**body, "date": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())})
        return oid

    def apply_commit(self, repo_id: str, branch: str, lines: list[dict]) -> str:
        header = next((ln["value"] for ln in lines if ln.get("key") == "header"), None)
        if header is None:
            raise HubError(400, "commit payload has no header line")
        with self.lock:
            meta = self.repo(repo_id)
            if branch not in meta["branches"]:
                raise HubError(404, f"Branch {branch} not found in {repo_id}", "RevisionNotFound")
            head = meta["branches"][branch]
            parent = header.get("parentCommit")
            if parent is not None and parent != head:
                raise HubError(412, f"parentCommit {parent} is not the head of {branch} ({head}); "
                                    "someone pushed in between")
            files = dict(self.commit(head)["files"])
            for ln in lines:
                self._apply_line(files, ln)
            oid = self._write_commit(repo_id, head, files, header.get("summary", ""), header.get("description", ""))
            meta["branches"][branch] = oid
            atomic_write_json(self._repo_file(repo_id), meta)  # the ref moves only after the commit is on disk
            return oid

    def _apply_line(self, files: dict, ln: dict) -> None:
        key, val = ln.get("key"), ln.get("value") or {}
        path = val.get("path", "")
        if key in ("file", "lfsFile", "deletedFile", "deletedFolder"):
            if not path or path.startswith("/") or ".." in path.split("/") or "\\" in path:
                raise HubError(400, f"invalid path {path!r}")
        if key == "file":
            data = base64.b64decode(val["content"]) if val.get("encoding") == "base64" else val["content"].encode()
            oid = git_blob_oid(data)
            blob = self.root / "blobs" / oid
            if not blob.is_file():
                atomic_write_bytes(blob, data)
            files[path] = {"lfs": False, "oid": oid, "size": len(data)}
        elif key == "lfsFile":
            sha = val.get("oid", "")
            obj = self.root / "lfs" / sha
            if not _HEX64.match(sha) or not obj.is_file():
                raise HubError(422, f"LFS object {sha} for {path} was never uploaded")
            files[path] = {"lfs": True, "oid": sha, "size": obj.stat().st_size}
        elif key == "deletedFile":
            if path not in files:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            del files[path]
        elif key == "deletedFolder":
            for p in [p for p in files if p.startswith(path.rstrip("/") + "/")]:
                del files[p]
        elif key != "header":
            raise HubError(400, f"unsupported commit operation {key!r}")

    def set_tag(self, repo_id: str, tag: str, oid: str) -> None:
        with self.lock:
            meta = self.repo(repo_id)
            if tag in meta["tags"] or tag in meta["branches"]:
                raise HubError(409, f"Tag {tag} already exists")
            meta["tags"][tag] = oid
            atomic_write_json(self._repo_file(repo_id), meta)

    # -- objects
    def entry_oid(self, entry: dict) -> str:
        """The git blob id of the file as git stores it (the pointer, for LFS files)."""
        return git_blob_oid(lfs_pointer(entry["oid"], entry["size"])) if entry["lfs"] else entry["oid"]

    def object_path(self, entry: dict) -> Path:
        return self.root / ("lfs" if entry["lfs"] else "blobs") / entry["oid"]

    def receive_lfs(self, sha: str, size: int, rfile, length: int | None, chunked: bool, slow: float) -> None:
        dest = self.root / "lfs" / sha
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=dest.parent)
        h, n = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in _body_chunks(rfile, length, chunked):
                    fh.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
                    if slow:  # test hook: widen the window in which a kill lands mid-upload
                        fh.flush()
                        time.sleep(slow)
                fh.flush()
                os.fsync(fh.fileno())
            if h.hexdigest() != sha or n != size:
                raise HubError(400, f"uploaded content does not match oid {sha} / size {size} "
                                    f"(got {h.hexdigest()} / {n} bytes)")
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _body_chunks(rfile, length: int | None, chunked: bool):
    if chunked:
        while True:
            size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return
            left = size
            while left:
                data = rfile.read(min(left, _CHUNK))
                if not data:
                    raise HubError(400, "request body ended early")
                left -= len(data)
                yield data
            rfile.readline()
    else:
        left = length or 0
        while left:
            data = rfile.read(min(left, _CHUNK))
            if not data:
                raise HubError(400, "request body ended early")
            left -= len(data)
            yield data


def _front_matter_errors(content: str) -> list[str]:
    """Like the Hub's `POST /api/validate-yaml` for a model card: no front matter is valid; one that is there
    must parse as a YAML mapping whose Hub keys have the Hub's types (`base_model` a repo id or a list of
    them, `base_model_relation` one of adapter / merge / quantized / finetune and only with a base_model,
    `license` / `library_name` / `pipeline_tag` strings, `tags` a list of strings)."""
    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
    if not m:
        if re.match(r"^---\s*\n", content) and not re.match(r"^---\s*\n---\s*(\n|$)", content):
            return ["the metadata block opened by `---` is never closed by a `---` line"]
        return []
    try:
        meta = yaml.safe_load(m.group(1))
    except yaml.YAMLError as exc:
        return [f"invalid YAML: {exc}"]
    if meta is None:
        return []
    if not isinstance(meta, dict):
        return ["metadata must be a YAML mapping"]
    errors = []
    for key in ("license", "library_name", "pipeline_tag", "base_model_relation"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    if "tags" in meta and not (isinstance(meta["tags"], list) and all(isinstance(t, str) for t in meta["tags"])):
        errors.append('"tags" must be a list of strings')
    bases = meta.get("base_model", [])
    for b in [bases] if isinstance(bases, str) else bases if isinstance(bases, list) else [None]:
        if not (isinstance(b, str) and _REPO_ID.match(b)):
            errors.append(f'"base_model" must be Hub repo ids, got {b!r}')
    if meta.get("base_model_relation") not in (None, "adapter", "merge", "quantized", "finetune"):
        errors.append('"base_model_relation" must be one of adapter, merge, quantized, finetune')
    if "base_model_relation" in meta and not meta.get("base_model"):
        errors.append('"base_model_relation" needs a "base_model"')
    return errors


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, fmt, *args):  # request lines only (never headers, so never a token)
        if self.server.verbose:
            super().log_message(fmt, *args)

    # -- plumbing
    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json", headers: dict | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _body(self) -> bytes:
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        length = int(self.headers.get("Content-Length") or 0)
        return b"".join(_body_chunks(self.rfile, length, chunked))

    def _require_token(self) -> None:
        auth = self.headers.get("Authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not token or (self.server.token is not None and token != self.server.token):
            raise HubError(401, "Invalid credentials in Authorization header")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if self.server.trace:
            with open(self.server.trace, "a") as fh:
                fh.write(f"{method} {url.path}\n")
        if self.server.die_on and self.server.die_on in f"{method} {url.path}":
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die exactly here, like a crashed host
        try:
            try:
                self._route(method, parts, query)
            except (ValueError, KeyError, TypeError) as exc:  # malformed request bodies
                raise HubError(400, f"malformed request: {exc}") from None
        except HubError as exc:
            headers = {"X-Error-Message": str(exc)[:200]}
            if exc.code:
                headers["X-Error-Code"] = exc.code
            if method in ("PUT", "POST"):  # the request body may be unread: say so, then drop the connection
                headers["Connection"] = "close"
                self.close_connection = True
            if method == "HEAD":
                self._send(exc.status, headers=headers, head=True)
            else:
                self._json(exc.status, {"error": str(exc), **exc.extra}, headers)

    do_GET = lambda self: self._dispatch("GET")  # noqa: E731
    do_HEAD = lambda self: self._dispatch("HEAD")  # noqa: E731
    do_POST = lambda self: self._dispatch("POST")  # noqa: E731
    do_PUT = lambda self: self._dispatch("PUT")  # noqa: E731

    # -- routes
    def _route(self, method: str, p: list[str], q: dict) -> None:
        store = self.server.store
        if method == "POST" and p[:3] == ["api", "repos", "create"]:
            return self._create_repo()
        if method == "POST" and p[:2] == ["api", "validate-yaml"]:
            errors = _front_matter_errors(json.loads(self._body() or b"{}").get("content", ""))
            return self._json(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": []})
        if len(p) >= 4 and p[0] == "api" and p[1] == "models":
            repo_id = f"{p[2]}/{p[3]}"
            return self._api_model(method, repo_id, p[4:], q)
        if method == "POST" and len(p) >= 2 and p[1].endswith(".git") and p[2:] == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(f"{p[0]}/{p[1][:-4]}")
        if method == "PUT" and len(p) == 4 and p[0] == "lfs-upload":
            # like a presigned S3 URL: the client sends no Authorization here, the href carries a signature
            if q.get("sig") != self.server.sign(f"{p[1]}/{p[2]}", p[3], q.get("size", "")):
                raise HubError(403, "upload URL signature does not match")
            store.repo(f"{p[1]}/{p[2]}")
            chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
            store.receive_lfs(p[3], int(q.get("size", -1)), self.rfile, int(self.headers.get("Content-Length") or 0),
                              chunked, self.server.slow_put)
            return self._send(200)
        if method in ("GET", "HEAD") and len(p) >= 5 and p[2] == "resolve":
            return self._resolve(method, f"{p[0]}/{p[1]}", p[3], "/".join(p[4:]))
        raise HubError(404, f"no route for {method} /{'/'.join(p)}")

    def _create_repo(self) -> None:
        self._require_token()
        body = json.loads(self._body() or b"{}")
        if body.get("type") not in (None, "model"):
            raise HubError(400, "this server stores model repos only")
        repo_id = f"{body.get('organization')}/{body.get('name')}"
        if not _REPO_ID.match(repo_id):
            raise HubError(400, f"invalid repo id {repo_id!r}")
        url = f"{self.server.url}/{repo_id}"
        if not self.server.store.create_repo(repo_id, body.get("visibility") == "private"):
            raise HubError(409, "You already created this model repo", extra={"url": url})
        self._json(200, {"url": url, "name": repo_id})

    def _api_model(self, method: str, repo_id: str, rest: list[str], q: dict) -> None:
        store = self.server.store
        op = rest[0] if rest else ""
        if method == "GET" and op in ("", "revision"):
            oid = store.resolve(repo_id, rest[1] if op else "main")
            files = store.commit(oid)["files"]
            siblings = [{"rfilename": path} for path in sorted(files)]
            meta = store.repo(repo_id)
            return self._json(200, {"id": repo_id, "author": repo_id.split("/")[0], "sha": oid,
                                    "private": meta["private"], "siblings": siblings, "tags": []})
        if method == "GET" and op == "refs":
            meta = store.repo(repo_id)

            def refs(kind, d):
                return [{"name": k, "ref": f"refs/{kind}/{k}", "targetCommit": v} for k, v in sorted(d.items())]
            return self._json(200, {"branches": refs("heads", meta["branches"]), "tags": refs("tags", meta["tags"]),
                                    "converts": []})
        if method == "GET" and op == "tree" and len(rest) >= 2:
            return self._json(200, self._tree(repo_id, rest[1], "/".join(rest[2:]),
                                              q.get("recursive", "false").lower() == "true"))
        if method == "POST" and op == "preupload" and len(rest) == 2:
            self._require_token()
            files = store.commit(store.resolve(repo_id, rest[1]))["files"]
            out = []
            for f in json.loads(self._body())["files"]:
                sample = base64.b64decode(f.get("sample", ""))
                lfs = f["path"].endswith(_LFS_SUFFIXES) or f["size"] >= _LFS_MIN_BYTES or b"\0" in sample
                remote = files.get(f["path"])
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": remote["oid"] if remote else None})
            return self._json(200, {"files": out, "commitOid": store.resolve(repo_id, rest[1])})
        if method == "POST" and op == "commit" and len(rest) == 2:
            self._require_token()
            lines = [json.loads(ln) for ln in self._body().splitlines() if ln.strip()]
            oid = store.apply_commit(repo_id, rest[1], lines)
            return self._json(200, {"success": True, "commitOid": oid, "pullRequestUrl": None,
                                    "commitUrl": f"{self.server.url}/{repo_id}/commit/{oid}"})
        if method == "POST" and op == "tag" and len(rest) == 2:
            self._require_token()
            body = json.loads(self._body())
            store.set_tag(repo_id, body["tag"], store.resolve(repo_id, rest[1]))
            return self._json(200, {})
        raise HubError(404, f"no route for {method} /api/models/{repo_id}/{'/'.join(rest)}")

    def _tree(self, repo_id: str, rev: str, under: str, recursive: bool) -> list[dict]:
        store = self.server.store
        files = store.commit(store.resolve(repo_id, rev))["files"]
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        out: dict[str, dict] = {}
        for path, entry in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix):].split("/")
            for depth in range(1, len(rel)):  # folders on the way
                folder = prefix + "/".join(rel[:depth])
                if recursive or depth == 1:
                    out.setdefault(folder, {"type": "directory", "path": folder, "size": 0,
                                            "oid": hashlib.sha1(folder.encode()).hexdigest()})
            if recursive or len(rel) == 1:
                item = {"type": "file", "path": path, "size": entry["size"], "oid": store.entry_oid(entry)}
                if entry["lfs"]:
                    item["lfs"] = {"oid": entry["oid"], "size": entry["size"],
                                   "pointerSize": len(lfs_pointer(entry["oid"], entry["size"]))}
                out[path] = item
        if prefix and not out:
            raise HubError(404, f"{under} not found at {rev}", "EntryNotFound")
        return [out[k] for k in sorted(out)]

    def _lfs_batch(self, repo_id: str) -> None:
        self._require_token()
        self.server.store.repo(repo_id)
        body = json.loads(self._body())
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj.get("oid", ""), obj.get("size")
            if not _HEX64.match(oid) or not isinstance(size, int) or size < 0:
                objects.append({"oid": str(oid), "size": int(size or 0),
                                "error": {"code": 422, "message": "invalid oid or size"}})
                continue
            item = {"oid": oid, "size": size, "authenticated": True}
            if not (self.server.store.root / "lfs" / oid).is_file():  # present objects get no actions
                sig = self.server.sign(repo_id, oid, str(size))
                href = f"{self.server.url}/lfs-upload/{repo_id}/{oid}?size={size}&sig={sig}"
                item["actions"] = {"upload": {"href": href, "header": {}}}
            objects.append(item)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   ctype="application/vnd.git-lfs+json")

    def _resolve(self, method: str, repo_id: str, rev: str, path: str) -> None:
        store = self.server.store
        oid = store.resolve(repo_id, rev)
        entry = store.commit(oid)["files"].get(path)
        if entry is None:
            raise HubError(404, f"{path} not found at {rev}", "EntryNotFound", extra={})
        data = b"" if method == "HEAD" else store.object_path(entry).read_bytes()
        etag = f'"{entry["oid"]}"'
        headers = {"X-Repo-Commit": oid, "ETag": etag, "Accept-Ranges": "bytes"}
        if entry["lfs"]:
            headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(entry["size"])})
        start = 0
        m = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
        if m and method == "GET":
            start = int(m.group(1))
            headers["Content-Range"] = f"bytes {start}-{entry['size'] - 1}/{entry['size']}"
        if method == "HEAD":
            self.send_response(200)
            self.send_header("Content-Length", str(entry["size"]))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            return
        self._send(206 if start else 200, data[start:], ctype="application/octet-stream", headers=headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    _secret = os.urandom(16)

    def sign(self, repo_id: str, oid: str, size: str) -> str:
        return hmac.new(self._secret, f"{repo_id}/{oid}/{size}".encode(), "sha256").hexdigest()[:32]


class HubServer:
    """Start in a thread for tests: `with HubServer(root) as srv: ... srv.url`."""

    def __init__(self, root: str | os.PathLike, port: int = 0, token: str | None = None, slow_put: float = 0.0,
                 trace: str | None = None, verbose: bool = False, die_on: str | None = None):
        self.httpd = _Server(("127.0.0.1", port), _Handler)
        self.httpd.store = Store(root)
        self.httpd.token, self.httpd.slow_put, self.httpd.trace = token, slow_put, trace
        self.httpd.verbose, self.httpd.die_on = verbose, die_on
        self.port = self.httpd.server_address[1]
        self.url = self.httpd.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hubserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.hubserver", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="storage directory (created if missing)")
    ap.add_argument("--port", type=int, default=0, help="0 = any free port (printed at start)")
    ap.add_argument("--token-env", default=None, help="accept only the token in this env var (default: any token)")
    ap.add_argument("--slow-put", type=float, default=0.0, help="seconds to sleep per 64 KiB of an LFS upload")
    ap.add_argument("--trace", default=None, help="append 'METHOD path' of each request to this file")
    ap.add_argument("--die-on", default=None, help="SIGKILL this process on the first request whose "
                    "'METHOD path' contains this text (fault injection)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    token = os.environ.get(args.token_env) if args.token_env else None
    srv = HubServer(args.root, args.port, token, args.slow_put, args.trace, args.verbose, args.die_on)
    print(f"hubserver listening on {srv.url} (storage {Path(args.root).resolve()})", flush=True)
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
