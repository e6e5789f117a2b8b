"""quantize-target: W4A16 (RTN+MSE or GPTQ) or NVFP4 of the target through llm-compressor's oneshot.

Recipe: validate the config on a weightless copy of the target, load the target, calibrate on the
blend's own token ids (data/samples.jsonl) when the recipe needs data, write a compressed-tensors
checkpoint with the tokenizer to runs/<name>/target/<target_quant.name>/.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pipeline.errors import bad_value
from pipeline.io import sha256_file
from pipeline.quant import calibrate, checks, export, recipes
from pipeline.rundir import RunDir
from pipeline.seeding import seed_everything

FIELD = "target_quant"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def target_config(cfg):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.target.path, revision=cfg.target.revision,
                                          trust_remote_code=bool(cfg.target.trust_remote_code))
    except (OSError, ValueError) as exc:
        raise bad_value("target.path", cfg.target.path, f"its config cannot be read ({str(exc).splitlines()[0]})",
                        "point target.path at a model directory or Hub repo with config.json") from None


def target_linears(config, ignore: list[str]) -> list[tuple[str, int]]:
    """Quantized layers and their widths from a meta-device model: shapes only, no weights read."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return recipes.quantized_linears(model, ignore)


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
    ignore = recipes.resolve_ignore(q)
    config = target_config(cfg)
    recipes.validate_group_size(q, FIELD, target_linears(config, ignore))
    rd = RunDir.from_cfg(cfg)
    samples_sha = None
    batches = None
    if recipes.needs_data(q):
        from pipeline.data import load_samples

        samples = load_samples(rd.data)
        samples_sha = sha256_file(rd.data / "samples.jsonl")
        batches = calibration_batches(samples, int(q.num_samples), int(q.max_seq_len), int(cfg.seed))

    seed_everything(int(cfg.seed))
    started = time.perf_counter()
    device = recipes.resolve_device(q.device)
    model = _load_dense(cfg, device)
    timings = {"load_s": round(time.perf_counter() - started, 3)}
    calibrate.run_oneshot(model, q, ignore, batches, int(cfg.seed))
    timings["oneshot_s"] = round(time.perf_counter() - started - sum(timings.values()), 3)
    baseline = None
    if calibrate.quantizes_activations(q) and q.calibration == "none":
        baseline = calibrate.set_fixed_activation_scales(model, float(q.fixed_activation_amax))
    scales = calibrate.input_global_scales(model)

    out = rd.target(q.name)
    with export.atomic_dir(out) as tmp:
        written = export.save_compressed(model, tmp)
        export.copy_tokenizer(cfg.target.tokenizer or cfg.target.path, tmp)
        export.rewrite_config(tmp, written)
    del model
    timings["write_s"] = round(time.perf_counter() - started - sum(timings.values()), 3)
    report = check_target(cfg, out, q, device)
    checks.write_report(rd.checks, "target", q.name, report)
    timings["check_s"] = round(time.perf_counter() - started - sum(timings.values()), 3)
    return {
        "output": str(out), "scheme": q.scheme, "observer": q.observer, "algorithm": q.algorithm,
        "group_size": recipes.group_size(q), "ignore": ignore, "recipe": (out / "recipe.yaml").read_text(encoding="utf-8"),
        "seed": int(cfg.seed), "calibration": q.calibration,
        "num_calibration_samples": len(batches or []),
        "num_calibration_tokens": int(sum(b["input_ids"].numel() for b in batches or [])),
        "calibration_free": baseline, "input_global_scales": scales,
        "inputs": {"target": _input_hashes(Path(cfg.target.path)), "samples_sha256": samples_sha},
        "outputs": export.output_hashes(out),
        "check": {"weight_error": checks.summarize(report["weight_error"])},
        "timings": timings, "device": str(device),
    }


def _load_dense(cfg, device: str | torch.device = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(cfg.target.path, revision=cfg.target.revision,
                                                dtype=DTYPES.get(cfg.target.dtype, torch.float32),
                                                trust_remote_code=bool(cfg.target.trust_remote_code)).to(device).eval()


def check_target(cfg, out: Path, q, device: str | torch.device = "cpu") -> dict:
    """Reload the written checkpoint, dequantize it, and compare every quantized layer to the original."""
    model = checks.load_dequantized(_load_dense(cfg, device), out)
    reference = _load_dense(cfg, device)
    errors = checks.weight_errors(model, reference)
    return {"kind": "target", "variant": q.name, "checkpoint": f"target/{q.name}", "scheme": q.scheme,
            "reloaded": True, "weight_error": errors, "weight_error_summary": checks.summarize(errors)}


def _input_hashes(path: Path) -> dict[str, str]:
    if not path.is_dir():
        return {}
    return {p.name: sha256_file(p) for p in sorted(path.iterdir())
            if p.is_file() and (p.suffix == ".safetensors" or p.name == "config.json")}
