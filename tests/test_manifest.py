"""Manifest stage on real runs: the session's fixture-world run (tests/conftest.py `tiny_run`: data written by
the data format's writer, the real cache stage, quantize-drafter nvfp4 as a subprocess, the real manifest) and,
for the data section, the real data stage on the tiny corpus. Every input comes from its writer."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from pipeline.artifacts import samples as samples_file
from pipeline.artifacts.cache import read_index
from pipeline.artifacts.check_report import load_report
from pipeline.artifacts.stage_record import read_record
from pipeline.core.config import compose
from pipeline.core.errors import SpecquantError
from pipeline.core.io import sha256_file
from pipeline.provenance import record as provenance
from pipeline.stages import ORDER, manifest
from tests._support import DRAFTER, REPO, TARGET, geometry, overrides

TOKEN = "sq_PlantedSecretToken1234567890abcdef"  # not HF-shaped: caught as the known value of HF_TOKEN


@pytest.fixture(scope="module")
def run(tiny_run):
    """The session's real run (data, cache, quantize-drafter nvfp4, manifest); read-only here."""
    return tiny_run["reference"]


def _manifest(run_dir, monkeypatch=None, token: str | None = None) -> dict:
    """The manifest stage on `run_dir` (runs root = its parent, run name = its name)."""
    mp = monkeypatch or pytest.MonkeyPatch()
    try:
        if token:
            mp.setenv("HF_TOKEN", token)
        return manifest.run(compose([f"runs_root={run_dir.parent}", f"run_name={run_dir.name}"]))
    finally:
        if monkeypatch is None:
            mp.undo()


@pytest.fixture(scope="module")
def data_run(tmp_path_factory, chat_tokenizer):
    """The real data stage (through pipeline.stages.runner, so its record is genuine) on the tiny corpus, with a
    token planted in its overrides, then the manifest stage with that token known: a run of one stage."""
    from pipeline.stages.runner import run_stage

    root = tmp_path_factory.mktemp("data_run")
    ov = [f"runs_root={root}", "run_name=d", "seed=3", f"target.tokenizer={chat_tokenizer}",
          "data.num_samples=6", f"publish.namespace={TOKEN}"]
    mp = pytest.MonkeyPatch()
    try:
        mp.delenv("HF_TOKEN", raising=False)  # the record is written before the token is known
        mp.setattr(sys, "argv", [str(REPO / "pipeline" / "__main__.py"), "data", *ov])
        run_stage("data", "pipeline.stages.data", compose(ov), ov)
        result = _manifest(root / "d", mp, token=TOKEN)
    finally:
        mp.undo()
    return root / "d", result


