"""bench/run_8b.py's hybrid shapes (Qwen3.8-27B, tiny-hybrid): configs, argument defaults, the random target."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench import run_8b, shapes  # noqa: E402


def test_qwen38_27b_shape_reads_its_sizes_from_the_one_target_config():
    """bench.shapes holds Qwen3.8-27B's text tower once (test_serve_dflash2 builds its target from the same function)."""
    t, s = shapes.QWEN38_27B_TARGET, shapes.QWEN38_27B
    assert (s.hidden_size, s.vocab_size, s.num_target_layers) == (t["hidden_size"], t["vocab_size"], t["num_hidden_layers"])
    assert t["layer_types"].count("full_attention") * 4 == t["num_hidden_layers"]
    assert max(s.zlab_layer_ids) < t["num_hidden_layers"]


@pytest.mark.parametrize("name", ["qwen3.8-27b", "tiny-hybrid"])
def test_hybrid_shapes_are_consistent(name):
    s = shapes.SHAPES[name]
    assert s.hybrid and s.target_architecture == "Qwen3_5ForCausalLM"
    ids = dict(s.specials).values()
    assert len(set(ids)) == len(ids) and all(0 <= i < s.vocab_size for i in ids)
    assert max(s.zlab_layer_ids) + 1 < s.num_target_layers  # aux layers are decoder outputs, not the final norm
    cfg = shapes.target_config(s)
    assert cfg.model_type == "qwen3_5_text" and cfg.architectures == ["Qwen3_5ForCausalLM"]
    assert list(cfg.layer_types) == s.hybrid_target["layer_types"]


def test_qwen38_27b_parameter_count_on_the_meta_device():
    s = shapes.QWEN38_27B
    with torch.device("meta"):
        model = shapes.target_class(s)(shapes.target_config(s))
    n = sum(p.numel() for p in model.parameters())
    assert 26.0e9 < n < 27.5e9  # 26,895,998,464: 53.8 GB in bf16


def test_shape_arguments():
    a = run_8b.parse_args(["--out", "x"])
    assert (a.shape, a.tiny, a.samples, a.seq_len, a.small_samples) == ("qwen3-8b", False, 264, 2048, 64)
    assert a.quant_variants == run_8b.DENSE_QUANT_VARIANTS
    assert run_8b.parse_args(["--out", "x", "--tiny"]).shape == "tiny"
    h = run_8b.parse_args(["--out", "x", "--shape", "qwen3.8-27b", "--samples", "64"])
    assert h.quant_variants == "quantize-target[w4a16]" and h.small_samples == 16 and h.heldout == 8
    assert run_8b.parse_args(["--out", "x", "--shape", "qwen3.8-27b", "--quant-variants", "a,b"]).quant_variants == "a,b"
    with pytest.raises(SystemExit):
        run_8b.parse_args(["--out", "x", "--tiny", "--shape", "qwen3.8-27b"])
    with pytest.raises(SystemExit):
        run_8b.parse_args(["--out", "x", "--samples", "8", "--heldout", "8"])


def test_tiny_hybrid_target_builds_and_loads_as_a_hybrid(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.models import targets

    s = shapes.TINY_HYBRID
    rec = shapes.build_target(s, tmp_path / "target", "cpu", seed=0)
    cfg = json.loads((tmp_path / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "target"))
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and rec["params"] == sum(p.numel() for p in model.parameters())
    assert targets.family_of(model.config).hybrid
    assert any("in_proj_a" in m for m in targets.dense_modules(model.config))
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3_5RMSNorm"]
    assert norms and all(float(m.weight.detach().abs().max()) == 0.0 for m in norms)  # x * (1 + 0): identity
    with torch.no_grad():
        out = model(torch.randint(0, 500, (1, 16)), output_hidden_states=True)
    assert all(torch.isfinite(h.float()).all() for h in out.hidden_states)
    again = shapes.build_target(s, tmp_path / "again", "cpu", seed=0)
    assert again["params"] == rec["params"]
    a = (tmp_path / "target" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "again" / "model.safetensors").read_bytes()  # seeded: bit-identical
