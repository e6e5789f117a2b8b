"""Bad inputs, one table: each is a real user mistake tried through the real entry point.

Every case runs `python -m pipeline <stage> ...` - in this process through `pipeline.__main__.main`
(tests/_support.run_main: the same code path, without a new interpreter per case, state restored after
each), or as a subprocess for the cases marked `cli` (one per way an error reaches the exit code) - and checks: exit code 2, exactly one `error:` line on stderr naming the field and the
offending value and saying a fix, no traceback, done in seconds, and nothing written to the run
directory (a listing of names, sizes and mtimes before and after). Target and drafter weights are
replaced by junk bytes wherever the mistake is visible from configs alone, so a stage that loaded
weights before checking would fail differently and the case would not pass.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._support import (
    DRAFTER,
    REPO,
    TARGET,
    build_chat_tokenizer,
    geometry,
    run_cli,
    run_main,
    w4a16_group,
)

G = geometry()  # the fixture pair's sizes: every number a case names comes from it
H, V, T, AUX = G["hidden"], G["vocab"], G["target_layers"], G["aux_layer_ids"]
# a W4A16 group size that leaves some layer of the fixture drafter untiled
WIDTHS = (H, G["intermediate"], G["heads"] * G["head_dim"], len(AUX) * H)
BAD_GROUP = next(n for n in (48, 40, 24, 80, 96) if any(w % n for w in WIDTHS))
TINY_TARGET = REPO / "assets" / "tiny" / "target"  # vocab 2048, tokenizer with <|MASK|> = 3
TOKEN = "hf_BadInputsPlantedToken0123456789"
FAST_S = 10.0  # in-process: configs are checked before any weight or model is loaded
FAST_CLI_S = 20.0  # a new interpreter imports torch and transformers first (slow on a shared 2-core box)

CHAT_ROW = {"conversations": [{"from": "human", "value": "What is 2 + 3?"}, {"from": "gpt", "value": "It is 5."}]}


# ---------------------------------------------------------------- the world the cases start from
@dataclass
class World:
    root: Path
    tok: Path  # chat tokenizer (has a chat template)
    plain_tok: Path  # same, without a chat template
    cached: Path  # a run dir with data/ and cache/ built by the real cache stage (fixture target + drafter)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    import torch

    from pipeline.stages import cache
    from tests._support import world_cfg, write_blend

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("bad_inputs")
    tok = build_chat_tokenizer(root / "tok")
    plain = build_chat_tokenizer(root / "plain_tok", chat_template=None)
    cfg = world_cfg(root / "runs", "cache.samples_per_shard=4")
    write_blend(Path(cfg.run_dir) / "data", num_samples=8)
    cache.run(cfg)
    # every stage's module imported once here, so a case's time (FAST_S) is its own checks', not the first
    # import of a stage's libraries, which would fall on whichever case of that stage happens to run first
    import importlib

    from pipeline.core.quiet import import_llmcompressor
    from pipeline.stages import MODULES

    import_llmcompressor()
    for module in MODULES.values():
        importlib.import_module(module)
    return World(root, tok, plain, Path(cfg.run_dir))


def poisoned_copy(src: Path, dst: Path, edit: Callable[[dict], None] | None = None) -> Path:
    """Copy a model dir, replace every weights file with junk, optionally edit its config.json."""
    shutil.copytree(src, dst)
    for w in dst.glob("*.safetensors"):
        w.write_bytes(b"junk: loading these weights must never be needed to find the mistake")
    if edit is not None:
        conf = json.loads((dst / "config.json").read_text())
        edit(conf)
        (dst / "config.json").write_text(json.dumps(conf, indent=2))
    return dst


def jsonl(path: Path, rows: list, raw: list[bytes] = ()) -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b"".join(x + b"\n" for x in raw))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Unpickled:
    """A pickle payload that leaves a marker file if anything ever unpickles it with plain pickle."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ---------------------------------------------------------------- one case = one mistake
@dataclass
class Case:
    id: str
    stage: str
    setup: Callable[[Path, World], list[str]]  # (case dir, world) -> overrides; the run dir is case/run
    needles: tuple[str, ...]  # must all appear in the error line: the field and the offending value
    cli: bool = False
    xfail: str | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    what: str = ""  # one sentence for docs/reliability.md (WHAT below)


