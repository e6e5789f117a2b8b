"""Mistakes a second tester found ending in tracebacks: each is now one sentence, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._support import run_main


def _tree(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("args, starts", [
    (["evaluate", "eval.prompt_sets=[{name:e,path:EMPTY,field:prompt}]"],
     "error: `eval.prompt_sets[0].path` = 'EMPTY': the file is empty"),
    (["quantize-drafter", "quant.max_seq_len=0"], "error: `quant.max_seq_len` = 0: "),
    (["quantize-target", "target_quant.max_seq_len=0"], "error: `target_quant.max_seq_len` = 0: "),
])
def test_one_sentence_and_nothing_written(args, starts, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    runs = tmp_path / "runs"
    rc, _, err = run_main(*[a.replace("EMPTY", str(empty)) for a in args], f"runs_root={runs}")
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and line[0].startswith(starts.replace("EMPTY", str(empty)))
    assert [p for p in _tree(runs) if not p.endswith((".lock",))] in ([], ["tiny"])


# ---------------------------------------------------------------- issue 19, the remaining cases
# Each runs the real entry point (`pipeline.__main__.main`, in this process: the same code path as
# `python -m pipeline`, without a new interpreter per case) or the real function, and checks the
# whole `error:` line, exit code 2, no traceback, and that the run directory did not change. Drafter
# weights are junk wherever the mistake is visible before loading, so a stage that loaded weights
# first would fail differently.


@dataclass(frozen=True)
class Said:
    """A parametrized case: its key and the sentence docs/reliability.md shows for it."""

    key: str
    what: str


def _cases(table: dict, what: dict[str, str]) -> list:
    assert set(table) == set(what)
    return [pytest.param(Said(k, what[k]), id=k) for k in sorted(table)]


def _main(argv: list[str]) -> tuple[int, str]:
    """`python -m pipeline *argv` in this process (tests/_support.run_main): (exit code, stderr)."""
    rc, _, err = run_main(*argv)
    return rc, err


def _listing(root: Path) -> list[tuple[str, int, int]]:
    """Every entry under root: (relative path, size, mtime_ns)."""
    if not root.exists():
        return []
    return sorted((p.relative_to(root).as_posix(), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*"))


def _one_error(rc: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, f"exit code {rc}; stderr:\n{err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> Path:
    """A run dir with data/ and a two-shard cache/ of the fixture world, built by the real cache stage."""
    import torch

    from pipeline.stages import cache
    from tests._support import world_cfg, write_blend

    torch.set_num_threads(1)
    cfg = world_cfg(tmp_path_factory.mktemp("round2") / "runs", "cache.samples_per_shard=4")
    write_blend(Path(cfg.run_dir) / "data", num_samples=8)
    cache.run(cfg)
    return Path(cfg.run_dir)


def _quant_args(run: Path, drafter: Path, *extra: str) -> list[str]:
    from tests._support import TARGET

    return ["quantize-drafter", f"run_dir={run}", f"target.path={TARGET}", f"target.tokenizer={TARGET}",
            f"drafter.path={drafter}", "drafter.format=speculators", "cache.storage_dtype=float32",
            "quant=nvfp4", "quant.num_samples=4", "quant.heldout_samples=2", "quant.max_seq_len=64", *extra]


def _junk_drafter(dst: Path) -> Path:
    from tests._support import DRAFTER

    shutil.copytree(DRAFTER, dst)
    for w in dst.glob("*.safetensors"):
        w.write_bytes(b"junk: reading these weights must never be needed to find the mistake")
    return dst


def _edit_index(edit):
    def apply(cache: Path) -> None:
        index = json.loads((cache / "index.json").read_text())
        edit(index)
        (cache / "index.json").write_text(json.dumps(index, indent=1))
    return apply


def _pop_shard_entry(index: dict) -> None:
    index["shards"].pop()
    index["num_shards"] -= 1


INDEX_CASES = {  # id: (edit of cache/, the problem the sentence names)
    "sample_length_changed": (_edit_index(lambda d: d["samples"][1].update(num_tokens=d["samples"][1]["num_tokens"] + 3)),
                              "shard shard-00000.safetensors records {t0} tokens but its samples add up to {t0p3}"),
    "num_samples_changed": (_edit_index(lambda d: d.update(num_samples=13)),
                            "num_samples is 13 but `samples` has 8 entries"),
    "shard_entry_removed": (_edit_index(lambda d: d["shards"].pop()), "num_shards is 2 but `shards` has 1 entry"),
    "shard_entry_removed_and_recounted": (_edit_index(_pop_shard_entry),
                                          "its shards hold 4 samples but `samples` has 8 entries"),
    "sample_shard_out_of_range": (_edit_index(lambda d: d["samples"][0].update(shard=7)),
                                  "sample 0 (synthetic/0) names shard 7 but the shards are numbered 0 to 1"),
    "sample_in_the_wrong_shard": (_edit_index(lambda d: d["samples"][0].update(shard=1)),
                                  "sample 0 (synthetic/0) names shard 1, which does not hold sample 0"),
}
REBUILD = "re-run the cache stage, which rebuilds it from the shards' sidecars."
INDEX_WHAT = {
    "sample_length_changed": "quantize-drafter: cache/index.json hand-edited, one sample's num_tokens changed: named (shard tokens vs its samples), before any load or write.",
    "num_samples_changed": "quantize-drafter: cache/index.json hand-edited, num_samples changed: named, before any load or write.",
    "shard_entry_removed": "quantize-drafter: cache/index.json hand-edited, a shard entry removed: named (num_shards vs entries), before any load or write.",
    "shard_entry_removed_and_recounted": "quantize-drafter: cache/index.json hand-edited, a shard entry removed and num_shards lowered to match: named (shards vs samples).",
    "sample_shard_out_of_range": "quantize-drafter: cache/index.json hand-edited, a sample names a shard that does not exist: named, before any load or write.",
    "sample_in_the_wrong_shard": "quantize-drafter: cache/index.json hand-edited, a sample names a shard that does not hold it: named, before any load or write.",
}


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("case", _cases(INDEX_CASES, INDEX_WHAT))
def test_hand_edited_cache_index_is_refused_before_the_drafter_loads(case, cached, tmp_path):
    """quantize-drafter on a hand-edited cache/index.json: one sentence naming the inconsistency, before any load or write."""
    edit, problem = INDEX_CASES[case.key]
    run = tmp_path / "run"
    shutil.copytree(cached, run)
    index = json.loads((run / "cache" / "index.json").read_text())
    t0 = index["shards"][0]["num_tokens"]
    edit(run / "cache")
    before = _listing(run)
    line = _one_error(*_main(_quant_args(run, _junk_drafter(tmp_path / "drafter"))))
    where = run / "cache" / "index.json"
    assert line == f"error: `cache/index.json` = '{where}': {problem.format(t0=t0, t0p3=t0 + 3)}; {REBUILD}", line
    assert _listing(run) == before, "the run directory changed"


@pytest.mark.faults("bad_input")
def test_deleted_cache_shard_is_named_before_the_drafter_loads(cached, tmp_path):
    """quantize-drafter on a cache with a deleted shard: the file and the fix, before the drafter load and drafter/bf16."""
    run = tmp_path / "run"
    shutil.copytree(cached, run)
    (run / "cache" / "shard-00001.safetensors").unlink()
    before = _listing(run)
    line = _one_error(*_main(_quant_args(run, _junk_drafter(tmp_path / "drafter"))))
    assert line == (f"error: `cache/index.json` = '{run / 'cache' / 'index.json'}': it lists shard-00001.safetensors, "
                    f"which is missing from {run / 'cache'}; re-run the cache stage, which rewrites the missing shard.")
    assert _listing(run) == before and not (run / "drafter").exists()


def test_cache_reader_checks_the_index_and_the_cache_stage_repairs_it(cached, tmp_path):
    """Every reader of the cache gets the check; the fix the sentence names (re-run the cache stage) works."""
    from pipeline.core.errors import SpecquantError
    from pipeline.stages import cache
    from pipeline.stages.cache import CacheReader
    from tests._support import world_cfg

    run = tmp_path / "runs" / "qw"
    shutil.copytree(cached, run)
    good = (run / "cache" / "index.json").read_bytes()
    INDEX_CASES["sample_length_changed"][0](run / "cache")
    with pytest.raises(SpecquantError, match=r"^`cache/index.json` = .*records \d+ tokens but its samples add up"):
        CacheReader(run / "cache")
    cache.run(world_cfg(tmp_path / "runs", "cache.samples_per_shard=4"))
    assert (run / "cache" / "index.json").read_bytes() == good
    assert len(CacheReader(run / "cache")) == 8


def _sharded_target(dst: Path) -> Path:
    """The fixture target re-saved as two safetensors shards + model.safetensors.index.json, then shard 2 deleted."""
    from safetensors.torch import load_file, save_file

    from tests._support import TARGET

    dst.mkdir()
    for f in TARGET.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, dst / f.name)
    state = load_file(str(TARGET / "model.safetensors"))
    keys = sorted(state)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [k for k in keys if "layers.0." not in k], [k for k in keys if "layers.0." in k]
    weight_map = {}
    for name, part in zip(names, halves, strict=True):
        save_file({k: state[k] for k in part}, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / names[1]).unlink()
    return dst


def _missing_shard_sentence(target: Path) -> str:
    return (f"`target.path` = '{target}': its model.safetensors.index.json lists model-00002-of-00002.safetensors, "
            f"which is missing from {target}; re-download the checkpoint or copy the missing shard into that directory.")


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("stage", _cases({"cache": 0, "quantize-target": 0}, {
    "cache": "cache: a sharded target (model.safetensors.index.json) with one shard deleted: the file, its directory and the fix, before loading or writing.",
    "quantize-target": "quantize-target: a sharded target with one shard deleted: the file, its directory and the fix, before loading or writing."}))
def test_sharded_target_with_a_missing_shard_is_named_before_loading(stage, tmp_path):
    """A sharded target with one shard deleted: the missing file, its directory and the fix, before loading or writing."""
    stage = stage.key
    from tests._support import DRAFTER, write_blend

    target = _sharded_target(tmp_path / "target")
    run = tmp_path / "run"
    write_blend(run / "data", num_samples=4)
    before = _listing(run)
    line = _one_error(*_main([stage, f"run_dir={run}", f"target.path={target}", f"target.tokenizer={target}",
                              f"drafter.path={DRAFTER}", "drafter.format=speculators", "target_quant=w4a16"]))
    assert line == "error: " + _missing_shard_sentence(target)
    assert _listing(run) == before


def test_sharded_target_with_a_missing_shard_in_the_drafter_and_eval_loaders(tmp_path):
    """quantize-drafter (the target's embed/lm_head) and evaluate (the whole target) name the missing shard too."""
    import torch

    from pipeline.core.errors import SpecquantError
    from pipeline.evaluation.fakequant import load_target
    from pipeline.models.formats import load_drafter
    from tests._support import DRAFTER

    target = _sharded_target(tmp_path / "target")
    with pytest.raises(SpecquantError) as err:
        load_drafter(_junk_drafter(tmp_path / "drafter"), target=target, fmt="speculators")
    assert str(err.value) == _missing_shard_sentence(target)
    with pytest.raises(SpecquantError) as err:
        load_target(str(target), torch.float32, "cpu")
    assert str(err.value) == _missing_shard_sentence(target)
    assert DRAFTER.is_dir()


TINY_QUANT = {  # in-process on the default (tiny) config: the checks run before the cache is even looked at
    "anchors_per_sequence_0": (["quantize-drafter", "quant.anchors_per_sequence=0"],
                               "`quant.anchors_per_sequence` = 0: each calibration and check sequence needs at least "
                               "one anchor block; use a positive number, e.g. 32."),
    "anchors_per_sequence_negative": (["quantize-drafter", "quant.anchors_per_sequence=-4"],
                                      "`quant.anchors_per_sequence` = -4: each calibration and check sequence needs "
                                      "at least one anchor block; use a positive number, e.g. 32."),
    "heldout_samples_0": (["quantize-drafter", "quant.heldout_samples=0"],
                          "`quant.heldout_samples` = 0: the checks need held-apart samples; use 1 or more."),
    "num_samples_negative": (["quantize-drafter", "quant=nvfp4a16", "quant.num_samples=-1"],
                             "`quant.num_samples` = -1: a sample count cannot be negative; use a positive number "
                             "(or 0 with calibration=none)."),
    "ignore_matches_nothing": (["quantize-drafter", "quant.ignore=[fc,layers.9.mlp.down_proj]"],
                               "`quant.ignore` = 'layers.9.mlp.down_proj': it matches no Linear layer of the model, "
                               "so it would keep nothing dense; remove it, or give an exact layer name or "
                               "`re:<regex>` over the names llm-compressor sees (fc, layers.0.self_attn.q_proj, "
                               "layers.0.self_attn.k_proj, ... (16 Linear layers))."),
    "ignore_regex_matches_nothing": (["quantize-drafter", "quant.ignore=[re:.*no_such_proj$]"],
                                     "`quant.ignore` = 're:.*no_such_proj$': it matches no Linear layer of the model"),
    "target_ignore_matches_nothing": (["quantize-target", "target_quant.ignore=[lm_head,nope]"],
                                      "`target_quant.ignore` = 'nope': it matches no Linear layer of the model"),
    "observer_kwargs_unknown_key": (["quantize-drafter", "+quant.observer_kwargs.bogus_key=1"],
                                    "`quant.observer_kwargs.bogus_key` = 1: the nvfp4_expanded_mse observer has no "
                                    "`bogus_key` setting; remove it (it reads expand, grid, maxshrink, norm, patience, "
                                    "triton_error_buffer)."),
    "observer_kwargs_for_an_observer_without_settings": (
        ["quantize-drafter", "quant.observer=static_minmax", "+quant.observer_kwargs.averaging_constant=0.1"],
        "`quant.observer_kwargs.averaging_constant` = 0.1: the static_minmax observer has no `averaging_constant` "
        "setting; remove it (it takes no settings)."),
    "override_indexes_a_list": (["data", "data.sources[0].weight=2"],
                                "invalid configuration: `data.sources[0].weight` = '2': a Hydra override cannot index "
                                "into a list; override the whole list instead (`data.sources=[...]` with every item "
                                "written out) or change the item in its file under conf/."),
    "override_unparsable": (["data", "data.num_samples==3"],
                            "invalid configuration: the override 'data.num_samples==3' cannot be parsed (extraneous "
                            "input '='); write it as key=value and quote a value that holds spaces, brackets or '=' "
                            "(see https://hydra.cc/docs/advanced/override_grammar/basic/)."),
}


SETTING_WHAT = {
    "anchors_per_sequence_0": "quantize-drafter: quant.anchors_per_sequence=0 refused under its dotted name before any load (was: after drafter/bf16).",
    "anchors_per_sequence_negative": "quantize-drafter: quant.anchors_per_sequence=-4 refused under its dotted name before any load.",
    "heldout_samples_0": "quantize-drafter: quant.heldout_samples=0 refused with the other settings, before any load.",
    "num_samples_negative": "quantize-drafter: a negative quant.num_samples (data-free preset) refused.",
    "ignore_matches_nothing": "quantize-drafter: a quant.ignore entry naming no layer of the drafter (was: accepted silently).",
    "ignore_regex_matches_nothing": "quantize-drafter: a quant.ignore `re:` pattern matching no layer (was: accepted silently).",
    "target_ignore_matches_nothing": "quantize-target: a target_quant.ignore entry naming no layer of the target.",
    "observer_kwargs_unknown_key": "quantize-drafter: a quant.observer_kwargs key the observer does not read, with the keys it does (was: accepted silently).",
    "observer_kwargs_for_an_observer_without_settings": "quantize-drafter: observer_kwargs for an observer that takes none.",
    "override_indexes_a_list": "overrides: data.sources[0].weight=2 (list indexing): one sentence with the fix, not a LexerNoViableAltException.",
    "override_unparsable": "overrides: an override the grammar cannot parse (`==`): one sentence, no lexer exception name or token list.",
}


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("case", _cases(TINY_QUANT, SETTING_WHAT))
def test_setting_refused_before_any_load(case, tmp_path):
    """A count <= 0, an ignore entry matching no layer, an observer setting the observer does not read, or a list-index override: one sentence, nothing written."""
    args, sentence = TINY_QUANT[case.key]
    runs = tmp_path / "runs"
    line = _one_error(*_main([*args, f"runs_root={runs}"]))
    assert line.startswith("error: " + sentence), line
    assert _tree(runs) in ([], ["tiny"])


# ---- data and prompt files
BOM = b"\xef\xbb\xbf"
CHAT = [{"conversations": [{"from": "human", "value": f"What is {i} + 3?"}, {"from": "gpt", "value": f"It is {i + 3}."}]}
        for i in range(4)]


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("suffix", _cases({".jsonl": 0, ".json": 0}, {
    ".jsonl": "data: a JSONL source saved with a UTF-8 BOM: every row kept (was: the first dropped as malformed_json).",
    ".json": "data: a .json source saved with a UTF-8 BOM: read (was: refused as not valid JSON)."}))
def test_utf8_bom_keeps_the_first_row(suffix, tmp_path):
    """A data source saved with a UTF-8 BOM (Windows editors): every row is kept, the first is not dropped as malformed_json."""
    suffix = suffix.key
    src = tmp_path / f"rows{suffix}"
    body = b"".join(json.dumps(r).encode() + b"\n" for r in CHAT) if suffix == ".jsonl" else json.dumps(CHAT).encode()
    src.write_bytes(BOM + body)
    run = tmp_path / "run"
    rc, err = _main(["data", f"run_dir={run}", "data.num_samples=4",
                     f"data.sources=[{{name: chat, path: {src}, format: sharegpt}}]"])
    assert rc == 0, err[-2000:]
    from pipeline.artifacts.samples import load_counts

    counts = load_counts(run / "data")["chat"]
    assert counts.kept == 4 and counts.dropped == {}, counts


@pytest.mark.faults("bad_input")
def test_data_source_that_is_a_directory_says_so(tmp_path):
    """data.sources[0].path names a directory: the sentence says it is a directory (not that it does not exist)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    run = tmp_path / "run"
    line = _one_error(*_main(["data", f"run_dir={run}", f"data.sources=[{{name: chat, path: {folder}}}]"]))
    assert line == (f"error: `data.sources[0].path` = '{folder}': it is a directory, not a file; "
                    "point it at a .json or .jsonl file inside it.")
    assert not run.exists()


@pytest.mark.faults("bad_input")
def test_prompt_file_holding_only_a_bom_is_empty(tmp_path):
    """An eval prompt file with nothing but a UTF-8 BOM is reported as empty (not a datasets ValueError)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(BOM + b"\n")
    runs = tmp_path / "runs"
    line = _one_error(*_main(["evaluate", f"runs_root={runs}",
                              f"eval.prompt_sets=[{{name: e, path: {prompts}, field: prompt}}]"]))
    assert line == (f"error: `eval.prompt_sets[0].path` = '{prompts}': the file is empty; "
                    "put one prompt per line in it, or drop the subset.")
    assert _tree(runs) in ([], ["tiny"])


def test_prompt_file_with_a_bom_keeps_its_first_prompt(tmp_path):
    from transformers import AutoTokenizer

    from pipeline.core.config import compose
    from pipeline.evaluation.prompts import load_prompt_sets
    from tests._support import REPO

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(BOM + b'{"prompt": "first"}\n{"prompt": "second"}\n')
    cfg = compose([f"eval.prompt_sets=[{{name: e, path: {prompts}, field: prompt}}]"])
    (subset,) = load_prompt_sets(cfg.eval, AutoTokenizer.from_pretrained(str(REPO / "assets" / "tiny" / "target")))
    assert subset.texts == ["first", "second"]


# ---- convert
@pytest.mark.faults("bad_input")
def test_convert_into_a_non_empty_directory_is_refused(tmp_path):
    """`python -m pipeline convert` into a directory that holds files: refused naming it, nothing written there."""
    from tests._support import REPO

    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me\n")
    before = _listing(dst)
    # in this process (a command's refusal through a real process: test_verify's test_cli_on_a_missing_path...)
    line = _one_error(*_main(["convert", "--to", "zlab", str(REPO / "assets" / "tiny" / "drafter"), str(dst)]))
    assert line == (f"error: `DST` = '{dst}': the directory is not empty (it holds notes.txt); "
                    "convert into a new or empty directory, or empty this one first.")
    assert _listing(dst) == before


def test_convert_into_a_file_or_under_one_is_one_sentence(tmp_path):
    from tests._support import REPO

    src = str(REPO / "assets" / "tiny" / "drafter")
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me\n")
    line = _one_error(*_main(["convert", "--to", "zlab", src, str(afile)]))
    assert line == f"error: `DST` = '{afile}': it is a file, not a directory; give a new or empty directory."
    line = _one_error(*_main(["convert", "--to", "zlab", src, str(afile / "sub")]))
    assert line.startswith(f"error: `convert` could not use {afile / 'sub'}: Not a directory; ")
    assert afile.read_text() == "keep me\n"
    assert pipeline_ok(["convert", "--to", "zlab", src, str(tmp_path / "empty")])


def pipeline_ok(argv: list[str]) -> bool:
    """An empty (here: new) DST still converts."""
    (Path(argv[-1])).mkdir()
    rc, err = _main(argv)
    return rc == 0 and (Path(argv[-1]) / "model.safetensors").is_file()
