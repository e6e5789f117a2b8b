"""quantize-target: W4A16 (RTN+MSE or GPTQ) or NVFP4 of the target through llm-compressor's oneshot.

Recipe: validate the config on a weightless copy of the target, load the target, calibrate on the
blend's own token ids (data/samples.jsonl) when the recipe needs data, write a compressed-tensors
checkpoint with the tokenizer to runs/<name>/target/<target_quant.name>/.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from pipeline.artifacts import check_report
from pipeline.artifacts.rundir import RunDir
from pipeline.core import distributed
from pipeline.core.dtypes import TORCH_DTYPES
from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_dir
from pipeline.core.loading import checkpoint_sha256
from pipeline.core.seeding import seed_everything
from pipeline.quant import calibrate, checks, export, recipes

FIELD = "target_quant"


def target_config(cfg):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.target.path, revision=cfg.target.revision,
                                          trust_remote_code=bool(cfg.target.trust_remote_code))
    except (OSError, ValueError) as exc:
        raise bad_value("target.path", cfg.target.path, f"its config cannot be read ({str(exc).splitlines()[0]})",
                        "point target.path at a model directory or Hub repo with config.json") from None


def _meta_model(config):
    from pipeline.models.targets import model_class

    with torch.device("meta"):
        return model_class(config).from_config(config)  # a multimodal wrapper keeps its vision tower


def target_linears(config, ignore: list[str]) -> list[tuple[str, int]]:
    """Quantized layers and their widths from a meta-device model: shapes only, no weights read."""
    return recipes.quantized_linears(_meta_model(config), ignore)


def family_ignore(config) -> list[str]:
    """What the target's family keeps dense beyond the recipe's ignore list (pipeline.models.targets:
    a hybrid's linear-attention gates, vision tower, MTP head; docs/hybrid.md), only the entries that
    match a Linear of this model. A dense target adds nothing, so its recipe is unchanged."""
    from pipeline.models.targets import dense_modules

    extra = dense_modules(config)
    if not extra:
        return []
    unmatched = set(recipes.quantized_linears(_meta_model(config), extra).unmatched_ignore)
    return [e for e in extra if e not in unmatched]


def calibration_batches(samples: list[dict], num_samples: int, max_seq_len: int, seed: int) -> list[dict]:
    """A seeded choice of `num_samples` blend samples, truncated, one sequence per batch."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for i in order[:num_samples]:
        ids = torch.tensor(samples[i]["input_ids"][:max_seq_len], dtype=torch.long)[None]
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return batches


def run(cfg) -> dict:
    q = cfg[FIELD]
    recipes.validate_settings(q, FIELD)
    if str(q.get("calibration_target") or "bf16") != "bf16":  # the schema is shared with `quant`
        raise bad_value(f"{FIELD}.calibration_target", q.calibration_target, "a target calibrates on its own "
                        "forward over the blend, not on cached hidden states", "leave it at bf16 (the drafter's "
                        "choice is quant.calibration_target)")
    from pipeline.models import validation

    validation.check_target(cfg.target.path, cfg.target.revision)  # every field of its family, vs its tensors
    config = target_config(cfg)
    ignore = list(dict.fromkeys(recipes.resolve_ignore(q) + family_ignore(config)))
    from pipeline.core.loading import check_safetensors_dir

    check_safetensors_dir(cfg.target.path, "target.path")  # pickles, truncated files, missing shards: before any load
    recipes.validate_group_size(q, FIELD, target_linears(config, ignore))
    _, world, _ = distributed.rank_world()
    if world > 1 and not recipes.needs_data(q):
        raise bad_value(f"{FIELD}.algorithm", q.algorithm,
                        f"a data-free recipe has no calibration forward to spread over {world} processes",
                        "run it without torchrun, or use algorithm=gptq / an activation-quantized scheme")
    rd = RunDir.from_cfg(cfg)
    from pipeline.quant import variants

    variants.refuse_overwrite(rd.stages / f"quantize-target-{q.name}.json", rd.target(q.name), FIELD, q, cfg.seed)
    batches, samples_sha = _calibration_data(cfg, q, rd, world)

    seed_everything(int(cfg.seed))
    started = time.perf_counter()
    device = distributed.rank_device(recipes.resolve_device(q.device))
    group = distributed.Group("auto", device)
    model = _load_dense(cfg, device) if world == 1 else _load_shared(cfg, device)
    timings = {"load_s": round(time.perf_counter() - started, 3)}
    # data-parallel calibration: each rank runs its own share of the same seeded sample order;
    # llm-compressor reduces GPTQ Hessians and activation statistics across ranks
    share = [batches[i] for i in distributed.partition(len(batches), group.rank, world)] if batches else None
    calibrate.run_oneshot(model, q, ignore, share, int(cfg.seed))
    timings["oneshot_s"] = round(time.perf_counter() - started - sum(timings.values()), 3)
    baseline = _served_scales(model, q)
    scales = calibrate.stored_activation_scales(model)

    out = rd.target(q.name)
    # under torchrun compressing is collective (every rank compresses its share of modules) and rank 0
    # writes; for one process the group calls are no-ops
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic_dir(out)) if group.is_main else None
        tmp = Path(group.broadcast(str(tmp) if tmp else None))
        _write(cfg, model, tmp, main=group.is_main)
        group.barrier()
    group.close()
    if not group.is_main:
        return {}
    del model
    timings["write_s"] = round(time.perf_counter() - started - sum(timings.values()), 3)
    report = check_target(cfg, out, q, device)
    checks.write_report(rd.checks, report)
    timings["check_s"] = round(time.perf_counter() - started - sum(timings.values()), 3)
    return {
        "output": str(out), "scheme": q.scheme, "observer": q.observer, "algorithm": q.algorithm,
        "group_size": recipes.group_size(q), "ignore": ignore, "recipe": (out / "recipe.yaml").read_text(encoding="utf-8"),
        "seed": int(cfg.seed), "calibration": q.calibration, "world_size": world,
        "num_calibration_samples": len(batches or []),
        "num_calibration_tokens": int(sum(b["input_ids"].numel() for b in batches or [])),
        "calibration_free": baseline, "input_global_scales": scales,
        "inputs": {"target": checkpoint_sha256(cfg.target.path, cfg.target.revision), "samples_sha256": samples_sha},
        "outputs": export.output_hashes(out),
        "check": {"weight_error": checks.summarize(report.weight_error)},
        "timings": timings, "device": str(device),
    }


