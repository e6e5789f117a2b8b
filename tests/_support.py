"""Helpers shared by the test modules (not a test module: nothing here is collected).

The golden DFlash fixtures are read from `SPECQUANT_FIXTURES` (a folder laid out as
tests/fixtures/dflash/, see its README), default tests/fixtures/dflash. Every size a test needs
(layers, block size, vocabulary, aux layers, hidden size) comes from that folder's own configs and
tensors (`geometry()`), so the same tests run against fixtures of another geometry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.core.config import compose
from pipeline.core.io import sha256_file

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
DFLASH = Path(os.environ.get("SPECQUANT_FIXTURES") or FIXTURES / "dflash").resolve()
TARGET = DFLASH / "target"  # Qwen3 target/verifier in HF format
DRAFTER = DFLASH / "speculators" / "checkpoint"  # the drafter in speculators format
ZLAB_DRAFTER = DFLASH / "zlab" / "checkpoint"  # the same drafter in z-lab format


@functools.cache
def geometry() -> dict:
    """The fixture pair's sizes, read from its configs (z-lab ids are HF ids - 1)."""
    target = json.loads((TARGET / "config.json").read_text())
    zlab = json.loads((ZLAB_DRAFTER / "config.json").read_text())
    spec = json.loads((DRAFTER / "config.json").read_text())
    tlc = spec["transformer_layer_config"]
    hidden = int(target["hidden_size"])
    heads = int(tlc["num_attention_heads"])
    return {
        "target_layers": int(target["num_hidden_layers"]), "hidden": hidden, "vocab": int(target["vocab_size"]),
        "layers": int(tlc["num_hidden_layers"]), "block_size": int(spec["block_size"]),
        "mask_token_id": int(spec["mask_token_id"]), "aux_layer_ids": list(spec["aux_hidden_state_layer_ids"]),
        "zlab_layer_ids": list(zlab["dflash_config"]["target_layer_ids"]),
        "intermediate": int(tlc["intermediate_size"]), "heads": heads,
        "kv_heads": int(tlc["num_key_value_heads"]), "head_dim": int(tlc.get("head_dim") or hidden // heads),
    }


# ---------------------------------------------------------------- entry points and a small tokenizer
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(out: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A small byte-level BPE tokenizer with chat special tokens and <|MASK|> (built in < 1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["Hello, how are you? I am fine, thank you.", "What is 2 + 3? The answer is 5.",
              "def add(a, b):\n    return a + b", "user assistant system"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|MASK|>"])
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return out


FIXTURE_WORDS = ("user assistant system hello how are you what is the answer def add return a b code math "
                 "one two three four five plus minus equals please write a function that sums numbers").split()


def build_fixture_tokenizer(out: Path, geo: dict | None = None) -> Path:
    """A word-level chat tokenizer inside the fixture target's vocabulary (`geometry()["vocab"]` ids, the last
    `mask_token_id` = <|MASK|>), so the real evaluate stage can tokenize prompts for the fixture pair; `geo`:
    another fixture's sizes (`vocab`, `mask_token_id`: the DFlash2 fixture's geometry.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    g = geo or geometry()
    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"]  # 0 = bos, 1 = eos, as the target says
    words = list(dict.fromkeys(FIXTURE_WORDS))
    vocab = {t: i for i, t in enumerate([*specials, *words])}
    assert len(vocab) < g["mask_token_id"] < g["vocab"], "the fixture vocabulary is too small for the test words"
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), g["mask_token_id"])})  # ids without gaps
    vocab["<|MASK|>"] = g["mask_token_id"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|MASK|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 600):
    """Run `python -m pipeline ...` as a user would; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_main(*argv: str, env: dict[str, str | None] | None = None, cwd: Path = REPO) -> tuple[int, str, str]:
    """`python -m pipeline *argv` in this process, through the same entry point (`pipeline.__main__.main`), with
    what the interpreter adds around it: `sys.exit`'s codes (a SystemExit code of None is 0, a string is printed
    and is 1) and an uncaught exception printed as a traceback with exit code 1. Returns (rc, stdout, stderr),
    caught at the file descriptors as well as sys.stdout/sys.stderr, so a C-level or early-bound write counts.

    Isolated from the calling test and from the next call: `env` (None removes a variable) and every change the
    run makes to os.environ are undone, as are cwd, sys.argv, torch's thread count and deterministic mode, the
    RNG states, warnings filters, logging (every logger's handlers, level, disabled flag, propagation), the
    transformers verbosity and Hydra's global state. What a new interpreter reads from `env` at start is read
    here too: TMPDIR (tempfile's cached directory is reset) and OMP_NUM_THREADS (torch's thread count)."""
    import contextlib
    import io
    import logging
    import random
    import tempfile
    import traceback
    import warnings

    import numpy as np
    from hydra.core.global_hydra import GlobalHydra

    def loggers() -> dict:
        found = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                        if isinstance(lg, logging.Logger))]
        return {lg: (list(lg.handlers), lg.level, lg.disabled, lg.propagate) for lg in found}

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), list(sys.argv)
    saved_threads, saved_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    saved_det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    saved_rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    saved_loggers, saved_disable = loggers(), logging.root.manager.disable
    saved_tempdir = tempfile.tempdir
    try:
        from transformers.utils import logging as hf_logging
        saved_hf = hf_logging.get_verbosity()
    except ImportError:  # pragma: no cover - transformers is a dependency
        hf_logging = saved_hf = None
    out_py, err_py = io.StringIO(), io.StringIO()
    sys.stdout.flush(), sys.stderr.flush()
    with tempfile.TemporaryFile() as out_fd, tempfile.TemporaryFile() as err_fd:
        kept = os.dup(1), os.dup(2)
        try:
            for k, v in (env or {}).items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.chdir(cwd)
            sys.argv = [str(REPO / "pipeline" / "__main__.py"), *argv]
            if "TMPDIR" in (env or {}):
                tempfile.tempdir = None  # read again from the environment, as a new interpreter would
            if (env or {}).get("OMP_NUM_THREADS"):
                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
            os.dup2(out_fd.fileno(), 1)
            os.dup2(err_fd.fileno(), 2)
            GlobalHydra.instance().clear()
            with contextlib.redirect_stdout(out_py), contextlib.redirect_stderr(err_py), warnings.catch_warnings():
                from pipeline.__main__ import main

                try:
                    code = main(list(argv))
                except SystemExit as exc:
                    code = exc.code
                except Exception:  # what the interpreter does with an uncaught one (a Ctrl-C of pytest stays one)
                    traceback.print_exc()
                    code = 1
                if code is not None and not isinstance(code, int):
                    print(code, file=sys.stderr)
                    code = 1
                sys.stdout.flush(), sys.stderr.flush()
        finally:
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            os.close(kept[0])
            os.close(kept[1])
            GlobalHydra.instance().clear()
            tempfile.tempdir = saved_tempdir
            os.chdir(saved_cwd)
            sys.argv = saved_argv
            os.environ.clear()
            os.environ.update(saved_env)
            torch.set_num_threads(saved_threads)
            torch.use_deterministic_algorithms(saved_det, warn_only=saved_det_warn)
            random.setstate(saved_rng[0])
            np.random.set_state(saved_rng[1])
            torch.set_rng_state(saved_rng[2])
            for lg in set(loggers()) - set(saved_loggers):
                lg.handlers[:], lg.level, lg.disabled, lg.propagate = [], logging.NOTSET, False, True
            for lg, (handlers, level, disabled, propagate) in saved_loggers.items():
                lg.handlers[:], lg.level, lg.disabled, lg.propagate = handlers, level, disabled, propagate
            logging.disable(saved_disable)
            if hf_logging is not None:
                hf_logging.set_verbosity(saved_hf)
        out_fd.seek(0), err_fd.seek(0)
        out = out_py.getvalue() + out_fd.read().decode(errors="replace")
        err = err_py.getvalue() + err_fd.read().decode(errors="replace")
    return (0 if code is None else code), out, err


# ---------------------------------------------------------------- the fixture world: target, drafter, blend, cache
def write_blend(data_dir: Path, num_samples: int = 30, seq_len: int = 40, seed: int = 0) -> Path:
    """The data stage's files (through its writer, `pipeline.artifacts.samples.write`): random ids below the
    mask id, loss mask 1 after a short prompt. Built here rather than by the data stage, which tokenizes
    text: the fixture target has no tokenizer."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        n = seq_len - int(torch.randint(0, 8, (1,), generator=g))
        ids = torch.randint(2, geometry()["mask_token_id"], (n,), generator=g).tolist()
        prompt = 6 + i % 5
        mask = [0] * prompt + [1] * (n - prompt)
        samples.append({"id": f"synthetic/{i}", "input_ids": ids, "loss_mask": mask, "source": "synthetic"})
    write_samples(data_dir, samples, seed=seed, max_seq_len=seq_len)
    return data_dir / "samples.jsonl"


def write_samples(data_dir: Path, samples: list[dict], seed: int = 0, max_seq_len: int = 64) -> None:
    """`samples` as the data stage writes them, with one synthetic source and the fixture target as tokenizer."""
    from pipeline.artifacts import samples as samples_file

    kept = Counter(s["source"] for s in samples)
    names = sorted(kept)
    counts = {n: samples_file.SourceCounts(
        requested=kept[n], available=kept[n], examined=kept[n], kept=kept[n], dropped={}, dropped_examples={},
        location="synthetic", revision=None, format="synthetic", weight=1.0) for n in names}
    samples_file.write(
        data_dir, samples, counts, seed=seed, max_seq_len=max_seq_len,
        tokenizer=samples_file.TokenizerRecord(name_or_path=str(TARGET), revision=None, files=None, sha256=None,
                                               vocab_size=geometry()["vocab"]),
        sources=[samples_file.SourceRecord(name=n, path=None, hub_id=None, revision=None, split="train",
                                           format="synthetic", weight=1.0) for n in names],
        blend_name="synthetic")


def world_cfg(runs_root: Path, *overrides: str, target: Path = TARGET, tokenizer: Path | None = None,
              overrides_only: bool = False):
    """The fixture world's config (run `qw` under runs_root), composed; or its override list (`overrides_only`)."""
    ov = [f"runs_root={runs_root}", "run_name=qw", f"target.path={target}", f"target.tokenizer={tokenizer or target}",
          f"drafter.path={DRAFTER}", "drafter.format=speculators", "cache.storage_dtype=float32",
          "quant.num_samples=12", "quant.heldout_samples=12", "quant.anchors_per_sequence=8",
          "quant.max_seq_len=64", "target_quant.num_samples=4", "target_quant.max_seq_len=64", *overrides]
    return ov if overrides_only else compose(ov)


def build_world(runs_root: Path, blend_seed: int = 0, num_samples: int = 30, target: Path = TARGET) -> Path:
    """Blend + cache (the real cache stage) under runs_root/qw; returns the run directory."""
    from pipeline.stages import cache

    cfg = world_cfg(runs_root, target=target)
    run_dir = Path(cfg.run_dir)
    write_blend(run_dir / "data", num_samples=num_samples, seed=blend_seed)
    cache.run(cfg)
    return run_dir


def copy_world(world: Path, runs_root: Path) -> Path:
    """A private copy of a built world (blend + cache, anything quantized in it) under runs_root."""
    shutil.copytree(world, runs_root, symlinks=True, dirs_exist_ok=True)
    return runs_root


def massive_activation_target(out: Path, factor: float = 1e4) -> Path:
    """The fixture target with layer 0's down_proj scaled: its residual stream (and so every cached
    hidden state after it) reaches ~3e4, like the massive activations of real LLMs' hidden states."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(TARGET, out)
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight"] *= factor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------- the cache stage on the fixture world
def write_data(run_dir: Path, n: int = 10, seed: int = 0, max_len: int = 40) -> list[dict]:
    """The data stage's files (its writer, see `write_samples`); random ids and loss mask."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        t = int(torch.randint(3, max_len, (1,), generator=g))
        ids = torch.randint(0, geometry()["mask_token_id"], (t,), generator=g).tolist()
        mask = torch.randint(0, 2, (t,), generator=g).tolist()
        samples.append({"id": f"syn/{i}", "source": "syn", "input_ids": ids, "loss_mask": mask})
    write_samples(run_dir / "data", samples, seed=seed, max_seq_len=max_len)
    return samples


def stage_overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"run_dir={run_dir}", f"target.path={TARGET}", f"drafter.path={DRAFTER}",
            "drafter.format=speculators", "cache.samples_per_shard=3", "cache.batch_tokens=64", *extra]


