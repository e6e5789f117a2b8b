"""A tiny quantization world on the golden DFlash fixtures: target, drafter, blend and cache.

Target = tests/fixtures/dflash/target (Qwen3, H=64, 6 layers, vocab 128), drafter = the fixture's
speculators checkpoint (2 layers, block 4, aux [2, 4], mask 127). The blend is synthetic token ids
(the fixture target has no tokenizer) written in the data stage's contract; the cache is built by
the real cache stage. Shared by the quant tests; the one test here checks the world itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.config import compose
from pipeline.io import atomic_write_json, sha256_file
from tests.conftest import FIXTURES

TARGET = FIXTURES / "dflash" / "target"
DRAFTER = FIXTURES / "dflash" / "speculators" / "checkpoint"


def write_blend(data_dir: Path, num_samples: int = 30, seq_len: int = 40, seed: int = 0) -> Path:
    """samples.jsonl + meta.json: random ids below the mask id, loss mask 1 after a short prompt."""
    g = torch.Generator().manual_seed(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(num_samples):
        n = seq_len - int(torch.randint(0, 8, (1,), generator=g))
        ids = torch.randint(2, 127, (n,), generator=g).tolist()
        prompt = 6 + i % 5
        mask = [0] * prompt + [1] * (n - prompt)
        lines.append(json.dumps({"id": f"synthetic/{i}", "input_ids": ids, "loss_mask": mask,
                                 "source": "synthetic"}, sort_keys=True))
    path = data_dir / "samples.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    atomic_write_json(data_dir / "meta.json", {"samples_sha256": sha256_file(path), "num_samples": num_samples,
                                               "seed": seed})
    return path


def world_cfg(runs_root: Path, *overrides: str, target: Path = TARGET):
    return compose([f"runs_root={runs_root}", "run_name=qw", f"target.path={target}", f"target.tokenizer={target}",
                    f"drafter.path={DRAFTER}", "drafter.format=speculators", "cache.storage_dtype=float32",
                    "quant.num_samples=12", "quant.heldout_samples=12", "quant.anchors_per_sequence=8",
                    "quant.max_seq_len=64", "target_quant.num_samples=4", "target_quant.max_seq_len=64",
                    *overrides])


def build_world(runs_root: Path, blend_seed: int = 0, num_samples: int = 30, target: Path = TARGET) -> Path:
    """Blend + cache under runs_root/qw; returns the run directory."""
    from pipeline import cache

    cfg = world_cfg(runs_root, target=target)
    run_dir = Path(cfg.run_dir)
    write_blend(run_dir / "data", num_samples=num_samples, seed=blend_seed)
    cache.run(cfg)
    return run_dir


def massive_activation_target(out: Path, factor: float = 1e4) -> Path:
    """The fixture target with layer 0's down_proj scaled: its residual stream (and so every cached
    hidden state after it) reaches ~3e4, like the massive activations of real LLMs' hidden states."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(TARGET, out)
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight"] *= factor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_world_builds_a_cache_the_drafter_can_read(tmp_path):
    from pipeline.cache import CacheReader

    run_dir = build_world(tmp_path)
    reader = CacheReader(run_dir / "cache")
    assert len(reader) == 30
    s = reader[0]
    assert s["hidden_states"].shape[1:] == (2, 64)
    assert s["hidden_states"].shape[0] == s["input_ids"].numel() == s["loss_mask"].numel()