def _calibration_data(cfg, q, rd: RunDir, world: int) -> tuple[list[dict] | None, str | None]:
    """(batches, the samples file's sha256) for a recipe with a calibration forward, else (None, None).
    Read and checked before any weight loads, so a missing or short `data/` fails in one sentence; the
    seeded choice is the same for any number of processes, each of which needs one sample at least."""
    if not recipes.needs_data(q):
        return None, None
    from pipeline.artifacts import samples as samples_file

    meta = samples_file.load_meta(rd.data)
    samples = samples_file.load_samples(rd.data, meta)
    samples_sha = meta.samples_sha256  # load_samples checked the file against it
    batches = calibration_batches(samples, int(q.num_samples), int(q.max_seq_len), int(cfg.seed))
    if len(batches) < world:
        raise bad_value(f"{FIELD}.num_samples", len(batches), f"{world} processes need at least one sample each",
                        f"use at least {world} calibration samples or fewer processes")
    return batches, samples_sha


def _served_scales(model, q) -> dict | None:
    """After oneshot, the scales set as vLLM serves them: FP8 fused groups (q/k/v, gate/up) share one weight
    scale (and, for static activations, one input scale); a calibration-free activation scheme gets the
    fixed input scales. Returns what `set_fixed_activation_scales` reports (the record's
    `calibration_free`), None otherwise."""
    baseline = None
    if not recipes.SCHEMES[q.scheme].grouped:  # FP8: fused groups at one scale, as vLLM serves them
        from pipeline.quant import act_scale

        act_scale.fp8_share_weight_scales(model)
        if recipes.SCHEMES[q.scheme].static_activations:
            act_scale.fp8_share_fused(model)  # the target's FP8 input scales are plain minmax
    elif calibrate.quantizes_activations(q) and q.calibration == "none":
        baseline = calibrate.set_fixed_activation_scales(model, float(q.fixed_activation_amax))
    return baseline


