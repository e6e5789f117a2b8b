"""repro-check's comparison: two runs of the same inputs in different run roots compare equal after the
documented exclusions (timing, run root); any other difference is named."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest

from pipeline.core.config import compose
from pipeline.stages import manifest
from tests import repro
from tests._support import ENV, overrides, run_main


def recorded_checkout(rd) -> dict:
    """The checkout state a run recorded, as the provenance functions return it: what its quantize-drafter stage
    saw (its record's git and source tree), what its manifest saw (the environment's git) and the source
    snapshot the manifest copied (provenance/source: SOURCE.json, the files, git.diff)."""
    src = rd / "provenance" / "source"
    snapshot = json.loads((src / "SOURCE.json").read_text())
    record = json.loads((rd / "stages" / "quantize-drafter-nvfp4.json").read_text())
    diff = (src / "git.diff").read_text() if snapshot["git"].get("diff") else ""
    info = {"git": snapshot["git"], "files": snapshot["files"], "tree_sha256": snapshot["tree_sha256"],
            "_blobs": {rel: (src / rel).read_bytes() for rel in snapshot["files"]}, "_diff": diff}
    manifest_git = json.loads((rd / "quant_run_manifest.json").read_text())["environment"]["git"]
    return {"stage_tree": record["source_sha256"], "stage_git": record["git"], "manifest_git": manifest_git,
            "source_info": info}


@contextlib.contextmanager
def checkout_as(git: dict, tree: str | None = None, info: dict | None = None):
    """The provenance functions (`pipeline.provenance.record`: git state, source tree, source snapshot) answer
    with this recorded state instead of reading the shared checkout, which others may edit meanwhile."""
    from pipeline.provenance import record

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(record, "git_state", lambda with_diff=False: {"untracked": [], **git,
                                                                  **({"_diff": ""} if with_diff else {})})
        if tree is not None:
            mp.setattr(record, "source_tree_sha256", lambda: tree)
        if info is not None:
            mp.setattr(record, "source_info", lambda: {**info, "_blobs": dict(info["_blobs"])})
        yield


@pytest.fixture(scope="module")
def built(tiny_run, tmp_path_factory):
    """Two runs of the same inputs in different run roots: the session's reference run (tiny_run: data + cache,
    quantize-drafter in a process of its own, the manifest) and a second root from the same data + cache
    (tiny_run's template, copied) through the same entry point in this process (`run_main`: the process
    state a new interpreter starts from, restored) and the manifest. `make repro-check` compares two whole
    `make all` runs, each stage its own process.

    The code is the same, but the shared checkout may have been edited or committed since the reference ran: the
    second run's stages see the checkout state the reference recorded (`checkout_as`), so the comparison never
    depends on when it runs and needs no retry (`test_checkout_state_is_the_recorded_one`)."""
    state = recorded_checkout(tiny_run["reference"])
    base = tmp_path_factory.mktemp("repro")
    shutil.copytree(tiny_run["template"], base / "b" / "qw")
    (base / "tmp-b").mkdir()
    with checkout_as(state["stage_git"], state["stage_tree"]):
        rc, _, err = run_main("quantize-drafter", *overrides(base / "b"), env={
            "TMPDIR": str(base / "tmp-b"), **{k: ENV[k] for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}})
    assert rc == 0, err[-3000:]
    with checkout_as(state["manifest_git"], info=state["source_info"]):
        manifest.run(compose(overrides(base / "b")))
    return [tiny_run["reference"], base / "b" / "qw"]


def test_checkout_state_is_the_recorded_one(built):
    """The second run recorded the reference's checkout state, nothing read from the checkout meanwhile."""
    a, b = built
    for rel in ("provenance/source/SOURCE.json", "stages/quantize-drafter-nvfp4.json"):
        ja, jb = (json.loads((rd / rel).read_text()) for rd in (a, b))
        keys = ("git", "tree_sha256") if rel.endswith("SOURCE.json") else ("git", "source_sha256")
        assert {k: ja[k] for k in keys} == {k: jb[k] for k in keys}, rel


@pytest.fixture
def two_runs(built, tmp_path):
    """Private copies (tests modify them), each with the runs root its files were written under."""
    out = []
    for side, rd in zip("ab", built):
        shutil.copytree(rd, tmp_path / side / rd.name)
        out.append((tmp_path / side / rd.name, rd.parent))
    return out


def test_same_inputs_compare_equal(two_runs):
    (a, ra), (b, rb) = two_runs
    assert (a / "provenance/commands.sh").read_bytes() != (b / "provenance/commands.sh").read_bytes()
    assert (a / "quant_run_manifest.json").read_bytes() != (b / "quant_run_manifest.json").read_bytes()
    da, skipped = repro.digests(a, ra)
    db, _ = repro.digests(b, rb)
    assert repro.compare(da, db) == []
    assert sorted(skipped) == [".work/hashes.json", ".work/hashes.lock",  # the hash memo (pipeline/core/hashes.py)
                               "stages/cache.json", "stages/quantize-drafter-nvfp4.json"]
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


