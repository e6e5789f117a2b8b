"""Secrets and security defaults on a real run (data -> cache -> quantize-drafter -> manifest).

A planted Hub token must never appear in any file the pipeline writes (run directory, stage
records, manifests, provenance, published folders, the Hub server's storage) nor in any captured
stdout/stderr - on success, on a forced error, and when given on the command line instead of the
environment. Security defaults: weights are never unpickled, `trust_remote_code` is off.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.config import CONF_DIR, compose
from tests import warm
from tests._support import ENV, REPO, overrides
from tests.hubserver import HubServer

TOKEN = "hf_PLANTEDsecret123456SpecquantXyZ"  # from the environment
ARG_TOKEN = "hf_PLANTEDonTheCommandLine987654"  # given as publish.token=... instead


@pytest.fixture(scope="module")
def run(tiny_run) -> dict:
    return tiny_run


def _runs(run: dict, tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    shutil.copytree(run["reference"], runs / "qw")
    return runs


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env, capture_output=True,
                    text=True, timeout=300)


def _files_holding(root: Path, secret: str) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes())


@pytest.mark.faults("secret")
def test_planted_token_is_in_no_file_and_no_output(run, tmp_path, capfd, monkeypatch):
    """HF_TOKEN planted; manifest, publish dry run, a push to the local Hub server and a forced error run: the token is in no file under the run or the Hub, and in no stdout/stderr."""
    from pipeline.__main__ import main

    runs = _runs(run, tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    ov = overrides(runs, "publish.namespace=specquant-test")
    outputs = []
    assert main(["manifest", *ov]) == 0
    assert main(["publish", *ov]) == 0  # dry run
    with HubServer(tmp_path / "hub", token=TOKEN) as hub:  # the server accepts only this token
        push = _cli("publish", *ov, "publish.dry_run=false", f"publish.endpoint={hub.url}",
                    env={**ENV, "HF_TOKEN": TOKEN})
        outputs += [push.stdout, push.stderr]
        assert push.returncode == 0, push.stderr[-3000:]
        assert "pushed" in push.stdout
        # a forced error whose message would quote the token: it pasted into the repo id by mistake
        bad = _cli("publish", *ov, "publish.dry_run=false", f"publish.endpoint={hub.url}",
                   f"publish.repo_id='{TOKEN} x'", env={**ENV, "HF_TOKEN": TOKEN})
        outputs += [bad.stdout, bad.stderr]
        assert bad.returncode == 2 and "error: `publish.repo_id`" in bad.stderr and "***" in bad.stderr, bad.stderr
    captured = capfd.readouterr()
    outputs += [captured.out, captured.err]
    assert (runs / "qw" / "publish" / "nvfp4.json").is_file() and (runs / "qw" / "stages" / "publish.json").is_file()
    assert [i for i, text in enumerate(outputs) if TOKEN in text] == []
    assert _files_holding(runs, TOKEN) == []
    assert _files_holding(tmp_path / "hub", TOKEN) == []


@pytest.mark.faults("secret")
def test_token_given_on_the_command_line_is_scrubbed(run, tmp_path):
    """A token passed as `publish.token=...` (no env): scrubbed from the captured argv, overrides and resolved config of every stage record, manifests and outputs."""
    from tests._support import run_main  # in this process (the test above: real ones); argv as -m sets it

    runs = _runs(run, tmp_path)
    no_token = {k: None for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SPECQUANT_HF_TOKEN")}
    ov = overrides(runs, "publish.namespace=specquant-test", f"publish.token={ARG_TOKEN}")
    texts = []
    for stage in ("manifest", "publish"):
        rc, out, err = run_main(stage, *ov, env={**no_token, "OMP_NUM_THREADS": ENV["OMP_NUM_THREADS"]})
        texts += [out, err]
        assert rc == 0, err[-3000:]
    record = (runs / "qw" / "stages" / "manifest.json").read_text()
    assert "publish.token=***" in record  # the override was captured, without its value
    assert [t for t in texts if ARG_TOKEN in t] == []
    assert _files_holding(runs, ARG_TOKEN) == []


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield node, owner, name


@pytest.mark.faults("secret")
def test_security_defaults_no_unpickling_no_remote_code():
    """No code path unpickles (no torch.load / pickle.load / weights_only=False) and trust_remote_code is off in every shipped config."""
    unpickling = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node, owner, name in _calls(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if (owner, name) in {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("dill", "load")}:
                unpickling.append(where)
            for kw in node.keywords:
                if kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                    unpickling.append(where)
                if kw.arg == "trust_remote_code" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                    unpickling.append(where)
    assert unpickling == []
    experiments = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    assert experiments
    for exp in experiments:
        cfg = compose([f"experiment={exp}"])
        assert cfg.target.trust_remote_code is False and cfg.drafter.trust_remote_code is False, exp
    for y in sorted(CONF_DIR.rglob("*.yaml")):
        assert "trust_remote_code: true" not in y.read_text(encoding="utf-8").lower(), y


def test_a_token_written_into_a_config_file_never_reaches_the_source_snapshot(tmp_path):
    """`publish.token: hf_...` in conf/publish/default.yaml (the documented field) and in the diff: the real
    source_info of this checkout, with that edit, through the real snapshot writer."""
    from pipeline.provenance import record as prov

    info = prov.source_info()
    rel = "conf/publish/default.yaml"
    planted = "hf_" + "Zq7" * 12
    text = info["_blobs"][rel].decode().replace("token: null", f"token: {planted}")
    assert planted in text
    info["_blobs"][rel] = text.encode()
    info["_diff"] = f"--- a/{rel}\n+++ b/{rel}\n-token: null\n+token: {planted}\n+hf_token: 'plain-secret-9'\n"
    info["git"]["diff"] = "git.diff"
    out = prov.write_source_snapshot(tmp_path / "source", info)
    assert _files_holding(tmp_path, planted) == [] and _files_holding(tmp_path, "plain-secret-9") == []
    assert out["files"][rel].get("redacted") is True
    assert "token: ***" in (tmp_path / "source" / rel).read_text()
