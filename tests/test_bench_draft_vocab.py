"""bench.draft_vocab: a vocabulary-trimmed draft head in the reference loop, on a small real run of the tiny world.

The run is built in tmp_path by the real stages (data on the tiny corpus, evaluate of the tiny drafter as the
bf16 reference on a few eval prompts), so the bench reads exactly what `make all` would give it, only smaller.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import _support

REPO = _support.REPO
FRACTIONS = [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """data (60 samples of the tiny blend) + evaluate (bf16 = assets/tiny/drafter, 2 prompts per subset, 48 new
    tokens), each through `run_stage` as the entry point runs it."""
    from pipeline.core.config import compose
    from pipeline.stages.runner import run_stage

    root = tmp_path_factory.mktemp("draft-vocab")
    ov = [f"runs_root={root}", "run_name=tiny", "data.num_samples=60", "eval.limit=2", "eval.max_new_tokens=48",
          "eval.include_source=false"]
    for stage in ("data", "evaluate"):
        run_stage(stage, f"pipeline.stages.{stage}", compose(ov), ov)
    return root / "tiny"


@pytest.fixture(scope="module")
def doc(small_run) -> dict:
    from bench import draft_vocab

    return draft_vocab.bench(small_run, FRACTIONS, ["bf16"])


def test_full_vocab_reproduces_the_evaluate_stage(doc, small_run):
    """f = 1.0 is the unrestricted reference loop: tau per subset and overall equal evaluate's results.json."""
    results = json.loads((small_run / "eval" / "results.json").read_text())["variants"]["bf16"]
    full = doc["variants"]["bf16"]["rows"][0]
    assert full["fraction"] == 1.0 and full["n"] == doc["vocab"]
    assert full["tau"] == {**{s: st["tau"] for s, st in results["subsets"].items()}, "all": results["overall"]["tau"]}
    assert doc["variants"]["bf16"]["evaluate_tau"] == full["tau"]


def test_vocab_and_sizes_come_from_the_target(doc):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(REPO / "assets" / "tiny" / "target").vocab_size
    assert doc["vocab"] == vocab
    assert [r["n"] for r in doc["fractions"]] == [round(f * vocab) for f in FRACTIONS]


def test_every_restricted_run_is_lossless_and_stays_in_the_kept_set(doc):
    rows = doc["variants"]["bf16"]["rows"]
    assert [r["fraction"] for r in rows] == FRACTIONS
    for r in rows:
        assert r["lossless"], r
        assert all(n == 0 for n in r["lossless_mismatches"].values())
        assert r["proposed_tokens"] > 0
        assert r["proposals_outside_kept"] == 0, r


def test_coverage_is_monotone_in_n(doc):
    rows = sorted(doc["fractions"], key=lambda r: r["n"])
    for key in ("calibration_coverage", "eval_coverage"):
        values = [r[key] for r in rows]
        assert values == sorted(values), (key, values)
        assert values[-1] == 1.0
    for a, b in zip(rows, rows[1:]):
        for s in a["eval_coverage_per_subset"]:
            assert a["eval_coverage_per_subset"][s] <= b["eval_coverage_per_subset"][s]


def test_restricted_head_confines_the_loops_proposals(small_run):
    """Independently of the bench's own counts: with the smallest kept set the unrestricted drafter proposes
    tokens outside it (so the restriction has work to do), the restricted one never does, and its output is
    still the target's own greedy output; removing the hook gives the unrestricted drafts back exactly."""
    import torch
    from transformers import AutoTokenizer

    from bench import draft_vocab
    from pipeline.artifacts import samples as samples_file
    from pipeline.evaluation.fakequant import load_drafter_variant, load_target
    from pipeline.models.spec_decode import greedy_generate, load_prompts, spec_generate

    tiny = REPO / "assets" / "tiny"
    target = load_target(str(tiny / "target"), torch.float32, "cpu")
    drafter, _ = load_drafter_variant(tiny / "drafter", target, torch.float32, "cpu")
    vocab = target.config.vocab_size
    counts = draft_vocab.assistant_counts(samples_file.load_samples(small_run / "data"), vocab)
    keep = draft_vocab.kept_ids(counts, draft_vocab.keep_size(FRACTIONS[-1], vocab))
    prompts = load_prompts(tiny / "eval", AutoTokenizer.from_pretrained(tiny / "target"), limit=1)
    stop = [AutoTokenizer.from_pretrained(tiny / "target").eos_token_id]

    def drafts(ids):
        r = spec_generate(target, drafter, ids, 48, stop, trace=True)
        return r, [t for c in r.draft_calls for t in c["draft_tokens"]]

    outside_before = 0
    for ids in [p for ps in prompts.values() for p in ps]:
        free, free_drafts = drafts(ids)
        outside_before += sum(t not in set(keep) for t in free_drafts)
        with draft_vocab.restricted_head(drafter, keep):
            kept, kept_drafts = drafts(ids)
        assert set(kept_drafts) <= set(keep)
        assert kept.output_ids == free.output_ids == greedy_generate(target, ids, 48, stop)
        again, again_drafts = drafts(ids)
        assert again_drafts == free_drafts and again.acceptance_lengths == free.acceptance_lengths
    assert outside_before > 0


def test_kept_ids_ties_by_lower_id():
    from bench import draft_vocab

    assert draft_vocab.kept_ids([0, 5, 2, 5, 0, 2], 3) == [1, 2, 3]
    assert draft_vocab.kept_ids([0, 5, 2, 5, 0, 2], 5) == [0, 1, 2, 3, 5]
    assert draft_vocab.kept_ids([1, 1, 1], 2) == [0, 1]


@pytest.mark.parametrize("args, words", [
    (["--run", "no/such/run"], ["`--run`", "'no/such/run'", "make all"]),
    (["--fractions", "1.0,1.5"], ["`--fractions`", "'1.0,1.5'", "(0, 1]"]),
    (["--fractions", "0"], ["`--fractions`", "(0, 1]"]),
    (["--fractions", "half"], ["`--fractions`", "'half'", "not a number"]),
    (["--variants", "bf16,fp3"], ["`--variants`", "fp3", "have bf16"]),
])
def test_bad_input_is_one_sentence_and_exit_2(small_run, capsys, args, words):
    from bench import draft_vocab

    argv = ["--run", str(small_run), *args] if args[0] != "--run" else args
    assert draft_vocab.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("error: ")
    for w in words:
        assert w in err, (w, err)


def test_cli_writes_the_same_json_twice(small_run, tmp_path, capsys):
    """The entry point end to end, twice: the same measurements (all but date and wall time) both times."""
    from bench import draft_vocab

    docs = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert draft_vocab.main(["--run", str(small_run), "--fractions", "0.25,0.0625", "--json", str(out)]) == 0
        docs.append({k: v for k, v in json.loads(out.read_text()).items() if k not in ("date", "wall_s", "command")})
    assert docs[0] == docs[1]
    assert [r["fraction"] for r in docs[0]["fractions"]] == [1.0, 0.25, 0.0625]  # f = 1.0 always measured
    printed = capsys.readouterr().out
    assert "| fraction | N |" in printed and "evaluate stage" in printed
