"""A text-only Qwen3.5 checkpoint served in its family's wrapper layout (vLLM 0.26 registers only
`Qwen3_5ForConditionalGeneration`): `pipeline.serving.layout` and serve-check's choice of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "assets" / "tiny-hybrid" / "target"

pytestmark = pytest.mark.skipif(not (TEXT / "config.json").is_file(),
                                reason="assets/tiny-hybrid not built (python -m pipeline.tiny.build_hybrid)")


def test_wrapped_checkpoint_holds_the_same_bytes_and_gives_the_same_logits(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models import targets
    from pipeline.serving.layout import wrap_text_checkpoint

    out = wrap_text_checkpoint(TEXT, tmp_path / "wrapped")
    conf = json.loads((out / "config.json").read_text())
    text = json.loads((TEXT / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert targets.multimodal(conf) and targets.family_of(conf) is targets.QWEN3_5
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "layer_types", "linear_num_value_heads"):
        assert conf["text_config"][key] == text[key]
    assert conf["vision_config"]["out_hidden_size"] == text["hidden_size"]
    names = targets.tensor_names(conf)
    with safe_open(str(TEXT / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert len(list(a.keys())) == len(list(b.keys()))
        assert names["embed"] in b.keys() and names["norm"] in b.keys() and names["lm_head"] in b.keys()
        for k in a.keys():
            new = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
            assert torch.equal(a.get_tensor(k), b.get_tensor(new)), k
    assert AutoConfig.from_pretrained(out).get_text_config().num_hidden_layers == text["num_hidden_layers"]
    ids = torch.randint(0, text["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(TEXT, dtype=torch.float32)(ids).logits
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)


def test_serve_check_wraps_only_where_the_engine_builds_the_wrapper_and_not_the_text_class(tmp_path):
    from pipeline.stages.serve_check import served_layouts

    targets = {"bf16": TEXT}
    cls, wrapper = "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"
    # what the worker's --probe reports (`model_classes`): None = builds, else why not
    registry_026 = {"vllm": "0.26.0", "platform": "cuda", "model_classes": {cls: "not in vLLM's model registry", wrapper: None}}
    got = served_layouts(registry_026, targets, tmp_path / "served")
    assert list(got) == ["bf16"] and got["bf16"]["wrapper"] == wrapper
    assert json.loads((Path(got["bf16"]["path"]) / "config.json").read_text())["architectures"] == [wrapper]
    assert "vLLM 0.26.0" in got["bf16"]["reason"] and "language_model_only" in got["bf16"]["reason"]
    builds_text = {"vllm": "0.32.0", "platform": "cuda", "model_classes": {cls: None, wrapper: None}}
    assert served_layouts(builds_text, targets, tmp_path / "s2") == {}
    neither = {"vllm": "0.32.0", "platform": "cpu", "model_classes": {cls: "ImportError: torchvision", wrapper: "ImportError"}}
    assert served_layouts(neither, targets, tmp_path / "s3") == {}
    assert not (tmp_path / "s2").exists() and not (tmp_path / "s3").exists()
