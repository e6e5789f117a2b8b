"""Hybrid targets (issue 35): a tiny qwen3_5 model (Gated DeltaNet + full attention) through the cache stage.

Sizes (layers, hidden size, vocab) are read from the config of the model the test builds or loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.core.config import compose
from pipeline.core.errors import SpecquantError
from tests._support import DRAFTER, one_thread, random_samples  # noqa: F401  (one_thread: autouse)

REPO = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = REPO / "assets" / "tiny" / "target"
TINY_DRAFTER = REPO / "assets" / "tiny" / "drafter"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    """The tiny hybrid target as pipeline.tiny.build_hybrid builds it (seeded init, no training), float32."""
    from transformers import AutoTokenizer

    from pipeline.core.seeding import seed_everything
    from pipeline.tiny.build_hybrid import build_model

    out = tmp_path_factory.mktemp("hybrid") / "target"
    seed_everything(0)
    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    model = build_model(tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_family_registry_reads_the_layer_mix(hybrid):
    from transformers import AutoConfig

    from pipeline.models import targets

    conf = AutoConfig.from_pretrained(hybrid)
    kinds = targets.layer_types(conf)
    assert targets.family_of(conf).name == "qwen3_5" and len(kinds) == conf.num_hidden_layers
    assert "linear_attention" in kinds and "full_attention" in kinds
    assert targets.describe(conf).startswith("qwen3_5: ")
    # dense targets add nothing to quantize-target's ignore list (their recipes stay byte-identical)
    assert targets.dense_modules(AutoConfig.from_pretrained(DRAFTER.parent.parent / "target")) == []


def test_cached_states_equal_output_hidden_states(tmp_path, hybrid):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.stages import cache
    from pipeline.stages.cache import CacheReader

    conf = AutoConfig.from_pretrained(hybrid)
    n = conf.num_hidden_layers
    ids = list(range(n + 1))  # embeddings, every decoder layer's output (DeltaNet and attention), final norm
    samples = random_samples(tmp_path, conf.vocab_size)
    cache.run(compose([f"run_dir={tmp_path}", f"target.path={hybrid}", f"drafter.path={TINY_DRAFTER}",
                       "cache.samples_per_shard=3", "cache.batch_tokens=64", "cache.storage_dtype=float32",
                       f"cache.aux_layer_ids=[{','.join(map(str, ids))}]"]))
    model = AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32).eval()
    reader = CacheReader(tmp_path / "cache")
    assert reader.aux_layer_ids == ids and len(reader) == len(samples)
    for s, item in zip(samples, reader, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([s["input_ids"]]), output_hidden_states=True).hidden_states
        assert len(ref) == n + 1 and item["hidden_states"].shape[-1] == conf.hidden_size
        for j, m in enumerate(ids):
            torch.testing.assert_close(item["hidden_states"][:, j], ref[m][0], atol=2e-5, rtol=1e-5)


def test_drafter_aux_layers_and_vocab_must_fit(hybrid):
    """The tiny dense world's drafter fits the hybrid by shape; one past its depth or of another vocabulary
    is refused in one sentence naming the field (and, for a hybrid, its layer mix)."""
    from types import SimpleNamespace

    from pipeline.core.io import read_json
    from pipeline.models.compat import check_compatible
    from pipeline.models.layout import light_config

    conf = read_json(hybrid / "config.json", "target")
    n = conf["num_hidden_layers"]
    drafter = light_config(TINY_DRAFTER)
    check_compatible(drafter, conf)
    with pytest.raises(SpecquantError) as exc:
        check_compatible(SimpleNamespace(**{**vars(drafter), "aux_layer_ids": [1, n + 1]}), conf)
    msg = str(exc.value)
    assert "\n" not in msg and "drafter.aux_layer_ids" in msg and "linear_attention" in msg and f"{n}-layer" in msg
    with pytest.raises(SpecquantError, match="drafter.vocab_size"):
        check_compatible(SimpleNamespace(**{**vars(drafter), "vocab_size": conf["vocab_size"] + 1}), conf)


def test_multimodal_wrapper_runs_the_text_tower_only():
    """A qwen3_5 config with a vision tower: the decoder found is the language model, and the cache's
    capture equals its output_hidden_states."""
    from transformers import AutoModel, Qwen3_5Config

    from pipeline.models import targets
    from pipeline.stages.cache import LayerCapture

    torch.manual_seed(0)
    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    conf = Qwen3_5Config(text_config=text, vision_config=vision)
    model = AutoModel.from_config(conf).eval()
    dec = targets.decoder(model)
    assert dec is model.language_model and targets.num_layers(conf) == 4
    ids = torch.randint(0, 128, (1, 9))
    cap = LayerCapture(model, [1, 4])
    with torch.no_grad():
        got = cap(ids, None)
        cap.remove()
        ref = dec(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got[0], ref[1])
    torch.testing.assert_close(got[1], ref[4])


def test_w4a16_quantizes_the_deltanet_projections_and_keeps_gates_dense(tmp_path, hybrid):
    """quantize-target W4A16 (data-free RTN) on the hybrid: in_proj_qkv / in_proj_z / out_proj, attention
    and MLP quantized; in_proj_a / in_proj_b (the gates), conv1d, A_log, dt_bias, norms, lm_head dense."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from pipeline.core.io import read_json
    from pipeline.models import targets
    from pipeline.stages import quantize_target
    from tests._support import world_cfg

    conf = AutoConfig.from_pretrained(hybrid)
    result = quantize_target.run(world_cfg(tmp_path, "target_quant=w4a16", target=hybrid, tokenizer=hybrid))
    assert set(targets.dense_modules(conf)) <= set(result["ignore"]) | set(targets.QWEN3_5.never_run)
    out = tmp_path / "qw" / "target" / "w4a16"
    quantized = set(read_json(tmp_path / "qw" / "checks" / "target-w4a16.json")["weight_error"])
    kinds = targets.layer_types(conf)
    expect = set()
    for i, kind in enumerate(kinds):
        mixer = (["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
                 if kind == "linear_attention" else [f"self_attn.{p}_proj" for p in "qkvo"])
        expect |= {f"model.layers.{i}.{m}" for m in mixer + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
    assert quantized == expect
    model = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    dense = AutoModelForCausalLM.from_pretrained(hybrid)
    i = kinds.index("linear_attention")
    for name in ("in_proj_a", "in_proj_b", "conv1d"):
        got = getattr(model.model.layers[i].linear_attn, name).weight
        assert torch.equal(got.float(), getattr(dense.model.layers[i].linear_attn, name).weight), name
    for name in ("A_log", "dt_bias"):
        assert torch.equal(getattr(model.model.layers[i].linear_attn, name).float(),
                           getattr(dense.model.layers[i].linear_attn, name)), name
    assert torch.equal(model.lm_head.weight.float(), dense.lm_head.weight)
    assert not torch.equal(model.model.layers[i].linear_attn.out_proj.weight.float(),
                           dense.model.layers[i].linear_attn.out_proj.weight)


def test_cache_refuses_aux_layers_past_the_hybrid_depth_in_one_sentence(tmp_path, hybrid):
    from transformers import AutoConfig

    from pipeline.stages import cache

    n = AutoConfig.from_pretrained(hybrid).num_hidden_layers
    random_samples(tmp_path, 16, n=2)
    with pytest.raises(SpecquantError) as exc:
        cache.run(compose([f"run_dir={tmp_path}", f"target.path={hybrid}", f"drafter.path={TINY_DRAFTER}",
                           f"cache.aux_layer_ids=[1,{n + 1}]"]))
    assert "\n" not in str(exc.value) and f"0..{n}" in str(exc.value) and "cache.aux_layer_ids" in str(exc.value)
    assert not (tmp_path / "cache").exists()