def _write(cfg, model, tmp: Path, main: bool = True) -> None:
    written = export.save_compressed(model, tmp, writer=main)
    if main:
        export.copy_tokenizer(cfg.target.tokenizer or cfg.target.path, tmp)
        export.rewrite_config(tmp, written)
        _carry_unloaded(cfg, tmp)


CARRIED_SHARD = "model-carried.safetensors"


def _carry_unloaded(cfg, tmp: Path) -> None:
    """Copy the source checkpoint's tensors that transformers' class does not load (the MTP head `mtp.*`
    of a Qwen3.5-family checkpoint: `targets.carried`) into the written checkpoint, bit-equal, same names:
    into a shard of their own (`model-carried.safetensors`) named by `model.safetensors.index.json` beside
    the shards compressed-tensors wrote, which are not read or rewritten (at 27B that file is ~17 GB); a
    checkpoint without such tensors is left as written."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.core.loading import local_snapshot
    from pipeline.models.targets import carried

    config = target_config(cfg)
    src = local_snapshot(cfg.target.path, cfg.target.revision)
    extra = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            extra.update({k: fh.get_tensor(k) for k in fh.keys() if carried(k, config)})
    if not extra:
        return
    index_path = tmp / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index_path.is_file():
        weight_map = dict(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"])
    else:
        for f in sorted(tmp.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                weight_map.update({k: f.name for k in fh.keys()})
    kept = {k: v.contiguous() for k, v in extra.items() if k not in weight_map}
    if not kept:
        return
    save_file(kept, str(tmp / CARRIED_SHARD), metadata={"format": "pt"})
    weight_map.update({k: CARRIED_SHARD for k in kept})
    total = sum(_tensor_bytes(tmp / name) for name in sorted(set(weight_map.values())))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _tensor_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file: its size less the 8-byte header length and the JSON header."""
    with open(path, "rb") as fh:
        header = int.from_bytes(fh.read(8), "little")
    return path.stat().st_size - 8 - header


def _load_dense(cfg, device: str | torch.device = "cpu"):
    from pipeline.core.loading import load_target
    from pipeline.models.targets import model_class

    t = cfg.target
    return load_target(t.path, revision=t.revision, trust_remote_code=bool(t.trust_remote_code),
                       dtype=TORCH_DTYPES.get(t.dtype, torch.float32), device=device,
                       auto_cls=model_class(target_config(cfg)))


def _load_shared(cfg, device: torch.device):
    """Under torchrun: rank 0 reads the weights once into shared CPU memory, the other ranks map them
    (compressed-tensors' offloading); calibration onloads one layer at a time to each rank's GPU."""
    from compressed_tensors.offload import load_offloaded_model

    from pipeline.core.loading import load_target

    # on a CPU-only host the loader's memory probe asks for an accelerator: name the CPU budget
    placement = {"device_map": "auto_offload"} if device.type == "cuda" else {
        "device_map": "cpu", "max_memory": {"cpu": _shared_memory_bytes()}}
    from pipeline.models.targets import model_class

    t = cfg.target
    with load_offloaded_model():
        return load_target(t.path, revision=t.revision, trust_remote_code=bool(t.trust_remote_code),
                           dtype=TORCH_DTYPES.get(t.dtype, torch.float32), auto_cls=model_class(target_config(cfg)),
                           **placement)


def _shared_memory_bytes() -> int:
    import shutil

    shm = Path("/dev/shm")
    return shutil.disk_usage(shm).free if shm.is_dir() else 8 * 2**30


def check_target(cfg, out: Path, q, device: str | torch.device = "cpu") -> check_report.TargetCheck:
    """Reload the written checkpoint, dequantize it, and compare every quantized layer to the original."""
    model = checks.load_dequantized(_load_dense(cfg, device), out)
    reference = _load_dense(cfg, device)
    errors = checks.weight_errors(model, reference)
    return check_report.TargetCheck(kind="target", variant=q.name, checkpoint=f"target/{q.name}", scheme=q.scheme,
                                    reloaded=True, weight_error=errors, weight_error_summary=checks.summarize(errors))