def _data(sources: str, *extra: str) -> Callable[[Path, World], list[str]]:
    def setup(case: Path, w: World) -> list[str]:
        src = {name: str(case / name) for name in ("rows.jsonl", "rows.json", "rows.csv")}
        return [f"run_dir={case / 'run'}", f"target.tokenizer={w.tok}", "data.num_samples=4",
                "data.sources=[" + sources.format(**{k.replace('.', '_'): v for k, v in src.items()}) + "]", *extra]
    return setup


def _rows(rows: list, raw: list[bytes] = (), name: str = "rows.jsonl"):
    def prepare(case: Path) -> None:
        jsonl(case / name, rows, raw)
    return prepare


def _with(prepare: Callable[[Path], None], setup: Callable[[Path, World], list[str]]):
    def both(case: Path, w: World) -> list[str]:
        prepare(case)
        return setup(case, w)
    return both


SHAREGPT = "{{name: chat, path: {rows_jsonl}, format: sharegpt}}"


def data_case(id_, rows=(), raw=(), needles=(), sources=SHAREGPT, extra=(), name="rows.jsonl", **kw) -> Case:
    return Case(id_, "data", _with(_rows(list(rows), list(raw), name), _data(sources, *extra)), needles, **kw)


def _cache_run(case: Path, w: World) -> Path:
    from tests._support import write_blend

    run = case / "run"
    write_blend(run / "data", num_samples=4)
    return run


def cache_case(id_, edit_drafter=None, target=None, needles=(), extra=(), **kw) -> Case:
    """The cache stage on a run with data/, a junk-weights target and an (edited) junk-weights drafter."""
    def setup(case: Path, w: World) -> list[str]:
        run = _cache_run(case, w)
        tgt = target(case) if target else poisoned_copy(TARGET, case / "target")
        drf = poisoned_copy(DRAFTER, case / "drafter", edit_drafter)
        return [f"run_dir={run}", f"target.path={tgt}", f"drafter.path={drf}", "drafter.format=speculators",
                *extra]
    return Case(id_, "cache", setup, needles, **kw)


def quant_case(id_, *extra, needles=(), cached=False, drafter=None, **kw) -> Case:
    """quantize-drafter with a junk-weights drafter (or `drafter(case)`), on an empty or a cached run."""
    def setup(case: Path, w: World) -> list[str]:
        run = case / "run"
        if cached:
            shutil.copytree(w.cached, run)
        drf = drafter(case) if drafter else poisoned_copy(DRAFTER, case / "drafter")
        return [f"run_dir={run}", f"target.path={TARGET}", f"drafter.path={drf}", "drafter.format=speculators",
                "quant.num_samples=4", "quant.heldout_samples=2", "quant.max_seq_len=64", *extra]
    return Case(id_, "quantize-drafter", setup, needles, **kw)


def publish_case(id_, *extra, needles=(), variants=("nvfp4",), **kw) -> Case:
    """publish on a run holding drafter/<variant>/ checkpoints (configs only: checks come first)."""
    def setup(case: Path, w: World) -> list[str]:
        run = case / "run"
        run.mkdir()
        for v in variants:
            (run / "drafter" / v).mkdir(parents=True)
            shutil.copyfile(DRAFTER / "config.json", run / "drafter" / v / "config.json")
        return [f"run_dir={run}", *extra]
    return Case(id_, "publish", setup, needles, **kw)


