"""quantize-drafter: a DFlash drafter calibrated on the target's cached hidden states.

Recipe: validate the config on a weightless drafter (shapes from config.json); load the drafter
with only the target's embed_tokens/lm_head; split the cache into held-apart and calibration
samples (seeded); run llm-compressor's oneshot with the drafter's own calibration forward over
anchored blocks; write a compressed-tensors checkpoint in speculators format to
runs/<name>/drafter/<quant.name>/ (and the unquantized reference to drafter/bf16/ if missing);
reload and check both against the held-apart samples.

Every drafter family (`pipeline.models.families`) goes through the same recipe; the stage asks the drafter's
family what differs: the Linears it keeps dense (`dense_linears`, written in `ignore` under both names), the
settings and vLLM ranges it cannot take (`check_settings`, `refuse_profile`), the record's `vllm` entry
(`vllm_record`) and what the check compares (`check_notes`). A DFlash2 drafter (`pipeline.models.dflash`:
convolutions and candidate selector): its calibration forward runs the convolutions; its `kernel_projection`s
and `hidden_projection` stay dense, base kernels and codebooks are written as they were; the check's top-1
compares the selectors' chosen tokens (`drafter_checks`); it needs a vLLM range with a DFlash2 model class
(`quant.vllm` 0.28-0.31 or 0.32+).
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import torch

from pipeline.artifacts.rundir import RunDir
from pipeline.core import hashes
from pipeline.core.errors import bad_value
from pipeline.core.io import PARTIAL_PREFIX, atomic_dir, atomic_write_json, remove_partials
from pipeline.core.loading import checkpoint_sha256
from pipeline.core.seeding import seed_everything
from pipeline.models import families
from pipeline.models.checkpoint_info import CheckpointInfo
from pipeline.quant import cache_batches, calibrate, drafter_checks, export, pairing, recipes

FIELD = "quant"
REFERENCE = "bf16"


def serving_verifier(cfg) -> str:
    """The verifier every written drafter names: the target's Hub id where one is configured, else the
    target path exactly as configured (relative to the checkout root the serving commands run from, or
    absolute), never the source drafter's own entry (z-lab/speculators write `../target`-style paths that
    vLLM resolves against its working directory: pipeline.serving.contract)."""
    return str(cfg.publish.target_model or cfg.target.path)


def drafter_config(cfg):
    from pipeline.models.formats import load_drafter_config

    dconf = load_drafter_config(cfg.drafter.path, cfg.drafter.format)
    dconf.verifier_name_or_path = serving_verifier(cfg)
    return dconf


def num_target_layers(cfg) -> int:
    """T: vLLM numbers draft layer i as `model.layers.{i + T}` (pipeline.serving.contract)."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(cfg.target.path), revision=cfg.target.revision,
                                    trust_remote_code=bool(cfg.target.trust_remote_code))
    return int(tc.num_hidden_layers)


def drafter_linears(dconf, ignore: list[str]) -> list[tuple[str, int]]:
    from pipeline.models.dflash import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(dconf)
    return recipes.quantized_linears(model, ignore)


def calibration_cache(cfg, rd: RunDir) -> Path:
    """The cache the drafter calibrates on: the bf16 target's, or `quant.calibration_target`'s."""
    import difflib

    target = str(cfg[FIELD].calibration_target)
    run = f" run_name={cfg.run_name}"
    if target != "bf16" and target not in rd.target_variants():
        close = difflib.get_close_matches(target, rd.target_variants(), n=1)
        raise bad_value(f"{FIELD}.calibration_target", target, f"this run has no quantized target "
                        f"{rd.target(target)} (have {rd.target_variants() or 'none'})",
                        f"did you mean {close[0]} (names are case-sensitive)" if close else
                        f"run `make quantize-target ARGS=\"target_quant={target}{run}\"` first, or use bf16")
    where = rd.cache_for(target)
    if target != "bf16" and not (where / "index.json").is_file():
        raise bad_value(f"{FIELD}.calibration_target", target, f"no cache of that target's hidden states in {where}",
                        f"run `make cache ARGS=\"cache.target={target}{run}\"` first")
    if target != "bf16":  # the cache must hold the states of the target variant as it is now
        from pipeline.artifacts.cache import read_index
        from pipeline.quant import pairing

        cached = read_index(where)["inputs"]["target"]["files_sha256"]
        now = pairing.target_identity(rd.target(target), target).get("files_sha256")
        if cached != now:
            raise bad_value(f"{FIELD}.calibration_target", target, f"{where} holds the hidden states of other "
                            f"target files ({str(cached)[:12]}) than {rd.target(target)} now has ({str(now)[:12]})",
                            f"re-run `make cache ARGS=\"cache.target={target}{run}\"` first")
    return where