def test_reference_same_fingerprint_fails_other_fingerprint_warns(two_runs, tmp_path, capsys):
    (a, ra), _ = two_runs
    view = repro._reference_view(a, ra)
    assert "quant_run_manifest.json" in view and "drafter/nvfp4/model.safetensors" in view
    assert not any(r.startswith(("provenance/", "stages/")) for r in view)
    ref = tmp_path / "ref"
    fp = repro.fingerprint()
    ref.mkdir()
    (ref / "outputs.sha256.json").write_text(json.dumps({"fingerprint": fp, "files": view}))
    assert repro.check_reference(ref, view) == 0
    changed = {**view, "drafter/nvfp4/model.safetensors": "0" * 64}
    (ref / "outputs.sha256.json").write_text(json.dumps({"fingerprint": fp, "files": changed}))
    assert repro.check_reference(ref, view) == 1
    assert "reference FAIL: drafter/nvfp4/model.safetensors: differs" in capsys.readouterr().out
    (ref / "outputs.sha256.json").write_text(json.dumps({"fingerprint": {**fp, "id": "other", "cpu": "X"},
                                                         "files": changed}))
    assert repro.check_reference(ref, view) == 0
    out = capsys.readouterr().out
    assert "reference warning: drafter/nvfp4/model.safetensors: differs" in out and "another machine" in out


def test_reference_ignores_machine_and_commit(two_runs):
    (a, ra), (b, rb) = two_runs
    q = json.loads((b / "quant_run_manifest.json").read_text())
    q["environment"]["git"]["commit"] = "f" * 40
    q["environment"]["device"]["cpu_count"] = 999
    (b / "quant_run_manifest.json").write_text(json.dumps(q, indent=2, sort_keys=True) + "\n")
    assert repro.compare(repro._reference_view(a, ra), repro._reference_view(b, rb)) == []
    assert repro.compare(repro.digests(a, ra)[0], repro.digests(b, rb)[0]) != []


def test_one_git_state_rule_for_stage_records_and_source_snapshot(tmp_path, monkeypatch):
    """stage records and provenance/source/SOURCE.json agree on "dirty": only pipeline/, conf/ and
    pyproject.toml count; working-tree changes vs HEAD and untracked, non-ignored files make it dirty."""
    import subprocess

    from pipeline.provenance import record as provenance
    from pipeline.stages import runner as stage

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    for rel, text in {"pipeline/a.py": "x = 1\n", "conf/c.yaml": "a: 1\n", "pyproject.toml": "[project]\n",
                      "tests/t.py": "", "docs/d.md": "", ".gitignore": "*.pyc\nruns/\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "init")
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)

    def both():
        rec, src = stage.git_state(), provenance.source_info()["git"]
        assert rec["commit"] == src["commit"] and len(rec["commit"]) == 40
        assert rec["dirty"] == src["dirty"]
        return rec["dirty"]

    assert both() is False
    (tmp_path / "tests" / "t.py").write_text("changed")  # outside the source paths
    (tmp_path / "docs" / "new.md").write_text("new")
    (tmp_path / "pipeline" / "a.pyc").write_bytes(b"ignored")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "x.json").write_text("{}")
    assert both() is False
    (tmp_path / "pipeline" / "a.py").write_text("x = 2\n")
    git("add", "pipeline/a.py")
    (tmp_path / "pipeline" / "a.py").write_text("x = 1\n")  # staged, then undone: the bytes that run are HEAD's
    assert both() is False
    (tmp_path / "conf" / "c.yaml").write_text("a: 2\n")
    assert both() is True
    git("checkout", "-q", "--", "conf/c.yaml")
    (tmp_path / "conf" / "new.yaml").write_text("b: 1\n")  # untracked, not ignored
    assert both() is True and provenance.git_state()["untracked"] == ["conf/new.yaml"]
    (tmp_path / "conf" / "new.yaml").unlink()
    (tmp_path / "pyproject.toml").unlink()  # a deletion
    assert both() is True


def test_the_warning_check_knows_the_pairing_sentence_and_nothing_else(capsys):
    """repro-check fails on any warning a stage prints that the README does not explain."""
    from pipeline.quant import pairing

    served = {"variant": "w4a16", "path": "target/w4a16", "files_sha256": "b" * 64, "shape": {}}
    record = {"variant": "bf16", "used": True, "files_sha256": "a" * 64, "shape": {}}
    pairing.warn(pairing.check_pair("w4a16-gptq", record, served), "evaluate")
    printed = capsys.readouterr().err
    text = ("cache rank 0: 100%|####| 23.6k/23.6k\r" + printed
            + "/x/transformers/quantizers/auto.py:279: UserWarning: You passed `quantization_config`\n")
    unexplained, explained = repro.warning_lines(text)
    assert explained == {"pairing: a drafter paired with a target other than the one it was calibrated on": 1}
    assert unexplained == ["/x/transformers/quantizers/auto.py:279: UserWarning: You passed `quantization_config`"]