def _validate(doc: dict, name: str) -> None:
    import jsonschema

    schema = json.loads((REPO / "manifests" / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


def test_calibration_manifest_fields(run):
    cal = json.loads((run / "calibration_manifest.json").read_text())
    _validate(cal, "calibration_manifest")
    data, cache = cal["data"], cal["cache"]
    meta, counts = samples_file.load_meta(run / "data"), samples_file.load_counts(run / "data")
    assert data["meta"] == dataclasses.asdict(meta)
    assert [s["name"] for s in data["sources"]] == [s.name for s in meta.sources] and "revision" in data["sources"][0]
    assert set(data["counts"]) == set(counts)
    for src, c in counts.items():
        assert data["counts"][src] == {**dataclasses.asdict(c), "dropped_total": sum(c.dropped.values())}
    assert (data["seed"], data["max_seq_len"]) == (meta.seed, meta.max_seq_len)
    assert data["samples_sha256"] == sha256_file(run / "data" / "samples.jsonl") == meta.samples_sha256
    assert (data["num_samples"], data["num_tokens"]) == (meta.num_samples, meta.num_tokens)
    index = read_index(run / "cache")
    assert cache["shards"] == [{"file": f"cache/{s['file']}", "sha256": sha256_file(run / "cache" / s["file"]),
                                "bytes": (run / "cache" / s["file"]).stat().st_size, "in_index": True}
                               for s in index["shards"]]
    assert len(cache["shards"]) > 1  # tiny_run writes 4 samples per shard
    assert cache["content_sha256"] == index["content_hash"]
    assert cache["index_sha256"] == sha256_file(run / "cache" / "index.json")
    assert (cache["aux_layer_ids"], cache["dtype"]) == (index["aux_layer_ids"], index["storage_dtype"]) \
        == (geometry()["aux_layer_ids"], "float32")
    assert cache["target_variant"] == "bf16" and cal["target_caches"] == {}
    assert set(cal["timing"]) == {"cache"} and cal["not_run"] == []  # the data files come from the format's writer


def test_data_section_of_the_real_data_stage(data_run, chat_tokenizer):
    """The data stage's own files: sources, counts with their drop totals, and the tokenizer's file hashes as
    the data stage computes them (`pipeline.stages.data.tokenizer_hashes`)."""
    from pipeline.stages import data as data_stage

    rd, _ = data_run
    cal = json.loads((rd / "calibration_manifest.json").read_text())
    data = cal["data"]
    rec = read_record(rd / "stages" / "data.json")
    assert [s["name"] for s in data["sources"]] == ["chat", "math", "code"]
    assert all(s["sha256"] == sha256_file(REPO / s["path"]) for s in data["sources"])
    assert sum(c["kept"] for c in data["counts"].values()) == data["num_samples"] == 6
    assert all(c["dropped_total"] == sum(c["dropped"].values()) for c in data["counts"].values())
    assert (data["seed"], data["max_seq_len"]) == (3, rec.resolved_config["data"]["max_seq_len"])
    hashes = data_stage.tokenizer_hashes(chat_tokenizer)
    assert "tokenizer.json" in hashes["files"]
    assert data["tokenizer"] == {"path": str(chat_tokenizer), "revision": None, **hashes}
    assert data["samples_sha256"] == sha256_file(rd / "data" / "samples.jsonl")
    assert set(cal["timing"]) == {"data"}


def test_quant_run_manifest_fields(run):
    q = json.loads((run / "quant_run_manifest.json").read_text())
    _validate(q, "quant_run_manifest")
    by = {(c["kind"], c["variant"]): c for c in q["checkpoints"]}
    assert set(by) == {("drafter", "bf16"), ("drafter", "nvfp4")}
    ck = by[("drafter", "nvfp4")]
    rec = read_record(run / "stages" / "quantize-drafter-nvfp4.json")
    qcfg = rec.config("quant")
    assert ck["quant_config"] == qcfg and ck["scheme"] == rec.result["scheme"] == "nvfp4"
    assert ck["observer"] == rec.result.get("observer", qcfg["observer"]) and isinstance(ck["observer"], str)
    assert ck["observer_kwargs"] == rec.result.get("observer_kwargs", qcfg["observer_kwargs"])
    assert ck["ignore"] == rec.result["ignore"] and "lm_head" in " ".join(ck["ignore"])  # the effective list
    assert ck["group_size"] == rec.result.get("group_size", qcfg["group_size"]) == 16
    out = run / "drafter" / "nvfp4"
    text = (out / "recipe.yaml").read_text()
    assert ck["recipe"]["text"] == text and ck["recipe"]["parsed"] == yaml.safe_load(text)
    assert ck["seeds"]["seed"] == rec.seed == 0
    assert all(ck["seeds"][k] == v for k, v in rec.result.items() if "seed" in k and isinstance(v, int))
    conf = json.loads((out / "config.json").read_text())
    assert ck["quantization_config"] == conf["quantization_config"]
    assert ck["inputs"]["drafter"]["files"]["model.safetensors"]["sha256"] == sha256_file(DRAFTER / "model.safetensors")
    assert ck["inputs"]["target"]["files"]["model.safetensors"]["sha256"] == sha256_file(TARGET / "model.safetensors")
    assert set(ck["inputs"]["target"]["files"]) == {"config.json", "model.safetensors"}  # weights + config only
    assert ck["inputs"]["calibration_cache"]["content_sha256"] == read_index(run / "cache")["content_hash"]
    assert ck["files"] == {f: {"sha256": sha256_file(out / f), "bytes": (out / f).stat().st_size}
                           for f in sorted(p.name for p in out.iterdir())}
    assert ck["checks"]["report"] == load_report(run / "checks", "drafter", "nvfp4").to_json()
    bf16 = by[("drafter", "bf16")]
    assert bf16["scheme"] == "unquantized" and bf16["quant_config"] is None and bf16["ignore"] is None
    assert bf16["vllm"] is None  # the reference is written for no vLLM range (no quantize-drafter record names one)
    assert bf16["stage"]["record"] == "stages/quantize-drafter-nvfp4.json"  # the stage that wrote it
    assert bf16["inputs"]["drafter"] == ck["inputs"]["drafter"] and bf16["inputs"]["calibration_cache"] is None
    env = q["environment"]
    assert {"torch", "transformers", "llmcompressor", "compressed-tensors", "specquant"} <= set(env["versions"])
    assert set(env["git"]) >= {"commit", "dirty"} and env["device"]["machine"]
    assert ck["stage"]["git"]["commit"] == rec.git["commit"]
    assert all(isinstance(t["wall_time_s"], float) for t in q["timing"].values())
    # a stage's own timings move out of its result into the timing section
    timed = {k: v for k, v in rec.result.items() if manifest._is_timing(k)}
    assert "timings" in timed and not set(timed) & set(ck["stage"]["result"])
    assert q["timing"]["quantize-drafter-nvfp4"]["result"] == timed
    assert q["not_run"] == [s for s in ORDER[:ORDER.index("manifest")] if s not in ("cache", "quantize-drafter")]


def test_provenance_folder(run):
    p = run / "provenance"
    cmds = json.loads((p / "commands.json").read_text())
    assert [c["stage"] for c in cmds] == ["cache", "quantize-drafter"]
    rec = read_record(run / "stages" / "quantize-drafter-nvfp4.json")
    assert cmds[1]["argv"] == rec.argv and cmds[1]["overrides"] == rec.overrides
    assert " ".join(rec.overrides[:2]) in (p / "commands.sh").read_text()
    subprocess.run(["bash", "-n", str(p / "commands.sh")], check=True)
    cfg = yaml.safe_load((p / "resolved_config" / "quantize-drafter-nvfp4.yaml").read_text())
    assert cfg["quant"]["scheme"] == "nvfp4" and cfg["run_dir"] == str(run)
    src = json.loads((p / "source" / "SOURCE.json").read_text())
    for rel in ("pipeline/stages/manifest.py", "pipeline/stages/runner.py"):
        assert src["files"][rel]["sha256"] == sha256_file(p / "source" / rel)
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
    assert deps[f"{TARGET}/model.safetensors"]["digest"]["sha256"] == sha256_file(TARGET / "model.safetensors")
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
    assert argv[:2] == ["serve", str(TARGET)]
    assert argv[2:5] == ["--attention-backend", "FLASH_ATTN", "--speculative-config"]  # non-causal drafting
    spec = json.loads(argv[5])
    assert spec == {"method": "dflash", "model": f"{run.resolve()}/drafter/nvfp4",
                    "num_speculative_tokens": geometry()["block_size"] - 1, "quantization": "compressed-tensors"}
    bad = subprocess.run(["bash", str(run / "provenance" / "vllm_serve.sh"), "nope"], env=env, capture_output=True)
    assert bad.returncode == 2


def test_eval_commands_compose_per_subset(run):
    """Each per-subset command's overrides compose with the real config tree to exactly one prompt set; with
    no evaluate stage (and so no eval/vllm_commands.sh) the script says so and has no vLLM section."""
    text = (run / "provenance" / "eval_commands.sh").read_text()
    subprocess.run(["bash", "-n", str(run / "provenance" / "eval_commands.sh")], check=True)
    import shlex

    cmds = [shlex.split(line) for line in text.splitlines() if line.startswith("python -m pipeline evaluate")]
    assert len(cmds) == 3
    assert not (run / "eval" / "vllm_commands.sh").exists() and "vllm bench serve" not in text
    assert "the evaluate stage has not run" in text
    names = []
    for argv in cmds:
        cfg = compose(argv[4:])
        assert len(cfg.eval.prompt_sets) == 1
        names.append(cfg.eval.prompt_sets[0].name)
        assert cfg.eval.prompt_sets[0].path.startswith("assets/tiny/eval/")
    assert names == ["chat", "math", "code"]


@pytest.mark.faults("secret")
def test_planted_token_never_written(data_run):
    rd, _ = data_run
    hits = [p for p in [rd / "calibration_manifest.json", rd / "quant_run_manifest.json", *(rd / "provenance").rglob("*")]
            if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert hits == []
    assert TOKEN in (rd / "stages" / "data.json").read_text()  # the plant really was in the inputs


def test_byte_stable_across_writes(run, tmp_path, monkeypatch):
    copy = tmp_path / run.parent.name / run.name
    shutil.copytree(run, copy)
    _manifest(copy, monkeypatch)

    def snapshot():
        return {r: (copy / r).read_bytes() for r in provenance.list_files(copy, provenance.is_late)}

    first = snapshot()
    for _ in range(3):  # others may edit the shared checkout between two writes; CI's tree is still
        _manifest(copy, monkeypatch)
        second = snapshot()
        if second["provenance/source/SOURCE.json"] == first["provenance/source/SOURCE.json"]:
            break
        first = second
    assert second == first


def test_degrades_when_stages_missing(data_run):
    rd, result = data_run
    cal = json.loads((rd / "calibration_manifest.json").read_text())
    q = json.loads((rd / "quant_run_manifest.json").read_text())
    _validate(cal, "calibration_manifest")
    _validate(q, "quant_run_manifest")
    assert cal["cache"] is None and cal["not_run"] == ["cache"] and q["checkpoints"] == []
    assert result["not_run"] == ["cache", "evaluate", "quantize-drafter", "quantize-target", "serve-check"]
    assert "vllm serve" not in (rd / "provenance" / "vllm_serve.sh").read_text().split("case")[1].split("*)")[0]


@pytest.mark.faults("tamper")
def test_corrupt_shard_refused_before_writing(tiny_run, tmp_path):
    rd = tmp_path / "runs" / "qw"
    shutil.copytree(tiny_run["template"], rd)  # data + cache, no manifest yet
    assert not (rd / "calibration_manifest.json").exists()
    shard = rd / "cache" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecquantError, match="cache/shard-00000.safetensors"):
        manifest.run(compose(overrides(rd.parent)))
    assert not (rd / "calibration_manifest.json").exists() and not (rd / "provenance").exists()


@pytest.mark.faults("bad_input")
def test_missing_run_dir_is_one_sentence(tmp_path):
    with pytest.raises(SpecquantError, match=r"`run_dir` = .*does not exist"):
        manifest.run(compose([f"runs_root={tmp_path}", "run_name=nothing"]))


@pytest.mark.faults("bad_input")
def test_unknown_format_versions_are_one_sentence(tiny_run, tmp_path):
    """A stage record or cache index of another format version is refused naming the file, field and value."""
    from pipeline.core.io import atomic_write_json, read_json

    rd = tmp_path / "runs" / "qw"
    shutil.copytree(tiny_run["template"], rd)
    rec = read_json(rd / "stages" / "cache.json")
    atomic_write_json(rd / "stages" / "cache.json", {**rec, "format_version": 99})
    with pytest.raises(SpecquantError, match=r"`stages/cache.json format_version` = 99: .*version 1"):
        manifest.run(compose(overrides(rd.parent)))
    atomic_write_json(rd / "stages" / "cache.json", rec)
    index = read_json(rd / "cache" / "index.json")
    atomic_write_json(rd / "cache" / "index.json", {**index, "format_version": 2})
    with pytest.raises(SpecquantError, match=r"`cache/index.json` = .*specquant-cache v1 index"):
        manifest.run(compose(overrides(rd.parent)))


@pytest.mark.faults("bad_input")
def test_check_report_of_another_format_is_one_sentence(run, tmp_path):
    """A check report whose field set is not the writer's (pipeline.artifacts.check_report) is refused, naming
    the file and the field; the report as written reads back to the same bytes."""
    from pipeline.core.io import atomic_write_json, dumps_json, read_json

    rd = tmp_path / "runs" / "qw"
    shutil.copytree(run, rd)
    path = rd / "checks" / "drafter-nvfp4.json"
    assert dumps_json(load_report(rd / "checks", "drafter", "nvfp4").to_json()).encode() == path.read_bytes()
    doc = read_json(path)
    atomic_write_json(path, {**doc, "max_rel_error": 0.1})
    with pytest.raises(SpecquantError, match=r"`checks/drafter-nvfp4.json max_rel_error` = 0.1: .*does not know"):
        manifest.run(compose(overrides(rd.parent)))
    atomic_write_json(path, {k: v for k, v in doc.items() if k != "weight_error"})
    with pytest.raises(SpecquantError, match=r"`checks/drafter-nvfp4.json weight_error` = None: .*has no such field"):
        manifest.run(compose(overrides(rd.parent)))


@pytest.mark.parametrize("name", ["calibration_manifest", "quant_run_manifest"])
def test_committed_tiny_manifests_validate(name):
    path = REPO / "manifests" / "tiny" / f"{name}.json"
    if not path.is_file():
        pytest.skip("manifests/tiny/ is written by `python -m tests.repro --update-reference`")
    doc = json.loads(path.read_text())
    _validate(doc, name)
    # the reference is made on a CPU machine: serve-check (GPU + vLLM) is the one stage it says it did not run
    assert doc["not_run"] == ([] if name == "calibration_manifest" else ["serve-check"]) and doc["run_name"] == "tiny"


def test_readers_round_trip_what_the_stage_wrote(run, tmp_path):
    """The manifests the real stage wrote read back through pipeline/artifacts/manifests.py, field for field,
    and its writer gives the same bytes again from the same documents."""
    from pipeline.artifacts import manifests

    cal_doc = json.loads((run / manifests.CALIBRATION).read_text())
    q_doc = json.loads((run / manifests.QUANT_RUN).read_text())
    cal, q = manifests.read_calibration(run / manifests.CALIBRATION), manifests.read_quant_run(run / manifests.QUANT_RUN)
    assert cal.schema == manifests.SCHEMAS[manifests.CALIBRATION] and cal.run_name == cal_doc["run_name"]
    assert [s.name for s in cal.sources] == [s["name"] for s in cal_doc["data"]["sources"]]
    assert [(s.file, s.sha256, s.bytes) for s in cal.cache.shards] == \
        [(s["file"], s["sha256"], s["bytes"]) for s in cal_doc["cache"]["shards"]]
    assert cal.cache.aux_layer_ids == cal_doc["cache"]["aux_layer_ids"]
    assert q.seed == q_doc["seed"] and len(q.checkpoints) == len(q_doc["checkpoints"])
    for entry, doc in zip(q.checkpoints, q_doc["checkpoints"], strict=True):
        assert (entry.kind, entry.variant, entry.path, entry.scheme, entry.quant_config, entry.ignore, entry.seeds) == \
            (doc["kind"], doc["variant"], doc["path"], doc["scheme"], doc["quant_config"], doc["ignore"], doc["seeds"])
        assert {r: (d.sha256, d.bytes) for r, d in entry.files.items()} == \
            {r: (e["sha256"], e["bytes"]) for r, e in doc["files"].items()}
    assert q.checkpoint("drafter", "nvfp4").path == "drafter/nvfp4" and q.checkpoint("drafter", "nope") is None
    texts = manifests.write(tmp_path, cal_doc, q_doc)
    for name in (manifests.CALIBRATION, manifests.QUANT_RUN):
        assert (tmp_path / name).read_bytes() == (run / name).read_bytes() == texts[name].encode()


@pytest.mark.faults("bad_input")
def test_a_manifest_of_another_schema_or_shape_is_one_sentence(run, tmp_path):
    """Another schema version, or a field the schema requires missing: one sentence naming file, field and fix."""
    from pipeline.artifacts import manifests
    from pipeline.core.io import atomic_write_json, read_json

    for name, read in ((manifests.QUANT_RUN, manifests.read_quant_run),
                       (manifests.CALIBRATION, manifests.read_calibration)):
        doc = read_json(run / name)
        other = doc["schema"].replace("/v1", "/v2")
        atomic_write_json(tmp_path / name, {**doc, "schema": other})
        with pytest.raises(SpecquantError) as exc:
            read(tmp_path / name)
        msg = str(exc.value)
        assert msg.startswith(f"`{name} schema` = {other!r}: this specquant reads {doc['schema']} only; re-run "
                              "`python -m pipeline manifest`") and "\n" not in msg and msg.count(". ") == 0, msg
    doc = read_json(run / manifests.QUANT_RUN)
    del doc["checkpoints"][0]["files"]
    atomic_write_json(tmp_path / manifests.QUANT_RUN, doc)
    with pytest.raises(SpecquantError, match=r"^`quant_run_manifest.json checkpoints/0` = None: the file does not "
                       r"match manifests/quant_run_manifest.schema.json \('files' is a required property\); re-run"):
        manifests.read_quant_run(tmp_path / manifests.QUANT_RUN)
    (tmp_path / manifests.CALIBRATION).write_text("{not json")
    with pytest.raises(SpecquantError, match=r"^`calibration_manifest.json` = .*not valid JSON"):
        manifests.read_calibration(tmp_path / manifests.CALIBRATION)


def test_checkpoint_states_the_vllm_range_it_is_written_for(run):
    """checkpoints[].vllm is the range quantize-drafter's record says the checkpoint was written and checked for
    (quant.vllm, pipeline.serving.contract), read back through the manifest reader; null for the bf16 reference."""
    from pipeline.artifacts import manifests
    from pipeline.serving import contract

    rec = read_record(run / "stages" / "quantize-drafter-nvfp4.json")
    doc = json.loads((run / manifests.QUANT_RUN).read_text())
    ck = next(c for c in doc["checkpoints"] if (c["kind"], c["variant"]) == ("drafter", "nvfp4"))
    assert ck["vllm"] == rec.result["vllm"] == contract.profile(rec.config("quant")["vllm"]).record()
    assert ck["vllm"]["profile"] == rec.config("quant")["vllm"] and ck["vllm"]["versions"].startswith("0.")
    assert ck["vllm"]["rules"] and all(":" in cite for cite in ck["vllm"]["rules"].values())  # file:line pinned
    q = manifests.read_quant_run(run / manifests.QUANT_RUN)
    assert q.checkpoint("drafter", "nvfp4").vllm == ck["vllm"] and q.checkpoint("drafter", "bf16").vllm is None
