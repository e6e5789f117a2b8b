"""The publish stage against the project's Hub server on 127.0.0.1 (tests.hubserver).

The run folder (tests/_support.make_run; conftest's `pristine_runs`, `run_root`) is small but real: the fixture
world's cache, quantize-drafter nvfp4 (drafter/bf16, drafter/nvfp4, its check and stage record), eval/ through
evaluate's writers, and the real manifest stage on top (manifests, provenance, in-toto statement, file list).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from pipeline.artifacts.eval_results import read_results
from pipeline.core.config import compose
from pipeline.core.errors import SpecquantError
from tests._support import (
    DRAFTER,
    download,
    front_matter,
    geometry,
    publish_cfg,
    publish_overrides,
    push_cfg,
    remanifest,
    sha256,
)
from tests._support import HUB_BASE as BASE
from tests._support import HUB_TARGET as TARGET
from tests._support import PUBLISH_TOKEN as TOKEN
from tests.hubserver import HubServer

CKPT = DRAFTER


def repos_on(server_root: Path) -> list[str]:
    d = server_root / "repos"
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*.json")) if d.is_dir() else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hub(tmp_path):
    with HubServer(tmp_path / "hub") as srv:
        yield srv


# ---------------------------------------------------------------- dry run and the card
def test_dry_run_assembles_verified_folder_with_card(run_root, tmp_path, capsys):
    from pipeline.provenance.verify import verify_dir
    from pipeline.stages import publish

    out = publish.run(publish_cfg(run_root))
    folder = run_root / "tiny" / "publish" / "nvfp4"
    rec = json.loads((run_root / "tiny" / "publish" / "nvfp4.json").read_text())
    assert out["variants"]["nvfp4"]["status"] == "dry-run" and rec["commit"] is None
    assert not (run_root / "tiny" / "publish" / "bf16").exists()  # bf16 only when asked
    names = set(rec["files"])
    for f in ("README.md", "config.json", "model.safetensors", "recipe.yaml", "calibration_manifest.json",
              "quant_run_manifest.json", "provenance/attestation.intoto.json", "provenance/files.sha256.json",
              "eval/report.md", "eval/results.json", "eval/tau_per_subset.png", "checks/drafter-nvfp4.json"):
        assert f in names, f
    assert not any(n.startswith(("tokenizer", "vocab", "merges", "special_tokens")) for n in names)
    assert sha256(folder / "model.safetensors") == sha256(run_root / "tiny" / "drafter" / "nvfp4" / "model.safetensors")
    assert verify_dir(folder) == []
    printed = capsys.readouterr().out
    assert "dry run: would push" in printed and "model.safetensors" in printed

    readme = (folder / "README.md").read_text()
    meta = front_matter(readme)
    assert meta["base_model"] == BASE and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0" and meta["library_name"] and meta["pipeline_tag"] == "text-generation"
    for t in ("speculative-decoding", "dflash", "speculators", "vllm", "nvfp4"):
        assert t in meta["tags"]
    q = compose(publish_overrides(run_root)).quant  # what quantize-drafter ran with (its stage record)
    speculative = f'"num_speculative_tokens":{geometry()["block_size"] - 1}'
    for text in ("not** a chat", TARGET, f"`{q.num_samples}`", f"`{q.max_seq_len}`", f"`{q.observer}`",
                 "vllm serve Qwen/Qwen3-8B --attention-backend FLASH_ATTN --speculative-config", speculative,
                 "python -m pipeline verify", "Not measured", "![eval/tau_per_subset.png](eval/tau_per_subset.png)"):
        assert text in readme, text
    # the card's tau table is evaluate's: every quantized row with its change against bf16
    rows = read_results(run_root / "tiny" / "eval").table
    assert {r.variant for r in rows} == {"bf16", "nvfp4"}
    for r in rows:
        if r.variant == "nvfp4" and r.subset != "all":
            assert f"{r.tau:.3f} ({r.relative_to_bf16 * 100:+.1f}%)" in readme, r

    # same run, same config: byte-identical folder and record; a killed assemble's partial folder is cleared
    before = {p: sha256(p) for p in sorted((run_root / "tiny" / "publish").rglob("*")) if p.is_file()}
    partial = run_root / "tiny" / "publish" / ".partial-nvfp4-99999"
    partial.mkdir()
    (partial / "README.md").write_text("half-assembled")
    publish.run(publish_cfg(run_root))
    assert not partial.exists()
    after = {p: sha256(p) for p in sorted((run_root / "tiny" / "publish").rglob("*")) if p.is_file()}
    assert before == after


# ---------------------------------------------------------------- push, download back, idempotence
def test_push_download_verify_then_no_second_commit(run_root, hub, tmp_path):
    from huggingface_hub import HfApi

    from pipeline.provenance.hub_push import hub_online
    from pipeline.stages import publish

    out = publish.run(push_cfg(run_root, hub.url))["variants"]["nvfp4"]
    assert out["status"] == "pushed" and len(out["commit"]) == 40
    rec = json.loads((run_root / "tiny" / "publish" / "nvfp4.json").read_text())
    repo = rec["repo_id"]
    assert repo == "specquant-test/tiny-dflash-b8-nvfp4"
    got = download(hub.url, repo, out["tag"], tmp_path / "cache")
    remote = {p.relative_to(got).as_posix(): sha256(p) for p in got.rglob("*") if p.is_file()}
    assert remote == {rel: e["sha256"] for rel, e in rec["files"].items()}
    listing = json.loads((got / "provenance" / "files.sha256.json").read_text())["files"]
    assert all(remote[rel] == e["sha256"] for rel, e in listing.items())
    assert front_matter((got / "README.md").read_text())["base_model"] == BASE
    with hub_online():
        api = HfApi(endpoint=hub.url, token=TOKEN)
        lfs = {f.path: f.lfs.sha256 for f in api.list_repo_tree(repo, recursive=True, revision=out["commit"])
               if getattr(f, "lfs", None)}
    assert lfs["model.safetensors"] == rec["files"]["model.safetensors"]["sha256"]

    again = publish.run(push_cfg(run_root, hub.url))["variants"]["nvfp4"]
    assert again["status"] == "no changes" and again["commit"] == out["commit"] and again["tag"] == out["tag"]
    with hub_online():
        refs = HfApi(endpoint=hub.url).list_repo_refs(repo, token=TOKEN)
    assert refs.branches[0].target_commit == out["commit"]

    # a changed run (new eval report, manifests re-written) -> exactly one new commit, only changed files sent
    (run_root / "tiny" / "eval" / "report.md").write_text("# Acceptance, revised\n")
    remanifest(run_root)
    with pytest.raises(SpecquantError, match="publish.tag"):  # a fixed tag already on other content
        publish.run(push_cfg(run_root, hub.url, f"publish.tag={out['tag']}"))
    with hub_online():
        assert HfApi(endpoint=hub.url).repo_info(repo, revision="main", token=TOKEN).sha == out["commit"]
    third = publish.run(push_cfg(run_root, hub.url))["variants"]["nvfp4"]
    rec3 = json.loads((run_root / "tiny" / "publish" / "nvfp4.json").read_text())
    assert third["status"] == "pushed" and third["commit"] != out["commit"]
    assert "model.safetensors" in rec3["unchanged"] and "eval/report.md" in rec3["uploaded"]
    with hub_online():
        info = HfApi(endpoint=hub.url).repo_info(repo, revision="main", token=TOKEN)
    assert info.sha == third["commit"]
    parent = json.loads((tmp_path / "hub" / "commits" / f"{third['commit']}.json").read_text())["parent"]
    assert parent == out["commit"]


# ---------------------------------------------------------------- refusals, each one sentence, nothing pushed
@pytest.mark.faults("tamper")
def test_tampered_checkpoint_refused_naming_the_file(run_root, hub, tmp_path):
    """A byte flipped in the run's drafter weights after the manifest: publish refuses, names the file."""
    from pipeline.stages import publish

    w = run_root / "tiny" / "drafter" / "nvfp4" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(SpecquantError) as err:
        publish.run(push_cfg(run_root, hub.url))
    msg = str(err.value)
    assert "drafter/nvfp4/model.safetensors" in msg and "refusing to publish" in msg and "\n" not in msg
    assert repos_on(tmp_path / "hub") == [] and not (run_root / "tiny" / "publish").exists()


