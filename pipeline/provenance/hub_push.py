"""The push of an assembled publish folder to the Hub: one commit of the changed files, then a tag.

Only files whose bytes differ from the remote tree are uploaded (compared by sha256 for LFS files, by git blob
id for the rest), files gone from the folder are deleted in the same commit, and the remote tree at the new
commit is compared with the local file list after, so an interrupted push is completed by re-running publish
and a finished one is known to match. The publish stage (`pipeline/stages/publish.py`) decides what the folder
holds and calls `push_or_explain`; the Hub client is imported only here, and only when a push is asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any

from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.secrets import scrub


def git_blob_oid(path: Path) -> str:
    """The git blob id the Hub lists for a file kept outside LFS, so an unchanged small file is not sent again."""
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def hub_online():
    """Talk to the configured endpoint even under HF_HUB_OFFLINE=1 (the Makefile's default), over plain LFS."""
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    saved = constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = False, True
    close_session()  # no pooled keep-alive connection to a server that has since died or restarted
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = saved


def remote_files(api, repo_id: str, revision: str, token: str) -> dict[str, Any]:
    from huggingface_hub.hf_api import RepoFile

    return {f.path: f for f in api.list_repo_tree(repo_id, recursive=True, revision=revision, token=token)
            if isinstance(f, RepoFile)}


def same_as_remote(path: Path, sha256: str, remote) -> bool:
    if remote is None:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == sha256
    return remote.blob_id == git_blob_oid(path)


def compare_remote(folder: Path, files: dict[str, dict], remote: dict[str, Any]) -> list[str]:
    problems = [f"{rel}: {'missing on the Hub' if rel not in remote else 'remote hash differs from the local one'}"
                for rel, e in sorted(files.items()) if not same_as_remote(folder / rel, e["sha256"], remote.get(rel))]
    return problems + [f"{rel}: on the Hub but not in the local folder" for rel in sorted(set(remote) - set(files))
                       if rel != ".gitattributes"]


def push(cfg, folder: Path, files: dict[str, dict], repo_id: str, tag: str, token: str) -> dict[str, Any]:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(endpoint=str(cfg.publish.endpoint), token=token, library_name="specquant")
    api.create_repo(repo_id, token=token, private=bool(cfg.publish.private), exist_ok=True)
    head = api.repo_info(repo_id, revision="main", token=token).sha
    remote = remote_files(api, repo_id, head, token)
    changed = [rel for rel, e in files.items() if not same_as_remote(folder / rel, e["sha256"], remote.get(rel))]
    stale = sorted(set(remote) - set(files) - {".gitattributes"})
    tags = {t.name: t.target_commit for t in api.list_repo_refs(repo_id, token=token).tags}
    if tag in tags and (changed or stale or tags[tag] != head):  # checked before committing anything
        raise bad_value("publish.tag", tag, f"the tag already points to commit {tags[tag][:12]} of {repo_id}, "
                        "which is not this folder's content", "choose another publish.tag (or leave it unset)")
    commit, status = head, "no changes"
    if changed or stale:
        ops = [CommitOperationAdd(rel, str(folder / rel)) for rel in changed] + [
            CommitOperationDelete(rel) for rel in stale]
        info = api.create_commit(repo_id, ops, commit_message=f"specquant: {cfg.run_name} / {folder.name}",
                                 commit_description=f"Published by `python -m pipeline publish` (tag {tag}).",
                                 token=token, revision="main", parent_commit=head)
        commit, status = info.oid, "pushed"
    if tag not in tags:
        api.create_tag(repo_id, tag=tag, revision=commit, token=token, tag_message=f"specquant run {cfg.run_name}")
    problems = compare_remote(folder, files, remote_files(api, repo_id, commit, token))
    if problems:
        raise SpecquantError(f"after the push, the Hub tree of {repo_id} at {commit[:12]} does not match the local "
                             f"folder: {'; '.join(problems[:3])}; re-run publish to repair it.")
    return {"status": status, "commit": commit, "tag": tag, "url": f"{cfg.publish.endpoint}/{repo_id}",
            "uploaded": sorted(changed), "deleted": stale, "unchanged": sorted(set(files) - set(changed)),
            "remote_verified": True}


def push_or_explain(cfg, folder, files, repo_id, tag, token) -> dict[str, Any]:
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    where = f"{repo_id} at {cfg.publish.endpoint}"
    try:
        with hub_online():
            return push(cfg, folder, files, repo_id, tag, token)
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else None
        if code in (401, 403):
            raise bad_value("publish.token_env", cfg.publish.token_env, f"the Hub refused the token for {where} "
                            f"(HTTP {code})", "use a token with write access to that namespace") from None
        reason = scrub(str(exc).splitlines()[0])
    except ValueError as exc:  # e.g. the Hub's validate-yaml refused the card's front matter
        raise SpecquantError(scrub(f"the Hub refused {where}: {str(exc).splitlines()[0]} "
                                   f"{' '.join(str(exc).splitlines()[1:3])}".rstrip() + "; fix it and re-run publish.")) from None
    except (httpx.HTTPError, RuntimeError, OSError) as exc:
        reason = scrub(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise SpecquantError(f"publishing {where} was interrupted ({reason}); nothing partial is visible on the Hub, "
                         "and re-running `python -m pipeline publish` with the same settings completes it.")
