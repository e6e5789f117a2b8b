"""The stock way to make a W4A16 target: plain llm-compressor `oneshot`, no pipeline around it.

    python -m bench.stock_target --target DIR --out-dir DIR --probe probe.json [--device cuda]

Same scheme and observer as `conf/target_quant/w4a16.yaml` (int4, group 128, MSE weight observer,
lm_head dense), loaded and saved the way llm-compressor's examples do, so the quantize-target
stage's extra work (config validation, reload + dequantize check, hashes) is measured against it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--probe", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)

    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from bench.probe import MemorySampler

    sampler = MemorySampler()
    sampler.start()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16)
    t_load = time.perf_counter() - t0
    torch.manual_seed(0)
    recipe = QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], weight_observer="mse")
    oneshot(model=model, recipe=recipe)
    t_quant = time.perf_counter() - t0 - t_load
    model.save_pretrained(args.out_dir, save_compressed=True)
    wall = time.perf_counter() - t0
    sampler.stop()
    rec = {"wall_s": round(wall, 2), "load_s": round(t_load, 2), "oneshot_s": round(t_quant, 2),
           "save_s": round(wall - t_load - t_quant, 2),
           "output_bytes": sum(f.stat().st_size for f in Path(args.out_dir).rglob("*") if f.is_file()),
           "probe": [{"host_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "host_peak_anon_mib": sampler.peak_anon // 1024,
                      "gpu_peak_alloc_mib": (torch.cuda.max_memory_allocated() // 2**20
                                             if torch.cuda.is_available() else None)}]}
    Path(args.probe).parent.mkdir(parents=True, exist_ok=True)
    Path(args.probe).write_text(json.dumps(rec, indent=2) + "\n")
    print(f"[stock] oneshot W4A16 target: {json.dumps(rec)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
