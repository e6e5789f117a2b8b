"""Manifest stage on a small hand-built run directory (records written by the real pipeline.stages.runner)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import yaml

from pipeline.core.config import compose
from pipeline.core.errors import SpecquantError
from pipeline.core.io import sha256_file
from pipeline.provenance import record as provenance
from pipeline.stages import manifest
from tests._support import DFLASH as FIX
from tests._support import MANIFEST_RECIPE as RECIPE
from tests._support import MANIFEST_TOKEN as TOKEN
from tests._support import REPO, build_run, run_manifest
from tests._support import manifest_overrides as _overrides


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run for the read-only tests of this module (built once: the machine is shared)."""
    mp = pytest.MonkeyPatch()
    try:
        rd, ov = build_run(tmp_path_factory.mktemp("manifest"), mp)
        run_manifest(rd, ov, mp)
    finally:
        mp.undo()
    return rd


def _validate(doc: dict, name: str) -> None:
    import jsonschema

    schema = json.loads((REPO / "manifests" / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


def test_calibration_manifest_fields(run):
    cal = json.loads((run / "calibration_manifest.json").read_text())
    _validate(cal, "calibration_manifest")
    data, cache = cal["data"], cal["cache"]
    assert data["sources"][0]["name"] == "chat" and "revision" in data["sources"][0]
    assert data["counts"]["chat"]["kept"] == 3 and data["counts"]["chat"]["dropped"]["no_assistant_turn"] == 1
    assert data["counts"]["chat"]["dropped_total"] == 1
    rec = json.loads((run / "stages" / "data.json").read_text())
    assert (data["seed"], data["max_seq_len"]) == (3, rec["resolved_config"]["data"]["max_seq_len"])
    assert data["tokenizer"]["sha256"] == "a" * 64
    assert data["samples_sha256"] == sha256_file(run / "data" / "samples.jsonl")
    shard = run / "cache" / "shard-00000.safetensors"
    assert cache["shards"] == [{"file": "cache/shard-00000.safetensors", "sha256": sha256_file(shard),
                                "bytes": shard.stat().st_size, "in_index": True}]
    assert cache["content_sha256"] == "c" * 64 and cache["index_sha256"] == sha256_file(run / "cache" / "index.json")
    assert (cache["aux_layer_ids"], cache["dtype"]) == ([2, 4], "bfloat16")
    assert set(cal["timing"]) == {"data", "cache"} and cal["not_run"] == []


def test_quant_run_manifest_fields(run):
    q = json.loads((run / "quant_run_manifest.json").read_text())
    _validate(q, "quant_run_manifest")
    by = {(c["kind"], c["variant"]): c for c in q["checkpoints"]}
    assert set(by) == {("drafter", "bf16"), ("drafter", "nvfp4")}
    ck = by[("drafter", "nvfp4")]
    qcfg = json.loads((run / "stages" / "quantize-drafter-nvfp4.json").read_text())["resolved_config"]["quant"]
    assert ck["quant_config"] == qcfg and ck["scheme"] == qcfg["scheme"] == "nvfp4"
    assert ck["observer"] == qcfg["observer"] and isinstance(ck["observer"], str)
    assert ck["observer_kwargs"] == {"averaging_constant": 0.01}
    assert ck["ignore"] == ["lm_head", "re:.*q_proj", "re:.*k_proj", "re:.*v_proj"]  # the effective list
    assert ck["group_size"] == 16
    assert ck["recipe"]["text"] == RECIPE and ck["recipe"]["parsed"] == yaml.safe_load(RECIPE)
    assert ck["seeds"] == {"seed": 3, "calibration_seed": 7, "anchors": 11}
    assert ck["quantization_config"]["format"] == "nvfp4-pack-quantized"
    src = FIX / "speculators" / "checkpoint"
    assert ck["inputs"]["drafter"]["files"]["model.safetensors"]["sha256"] == sha256_file(src / "model.safetensors")
    assert ck["inputs"]["target"]["files"]["model.safetensors"]["sha256"] == sha256_file(FIX / "target" / "model.safetensors")
    assert set(ck["inputs"]["target"]["files"]) == {"config.json", "model.safetensors"}  # weights + config only
    assert ck["inputs"]["calibration_cache"]["content_sha256"] == "c" * 64
    out = run / "drafter" / "nvfp4"
    assert ck["files"] == {f: {"sha256": sha256_file(out / f), "bytes": (out / f).stat().st_size}
                           for f in ("config.json", "model.safetensors", "recipe.yaml")}
    assert ck["checks"]["report"] == {"kl_vs_bf16": 0.01}
    bf16 = by[("drafter", "bf16")]
    assert bf16["scheme"] == "unquantized" and bf16["quant_config"] is None and bf16["ignore"] is None
    assert bf16["stage"]["record"] == "stages/quantize-drafter-nvfp4.json"  # the stage that wrote it
    assert bf16["inputs"]["drafter"] == ck["inputs"]["drafter"] and bf16["inputs"]["calibration_cache"] is None
    env = q["environment"]
    assert {"torch", "transformers", "llmcompressor", "compressed-tensors", "specquant"} <= set(env["versions"])
    assert set(env["git"]) >= {"commit", "dirty"} and env["device"]["machine"]
    assert ck["stage"]["git"]["commit"] == env["git"]["commit"]
    assert all(isinstance(t["wall_time_s"], float) for t in q["timing"].values())
    # a stage's own timings move out of its result into the timing section
    assert "timings" not in ck["stage"]["result"] and "load_s" not in ck["stage"]["result"]
    assert q["timing"]["quantize-drafter-nvfp4"]["result"] == {"timings": {"oneshot_s": 1.5}, "load_s": 0.25}
    assert q["not_run"] == ["quantize-target", "evaluate", "serve-check"]


def test_provenance_folder(run):
    p = run / "provenance"
    cmds = json.loads((p / "commands.json").read_text())
    assert [c["stage"] for c in cmds] == ["data", "cache", "quantize-drafter"]
    rec = json.loads((run / "stages" / "quantize-drafter-nvfp4.json").read_text())
    assert cmds[2]["argv"] == rec["argv"] and cmds[2]["overrides"] == rec["overrides"]
    assert " ".join(rec["overrides"][:2]) in (p / "commands.sh").read_text()
    subprocess.run(["bash", "-n", str(p / "commands.sh")], check=True)
    cfg = yaml.safe_load((p / "resolved_config" / "quantize-drafter-nvfp4.yaml").read_text())
    assert cfg["quant"]["scheme"] == "nvfp4" and cfg["run_dir"] == str(run)
    src = json.loads((p / "source" / "SOURCE.json").read_text())
    assert src["files"]["pipeline/stages/manifest.py"]["sha256"] == sha256_file(REPO / "pipeline" / "manifest.py")
    assert (p / "source" / "pipeline" / "stage.py").read_bytes() == (REPO / "pipeline" / "stage.py").read_bytes()
    assert (p / "source" / "git.diff").exists() == bool(src["git"]["dirty"] and src["git"]["diff"])
    att = json.loads((p / "attestation.intoto.json").read_text())
    assert att["_type"] == "https://in-toto.io/Statement/v1" and att["predicateType"] == "https://slsa.dev/provenance/v1"
    bd = att["predicate"]["buildDefinition"]
    assert {"buildType", "externalParameters", "internalParameters", "resolvedDependencies"} <= set(bd)
    assert att["predicate"]["runDetails"]["builder"]["id"]
    import datetime as dt

    meta = att["predicate"]["runDetails"]["metadata"]
    assert dt.datetime.fromisoformat(meta["startedOn"]) <= dt.datetime.fromisoformat(meta["finishedOn"])
    assert all(set(d) & {"uri", "digest"} for d in bd["resolvedDependencies"])
    deps = {d["name"]: d for d in bd["resolvedDependencies"]}
    assert deps[f"{FIX / 'target'}/model.safetensors"]["digest"]["sha256"] == sha256_file(FIX / "target" / "model.safetensors")
    every = provenance.list_files(run, lambda r: provenance.is_late(r))
    expected = sorted(set(every) - {provenance.ATTESTATION, provenance.FILE_LIST})
    assert [s["name"] for s in att["subject"]] == expected
    assert all(s["digest"]["sha256"] == sha256_file(run / s["name"]) for s in att["subject"])


def test_vllm_serve_command_runs(run, tmp_path):
    """The script calls `vllm serve` with valid JSON: a stand-in `vllm` on PATH prints its argv."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "vllm"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(run / "provenance" / "vllm_serve.sh"), "nvfp4"], env=env, check=True,
                         capture_output=True, text=True).stdout
    argv = json.loads(out)
    assert argv[:2] == ["serve", str(FIX / "target")]
    assert argv[2:5] == ["--attention-backend", "FLASH_ATTN", "--speculative-config"]  # non-causal drafting
    spec = json.loads(argv[5])
    assert spec == {"method": "dflash", "model": f"{run.resolve()}/drafter/nvfp4", "num_speculative_tokens": 3}
    bad = subprocess.run(["bash", str(run / "provenance" / "vllm_serve.sh"), "nope"], env=env, capture_output=True)
    assert bad.returncode == 2


def test_eval_commands_compose_per_subset(run):
    """Each per-subset command's overrides compose with the real config tree to exactly one prompt set."""
    text = (run / "provenance" / "eval_commands.sh").read_text()
    subprocess.run(["bash", "-n", str(run / "provenance" / "eval_commands.sh")], check=True)
    import shlex

    cmds = [shlex.split(line) for line in text.splitlines() if line.startswith("python -m pipeline evaluate")]
    assert len(cmds) == 3 and "vllm bench serve" in text
    names = []
    for argv in cmds:
        cfg = compose(argv[4:])
        assert len(cfg.eval.prompt_sets) == 1
        names.append(cfg.eval.prompt_sets[0].name)
        assert cfg.eval.prompt_sets[0].path.startswith("assets/tiny/eval/")
    assert names == ["chat", "math", "code"]


@pytest.mark.faults("secret")
def test_planted_token_never_written(run):
    hits = [p for p in [run / "calibration_manifest.json", run / "quant_run_manifest.json",
                        *(run / "provenance").rglob("*")]
            if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert hits == []
    assert TOKEN in (run / "stages" / "data.json").read_text()  # the plant really was in the inputs


def test_byte_stable_across_writes(run, monkeypatch):
    def snapshot():
        return {r: (run / r).read_bytes() for r in provenance.list_files(run, provenance.is_late)}

    first = snapshot()
    for _ in range(3):  # others may edit the shared checkout between two writes; CI's tree is still
        run_manifest(run, _overrides(run.parent), monkeypatch)
        second = snapshot()
        if second["provenance/source/SOURCE.json"] == first["provenance/source/SOURCE.json"]:
            break
        first = second
    assert second == first


def test_degrades_when_stages_missing(tmp_path, monkeypatch):
    rd, ov = build_run(tmp_path, monkeypatch, stages=("data",))
    result = run_manifest(rd, ov, monkeypatch)
    cal = json.loads((rd / "calibration_manifest.json").read_text())
    q = json.loads((rd / "quant_run_manifest.json").read_text())
    _validate(cal, "calibration_manifest")
    _validate(q, "quant_run_manifest")
    assert cal["cache"] is None and cal["not_run"] == ["cache"] and q["checkpoints"] == []
    assert result["not_run"] == ["cache", "evaluate", "quantize-drafter", "quantize-target", "serve-check"]
    assert "vllm serve" not in (rd / "provenance" / "vllm_serve.sh").read_text().split("case")[1].split("*)")[0]


@pytest.mark.faults("tamper")
def test_corrupt_shard_refused_before_writing(tmp_path, monkeypatch):
    rd, ov = build_run(tmp_path, monkeypatch, stages=("data", "cache"))
    shard = rd / "cache" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecquantError, match="cache/shard-00000.safetensors"):
        run_manifest(rd, ov, monkeypatch)
    assert not (rd / "calibration_manifest.json").exists() and not (rd / "provenance").exists()


@pytest.mark.faults("bad_input")
def test_missing_run_dir_is_one_sentence(tmp_path):
    with pytest.raises(SpecquantError, match=r"`run_dir` = .*does not exist"):
        manifest.run(compose([f"runs_root={tmp_path}", "run_name=nothing"]))


@pytest.mark.parametrize("name", ["calibration_manifest", "quant_run_manifest"])
def test_committed_tiny_manifests_validate(name):
    path = REPO / "manifests" / "tiny" / f"{name}.json"
    if not path.is_file():
        pytest.skip("manifests/tiny/ is written by `python -m tests.repro --update-reference`")
    doc = json.loads(path.read_text())
    _validate(doc, name)
    # the reference is made on a CPU machine: serve-check (GPU + vLLM) is the one stage it says it did not run
    assert doc["not_run"] == ([] if name == "calibration_manifest" else ["serve-check"]) and doc["run_name"] == "tiny"


def test_tokenizer_section_agrees_with_the_data_stage(chat_tokenizer):
    """The manifest reports the data stage's tokenizer hashes, and hashes a bare path the same way."""
    from pipeline.stages import data

    hashes = data.tokenizer_hashes(chat_tokenizer)
    recorded = manifest._tokenizer({"tokenizer": {"name_or_path": str(chat_tokenizer), "revision": None, **hashes}}, {})
    fallback = manifest._tokenizer({}, {"target": {"tokenizer": str(chat_tokenizer)}})
    assert recorded["files"] == fallback["files"] == hashes["files"] and "tokenizer.json" in hashes["files"]
    assert recorded["sha256"] == fallback["sha256"] == hashes["sha256"]
