"""repro-check's comparison: two runs of the same inputs in different run roots compare equal after the
documented exclusions (timing, run root); any other difference is named."""

from __future__ import annotations

import json

import pytest

from pipeline import repro
from tests.test_manifest import build_run, run_manifest


def _tree(rd):
    return json.loads((rd / "provenance/source/SOURCE.json").read_text())["tree_sha256"]


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    built = [build_run(tmp_path / side, monkeypatch) for side in ("a", "b")]
    for _ in range(3):  # other people may edit the checkout between the two snapshots; CI's tree is still
        for rd, ov in built:
            run_manifest(rd, ov, monkeypatch)
        if _tree(built[0][0]) == _tree(built[1][0]):
            break
    return [(rd, rd.parent) for rd, _ in built]


def test_same_inputs_compare_equal(two_runs):
    (a, ra), (b, rb) = two_runs
    assert (a / "provenance/commands.sh").read_bytes() != (b / "provenance/commands.sh").read_bytes()
    assert (a / "quant_run_manifest.json").read_bytes() != (b / "quant_run_manifest.json").read_bytes()
    da, skipped = repro.digests(a, ra)
    db, _ = repro.digests(b, rb)
    assert repro.compare(da, db) == []
    assert sorted(skipped) == ["stages/cache.json", "stages/data.json", "stages/quantize-drafter-nvfp4.json"]
    assert {"quant_run_manifest.json", "provenance/attestation.intoto.json", "provenance/files.sha256.json",
            "drafter/nvfp4/model.safetensors", "cache/shard-00000.safetensors"} <= set(da)


def test_a_real_difference_is_named(two_runs):
    (a, ra), (b, rb) = two_runs
    shard = b / "cache/shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    q = json.loads((b / "quant_run_manifest.json").read_text())
    q["checkpoints"][1]["ignore"] = []
    (b / "quant_run_manifest.json").write_text(json.dumps(q, indent=2, sort_keys=True) + "\n")
    diffs = repro.compare(repro.digests(a, ra)[0], repro.digests(b, rb)[0])
    assert [d.split(":")[0] for d in diffs] == ["cache/shard-00000.safetensors", "quant_run_manifest.json"]


def test_timing_fields_are_the_only_normalized_json(two_runs):
    (a, ra), _ = two_runs
    roots = [(str(ra), "<RUNS_ROOT>")]
    q = json.loads(repro.normalized(a, "quant_run_manifest.json", roots))
    assert q["timing"] == "<excluded>" and q["checkpoints"][1]["files"]["model.safetensors"]["sha256"] != "<excluded>"
    att = json.loads(repro.normalized(a, "provenance/attestation.intoto.json", roots))
    assert att["predicate"]["runDetails"]["metadata"]["startedOn"] == "<excluded>"
    assert "<RUNS_ROOT>" in json.dumps(att["predicate"]["buildDefinition"]["externalParameters"])


def test_excluded_patterns():
    assert repro.excluded("stages/data.json") and repro.excluded("eval/timings.json")
    assert repro.excluded("publish/nvfp4.json") and repro.excluded("publish/nvfp4/eval/timings.json")
    assert not repro.excluded("publish/nvfp4/config.json") and not repro.excluded("eval/results.json")