def check_cache(rd: RunDir, dconf, cache_dir: Path | None = None) -> dict:
    cache_dir = cache_dir or rd.cache
    from pipeline.artifacts.cache import read_index

    # the index against its shards (files, sizes, counts, sample -> shard), before any weight is read
    index = read_index(cache_dir)
    if list(index.get("aux_layer_ids") or []) != list(dconf.aux_layer_ids or []):
        raise bad_value("cache/index.json", str(cache_dir), f"it holds aux layers {index.get('aux_layer_ids')} but "
                        f"the drafter reads {dconf.aux_layer_ids}", "re-run the cache stage for this drafter")
    return index


def validate(cfg):
    """Everything that can fail before weights are read: settings, shapes, cache layout."""
    q = cfg[FIELD]
    recipes.validate_settings(q, FIELD)
    from pipeline.serving import contract

    contract.refuse_settings(q, FIELD)  # what the chosen vLLM range cannot serve, before any work
    if str(q.calibration_target) != "bf16" and not recipes.needs_data(q):
        raise bad_value(f"{FIELD}.calibration_target", q.calibration_target, f"quant `{str(q.name).rsplit('-on-', 1)[0]}` is data-free (it reads no "
                        "cached hidden states), so no target's states can calibrate it",
                        "leave calibration_target=bf16, or pick a calibrated preset (e.g. quant=w4a16-gptq)")
    from pipeline.models import compat

    # every field of the drafter's and the target's families against their tensors' headers, then the pair
    compat.check_checkpoints(cfg.drafter.path, cfg.target.path, cfg.drafter.format, cfg.target.revision)
    dconf = drafter_config(cfg)
    if dconf.has_draft_vocab:  # its head is its own; the quantized checkpoint would be written without it
        raise bad_value("drafter.path", str(cfg.drafter.path), f"the drafter has a trimmed head of "
                        f"{dconf.draft_vocab_size} tokens", "quantize the full-vocabulary drafter, then trim its "
                        "head with `python -m pipeline convert --draft-vocab N`")
    family = families.family_of(dconf)  # a range or settings the family cannot take: one sentence, before any weight
    family.refuse_profile(contract.profile(q.vllm, f"{FIELD}.vllm"), FIELD)
    family.check_settings(q, dconf, FIELD)
    ignore = recipes.resolve_ignore(q, dconf)
    recipes.validate_group_size(q, FIELD, drafter_linears(dconf, ignore))
    n_target = num_target_layers(cfg)
    with torch.device("meta"):
        from pipeline.models.dflash import DFlashDrafter

        names = [n for n, m in DFlashDrafter(dconf).named_modules() if isinstance(m, torch.nn.Linear)]
    # refuses a fused pair named only in part before any weight is read
    contract.serving_ignore([n for n in names if contract.matches(n, ignore)] + ignore, q.ignore, n_target)
    dconf.num_target_layers = dconf.num_target_layers or n_target
    return q, ignore, dconf


def load_working_drafter(cfg, dconf):
    from pipeline.models.formats import load_drafter

    model = load_drafter(cfg.drafter.path, target=cfg.target.path, fmt=cfg.drafter.format, dtype=torch.float32,
                         device=recipes.resolve_device(cfg[FIELD].device))
    model.config.verifier_name_or_path = dconf.verifier_name_or_path
    model.config.verifier_architectures = dconf.verifier_architectures
    return model


def work_root(rd: RunDir) -> Path:
    """Scratch space inside the run dir (not $TMPDIR), so a killed run's leftovers are removed by the next."""
    root = rd.root / ".work"
    root.mkdir(parents=True, exist_ok=True)
    return root