# ---- setups that need files of their own
def _truncated(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    w = dst / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return dst


def _pickle_only(src: Path, dst: Path) -> Path:
    """config.json + pytorch_model.bin (a pickle whose unpickling would create `unpickled.marker`)."""
    dst.mkdir()
    shutil.copyfile(src / "config.json", dst / "config.json")
    (dst / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": _Unpickled(dst.parent / "unpickled.marker")}))
    return dst


def _remote_code_target(case: Path) -> Path:
    def edit(conf):
        conf.update(model_type="my_custom_lm", architectures=["MyCustomLM"],
                    auto_map={"AutoConfig": "configuration_my.MyConfig", "AutoModel": "modeling_my.MyModel"})
    d = poisoned_copy(TARGET, case / "target", edit)
    (d / "configuration_my.py").write_text("from transformers import PretrainedConfig\n\n\n"
                                           "class MyConfig(PretrainedConfig):\n    model_type = 'my_custom_lm'\n")
    return d


def _symlink_escape(case: Path, w: World) -> list[str]:
    run = _cache_run(case, w)
    outside = case / "elsewhere"
    outside.mkdir()
    (outside / "notes.txt").write_text("outside the run directory\n")
    (run / "data" / "notes.txt").symlink_to(outside / "notes.txt")
    return [f"run_dir={run}", f"target.path={TARGET}", f"drafter.path={DRAFTER}", "drafter.format=speculators"]


def _tiny_drafter(case: Path) -> Path:
    """A (junk-weights) speculators drafter config made for the tiny target: H=256, vocab 2048, mask 3."""
    def edit(conf):
        tlc = conf["transformer_layer_config"]
        tlc.update(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=2048, num_hidden_layers=1,
                   layer_types=["full_attention"], max_window_layers=1, num_target_layers=4)
        conf.update(aux_hidden_state_layer_ids=[1, 3], draft_vocab_size=2048, mask_token_id=3)
    return poisoned_copy(DRAFTER, case / "drafter", edit)


def _evaluate_mask(case: Path, w: World) -> list[str]:
    return [f"run_dir={case / 'run'}", f"target.path={TINY_TARGET}", f"target.tokenizer={TINY_TARGET}",
            f"drafter.path={_tiny_drafter(case)}", "drafter.mask_token='<|mask|>'", "eval.max_new_tokens=4"]


def _edit(**kv):
    def edit(conf):
        for k, v in kv.items():
            if k.startswith("tlc_"):
                conf["transformer_layer_config"][k[4:]] = v
            elif v is None:
                conf.pop(k, None)
            else:
                conf[k] = v
    return edit


LONG = "x" * 500
CASES = [
    # ---- data: rows and sources (a source with no usable row is refused; the reasons are counted)
    data_case("malformed_jsonl_rows", raw=[b'{"conversations": [', b"{not json}"],
              needles=("data.sources[0]", "malformed_json=2")),
    data_case("json_file_not_json", raw=[b"[{broken"], sources="{{name: chat, path: {rows_json}}}", name="rows.json",
              needles=("data.sources[0].path", "rows.json", "not valid UTF-8 JSON")),
    data_case("non_utf8_rows", raw=[b"\xff\xfe\x00 latin-1 caf\xe9"], needles=("data.sources[0]", "not_utf8=1")),
    data_case("no_assistant_turn", rows=[{"conversations": [{"from": "human", "value": "Hello?"}]}] * 3,
              needles=("data.sources[0]", "no_assistant_turn=3")),
    data_case("empty_turn", rows=[{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": " "}]}],
              needles=("data.sources[0]", "empty_turn=1")),
    data_case("oversized_turn", rows=[{"conversations": [{"from": "human", "value": LONG},
                                                        {"from": "gpt", "value": "ok"}]}] * 2,
              extra=("data.max_turn_chars=100",), needles=("data.sources[0]", "oversized_turn=2")),
    data_case("openai_format_on_sharegpt_rows", rows=[CHAT_ROW] * 3,
              sources="{{name: chat, path: {rows_jsonl}, format: openai}}",
              needles=("data.sources[0]", "wrong_format=3")),
    data_case("unknown_chat_format", rows=[CHAT_ROW], sources="{{name: chat, path: {rows_jsonl}, format: alpaca}}",
              needles=("data.sources[0].format", "alpaca")),
    data_case("csv_source", rows=[CHAT_ROW], sources="{{name: chat, path: {rows_csv}}}", name="rows.csv",
              needles=("data.sources[0].path", "rows.csv")),
    data_case("data_source_path_missing", sources="{{name: chat, path: /nonexistent/chat.jsonl}}",
              needles=("data.sources[0].path", "/nonexistent/chat.jsonl", "does not exist")),
    Case("tokenizer_without_chat_template", "data",
         _with(_rows([CHAT_ROW]), lambda c, w: [*_data(SHAREGPT)(c, w), f"target.tokenizer={w.plain_tok}"]),
         ("target.tokenizer", "plain_tok", "no chat template")),
    Case("tokenizer_path_missing", "data",
         _with(_rows([CHAT_ROW]), lambda c, w: [*_data(SHAREGPT)(c, w), "target.tokenizer=/nonexistent/tok"]),
         ("target.tokenizer", "/nonexistent/tok")),
    # ---- cache: the drafter against the target, from configs alone
    cache_case("drafter_fc_width_mismatch", _edit(target_hidden_size=H // 2),
               needles=("drafter.target_hidden_size", str(H // 2), str(H))),
    cache_case("aux_layer_ids_beyond_target_depth", _edit(aux_hidden_state_layer_ids=[AUX[0], T + 3]),
               needles=("aux_layer_ids", str(T + 3), f"{T} decoder layers")),
    cache_case("drafter_without_mask_token", _edit(mask_token_id=None), needles=("drafter.mask_token_id", "None")),
    cache_case("mismatched_vocabularies", _edit(draft_vocab_size=2 * V, tlc_vocab_size=2 * V),
               needles=("drafter.vocab_size", str(2 * V), str(V))),
    cache_case("block_size_below_2", _edit(block_size=1), needles=("block_size", "1", ">= 2")),
    cache_case("drafter_format_mismatch", extra=("drafter.format=zlab",), needles=("drafter.format", "zlab")),
    Case("cache_before_data", "cache", lambda c, w: [f"run_dir={c / 'run'}", f"target.path={TARGET}",
                                                     f"drafter.path={DRAFTER}", "drafter.format=speculators"],
         ("data/meta.json", "does not exist")),
    Case("symlink_escaping_run_dir", "cache", _symlink_escape, ("run_dir/data/notes.txt", "outside the run directory")),
    cache_case("trust_remote_code_required_but_off", target=_remote_code_target,
               needles=("trust_remote_code",)),
    cache_case("truncated_target_safetensors", target=lambda c: _truncated(TARGET, c / "target"),
               needles=("target.path", "model.safetensors")),
    cache_case("pickle_target_weights", target=lambda c: _pickle_only(TARGET, c / "target"),
               needles=("target.path", "pytorch_model.bin")),
    # ---- quantize-drafter: settings checked on a weightless drafter
    quant_case("unknown_scheme", "quant.scheme=int3", needles=("quant.scheme", "int3", "nvfp4")),
    quant_case("unknown_observer", "quant.observer=minmaxx", needles=("quant.observer", "minmaxx")),
    # an observer tuned to the other 4-bit format (pipeline.quant.recipes.FORMAT_OBSERVERS): the fix is its twin
    quant_case("fp4_observer_on_int4_scheme", "quant=w4a16", "quant.observer=nvfp4_expanded_mse",
               needles=("`quant.observer` = 'nvfp4_expanded_mse'", "w4a16 stores INT4", "use quant.observer=mse")),
    quant_case("int4_observer_on_fp4_scheme", "quant=nvfp4a16", "quant.observer=imatrix_mse",
               needles=("`quant.observer` = 'imatrix_mse'", "nvfp4a16 stores FP4",
                        "use quant.observer=nvfp4_expanded_imatrix")),
    quant_case("group_size_not_dividing_a_layer", "quant=w4a16", f"quant.group_size={BAD_GROUP}",
               needles=("quant.group_size", str(BAD_GROUP), "does not divide the in-features")),
    quant_case("nvfp4_group_size_not_16", "quant.group_size=32", needles=("quant.group_size", "32", "16")),
    quant_case("gptq_without_calibration", "quant=w4a16", f"quant.group_size={w4a16_group()}", "quant.algorithm=gptq",
               needles=("quant.algorithm", "gptq")),
    quant_case("quantize_drafter_before_cache", needles=("cache/index.json", "does not exist")),
    quant_case("truncated_drafter_checkpoint", cached=True, drafter=lambda c: _truncated(DRAFTER, c / "drafter"),
               needles=("drafter.path", "model.safetensors")),
    quant_case("pickle_drafter_weights", cached=True, drafter=lambda c: _pickle_only(DRAFTER, c / "drafter"),
               needles=("drafter.path", "safetensors")),
    # ---- evaluate: the tokenizer against the drafter
    Case("mask_token_not_in_tokenizer", "evaluate", _evaluate_mask, ("drafter.mask_token", "<|mask|>")),
    # ---- publish: checked before anything is assembled or sent
    publish_case("repo_id_invalid_characters", "publish.repo_id='me/bad name!'",
                 needles=("publish.repo_id", "me/bad name!"), cli=True),
    publish_case("missing_token_for_push", "publish.dry_run=false", "publish.namespace=me",
                 needles=("publish.token_env", "HF_TOKEN"), env={"HF_TOKEN": None}),
    publish_case("unreachable_endpoint", "publish.dry_run=false", "publish.namespace=me",
                 f"publish.endpoint=http://127.0.0.1:{free_port()}", needles=("publish.endpoint", "127.0.0.1"),
                 env={"HF_TOKEN": TOKEN}),
    publish_case("publish_before_quantize", variants=(), needles=("run_dir", "no quantized drafter")),
    # ---- overrides: wrong types and unknown keys fail at composition
    Case("override_wrong_type", "quantize-drafter", lambda c, w: [f"run_dir={c / 'run'}", "quant.num_samples=lots"],
         ("num_samples", "lots"), cli=True),
    Case("override_unknown_key", "cache", lambda c, w: [f"run_dir={c / 'run'}", "+cache.shard_size=3"],
         ("cache.shard_size",)),
]

# what each case tries, in one sentence (the reliability report's "what is tried and checked")
WHAT = {
    "malformed_jsonl_rows": "data: a JSONL source whose every line is broken JSON.",
    "json_file_not_json": "data: a .json source that is not valid JSON.",
    "non_utf8_rows": "data: a JSONL source in latin-1, not UTF-8.",
    "no_assistant_turn": "data: conversations with no assistant turn.",
    "empty_turn": "data: an assistant turn that is only whitespace.",
    "oversized_turn": "data: turns longer than data.max_turn_chars.",
    "openai_format_on_sharegpt_rows": "data: format=openai declared on ShareGPT rows.",
    "unknown_chat_format": "data: a chat format name that does not exist (alpaca).",
    "csv_source": "data: a .csv file offered as a source.",
    "data_source_path_missing": "data: a source path that does not exist.",
    "tokenizer_without_chat_template": "data: a tokenizer without a chat template.",
    "tokenizer_path_missing": "data: a tokenizer path that does not exist.",
    "drafter_fc_width_mismatch": f"cache: a drafter whose fc expects another target hidden size ({H // 2} vs {H}).",
    "aux_layer_ids_beyond_target_depth": f"cache: drafter aux layer ids beyond the target's {T} layers.",
    "drafter_without_mask_token": "cache: a drafter config without mask_token_id.",
    "mismatched_vocabularies": f"cache: a drafter vocabulary ({2 * V}) unlike the target's ({V}).",
    "block_size_below_2": "cache: a drafter with block_size 1.",
    "drafter_format_mismatch": "cache: drafter.format=zlab on a speculators checkpoint.",
    "cache_before_data": "cache: run before the data stage has written data/.",
    "symlink_escaping_run_dir": "cache: a symlink in the run directory pointing outside it.",
    "trust_remote_code_required_but_off": "cache: a target that needs custom code while trust_remote_code is off.",
    "truncated_target_safetensors": "cache: a target whose model.safetensors is truncated.",
    "pickle_target_weights": "cache: a target with only pytorch_model.bin (a pickle): refused, never unpickled.",
    "unknown_scheme": "quantize-drafter: an unknown scheme.",
    "unknown_observer": "quantize-drafter: an observer llm-compressor does not register.",
    "fp4_observer_on_int4_scheme": "quantize-drafter: an FP4 observer (nvfp4_expanded_mse) on the int4 W4A16 scheme.",
    "int4_observer_on_fp4_scheme": "quantize-drafter: an int4 observer (imatrix_mse) on the FP4 NVFP4A16 scheme.",
    "group_size_not_dividing_a_layer": f"quantize-drafter: a W4A16 group size ({BAD_GROUP}) that divides no layer width.",
    "nvfp4_group_size_not_16": "quantize-drafter: NVFP4 with group size 32.",
    "gptq_without_calibration": "quantize-drafter: GPTQ with calibration=none.",
    "quantize_drafter_before_cache": "quantize-drafter: run before the cache stage.",
    "truncated_drafter_checkpoint": "quantize-drafter: a drafter whose model.safetensors is truncated.",
    "pickle_drafter_weights": "quantize-drafter: a drafter with only pytorch_model.bin: refused, never unpickled.",
    "mask_token_not_in_tokenizer": "evaluate: a drafter.mask_token the tokenizer does not have.",
    "repo_id_invalid_characters": "publish: a repo id with a space and '!' (via the CLI).",
    "missing_token_for_push": "publish: a real push with HF_TOKEN unset.",
    "unreachable_endpoint": "publish: a real push to an endpoint where nothing listens.",
    "publish_before_quantize": "publish: a run with no quantized drafter.",
    "override_wrong_type": "overrides: a string for an integer key (via the CLI).",
    "override_unknown_key": "overrides: an unknown key added with +.",
}
for _c in CASES:
    _c.what = WHAT[_c.id]


def listing(root: Path) -> list[tuple[str, int, int]]:
    """Every entry under root (symlinks not followed): (relative path, size, mtime_ns)."""
    if not root.exists():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out.append((p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns))
    return sorted(out)


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)]
                                               if c.xfail else []) for c in CASES])
def test_bad_input(case: Case, world: World, tmp_path: Path):
    """One user mistake: exit 2 with one `error:` line naming the field, the value and a fix, fast, nothing written."""
    case_dir = tmp_path / "case"
    case_dir.mkdir()
    overrides = case.setup(case_dir, world)
    run_dir = case_dir / "run"
    before = listing(run_dir)
    t0 = time.time()
    if case.cli:
        assert not case.env, "a CLI case runs in the test's own environment"
        res = run_cli(case.stage, *overrides, env={"OMP_NUM_THREADS": "1"}, timeout=120)  # + os.environ
        rc, err = res.returncode, res.stderr
        limit = FAST_CLI_S
    else:
        rc, _, err = run_main(case.stage, *overrides, env=case.env)
        limit = FAST_S
    elapsed = time.time() - t0
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, f"exit code {rc}; stderr:\n{err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    assert len(errors) == 1, err[-2000:]
    line = errors[0]
    print(f"{case.id}: {line}")
    for needle in case.needles:
        assert needle in line, (needle, line)
    assert ";" in line and line.rstrip().endswith((".", ")")), f"no fix in: {line}"  # `problem; fix.`
    assert elapsed < limit, f"took {elapsed:.1f}s (limit {limit}s): work ran before the check"
    assert listing(run_dir) == before, "the run directory changed"
    assert not list(case_dir.rglob("unpickled.marker")), "a pickle was unpickled"


def test_table_has_every_required_mistake():
    """The table covers the mistakes issue 10 lists (>= 25 cases, a CLI subset, every stage's entry point).

    The CLI subset is one case per way an error reaches a real process's exit code: a configuration error
    (SystemExit(2) from composing) and a stage's refusal (SpecquantError, main's return value through
    sys.exit); every other case runs the same entry point in this process (tests/_support.run_main)."""
    ids = {c.id for c in CASES}
    assert len(CASES) >= 25 and len(ids) == len(CASES) and ids == set(WHAT)
    cli = [c for c in CASES if c.cli]
    assert any(c.id.startswith("override_") for c in cli), "no CLI case fails at composition"
    assert any(not c.id.startswith("override_") for c in cli), "no CLI case fails inside a stage"
    assert {c.stage for c in CASES} >= {"data", "cache", "quantize-drafter", "evaluate", "publish"}
