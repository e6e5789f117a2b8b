"""Cache stage: the target's hidden states at the drafter's aux layers, streamed to sharded safetensors.

Recipe: read the data stage's samples -> resolve and check the aux layer ids against the target's
depth (before any weight is loaded) -> skip if a finished cache of the same inputs exists -> plan
shards (independent of the number of processes) -> each rank runs the target over its shards with
forward hooks that stop the forward after the deepest aux layer -> device->host copies on a side
stream into pinned buffers, shards written and hashed by a background thread -> rank 0 writes
index.json. Format: docs/cache_format.md; reader: `CacheReader`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from pipeline.artifacts import samples as samples_file
from pipeline.artifacts.cache import (
    CacheReader,
    Layout,
    build_index,
    check_storage_dtype,
    clear_stale,
    encode_hidden,
    finished_index,
    pack_batches,
    plan_shards,
    read_sidecar,
)
from pipeline.artifacts.cache_writer import BackgroundWriter
from pipeline.artifacts.rundir import RunDir
from pipeline.core import distributed
from pipeline.core.dtypes import TORCH_DTYPES
from pipeline.core.errors import bad_value
from pipeline.core.io import confine, dumps_json, read_json, remove_stale_temps, sha256_text
from pipeline.core.loading import check_safetensors_dir, checkpoint_hashes, local_snapshot, target_config


class _StopForward(Exception):
    """Raised by the hook on the deepest aux layer: nothing after it is computed."""


class LayerCapture:
    """Forward hooks that keep the outputs at `aux_layer_ids` (HF output_hidden_states convention:
    0 = embeddings, m = output of decoder layer m-1, L = the final norm's output) and stop the
    forward right after the deepest one."""

    def __init__(self, model, aux_layer_ids: list[int]):
        from pipeline.models.targets import decoder

        # the text decoder of any family (pipeline.models.targets): a vision tower or MTP head is never run
        self.base = decoder(model)
        n = len(self.base.layers)
        modules = {0: self.base.get_input_embeddings(), n: self.base.norm}
        modules.update({m: self.base.layers[m - 1] for m in range(1, n)})
        self.aux = list(aux_layer_ids)
        self.deepest = max(self.aux)
        self.store: dict[int, torch.Tensor] = {}
        self._handles = [modules[m].register_forward_hook(self._hook(m)) for m in self.aux]

    def _hook(self, m: int):
        def hook(_module, _args, output):
            self.store[m] = output[0] if isinstance(output, tuple) else output
            if m == self.deepest:
                raise _StopForward

        return hook

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
        self.store = {}
        with contextlib.suppress(_StopForward):
            self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        out = [self.store[m] for m in self.aux]
        self.store = {}
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def compile_layers(self) -> None:
        """torch.compile each needed decoder layer's forward; the hooks stay outside the compiled code."""
        for layer in self.base.layers[: self.deepest]:
            layer.forward = torch.compile(layer.forward)


def check_aux_layer_ids(aux, num_layers: int, field: str = "drafter aux_layer_ids", mix: str = "") -> list[int]:
    """`mix`: the target's layer types (`targets.describe`), named for a hybrid target."""
    ids = list(aux) if aux is not None else []
    if not ids or not all(isinstance(m, int) and not isinstance(m, bool) for m in ids):
        raise bad_value(field, ids, "it must be a non-empty list of integer layer indices",
                        "give the target layers the drafter reads (HF output_hidden_states indices)")
    bad = [m for m in ids if not 0 <= m <= num_layers]
    if bad:
        raise bad_value(field, ids, f"index {bad[0]} is outside the target's hidden states 0..{num_layers} "
                        f"(it has {num_layers} decoder layers{': ' + mix if mix else ''})", "use a drafter made for this target "
                        "or fix the layer ids (index m = output of decoder layer m-1)")
    if len(set(ids)) != len(ids):
        raise bad_value(field, ids, "it repeats a layer", "list each aux layer once")
    return ids


def resolve_aux_layer_ids(cfg) -> list[int]:
    """cache.aux_layer_ids if set, else the drafter config's (HF index convention)."""
    if cfg.cache.get("aux_layer_ids"):
        return [int(m) for m in cfg.cache.aux_layer_ids]
    from pipeline.models.formats import load_drafter_config

    return list(load_drafter_config(cfg.drafter.path, cfg.drafter.format).aux_layer_ids)


def _check_drafter(cfg, target_config) -> None:
    """The drafter's own shape checks against the target (hidden size, layers), from configs only."""
    from pipeline.models.compat import check_compatible
    from pipeline.models.formats import load_drafter_config

    check_compatible(load_drafter_config(cfg.drafter.path, cfg.drafter.format), target_config)


def target_files_sha256(cfg, target_cfg=None) -> str:
    """One sha256 over the target's weight + config files (names and contents; `checkpoint_hashes`),
    from a local directory or the Hub cache's snapshot of target.revision. Download metadata such as
    `.cache/huggingface/` does not count, so a re-downloaded target reuses its cache."""
    t = target_cfg if target_cfg is not None else cfg.target
    files = checkpoint_hashes(t.path, t.revision)
    if not files:
        try:
            local_snapshot(t.path, t.revision)
            why = "it holds no weight or config files"
        except LookupError as exc:
            why = str(exc)
        raise bad_value("target.path", t.path, why, "download it first or give a local directory")
    return sha256_text(dumps_json({rel: e["sha256"] for rel, e in files.items()}))


def _check_cfg(cfg) -> None:
    c = cfg.cache
    check_storage_dtype(c.storage_dtype)
    for key in ("samples_per_shard", "max_shard_bytes", "batch_tokens", "shards_in_flight"):
        if int(c[key]) < 1:
            raise bad_value(f"cache.{key}", c[key], "it must be a positive integer", "set it to 1 or more")
    if c.get("engine", "hf") not in ("hf", "vllm"):
        raise bad_value("cache.engine", c.engine, "it is not a known engine",
                        "use hf (the target in transformers, here) or vllm (vLLM's extract_hidden_states)")
    if c.distributed_backend not in ("auto", "gloo", "nccl"):
        raise bad_value("cache.distributed_backend", c.distributed_backend, "it is not a known backend",
                        "use auto, gloo or nccl")
    if cfg.target.dtype not in TORCH_DTYPES:
        raise bad_value("target.dtype", cfg.target.dtype, "it is not supported", f"use one of {', '.join(TORCH_DTYPES)}")


def _device(cfg) -> torch.device:
    dev = distributed.rank_device(torch.device(cfg.target.device))
    if dev.type == "cuda":
        if dev.index is None:  # set_device and the pinned-copy stream want an explicit index
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def target_for_cache(cfg, rd: RunDir):
    """(target config node, variant): `target.path` for bf16, else the run's quantized target/<variant>/
    (same tokenizer, dtype and attention settings; loaded dequantized, as pipeline.evaluation loads it)."""
    from omegaconf import OmegaConf

    variant = str(cfg.cache.target)
    if variant == "bf16":
        return cfg.target, variant
    have = rd.target_variants()
    if variant not in have:
        import difflib

        close = difflib.get_close_matches(variant, have, n=1)
        raise bad_value("cache.target", variant, f"no quantized target {rd.target(variant)} in this run "
                        f"(have {have or 'none'})", f"did you mean {close[0]} (names are case-sensitive)" if close else
                        f"run `make quantize-target ARGS=\"target_quant={variant} run_name={cfg.run_name}\"` "
                        "first or use cache.target=bf16")
    node = OmegaConf.create(OmegaConf.to_container(cfg.target, resolve=True))
    node.path, node.revision = str(rd.target(variant)), None
    node.tokenizer = cfg.target.tokenizer or cfg.target.path
    return node, variant


def load_target(cfg, device: torch.device, target_cfg=None):
    target_cfg = target_cfg if target_cfg is not None else cfg.target
    from pipeline.artifacts.checkpoint import read_quantization_config

    if Path(str(target_cfg.path)).is_dir() and read_quantization_config(target_cfg.path) is not None:
        from pipeline.evaluation.fakequant import load_target as load_served

        # a compressed-tensors target, dequantized (W4A4 inputs QDQ'd): the states its drafter reads
        return load_served(str(target_cfg.path), TORCH_DTYPES[target_cfg.dtype], str(device), None,
                           bool(target_cfg.trust_remote_code), target_cfg.attn_implementation)
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    from pipeline.core.loading import load_target as load_checkpoint

    # the base model is loaded without lm_head on purpose: silence the "UNEXPECTED lm_head" report
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load_checkpoint(
            target_cfg.path, revision=target_cfg.revision, trust_remote_code=bool(target_cfg.trust_remote_code),
            dtype=TORCH_DTYPES[target_cfg.dtype], attn_implementation=target_cfg.attn_implementation, device=device,
            auto_cls=AutoModel, **({"device_map": str(device)} if device.type == "cuda" else {}))
    finally:
        hf_logging.set_verbosity(level)


def forward_batch(capture: LayerCapture, batch: list[list[int]], layout: Layout, device: torch.device):
    """Run one padded batch; returns the packed [sum T, n_aux, H] storage tensor (+ fp8 scales).

    Padding is dropped on the device with an index built on the host, so no host sync is needed."""
    lens = [len(ids) for ids in batch]
    tmax, pin = max(lens), device.type == "cuda"
    ids = torch.zeros(len(batch), tmax, dtype=torch.long)
    for b, row in enumerate(batch):
        ids[b, : lens[b]] = torch.tensor(row, dtype=torch.long)
    padded = min(lens) != tmax
    mask = (torch.arange(tmax)[None, :] < torch.tensor(lens)[:, None]).long() if padded else None
    to = (lambda t: t.pin_memory().to(device, non_blocking=True)) if pin else (lambda t: t.to(device))
    outs = capture(to(ids), None if mask is None else to(mask))
    h = layout.hidden_size
    if padded:
        keep = to(torch.cat([torch.arange(n) + b * tmax for b, n in enumerate(lens)]))
        packed = torch.stack([o.reshape(-1, h).index_select(0, keep) for o in outs], dim=1)
    else:
        packed = torch.stack([o.reshape(-1, h) for o in outs], dim=1)
    return encode_hidden(packed, layout)


def cache_shards(capture: LayerCapture, plans, samples, layout: Layout, out: Path, resume_key: str,
                 device: torch.device, batch_tokens: int, rank: int = 0, dry_run: bool = False,
                 shards_in_flight: int = 1) -> int:
    """Compute and write `plans` (shards, in order); returns the tokens written. The loop only
    launches GPU work and hands batches over: copies, writes and hashes happen off this thread.
    With shards_in_flight = W, W consecutive shards are written at once by W writer threads (their
    batches interleaved). `dry_run` copies to host but writes nothing (benchmarks)."""
    from tqdm import tqdm

    longest = max(len(samples[g]["input_ids"]) for p in plans for g in range(p.first, p.first + p.count))
    writer = BackgroundWriter(out, samples, layout, resume_key, device, dry_run=dry_run,
                              max_batch_tokens=max(batch_tokens, longest), lanes=shards_in_flight)
    bar = tqdm(total=sum(p.num_tokens for p in plans), unit="tok", unit_scale=True, disable=rank != 0,
               desc=f"cache rank {rank}", mininterval=1.0)
    try:
        with torch.inference_mode():
            for start in range(0, len(plans), shards_in_flight):
                group = plans[start:start + shards_in_flight]
                batches = []
                for lane, plan in enumerate(group):
                    lengths = [len(samples[g]["input_ids"]) for g in range(plan.first, plan.first + plan.count)]
                    batches.append([[plan.first + i for i in b] for b in pack_batches(lengths, batch_tokens)])
                    writer.open_shard(plan, [g for b in batches[-1] for g in b], lane)
                for step in range(max(len(b) for b in batches)):
                    for lane, shard_batches in enumerate(batches):
                        if step < len(shard_batches):
                            b = shard_batches[step]
                            hs, scale = forward_batch(capture, [samples[g]["input_ids"] for g in b], layout, device)
                            writer.put_batch(b, [len(samples[g]["input_ids"]) for g in b], hs, scale, lane)
                            bar.update(sum(len(samples[g]["input_ids"]) for g in b))
                for lane in range(len(group)):
                    writer.close_shard(lane)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return sum(p.num_tokens for p in plans)


def _cache_rank(cfg, plans, samples, layout, out: Path, resume_key: str, device, rank: int,
                target_cfg=None) -> tuple[int, int]:
    if not plans:
        return 0, 0
    capture = LayerCapture(load_target(cfg, device, target_cfg), list(layout.aux_layer_ids))
    if cfg.cache.get("compile_layers"):
        capture.compile_layers()
    try:
        return len(plans), cache_shards(capture, plans, samples, layout, out, resume_key, device,
                                        int(cfg.cache.batch_tokens), rank,
                                        shards_in_flight=int(cfg.cache.get("shards_in_flight", 1)))
    finally:
        capture.remove()


def run(cfg) -> dict:
    _check_cfg(cfg)
    rd = RunDir.from_cfg(cfg)
    tcfg, variant = target_for_cache(cfg, rd)
    where = rd.cache_for(variant)
    out = confine(where, rd.root, "cache dir") if rd.root.exists() else where
    data_meta = samples_file.load_meta(rd.data)
    samples = samples_file.load_samples(rd.data, data_meta)
    if not samples:
        raise bad_value("data", str(rd.data), "it holds no samples", "re-run `make data` with a non-empty blend")
    tconf, aux = _checked_models(cfg, tcfg)
    check_safetensors_dir(tcfg.path, "target.path" if variant == "bf16" else "cache.target")  # refuse pickles / truncated files before any work
    engine = str(cfg.cache.get("engine", "hf"))
    if engine == "vllm":  # an interpreter with vLLM and a GPU, and layer ids it can extract: before any work
        from pipeline.serving.extract_stream import check_vllm_engine

        check_vllm_engine(cfg, aux, int(tconf.num_hidden_layers))
    layout = Layout(tuple(aux), int(tconf.hidden_size), cfg.cache.storage_dtype)
    files_sha = target_files_sha256(cfg, tcfg)
    inputs = _cache_inputs(cfg, aux, layout, files_sha, data_meta.samples_sha256, len(samples), engine)
    inputs_hash = sha256_text(dumps_json(inputs))
    done = finished_index(out, inputs_hash)
    if done is not None:
        print(f"[specquant] cache: {out} already holds these inputs ({inputs_hash[:12]}...); nothing to do")
        return _summary(out, done, written=0, seconds=0.0, reused=True)
    plans = plan_shards([len(s["input_ids"]) for s in samples], layout, int(cfg.cache.samples_per_shard),
                        int(cfg.cache.max_shard_bytes))
    device = _device(cfg) if engine == "hf" else torch.device("cpu")  # vLLM gets the GPU to itself
    resume_key = sha256_text(dumps_json({"inputs_hash": inputs_hash, "batch_tokens": int(cfg.cache.batch_tokens),
                                         "device_type": device.type,
                                         "compile_layers": bool(cfg.cache.get("compile_layers")),
                                         "plan": [[p.first, p.count] for p in plans]}))
    dist = distributed.Group(cfg.cache.distributed_backend, device)
    try:
        if dist.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(out)
            clear_stale(out, resume_key, len(plans))
        dist.barrier()
        mine = [p for p in plans if p.index % dist.world == dist.rank and read_sidecar(out, p.index, resume_key) is None]
        started = time.time()
        engine_report: dict = {}
        if engine == "vllm":
            from pipeline.serving.extract_stream import cache_shards_vllm

            *written, engine_report = cache_shards_vllm(cfg, mine, samples, layout, out, resume_key, tcfg,
                                                        rd.root / ".work", rd.data / samples_file.SAMPLES)
        else:
            written = _cache_rank(cfg, mine, samples, layout, out, resume_key, device, dist.rank, tcfg)
        per_rank = dist.gather([*written, time.time() - started])
        dist.barrier()
        index = None
        if dist.rank == 0:
            extra = _index_extra(cfg, variant, tcfg, tconf, device, engine, engine_report)
            index = build_index(out, plans, layout, inputs, inputs_hash, resume_key, extra)
        dist.barrier()
        index = index or read_json(out / "index.json", "cache/index.json")
    finally:
        dist.close()
    summary = _summary(out, index, written=sum(r[0] for r in per_rank), tokens=sum(r[1] for r in per_rank),
                       seconds=max(r[2] for r in per_rank), reused=False)
    if engine != "hf":
        summary["engine"] = {"name": engine, **{k: engine_report.get(k) for k in ("load_s", "extract_s", "stop_s", "versions")}}
    return summary


def _checked_models(cfg, tcfg) -> tuple:
    """(the target's text config, the aux layer ids), checked from configs and tensor headers before any
    weight loads: every field of the target's and the drafter's families (issue 47; the drafter's only when
    its config supplies the ids), the ids against the target's depth (a hybrid target's layer mix named in
    the sentence), then the drafter's shape against the target."""
    from pipeline.models import validation
    from pipeline.models.targets import text_config

    # every field of the target's and the drafter's families, against their tensors' headers (issue 47)
    validation.check_target(tcfg.path, tcfg.revision)
    if not cfg.cache.get("aux_layer_ids"):
        validation.check_drafter(cfg.drafter.path, cfg.drafter.format)
    tconf = text_config(target_config(tcfg))
    field = "cache.aux_layer_ids" if cfg.cache.get("aux_layer_ids") else "drafter aux_layer_ids"
    from pipeline.models.targets import describe, family_of

    mix = describe(tconf) if family_of(tconf).hybrid else ""  # a dense target's sentence is unchanged
    aux = check_aux_layer_ids(resolve_aux_layer_ids(cfg), int(tconf.num_hidden_layers), field, mix)
    if not cfg.cache.get("aux_layer_ids"):
        _check_drafter(cfg, tconf)
    return tconf, aux


def _cache_inputs(cfg, aux: list[int], layout: Layout, files_sha: str, samples_sha: str, num_samples: int,
                  engine: str) -> dict:
    """What the cached values depend on, hashed into `inputs_hash` to reuse a finished cache: paths are not
    (a moved target or run dir reuses the cache), and the keys and their order are the index's format."""
    inputs = {"format_version": 1, "aux_layer_ids": aux, "storage_dtype": layout.storage_dtype,
              "target": {"files_sha256": files_sha, "dtype": cfg.target.dtype,
                         "attn_implementation": cfg.target.attn_implementation},
              "data": {"samples_sha256": samples_sha, "num_samples": num_samples}}
    if engine != "hf":  # other kernels, other values (the HF engine's inputs, and so its caches, are unchanged)
        inputs["engine"] = engine
    return inputs


def _index_extra(cfg, variant: str, tcfg, tconf, device: torch.device, engine: str, engine_report: dict) -> dict:
    """The index's record of which target made the cache and how (beyond what `inputs` hashes). A quantized
    target is named by its place in the run (`target/<variant>`), so the index does not depend on where the
    run directory lives."""
    extra = {"target_variant": variant, "target_revision": tcfg.revision,
             "target_path": str(cfg.target.path) if variant == "bf16" else f"target/{variant}",
             "target_shape": {k: int(getattr(tconf, k)) for k in ("vocab_size", "hidden_size", "num_hidden_layers")},
             "device_type": device.type if engine == "hf" else "cuda", "batch_tokens": int(cfg.cache.batch_tokens)}
    if engine != "hf":
        extra["engine"] = {"name": engine, **{k: engine_report[k] for k in ("versions", "gpu")
                                              if k in engine_report}}
    return extra


def _summary(out: Path, index: dict, written: int, seconds: float, reused: bool, tokens: int = 0) -> dict:
    return {"output": str(out), "content_hash": index["content_hash"], "inputs_hash": index["inputs_hash"],
            "num_samples": index["num_samples"], "num_tokens": index["num_tokens"], "num_shards": index["num_shards"],
            "total_bytes": index["total_bytes"], "shards_written": written, "reused": reused,
            "seconds": round(seconds, 3),
            "tokens_written": tokens, "tokens_per_s": round(tokens / seconds, 1) if tokens and seconds else None}


__all__ = ["run", "CacheReader", "LayerCapture", "check_aux_layer_ids", "resolve_aux_layer_ids", "forward_batch",
           "cache_shards", "load_target"]