def write_reference(rd: RunDir, model) -> Path:
    """drafter/bf16/: the unquantized drafter in speculators format, in bfloat16 (what vLLM serves).

    Rebuilt every run and swapped in only when its bytes differ, so a reference left by another
    drafter is never reused and an up-to-date one is not touched.
    """
    from pipeline.models.formats import TARGET_KEYS, speculators_config_dict

    out = rd.drafter(REFERENCE)
    # the loaded weights, before any quantization, as `save_speculators` writes a bf16 copy of the model
    # (its own tensors only): each cast on the model's device and streamed to the file a slice at a time,
    # so neither the copy nor the borrowed embed_tokens/lm_head pass through host memory
    state = {k: v for k, v in model.state_dict().items() if k not in TARGET_KEYS and k != "inv_freq"}
    config = copy.deepcopy(model.config)
    config.dtype = torch.bfloat16
    with tempfile.TemporaryDirectory(prefix=PARTIAL_PREFIX + "bf16-", dir=work_root(rd)) as fresh:
        export.save_safetensors(state, Path(fresh) / "model.safetensors", {"format": "pt"}, dtype=torch.bfloat16)
        atomic_write_json(Path(fresh) / "config.json", speculators_config_dict(config))
        if export.output_hashes(Path(fresh)) != (export.output_hashes(out) if out.is_dir() else None):
            with atomic_dir(out) as tmp:
                for f in sorted(Path(fresh).iterdir()):
                    hashes.move(f, tmp / f.name)  # both inside the run directory: moved, not copied (digest kept)
    return out


def _write_native_config(model, work: Path) -> None:
    """oneshot and save_pretrained re-read config.json from model.config.name_or_path."""
    d = json.loads(json.dumps(model.config.to_dict(), default=str))
    d["architectures"] = ["DFlashDrafter"]
    atomic_write_json(work / "config.json", d)
    model.config.name_or_path = str(work)
    model.name_or_path = str(work)


def write_quantized(model, out: Path, ignore: list[str], user_ignore: list[str], n_target: int,
                    vllm: str | None = None) -> list[str]:
    """Compressed checkpoint in speculators layout: body tensors only, quantization_config in config.

    compressed-tensors writes `ignore` as the HF names of the layers it left dense
    (`layers.0.self_attn.q_proj`), which match nothing in vLLM (draft layers are `model.layers.{i+T}`,
    q/k/v fused): the list is rewritten as patterns vLLM and HF both match, and the folder is checked
    against the reading of the vLLM range `vllm` (quant.vllm; pipeline.serving.contract.PROFILES) before
    it is swapped in.
    """
    from safetensors import safe_open

    from pipeline.models.formats import TARGET_KEYS, speculators_config_dict
    from pipeline.serving import contract

    with atomic_dir(out) as tmp:
        written = export.save_compressed(model, tmp)
        with safe_open(str(tmp / "model.safetensors"), framework="pt") as fh:  # the body only, never a target key
            kept = {k: fh.get_tensor(k) for k in fh.keys() if not k.endswith(TARGET_KEYS) and k != "inv_freq"}
        export.save_safetensors(kept, tmp / "model.safetensors", {"format": "pt"})  # streamed, no whole-file bytes
        kept_keys = list(kept)
        del kept
        qc = dict(written["quantization_config"])
        native = list(qc.get("ignore") or [])  # compressed-tensors' own list (HF names), kept for the record
        qc["ignore"] = contract.serving_ignore(ignore, user_ignore, n_target)
        prof = contract.profile(vllm)
        config = contract.written_config(speculators_config_dict(model.config, qc), prof)
        export.rewrite_config(tmp, config)
        _, _, scales = contract.read_dir(tmp)
        problems = contract.checkpoint_problems(config, kept_keys, n_target, prof, scales)
        if problems:
            raise bad_value("quant.ignore", qc["ignore"], f"vLLM {prof.versions} would not serve the written "
                            f"checkpoint as quantized: {problems[0]}", "fix quant.ignore or quant.vllm "
                            "(pipeline/serving/contract.py)")
    return native


