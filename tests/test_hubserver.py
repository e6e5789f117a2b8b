"""tests.hubserver speaks enough of the Hub API for huggingface_hub's real client (LFS, no Xet)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipeline.provenance.hub_push import hub_online
from tests.hubserver import HubServer

TOKEN = "hf_servertest_token_0123456789"


def git_blob(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@pytest.fixture
def srv(tmp_path):
    with HubServer(tmp_path / "store") as s, hub_online():
        yield s


@pytest.fixture
def api(srv):
    from huggingface_hub import HfApi

    return HfApi(endpoint=srv.url, token=TOKEN)


def _folder(root: Path) -> Path:
    root.mkdir()
    (root / "model.safetensors").write_bytes(os.urandom(200_000))
    (root / "README.md").write_text("---\nlicense: apache-2.0\ntags: [dflash]\n---\n# hi\n")
    (root / "sub").mkdir()
    (root / "sub" / "a.json").write_text('{"a": 1}\n')
    return root


def test_client_roundtrip_commit_tag_tree_download(api, srv, tmp_path):
    from huggingface_hub import CommitOperationAdd, snapshot_download

    src = _folder(tmp_path / "src")
    url = api.create_repo("me/model", token=TOKEN)
    assert url.endswith("/me/model")
    assert api.create_repo("me/model", token=TOKEN, exist_ok=True).endswith("/me/model")  # 409 + url
    ops = [CommitOperationAdd(p.relative_to(src).as_posix(), str(p)) for p in sorted(src.rglob("*")) if p.is_file()]
    c1 = api.create_commit("me/model", ops, commit_message="first", token=TOKEN).oid
    api.create_tag("me/model", tag="v1", revision=c1, token=TOKEN)
    assert [t.name for t in api.list_repo_refs("me/model", token=TOKEN).tags] == ["v1"]
    assert api.repo_info("me/model", revision="v1", token=TOKEN).sha == c1

    tree = {f.path: f for f in api.list_repo_tree("me/model", recursive=True, revision=c1, token=TOKEN)}
    weights = (src / "model.safetensors").read_bytes()
    assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256(weights).hexdigest()
    assert tree["model.safetensors"].lfs.size == len(weights)
    assert tree["README.md"].lfs is None and tree["README.md"].blob_id == git_blob((src / "README.md").read_bytes())
    assert "sub" in tree and "sub/a.json" in tree
    top = [f.path for f in api.list_repo_tree("me/model", revision=c1, token=TOKEN)]
    assert top == ["README.md", "model.safetensors", "sub"]

    got = Path(snapshot_download("me/model", revision="v1", endpoint=srv.url, token=TOKEN, cache_dir=tmp_path / "c"))
    for p in src.rglob("*"):
        if p.is_file():
            assert (got / p.relative_to(src)).read_bytes() == p.read_bytes()

    # the same files again: the client's own preupload comparison skips them, no new commit
    ops = [CommitOperationAdd(p.relative_to(src).as_posix(), str(p)) for p in sorted(src.rglob("*")) if p.is_file()]
    assert api.create_commit("me/model", ops, commit_message="again", token=TOKEN).oid == c1


def test_protocol_errors(api, srv, tmp_path):
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.errors import HfHubHTTPError

    api.create_repo("me/m", token=TOKEN)
    r = httpx.post(f"{srv.url}/api/repos/create", json={"name": "m", "organization": "me"},
                   headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 409 and r.json()["url"] == f"{srv.url}/me/m"
    assert httpx.post(f"{srv.url}/api/repos/create", json={"name": "n", "organization": "me"}).status_code == 401
    # a stale parentCommit is refused with 412
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit("me/m", [CommitOperationAdd("a.txt", b"x")], commit_message="m", token=TOKEN,
                          parent_commit="0" * 40)
    assert err.value.response.status_code == 412
    # an lfsFile whose object was never uploaded is refused; nothing is committed
    head = api.repo_info("me/m", token=TOKEN).sha
    body = "\n".join(json.dumps(x) for x in (
        {"key": "header", "value": {"summary": "s"}},
        {"key": "lfsFile", "value": {"path": "w.safetensors", "algo": "sha256", "oid": "ab" * 32, "size": 3}}))
    r = httpx.post(f"{srv.url}/api/models/me/m/commit/main", content=body,
                   headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and api.repo_info("me/m", token=TOKEN).sha == head
    # an upload whose bytes do not hash to the announced oid is rejected and not stored
    data = b"hello world" * 1000
    oid = hashlib.sha256(data).hexdigest()
    batch = httpx.post(f"{srv.url}/me/m.git/info/lfs/objects/batch", headers={"authorization": f"Bearer {TOKEN}"},
                       json={"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                             "objects": [{"oid": oid, "size": len(data)}]}).json()
    href = batch["objects"][0]["actions"]["upload"]["href"]
    assert httpx.put(href, content=data[:-1] + b"X").status_code == 400
    assert not (tmp_path / "store" / "lfs" / oid).exists()
    assert httpx.put(href.replace("sig=", "sig=0"), content=data).status_code == 403
    assert httpx.put(href, content=data).status_code == 200 and (tmp_path / "store" / "lfs" / oid).is_file()
    # invalid front matter fails validate-yaml (the client calls it before committing README.md)
    bad = httpx.post(f"{srv.url}/api/validate-yaml", json={"content": "---\ntags: 3\n---\n", "repoType": "model"})
    assert bad.status_code == 400 and "tags" in bad.json()["errors"][0]["message"]
    with pytest.raises(ValueError):
        api.create_commit("me/m", [CommitOperationAdd("README.md", b"---\nbase_model: not a repo\n---\n")],
                          commit_message="m", token=TOKEN)


@pytest.mark.faults("kill")
def test_subprocess_server_survives_sigkill_with_consistent_storage(tmp_path):
    """SIGKILL during an LFS upload leaves no visible partial object; a restart serves the same repos."""
    from huggingface_hub import CommitOperationAdd, HfApi

    store, trace = tmp_path / "store", tmp_path / "trace.txt"

    def start(port: int, *extra: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "tests.hubserver", "--root", str(store), "--port",
                                 str(port), "--trace", str(trace), *extra], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        assert "listening on" in line, line
        return proc, int(line.split("127.0.0.1:")[1].split()[0])

    proc, port = start(0, "--slow-put", "0.3")
    url = f"http://127.0.0.1:{port}"
    with hub_online():
        api = HfApi(endpoint=url, token=TOKEN)
        api.create_repo("me/k", token=TOKEN)
        blob = os.urandom(300_000)
        lfs = tmp_path / "w.safetensors"
        lfs.write_bytes(blob)
        done = {}

        def upload():
            try:
                done["oid"] = api.create_commit("me/k", [CommitOperationAdd("w.safetensors", str(lfs))],
                                                commit_message="m", token=TOKEN).oid
            except Exception as exc:  # noqa: BLE001 - the kill surfaces as some network error
                done["error"] = exc

        import threading
        t = threading.Thread(target=upload)
        t.start()
        deadline = time.time() + 20
        while time.time() < deadline and not any(p.name.startswith(".tmp-") for p in (store / "lfs").iterdir()):
            time.sleep(0.05)
        assert any(p.name.startswith(".tmp-") for p in (store / "lfs").iterdir()), "upload never started"
        proc.kill()
        proc.wait()
        proc2, _ = start(port)  # same port and storage; the client's retries may now complete the upload
        try:
            t.join(60)
            assert not t.is_alive()
            assert not [p for p in store.rglob(".tmp-*")], "a half-written object survived the restart"
            head = api.repo_info("me/k", token=TOKEN).sha
            files = {f.path: f for f in api.list_repo_tree("me/k", recursive=True, revision=head, token=TOKEN)}
            if "oid" in done:  # completed on the restarted server: the file is whole
                assert files["w.safetensors"].lfs.sha256 == hashlib.sha256(blob).hexdigest()
            else:  # failed: nothing of it is visible
                assert files == {}
            objs = [p for p in (store / "lfs").iterdir() if not p.name.startswith(".tmp-")]
            assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in objs)
        finally:
            proc2.kill()
            proc2.wait()


def test_repo_ids_never_reach_outside_the_storage_root(srv, tmp_path):
    """Every route takes its repo id through one check: a traversal is 404 (no file read or written, and no
    400-vs-404 hint whether a file exists), with or without a token."""
    outside = srv.httpd.store.root.parent / "victim" / "x.json"  # where repos/../../victim/x.json points
    outside.parent.mkdir()
    outside.write_text(json.dumps({"id": "x", "refs": {"main": "0" * 40}, "tags": {}, "private": False}))
    before = outside.read_bytes()
    auth = {"authorization": f"Bearer {TOKEN}"}
    for rid in ("..%2F..%2Fvictim/x", "..%2Fvictim/x", "me/..", "..%2F..%2Fnot-there/x"):
        for method, path, kw in (("GET", f"/api/models/{rid}", {}), ("GET", f"/api/models/{rid}/revision/main", {}),
                                 ("POST", f"/api/models/{rid}/tag/main", {"json": {"tag": "t"}, "headers": auth}),
                                 ("POST", f"/{rid}.git/info/lfs/objects/batch", {"json": {}, "headers": auth})):
            r = httpx.request(method, f"{srv.url}{path}", **kw)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
    assert outside.read_bytes() == before