def _one_sentence(msg: str, *needles: str) -> None:
    assert "\n" not in msg and msg.endswith(".") and "Traceback" not in msg and len(msg) < 600, msg
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("case", ["missing token", "unreachable endpoint", "invalid repo id", "no repo id",
                                  "bad tag", "unknown variant", "symlink out of the run", "pickle weights"])
@pytest.mark.faults("bad_input")
def test_bad_publish_inputs_one_sentence_nothing_pushed(case, run_root, hub, tmp_path, monkeypatch):
    """Bad publish settings: one sentence naming the field, before anything is written or pushed."""
    from pipeline.stages import publish

    cfgs = {  # composed on demand: only this case's config
        "missing token": (lambda: push_cfg(run_root, hub.url), "publish.token_env"),
        "unreachable endpoint": (lambda: push_cfg(run_root, f"http://127.0.0.1:{free_port()}"), "publish.endpoint"),
        "invalid repo id": (lambda: push_cfg(run_root, hub.url, "publish.repo_id='me/bad name!'"), "publish.repo_id"),
        "no repo id": (lambda: push_cfg(run_root, hub.url, "publish.namespace=null"), "publish.repo_id"),
        "bad tag": (lambda: push_cfg(run_root, hub.url, "publish.tag='v 1/x'"), "publish.tag"),
        "unknown variant": (lambda: push_cfg(run_root, hub.url, "publish.variants=[w8a8]"), "publish.variants"),
        "symlink out of the run": (lambda: push_cfg(run_root, hub.url), "publish"),
        "pickle weights": (lambda: push_cfg(run_root, hub.url), "publish"),
    }
    make, field = cfgs[case]
    cfg = make()
    ckpt = run_root / "tiny" / "drafter" / "nvfp4"
    if case == "missing token":
        monkeypatch.delenv("HF_TOKEN")
    elif case == "symlink out of the run":
        (tmp_path / "secret.json").write_text("{}")
        (ckpt / "generation_config.json").symlink_to(tmp_path / "secret.json")
    elif case == "pickle weights":
        (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(SpecquantError) as err:
        publish.run(cfg)
    _one_sentence(str(err.value), f"`{field}`")
    assert repos_on(tmp_path / "hub") == [] and not (run_root / "tiny" / "publish").exists()


@pytest.mark.faults("secret")
def test_planted_token_never_written_or_printed(run_root, hub, tmp_path, capfd, caplog, monkeypatch):
    """A planted HF token is used for the push, yet appears in no file, record, log or output."""
    from pipeline.stages.runner import run_stage

    caplog.set_level("DEBUG")
    monkeypatch.setenv("HF_HUB_VERBOSITY", "debug")
    overrides = [*publish_overrides(run_root), "publish.dry_run=false", f"publish.endpoint={hub.url}",
                 "publish.namespace=specquant-test"]
    run_stage("publish", "pipeline.stages.publish", compose(overrides), overrides)
    run_stage("publish", "pipeline.stages.publish", compose([*overrides, f"publish.token={TOKEN}x"]),
              [*overrides, f"publish.token={TOKEN}x"])  # a token given in config is scrubbed too
    with pytest.raises(SpecquantError) as err:
        run_stage("publish", "pipeline.stages.publish", compose([*overrides, "publish.repo_id=me/x--y"]), overrides)
    download(hub.url, "specquant-test/tiny-dflash-b8-nvfp4", "main", tmp_path / "cache")
    captured = capfd.readouterr()
    texts = [captured.out, captured.err, caplog.text, str(err.value)]
    assert all(TOKEN not in t for t in texts)
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert leaked == []
    assert (run_root / "tiny" / "stages" / "publish.json").is_file()


@pytest.mark.faults("secret")
def test_tokens_in_env_are_forwarded_only_to_the_endpoint(run_root, hub, tmp_path, monkeypatch):
    """The server sees the token (401 otherwise): a wrong one is refused with one sentence."""
    from pipeline.stages import publish

    with HubServer(tmp_path / "hub2", token="the-right-token") as strict:
        with pytest.raises(SpecquantError) as err:
            publish.run(push_cfg(run_root, strict.url))
        _one_sentence(str(err.value), "`publish.token_env`", "401")
        monkeypatch.setenv("HF_TOKEN", "the-right-token")
        assert publish.run(push_cfg(run_root, strict.url))["variants"]["nvfp4"]["status"] == "pushed"
    assert os.environ["HF_TOKEN"] == "the-right-token"


def test_card_and_vllm_commands_state_the_vllm_range(run_root):
    """The card says the vLLM range the drafter was written and checked for, as quant_run_manifest.json's
    checkpoints[].vllm and the quantize-drafter record hold it; eval/vllm_commands.sh says it per drafter."""
    from pipeline.artifacts import manifests
    from pipeline.artifacts.stage_record import load_record
    from pipeline.stages import publish

    publish.run(publish_cfg(run_root))
    rd, folder = run_root / "tiny", run_root / "tiny" / "publish" / "nvfp4"
    rec = load_record(rd, "quantize-drafter-nvfp4")
    entry = manifests.read_quant_run(folder / manifests.QUANT_RUN).checkpoint("drafter", "nvfp4")
    assert entry.vllm == rec.result["vllm"] and entry.vllm["profile"] == rec.config("quant")["vllm"]
    readme = (folder / "README.md").read_text()
    assert f"Written and checked for **vLLM {entry.vllm['versions']}**" in readme
    assert f"contract profile `{entry.vllm['profile']}`" in readme and "is not recorded" not in readme
    cmds = (folder / "eval" / "vllm_commands.sh").read_text()
    assert cmds == (rd / "eval" / "vllm_commands.sh").read_text()
    assert f"#   nvfp4: vLLM {entry.vllm['versions']} (profile {entry.vllm['profile']})" in cmds
    assert "#   bf16: not recorded" in cmds  # the reference: no quantize-drafter record names a range
    head = cmds.split("set -euo pipefail")[0]
    assert all(line.startswith("#") for line in head.splitlines() if line)  # comments, before any command
