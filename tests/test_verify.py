"""`python -m pipeline verify`: a fresh run passes; one flipped byte, an extra or a missing file fails naming it.

The run is real: the session's data -> cache -> quantize-drafter nvfp4 -> manifest on the fixture world
(tests/conftest.py `tiny_run`), copied per test."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.config import compose
from pipeline.core.io import TMP_PREFIX, read_json
from pipeline.provenance import record as provenance
from pipeline.provenance import verify
from tests._support import HUB_BASE, REPO, overrides


@pytest.fixture(scope="module")
def pristine(tiny_run):
    return tiny_run["reference"]  # written by the real stages and the manifest stage; never changed here


@pytest.fixture
def run(pristine, tmp_path):
    dst = tmp_path / "copy" / pristine.name
    shutil.copytree(pristine, dst)
    return dst


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def test_fresh_run_verifies(run):
    assert verify.verify_dir(run) == []
    out = subprocess.run([sys.executable, "-m", "pipeline", "verify", str(run)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "verify: OK" in out.stdout


FLIPS = ["cache/shard-00000.safetensors", "cache/shard-00000.json", "cache/index.json", "data/samples.jsonl",
         "data/meta.json", "drafter/nvfp4/model.safetensors", "drafter/nvfp4/config.json", "drafter/nvfp4/recipe.yaml",
         "drafter/bf16/model.safetensors", "checks/drafter-nvfp4.json", "checks/drafter-nvfp4-weight-error.png",
         "stages/quantize-drafter-nvfp4.json", "stages/cache.json", "calibration_manifest.json",
         "quant_run_manifest.json", "provenance/commands.sh", "provenance/commands.json",
         "provenance/resolved_config/cache.yaml",
         "provenance/source/pipeline/stages/runner.py", "provenance/source/SOURCE.json", "provenance/vllm_serve.sh",
         "provenance/eval_commands.sh", "provenance/attestation.intoto.json", "provenance/files.sha256.json"]


@pytest.mark.parametrize("rel", FLIPS)
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
@pytest.mark.faults("tamper")
def test_one_flipped_byte_is_named(run, rel, where):
    _flip(run / rel, where)
    problems = verify.verify_dir(run)
    assert problems and any(p.startswith(f"{rel}:") for p in problems), problems


@pytest.mark.faults("tamper")
def test_cli_fails_naming_the_file(run):
    _flip(run / "drafter/nvfp4/model.safetensors")
    out = subprocess.run([sys.executable, "-m", "pipeline", "verify", str(run)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1
    assert "verify: drafter/nvfp4/model.safetensors: changed" in out.stdout and "FAILED" in out.stdout


@pytest.mark.faults("tamper")
def test_extra_missing_and_temp_files(run):
    (run / "drafter/nvfp4/extra.bin").write_bytes(b"x")
    (run / "cache/shard-00000.safetensors").unlink()
    (run / "data" / f"{TMP_PREFIX}abc").write_bytes(b"partial")
    (run / "drafter/nvfp4/escape.safetensors").symlink_to("/etc/hostname")
    problems = verify.verify_dir(run)
    assert "drafter/nvfp4/extra.bin: extra file, not listed in provenance/files.sha256.json" in problems
    assert "cache/shard-00000.safetensors: missing (listed in provenance/files.sha256.json)" in problems
    assert f"data/{TMP_PREFIX}abc: extra temporary file left by an interrupted write" in problems
    assert any(p.startswith("drafter/nvfp4/escape.safetensors: extra symbolic link") for p in problems)


@pytest.mark.faults("tamper")
def test_record_edited_consistently_is_caught_by_other_records(run):
    """Re-writing the list so it agrees with a changed shard still fails: the manifests and statement disagree."""
    _flip(run / "cache/shard-00000.safetensors")
    provenance.write_file_list(run, kind="run")
    problems = verify.verify_dir(run)
    assert any(p.startswith("cache/shard-00000.safetensors") or "for cache/shard-00000.safetensors" in p
               for p in problems), problems
    assert any(p.startswith("calibration_manifest.json:") for p in problems)
    assert any(p.startswith("provenance/attestation.intoto.json:") for p in problems)


def test_late_outputs_are_not_extra(run):
    """Stage records written after the manifest (its own, publish's: by the one writer) and publish/ are no extra
    files (publish/ itself: test_published_folder)."""
    from pipeline.artifacts.stage_record import read_record, write_record

    rec = read_record(run / "stages" / "cache.json")
    write_record(run, "manifest", dataclasses.replace(rec, stage="manifest"))
    write_record(run, "publish", dataclasses.replace(rec, stage="publish"))
    assert verify.verify_dir(run) == []


def _publish(run: Path) -> Path:
    """The publish stage's dry run (it assembles publish/nvfp4/ and writes its file list last)."""
    from pipeline.stages import publish

    publish.run(compose(overrides(run.parent, f"publish.base_model={HUB_BASE}", "publish.namespace=specquant-test")))
    return run / "publish" / "nvfp4"


@pytest.mark.faults("tamper")
def test_published_folder(run):
    pub = _publish(run)
    assert verify.verify_dir(pub) == []
    assert verify.verify_dir(run) == []  # the run dir verifies publish/<variant>/ too
    _flip(pub / "model.safetensors")
    assert any(p.startswith("model.safetensors: changed") for p in verify.verify_dir(pub))
    assert any(p.startswith("publish/nvfp4/model.safetensors: changed") for p in verify.verify_dir(run))


@pytest.mark.faults("tamper")
def test_published_file_that_differs_from_the_run_is_named(run):
    pub = _publish(run)
    _flip(pub / "recipe.yaml")
    lst = read_json(pub / provenance.FILE_LIST)
    provenance.write_file_list(pub, kind="published",
                               origins={r: e["origin"] for r, e in lst["files"].items() if "origin" in e})
    problems = verify.verify_dir(pub)
    assert any("recipe.yaml" in p and "attestation" in p for p in problems), problems


def test_missing_list_and_not_a_dir(tmp_path):
    assert verify.verify_dir(tmp_path / "nope") == [f"{tmp_path / 'nope'}: not a directory"]
    (tmp_path / "x").mkdir()
    assert verify.verify_dir(tmp_path / "x")[0].startswith("provenance/files.sha256.json: missing")


@pytest.mark.faults("bad_input")
def test_cli_on_a_missing_path_is_one_sentence(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipeline", "verify", str(tmp_path / "nope")], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "`path` = " in out.stderr


def test_an_attestation_subject_whose_name_key_was_altered_is_named_not_a_traceback(run):
    """A flipped byte can turn `"name"` into `"oame"` (0x6e ^ 0x01): verify says so; CI hit this as a TypeError."""
    att = run / provenance.ATTESTATION
    text = att.read_text()
    first = text.index('"name"', text.index('"subject"'))
    att.write_text(text[:first] + '"oame"' + text[first + 6:])
    json.loads(att.read_text())  # still valid JSON: only the key changed
    problems = verify.verify_dir(run)
    assert any(p.startswith(f"{provenance.ATTESTATION}: 1 subject(s) without a file name") for p in problems), problems


def test_file_list_reader_round_trips_the_writer(run, tmp_path):
    """The run's list (written by the manifest stage through pipeline/artifacts/file_list.py) reads back field for
    field, and the writer gives the same bytes again from the same entries."""
    from pipeline.artifacts import file_list

    raw = read_json(run / provenance.FILE_LIST)
    listing = file_list.read(run / provenance.FILE_LIST)
    assert (listing.kind, listing.schema, listing.files_sha256) == ("run", file_list.SCHEMA, raw["files_sha256"])
    assert {r: (e.sha256, e.bytes, e.origin) for r, e in listing.files.items()} == \
        {r: (e["sha256"], e["bytes"], None) for r, e in raw["files"].items()}
    again = file_list.write(tmp_path, raw["files"], "run")
    assert (tmp_path / provenance.FILE_LIST).read_bytes() == (run / provenance.FILE_LIST).read_bytes()
    assert again == listing


@pytest.mark.faults("bad_input")
def test_a_file_list_of_another_schema_is_one_sentence(run):
    """A list rewritten consistently (its own sha256 recomputed) under another schema: the reader refuses it in one
    sentence, and verify reports that sentence as one problem instead of checking files against it."""
    from pipeline.artifacts import file_list
    from pipeline.core.errors import SpecquantError
    from pipeline.core.io import atomic_write_json

    doc = {**read_json(run / provenance.FILE_LIST), "schema": "specquant.files/v2"}
    atomic_write_json(run / provenance.FILE_LIST, {**doc, "files_sha256": file_list.files_sha256_of(doc)})
    with pytest.raises(SpecquantError, match=r"^`provenance/files.sha256.json schema` = 'specquant.files/v2': this "
                       r"specquant reads file lists of schema specquant.files/v1 only; re-run"):
        file_list.read(run / provenance.FILE_LIST)
    problems = verify.verify_dir(run)
    assert len(problems) == 1 and problems[0].startswith(
        "provenance/files.sha256.json: `provenance/files.sha256.json schema` = 'specquant.files/v2'"), problems


@pytest.mark.faults("tamper")
def test_a_manifest_that_is_json_but_no_manifest_is_named_not_a_traceback(run):
    """A quant run manifest whose checkpoints lost a required field (valid JSON still): verify names it twice
    (changed, and what its reader refuses), no traceback."""
    doc = read_json(run / "quant_run_manifest.json")
    del doc["checkpoints"][0]["path"]
    (run / "quant_run_manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    problems = verify.verify_dir(run)
    assert any(p.startswith("quant_run_manifest.json: changed (") for p in problems), problems
    assert any(p.startswith("quant_run_manifest.json: `quant_run_manifest.json checkpoints/0` = None: the file does "
                            "not match manifests/quant_run_manifest.schema.json") for p in problems), problems