def run_cache(run_dir: Path, *extra: str) -> dict:
    from pipeline.stages import cache
    return cache.run(compose(stage_overrides(run_dir, *extra)))


def hub_cache(root: Path, repo: str, src: Path, commit: str = "c0ffee" * 6 + "abcd") -> Path:
    """`src`'s files laid out as the Hub client caches repo `repo` at `commit` (blobs, snapshot links,
    refs/main); returns the cache root to point huggingface_hub at."""
    d = root / f"models--{repo.replace('/', '--')}"
    snap = d / "snapshots" / commit
    snap.mkdir(parents=True)
    (d / "blobs").mkdir(exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file():
            blob = d / "blobs" / sha256_file(p)
            shutil.copyfile(p, blob)
            (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    (d / "refs").mkdir(exist_ok=True)
    (d / "refs" / "main").write_text(commit)
    return root


# ---------------------------------------------------------------- one real run of the fixture world, shared
QUANT = ["quant=nvfp4", "quant.num_samples=6", "quant.heldout_samples=4", "quant.anchors_per_sequence=8",
         "quant.max_seq_len=64",
         # the drafter names its target by Hub id, as a pushed drafter must (pipeline/serving/contract.py)
         "publish.target_model=Qwen/Qwen3-8B"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PARTIAL = ".partial-"  # pipeline.quant.export.PARTIAL_PREFIX

# `python -c KILLPOINT_MAIN <stage> [overrides]`: the real entry point, with one function wrapped so
# that its n-th call writes a marker file and hangs - a precise place for the test to SIGKILL.
KILLPOINT_MAIN = r"""
import functools, importlib, os, sys, time
target, nth, marker = os.environ["SPECQUANT_TEST_KILLPOINT"].split("|")
modname, qual = target.split(":")
owner = importlib.import_module(modname)
*path, name = qual.split(".")
for p in path:
    owner = getattr(owner, p)
original, calls = getattr(owner, name), [0]
@functools.wraps(original)
def hooked(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(nth):
        with open(marker, "w") as fh:
            fh.write(str(os.getpid()))
        while True:
            time.sleep(60)
    return original(*args, **kwargs)
setattr(owner, name, hooked)
from pipeline.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def overrides(runs_root: Path, *extra: str) -> list[str]:
    return [f"runs_root={runs_root}", "run_name=qw", f"target.path={TARGET}", f"target.tokenizer={TARGET}",
            f"drafter.path={DRAFTER}", "drafter.format=speculators", "cache.storage_dtype=float32", *QUANT, *extra]


def quantize_cli(runs_root: Path, tmpdir: Path, killpoint: str | None = None, cold: bool = False):
    """quantize-drafter in its own process (`killpoint`: hang at that call for a SIGKILL), forked from the
    warm launcher (tests/warm.py) unless `cold`: then a real exec, as a user runs it."""
    from tests import warm

    tmpdir.mkdir(parents=True, exist_ok=True)
    env = {**ENV, "TMPDIR": str(tmpdir), **({"SPECQUANT_TEST_KILLPOINT": killpoint} if killpoint else {})}
    argv = [sys.executable, "-c", KILLPOINT_MAIN] if killpoint else [sys.executable, "-m", "pipeline"]
    launch = subprocess.Popen if cold else warm.popen
    return launch([*argv, "quantize-drafter", *overrides(runs_root)], cwd=REPO, env=env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def outputs(run: Path) -> dict[str, str]:
    """sha256 of everything quantize-drafter writes (its stage record aside: it holds wall times)."""
    from pipeline.core.io import hash_tree

    return {f"{d}/{k}": v["sha256"] for d in ("drafter", "checks") if (run / d).is_dir()
            for k, v in hash_tree(run / d).items()}


def leftovers(root: Path) -> list[str]:
    from pipeline.core.io import TMP_PREFIX

    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.name.startswith((TMP_PREFIX, PARTIAL)))


def tiny_run(root: Path) -> dict:
    """The real stages under root: `template` (data + cache), `reference` (+ quantize-drafter nvfp4 as a
    subprocess, + manifest) and `outputs` (the reference's quantize-drafter file hashes). Built once per
    session by conftest's `tiny_run` fixture."""
    from pipeline.stages import manifest
    from pipeline.stages.runner import run_stage

    torch.set_num_threads(1)
    template = root / "template"
    write_blend(template / "qw" / "data", num_samples=16)
    ov = overrides(template, "cache.samples_per_shard=4")
    run_stage("cache", "pipeline.stages.cache", compose(ov), ov)
    reference = root / "reference"
    shutil.copytree(template, reference)
    proc = quantize_cli(reference, root / "tmp", cold=True)  # the suite's one real-exec run of the stage
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    run = {"template": template / "qw", "reference": reference / "qw", "outputs": outputs(reference / "qw")}
    manifest.run(compose(overrides(reference)))
    return run


# ---------------------------------------------------------------- a small real run for the publish tests
PUBLISH_TOKEN = "hf_plantedTOKENpublish0123456789abcd"
HUB_BASE = "z-lab/Qwen3-8B-DFlash-b16"
HUB_TARGET = "Qwen/Qwen3-8B"


def publish_overrides(runs_root: Path, name: str = "tiny", seed: int = 0) -> list[str]:
    """The publish tests' run: the fixture world under `runs_root/name`, quantize-drafter nvfp4 (QUANT) and
    evaluate on two prompt subsets, with the fixture tokenizer `make_run` writes beside the run."""
    tok, prompts = runs_root / "tokenizer", runs_root / "prompts"
    return [f"runs_root={runs_root}", f"run_name={name}", f"seed={seed}", f"target.path={TARGET}",
            f"target.tokenizer={tok}", f"drafter.path={DRAFTER}", "drafter.format=speculators",
            "cache.storage_dtype=float32", "cache.samples_per_shard=4", *QUANT, "eval.name=fixture",
            "eval.max_new_tokens=12", "eval.include_source=false", f"eval.prompt_sets=[{{name: chat, path: {prompts / 'chat.jsonl'}, field: prompt}},"
            f"{{name: code, path: {prompts / 'code.jsonl'}, field: prompt}}]"]


PUBLISH_PROMPTS = {"chat": ["hello how are you", "what is the answer please"],
                   "code": ["def add a b return a plus b", "write a function that sums numbers"]}


def make_run(runs_root: Path, name: str = "tiny", seed: int = 0) -> Path:
    """A real run of the fixture world for the publish tests, every file from the stage that makes it: the
    blend (the data stage's writer: the fixture target has no corpus tokenizer), the cache stage,
    quantize-drafter nvfp4 (drafter/bf16, drafter/nvfp4, checks/), evaluate (eval/ on PUBLISH_PROMPTS, with
    `build_fixture_tokenizer`), each through `run_stage` as the entry point runs it, then the manifest stage."""
    from pipeline.stages.runner import run_stage

    build_fixture_tokenizer(runs_root / "tokenizer")
    (runs_root / "prompts").mkdir(parents=True, exist_ok=True)
    for subset, prompts in PUBLISH_PROMPTS.items():
        (runs_root / "prompts" / f"{subset}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                                      for p in prompts))
    ov = publish_overrides(runs_root, name, seed)
    rd = runs_root / name
    write_blend(rd / "data", num_samples=16)
    for stage in ("cache", "quantize-drafter", "evaluate"):
        run_stage(stage, f"pipeline.stages.{stage.replace('-', '_')}", compose(ov), ov)
    remanifest(runs_root, name, seed)
    return rd


def remanifest(runs_root: Path, name: str = "tiny", seed: int = 0) -> None:
    from pipeline.stages import manifest

    manifest.run(compose(publish_overrides(runs_root, name, seed)))


def publish_cfg(runs_root: Path, *extra: str, name: str = "tiny"):
    return compose([*publish_overrides(runs_root, name), f"publish.base_model={HUB_BASE}",
                    f"publish.target_model={HUB_TARGET}", "publish.namespace=specquant-test", *extra])


def push_cfg(runs_root: Path, url: str, *extra: str):
    return publish_cfg(runs_root, "publish.dry_run=false", f"publish.endpoint={url}", *extra)


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n")[1])


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def download(url: str, repo_id: str, revision: str, cache: Path) -> Path:
    from huggingface_hub import snapshot_download

    from pipeline.provenance.hub_push import hub_online

    with hub_online():
        snap = Path(snapshot_download(repo_id, revision=revision, endpoint=url, token=PUBLISH_TOKEN, cache_dir=cache))
    plain = cache.parent / f"{cache.name}-files"  # the cache's snapshot is symlinks; verify wants files
    shutil.rmtree(plain, ignore_errors=True)
    shutil.copytree(snap, plain, symlinks=False)
    return plain


# ---------------------------------------------------------------- numerics shared by the quantization tests
def nvfp4_qdq_reference(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Independent NVFP4 activation quantize-dequantize with vLLM's semantics (per token, groups of 16):
    block scale = fp8_e4m3(global_scale * amax / 6) (saturating), values rounded to the E2M1 grid."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    g = x.float().unflatten(-1, (-1, 16))
    amax = g.abs().amax(-1, keepdim=True)
    scale = (global_scale * amax / 6).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.finfo(torch.float8_e4m3fn).tiny, scale)
    y = (g / (scale / global_scale)).clamp(-6, 6)
    idx = (y.abs()[..., None] - grid).abs().argmin(-1)
    q = grid[idx] * y.sign()
    return (q * (scale / global_scale)).flatten(-2).to(x.dtype)


@pytest.fixture(autouse=True)
def one_thread():
    """Same thread count as the torchrun/subprocess runs, so hashes compare bit for bit (autouse where imported)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def w4a16_group() -> int:
    """A W4A16 group size that divides every quantized width of the fixture drafter (128 at most)."""
    import math

    g = geometry()
    return math.gcd(128, g["hidden"], g["intermediate"], g["heads"] * g["head_dim"])


def target_w4a16_group() -> int:
    """A W4A16 group size that divides every quantized input width of the fixture target (128 at most):
    hidden (q/k/v, gate/up), heads x head_dim (o_proj), intermediate (down_proj)."""
    import math

    c = json.loads((TARGET / "config.json").read_text())
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return math.gcd(128, int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_attention_heads"]) * head_dim)


# the variants conftest's `quantized_world` writes once per session (quantize-drafter, real stage)
SHARED_VARIANTS = {"nvfp4": ("quant=nvfp4",), "nvfp4a16": ("quant=nvfp4a16",),
                   "w4a16": ("quant=w4a16", f"quant.group_size={w4a16_group()}")}


# ---------------------------------------------------------------- recorded vLLM worker results
def worker_results(archive: Path, into: Path) -> list[dict]:
    """The serve-check worker's result files recorded in a tar.xz under tests/fixtures/vllm/, unpacked into `into`."""
    import tarfile

    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return [json.loads(p.read_text()) for p in sorted(into.glob("*.json"))]


def worker_prompts(results: list[dict]) -> dict[str, list]:
    """{subset: one placeholder per prompt}, read off the target-alone result (what verdict.summarize counts)."""
    alone = next(r for r in results if r["job"]["variant"] is None)
    return {s: [None] * len(d["outputs"]) for s, d in alone["subsets"].items()}


# ---------------------------------------------------------------- the DFlash2 fixture world
# (tests/test_dflash2_quant.py, tests/test_serve_dflash2.py): the DFlash2 golden fixture's drafter and a Qwen3
# target of its geometry, every size read from the fixture (SPECQUANT_DFLASH2_FIXTURES: another geometry)
DFLASH2_FIXTURES = Path(os.environ.get("SPECQUANT_DFLASH2_FIXTURES") or FIXTURES / "dflash2").resolve()
DFLASH2_DRAFTER = DFLASH2_FIXTURES / "speculators" / "checkpoint"




def dflash2_geometry() -> dict:
    return json.loads((DFLASH2_FIXTURES / "geometry.json").read_text())


def write_dflash2_target(out: Path) -> Path:
    """A Qwen3 target of the fixture's geometry: the fixture's embed_tokens / lm_head, seeded random layers."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    g = dflash2_geometry()
    config = Qwen3Config(vocab_size=g["vocab"], hidden_size=g["hidden"], intermediate_size=g["intermediate"],
                         num_hidden_layers=g["target_layers"], num_attention_heads=g["heads"],
                         num_key_value_heads=g["kv_heads"], head_dim=g["head_dim"], max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(config)
    inputs = load_file(str(DFLASH2_FIXTURES / "zlab" / "inputs.safetensors"))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(inputs["embed_tokens_weight"])
        model.lm_head.weight.copy_(inputs["lm_head_weight"])
        for name, p in model.named_parameters():  # layers large enough that hidden states carry signal
            if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(str(out))
    return out


def write_dflash2_blend(data_dir: Path, num_samples: int = 30, seq_len: int = 40, seed: int = 0) -> None:
    """The data stage's files: random ids below the mask id, loss mask 1 after a short prompt."""
    from pipeline.artifacts import samples as samples_file

    g, geo = torch.Generator().manual_seed(seed), dflash2_geometry()
    samples = []
    for i in range(num_samples):
        n = seq_len - int(torch.randint(0, 8, (1,), generator=g))
        ids = torch.randint(2, geo["mask_token_id"], (n,), generator=g).tolist()
        prompt = 6 + i % 5
        samples.append({"id": f"synthetic/{i}", "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt),
                        "source": "synthetic"})
    kept = Counter(s["source"] for s in samples)
    counts = {n: samples_file.SourceCounts(
        requested=kept[n], available=kept[n], examined=kept[n], kept=kept[n], dropped={}, dropped_examples={},
        location="synthetic", revision=None, format="synthetic", weight=1.0) for n in kept}
    samples_file.write(
        data_dir, samples, counts, seed=seed, max_seq_len=seq_len,
        tokenizer=samples_file.TokenizerRecord(name_or_path="synthetic", revision=None, files=None, sha256=None,
                                               vocab_size=geo["vocab"]),
        sources=[samples_file.SourceRecord(name=n, path=None, hub_id=None, revision=None, split="train",
                                           format="synthetic", weight=1.0) for n in kept],
        blend_name="synthetic")


def dflash2_world_cfg(root: Path, *overrides: str):
    target = root / "target"
    return compose([f"runs_root={root}", "run_name=qw", f"target.path={target}", f"target.tokenizer={target}",
                    f"drafter.path={DFLASH2_DRAFTER}", "drafter.format=speculators", "cache.storage_dtype=float32",
                    "quant.num_samples=12", "quant.heldout_samples=12", "quant.anchors_per_sequence=8",
                    "quant.max_seq_len=64", *overrides])


def build_dflash2_world(root: Path) -> Path:
    from pipeline.stages import cache

    write_dflash2_target(root / "target")
    cfg = dflash2_world_cfg(root)
    write_dflash2_blend(Path(cfg.run_dir) / "data")
    cache.run(cfg)
    return root


def dflash2_quantized_widths() -> list[int]:
    """The in/out widths of the fixture drafter's quantized Linears: fc reads the aux layers' concatenated hidden
    states (n_aux x hidden); o_proj and the MLP read and write hidden, heads x head_dim and intermediate."""
    g = dflash2_geometry()
    return [len(g["zlab_target_layer_ids"]) * g["hidden"], g["hidden"], g["intermediate"], g["heads"] * g["head_dim"]]


def dflash2_w4a16_group() -> int:
    """A W4A16 group size dividing every quantized width of the fixture drafter (fc's n_aux x hidden included)."""
    import math

    return math.gcd(128, *dflash2_quantized_widths())


def random_samples(run_dir: Path, vocab: int, n: int = 6, max_len: int = 40) -> list[dict]:
    """n seeded random-id samples (3..max_len tokens, loss on every token) written as run_dir/data/: a calibration
    set for stages that only need the format (the hybrid target tests)."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        t = int(torch.randint(3, max_len, (1,), generator=g))
        samples.append({"id": f"syn/{i}", "source": "syn", "input_ids": torch.randint(0, vocab, (t,), generator=g).tolist(),
                        "loss_mask": [1] * t})
    write_samples(run_dir / "data", samples, max_seq_len=max_len)
    return samples


# ---------------------------------------------------------------- `vllm serve` commands a run writes
def vllm_argv(script: Path, *args: str, tmp_path: Path) -> list[str]:
    """The argv `vllm` gets when the script runs (a stand-in `vllm` on PATH prints it)."""
    import stat

    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    stub = bindir / "vllm"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv))\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PORT": "8123"}
    out = subprocess.run(["bash", str(script), *args], env=env, check=True, capture_output=True, text=True,
                         cwd=REPO).stdout
    argv = json.loads(out.strip().splitlines()[-1])
    return ["vllm", *argv[1:]]


def serve_parts(argv: list[str]) -> tuple[str, dict, list[str]]:
    """(target, speculative config, the argv with both locations taken out) of one `vllm serve` command."""
    assert argv[:2] == ["vllm", "serve"], argv
    at = argv.index("--speculative-config")
    spec = json.loads(argv[at + 1])
    rest = [*argv[:2], "<target>", *argv[3:at + 1], "<spec>", *argv[at + 2:]]
    return argv[2], spec, rest