def run(cfg) -> dict:
    clock = _Clock()
    q, ignore, dconf = validate(cfg)
    rd = RunDir.from_cfg(cfg)
    from pipeline.quant import variants

    variants.refuse_overwrite(rd.stages / f"quantize-drafter-{q.name}.json", rd.drafter(q.name), FIELD, q, cfg.seed)
    cache_dir = calibration_cache(cfg, rd)
    index = check_cache(rd, dconf, cache_dir)
    remove_partials(rd.root / ".work")  # scratch left by a killed run
    need_data = recipes.needs_data(q)
    seed = int(cfg.seed)
    calib_idx, held_idx = cache_batches.split_indices(int(index["num_samples"]), int(q.num_samples),
                                                      int(q.heldout_samples), seed, need_data, FIELD)
    from pipeline.artifacts.cache import CacheReader

    # the inputs' sha256 (the drafter's files, the target's weights) for the record: on a thread from the
    # start, beside the work that needs a GPU (hashlib and file reads release the GIL)
    inputs = _Background(input_hashes, cfg)
    reader = CacheReader(cache_dir, dtype=cache_batches.reader_dtype(index))
    # every shard the calibration and the checks read, verified on threads while the drafter loads
    verifier = cache_batches.ShardVerifier(reader, list(calib_idx) + list(held_idx))
    clock.lap("prepare_s")
    batches = None
    try:
        seed_everything(seed)
        model = load_working_drafter(cfg, dconf)
        reference = write_reference(rd, model)
        clock.lap("load_s")
        if need_data:
            batches = cache_batches.Prefetched(
                cache_batches.drafter_batches(reader, calib_idx, int(q.anchors_per_sequence), dconf.block_size,
                                              int(dconf.mask_token_id), int(q.max_seq_len), seed),
                next(model.parameters()).device, verifier)
        out = rd.drafter(q.name)
        with tempfile.TemporaryDirectory(prefix=PARTIAL_PREFIX + "drafter-", dir=work_root(rd)) as work:
            _write_native_config(model, Path(work))
            calibrate.run_oneshot(model, q, ignore, batches, seed, skip_head=True)
            clock.lap("oneshot_s")
            baseline, search, minmax_scales = calibrate.activation_scales(model, q, batches)
            if search is not None:
                clock.lap("scale_search_s")
            if batches is not None:
                batches.close()
            scales = calibrate.stored_activation_scales(model)
            native_ignore = write_quantized(model, out, ignore, list(q.ignore), int(dconf.num_target_layers),
                                            str(q.vllm))
            clock.lap("write_s")
        del model
        report = drafter_checks.check_drafter(cfg, rd, q, reader, held_idx, dconf, search, verifier)
        clock.lap("check_s")
        hashed = inputs.result()
        clock.lap("inputs_hash_wait_s")
    finally:
        if batches is not None:
            batches.close()
        verifier.close()
    return {
        "output": str(out), "reference": str(reference), "scheme": q.scheme, "observer": q.observer,
        "observer_kwargs": dict(q.observer_kwargs or {}), "algorithm": q.algorithm,
        "group_size": recipes.group_size(q), "ignore": ignore, "calibration": q.calibration,
        "ignore_written": list(CheckpointInfo.read(out, f"drafter/{q.name}").ignore),
        "ignore_compressed_tensors": native_ignore,
        # the vLLM range the checkpoint is written and checked for
        "vllm": families.family_of(dconf).vllm_record(contract_profile(q)),
        "recipe": (out / "recipe.yaml").read_text(encoding="utf-8"),
        "seeds": _seeds(seed), **_calibration_counts(batches),
        "heldout_sample_ids": [reader.index["samples"][i]["id"] for i in held_idx],
        "calibration_free": baseline, "input_global_scales": scales,
        "activation_scale": q.activation_scale if minmax_scales else None, "minmax_input_global_scales": minmax_scales,
        "activation_scale_search": search,
        "calibration_target": pairing.calibration_record(cfg, index, need_data),
        "inputs": {"drafter": hashed["drafter"], "cache_content_hash": index.get("content_hash"),
                   "target_head": hashed["target_head"]},
        "outputs": export.output_hashes(out),
        "check": _check_summary(report, dconf),
        "timings": clock.finish(),
        "device": str(recipes.resolve_device(q.device)),
    }


def _seeds(seed: int) -> dict:
    """Every seed the stage used and how each sample's anchors derive from it, so a reader can redraw the
    calibration split and anchors without reading the code."""
    return {"seed": seed, "split_permutation": seed, "torch_manual_seed": seed,
            "anchors": f"{seed} * {cache_batches.SAMPLE_SEED_STRIDE} + cache index",
            "heldout_anchors": f"{seed + cache_batches.HELDOUT_SEED_OFFSET} * "
                               f"{cache_batches.SAMPLE_SEED_STRIDE} + cache index"}


def _calibration_counts(batches) -> dict:
    """How much calibration data oneshot saw (zeros for a calibration-free scheme, whose batches are None)."""
    return {"num_calibration_samples": len(batches or []),
            "num_calibration_anchors": cache_batches.count_anchors(batches or []),
            "num_calibration_tokens": cache_batches.count_tokens(batches or [])}


