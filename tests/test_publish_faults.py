"""Publish survives the Hub server dying mid-push: a re-run completes the repo, verified, with one commit.

The server runs as a subprocess on the same storage directory across the kill; it is killed with
SIGKILL either from outside while an LFS upload is streaming, or by itself (`--die-on`) exactly
when a given request arrives (before the commit, before the tag).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.core.errors import SpecquantError
from tests import warm
from tests._support import PUBLISH_TOKEN as TOKEN
from tests._support import REPO, download, publish_cfg, publish_overrides, push_cfg

REPO_ID = "specquant-test/tiny-dflash-b8-nvfp4"


class Server:
    def __init__(self, store: Path, port: int = 0, *extra: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.hubserver", "--root", str(store),
                                      "--port", str(port), *extra], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.port = int(line.split("127.0.0.1:")[1].split()[0])
        self.url = f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _commits(store: Path) -> dict:
    meta = json.loads((store / "repos" / f"{REPO_ID}.json").read_text())
    return {"main": meta["branches"]["main"], "tags": meta["tags"]}


def _check_complete(run_root: Path, store: Path, url: str, revision: str, cache: Path) -> None:
    from pipeline.provenance.verify import verify_dir

    rec = json.loads((run_root / "tiny" / "publish" / "nvfp4.json").read_text())
    got = download(url, REPO_ID, revision, cache)
    remote = {p.relative_to(got).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
              for p in got.rglob("*") if p.is_file()}
    assert remote == {rel: e["sha256"] for rel, e in rec["files"].items()}
    assert verify_dir(got) == []
    assert verify_dir(run_root / "tiny") == []
    assert not list(store.rglob(".tmp-*")) and not list((run_root / "tiny").rglob(".tmp-*"))


@pytest.mark.faults("kill")
@pytest.mark.parametrize("point", ["before the commit", "before the tag"])
def test_server_killed_at_a_request_then_rerun_completes(point, run_root, tmp_path):
    """SIGKILL of the Hub server at a precise request; restart on the same storage; re-run publish."""
    from pipeline.stages import publish

    store = tmp_path / "hub"
    die_on = {"before the commit": f"POST /api/models/{REPO_ID}/commit/",
              "before the tag": f"POST /api/models/{REPO_ID}/tag/"}[point]
    srv = Server(store, 0, "--die-on", die_on)
    with pytest.raises(SpecquantError) as err:
        publish.run(push_cfg(run_root, srv.url))
    msg = str(err.value)
    assert "re-running" in msg and "\n" not in msg and TOKEN not in msg
    srv.proc.wait(10)
    state = _commits(store)
    assert state["tags"] == {}
    srv = Server(store, srv.port)
    try:
        out = publish.run(push_cfg(run_root, srv.url))["variants"]["nvfp4"]
        after = _commits(store)
        if point == "before the tag":  # the commit had landed: the re-run only adds the tag
            assert out["status"] == "no changes" and out["commit"] == state["main"]
        else:
            assert out["status"] == "pushed" and out["commit"] != state["main"]
        assert after["main"] == out["commit"] and after["tags"] == {out["tag"]: out["commit"]}
        _check_complete(run_root, store, srv.url, out["tag"], tmp_path / "cache")
        again = publish.run(push_cfg(run_root, srv.url))["variants"]["nvfp4"]
        assert again["status"] == "no changes" and _commits(store) == after
    finally:
        srv.kill()


class _ShortWaits:
    """The `time` module as huggingface_hub's HTTP retries see it, with `sleep` 20x shorter."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds / 20)


@pytest.mark.faults("kill")
def test_server_killed_mid_lfs_upload_then_rerun_completes(run_root, tmp_path, monkeypatch):
    """SIGKILL while the weights stream in: no partial object or commit is visible; the re-run completes."""
    from huggingface_hub.utils import _http

    from pipeline.stages import publish

    # huggingface_hub retries each failed request 5 times, waiting 1, 2, 4, 8, 8 s: the same retries here,
    # each wait a twentieth as long (the other worker's tests have the core meanwhile either way)
    monkeypatch.setattr(_http, "time", _ShortWaits())
    store = tmp_path / "hub"
    srv = Server(store, 0, "--slow-put", "0.4")
    outcome: dict = {}
    cfg = push_cfg(run_root, srv.url)

    def first_push():
        try:
            outcome["result"] = publish.run(cfg)
        except SpecquantError as exc:
            outcome["error"] = str(exc)

    t = threading.Thread(target=first_push)
    t.start()
    deadline = time.time() + 60
    while time.time() < deadline and not list((store / "lfs").glob(".tmp-*")):
        time.sleep(0.02)
    assert list((store / "lfs").glob(".tmp-*")), "the upload never started"
    srv.kill()
    t.join(120)  # the client retries the upload (for ~1 s, ~23 s unpatched) before giving up
    assert not t.is_alive() and "error" in outcome, outcome
    assert "re-running" in outcome["error"] and "\n" not in outcome["error"]
    srv = Server(store, srv.port)  # restart cleans the half-written object
    try:
        assert not list(store.rglob(".tmp-*"))
        state = _commits(store)
        out = publish.run(push_cfg(run_root, srv.url))["variants"]["nvfp4"]
        assert out["status"] == "pushed" and _commits(store)["main"] == out["commit"] != state["main"]
        _check_complete(run_root, store, srv.url, out["tag"], tmp_path / "cache")
    finally:
        srv.kill()


@pytest.mark.faults("kill")
def test_publish_process_killed_mid_upload_then_rerun_completes(run_root, pristine_runs, tmp_path):
    """SIGKILL of `python -m pipeline publish` itself while the weights upload; the re-run completes."""
    import os

    from pipeline.stages import publish
    from tests.hubserver import HubServer

    store = tmp_path / "hub"
    with HubServer(store, slow_put=0.3) as srv:
        overrides = [*publish_overrides(run_root), "publish.dry_run=false",
                     f"publish.endpoint={srv.url}", "publish.namespace=specquant-test"]
        proc = warm.popen([sys.executable, "-m", "pipeline", "publish", *overrides], cwd=REPO,
                          env={**os.environ, "HF_TOKEN": TOKEN}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 90
        while time.time() < deadline and not list((store / "lfs").glob(".tmp-*")) and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, proc.stdout.read()
        proc.kill()
        out_text = proc.communicate()[0]
        assert TOKEN not in out_text
        deadline = time.time() + 10  # the server drops the half-received object when the socket dies
        while time.time() < deadline and list((store / "lfs").glob(".tmp-*")):
            time.sleep(0.05)
        assert not list(store.rglob(".tmp-*"))
        state = _commits(store)
        out = publish.run(push_cfg(run_root, srv.url))["variants"]["nvfp4"]
        assert out["status"] == "pushed" and _commits(store)["main"] == out["commit"] != state["main"]
        _check_complete(run_root, store, srv.url, out["tag"], tmp_path / "cache")
    # the same files an uninterrupted run assembles
    shutil.copytree(pristine_runs, tmp_path / "clean", symlinks=True)
    clean = publish.run(publish_cfg(tmp_path / "clean"))["variants"]["nvfp4"]
    assert clean["files_sha256"] == out["files_sha256"] and clean["tag"] == out["tag"]