def _check_summary(report, dconf) -> dict:
    """The check report's summaries the record keeps (the per-row detail stays in checks/), with the family's
    note on what its top-1 numbers compare (a DFlash record is left as it was)."""
    return {**{k: v for k, v in report.to_json().items()
               if k in ("weight_error_summary", "layer_output_error_summary", "served", "weights_only",
                        "served_rounding_band", "activation_error_summary")},
            **families.family_of(dconf).check_notes(dconf)}


def contract_profile(q):
    from pipeline.serving import contract

    return contract.profile(q.vllm, f"{FIELD}.vllm")


def input_hashes(cfg) -> dict:
    """sha256 of the drafter's files and of the target's weights (its embedding and lm_head are used)."""
    return {"drafter": checkpoint_sha256(cfg.drafter.path, cfg.drafter.revision),
            "target_head": checkpoint_sha256(cfg.target.path, cfg.target.revision, weights_only=True)}


class _Background:
    """fn(*args) on a daemon thread (a failed or interrupted stage exits without waiting for it);
    `result()` waits and re-raises its error."""

    def __init__(self, fn, *args):
        import threading

        self._out: tuple | None = None

        def work():
            try:
                self._out = (fn(*args), None)
            except BaseException as exc:  # handed to the caller of result()
                self._out = (None, exc)

        self._thread = threading.Thread(target=work, name="specquant-inputs", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        value, exc = self._out
        if exc is not None:
            raise exc
        return value


class _Clock:
    """Wall time per phase of the stage (prepare, load, oneshot, scale search, write, check, and the wait
    for the inputs' hashes), and the peak GPU memory (torch.cuda.max_memory_allocated) at the end of each
    phase, for benchmarks. `finish` adds `total_s` (the stage's own wall, from run()'s first line)."""

    def __init__(self):
        import time

        self._now = time.perf_counter
        self._t = self._start = self._now()
        self.laps: dict[str, float] = {}
        self.peak_gpu: dict | None = None  # on CUDA: peak_gpu_alloc_bytes, _reserved_bytes, _alloc_bytes_after

        self.host = _HostAnonPeak()
        self.peak_host: dict[str, int] = {}

    def lap(self, name: str) -> None:
        t = self._now()
        self.laps[name] = round(t - self._t, 3)
        self._t = t
        peak = self.host.take()
        if peak is not None:
            self.peak_host[name] = peak
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = range(torch.cuda.device_count())
            peak = int(max(torch.cuda.max_memory_allocated(d) for d in devices))
            self.peak_gpu = {"peak_gpu_alloc_bytes": peak,
                             "peak_gpu_reserved_bytes": int(max(torch.cuda.max_memory_reserved(d) for d in devices)),
                             "peak_gpu_alloc_bytes_after": {**(self.peak_gpu or {}).get("peak_gpu_alloc_bytes_after", {}),
                                                            name: peak}}

    def finish(self) -> dict:
        """The laps, `total_s`, and on CUDA the peak GPU memory (overall and as it stood after each phase);
        under `timings`, which the manifests treat as measurements (pipeline.stages.manifest TIMING_KEYS)."""
        self.host.close()
        host = {"peak_host_anon_bytes": self.peak_host} if self.peak_host else {}
        return {**self.laps, "total_s": round(self._now() - self._start, 3), **(self.peak_gpu or {}), **host}


class _HostAnonPeak:
    """The process's peak anonymous RSS (`RssAnon` of /proc/self/status, what a memory limit counts) per
    phase, sampled every few milliseconds on a daemon thread (the kernel keeps no peak of it); `take()`
    returns the peak since the last call. Without /proc (not Linux), nothing is measured."""

    PERIOD_S = 0.01

    def __init__(self):
        import threading

        self._peak = self._read()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        if self._peak is not None:
            self._thread = threading.Thread(target=self._run, name="specquant-host-anon", daemon=True)
            self._thread.start()

    @staticmethod
    def _read() -> int | None:
        try:
            with open("/proc/self/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"RssAnon:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            now = self._read()
            if now is not None:
                with self._lock:
                    self._peak = max(self._peak or 0, now)

    def take(self) -> int | None:
        if self._peak is None:
            return None
        now = self._read() or 0
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return int(peak)

    def close(self) -> None:
        self._stop.set()
