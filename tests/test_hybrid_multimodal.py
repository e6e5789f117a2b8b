"""A Qwen3.5-family target as Qwen3.8-27B ships it (issue 35): `Qwen3_5ForConditionalGeneration` with the text
weights under `model.language_model.`, a vision tower `model.visual.` and an MTP head `mtp.` (which transformers'
class does not load). Built here from the shipped tiny hybrid text model with a tiny vision tower; every size is
read from the configs of the checkpoints loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.core.config import compose
from tests._support import one_thread  # noqa: F401  (autouse)

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "assets" / "tiny-hybrid" / "target"

pytestmark = pytest.mark.skipif(not (REPO / "assets" / "tiny-hybrid" / "drafter" / "config.json").is_file(),
                                reason="assets/tiny-hybrid not built (python -m pipeline.tiny.build_hybrid)")


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory) -> Path:
    """The tiny hybrid text model inside a Qwen3_5ForConditionalGeneration (1-block vision tower), plus two
    `mtp.*` tensors appended to its safetensors, float32."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text_conf = AutoConfig.from_pretrained(TEXT)
    h = text_conf.hidden_size
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": h}
    conf = Qwen3_5Config(text_config=text_conf.to_dict(), vision_config=vision,
                         tie_word_embeddings=text_conf.tie_word_embeddings)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(conf)
    text = AutoModelForCausalLM.from_pretrained(TEXT, dtype=torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    out = tmp_path_factory.mktemp("mm") / "target"
    model.save_pretrained(out)
    for f in TEXT.iterdir():  # tokenizer, generation config
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    path = out / "model.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    g = torch.Generator().manual_seed(1)
    save_file({**load_file(str(path)), "mtp.fc.weight": torch.randn(h, 2 * h, generator=g),
               "mtp.norm.weight": torch.rand(h, generator=g)}, str(path), metadata=meta)
    return out


def _samples(run: Path, vocab: int):
    from tests._support import random_samples as write

    return write(run, vocab, n=6, max_len=48)


def test_names_and_head_weights_of_the_wrapper(wrapped):
    from transformers import AutoConfig

    from pipeline.core.io import read_json
    from pipeline.models import targets
    from pipeline.models.formats import target_head_weights

    conf = read_json(wrapped / "config.json", "t")
    assert targets.multimodal(conf) and targets.family_of(conf).name == "qwen3_5"
    names = targets.tensor_names(conf)
    assert names["embed"] == "model.language_model.embed_tokens.weight"
    assert targets.tensor_names(read_json(TEXT / "config.json", "t"))["embed"] == "model.embed_tokens.weight"
    assert targets.carried("mtp.fc.weight", conf) and not targets.carried("model.language_model.norm.weight", conf)
    embed, head = target_head_weights(wrapped)
    embed_t, head_t = target_head_weights(TEXT)
    assert embed.shape == (AutoConfig.from_pretrained(TEXT).vocab_size, AutoConfig.from_pretrained(TEXT).hidden_size)
    assert torch.equal(embed, embed_t) and torch.equal(head, head_t)


def test_cache_and_evaluate_run_the_text_tower_of_the_wrapper(tmp_path, wrapped):
    """The cache stage's states from the wrapper equal those from the text-only checkpoint; evaluate with the
    wrapper as target (and the tiny hybrid drafter) is lossless, with the same tau as the text-only target."""
    from transformers import AutoConfig

    from pipeline.stages import cache, evaluate
    from pipeline.stages.cache import CacheReader

    vocab = AutoConfig.from_pretrained(TEXT).vocab_size
    states = {}
    for name, path in (("mm", wrapped), ("text", TEXT)):
        run = tmp_path / name
        _samples(run, vocab)
        cache.run(compose(["experiment=tiny-hybrid", f"run_dir={run}", f"target.path={path}",
                           "cache.storage_dtype=float32"]))
        states[name] = [item["hidden_states"] for item in CacheReader(run / "cache")]
    assert len(states["mm"]) == len(states["text"]) > 0
    for a, b in zip(states["mm"], states["text"], strict=True):
        assert torch.equal(a, b)
    taus = {}
    for name, path in (("mm", wrapped), ("text", TEXT)):
        out = evaluate.run(compose(["experiment=tiny-hybrid", f"run_dir={tmp_path / name}", f"target.path={path}",
                                    "eval.limit=1", "eval.max_new_tokens=32", "eval.include_source=false"]))
        assert out["lossless"] is True
        taus[name] = out["tau"]["bf16"]
    assert taus["mm"] == taus["text"]


def test_quantize_target_keeps_vision_tower_and_mtp_head_unchanged(tmp_path, wrapped):
    """W4A16 on the wrapper: every `model.visual.*` and `mtp.*` tensor is written bit-equal under its name, the
    text decoder's documented Linears (docs/hybrid.md) are the only ones quantized."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from pipeline.core.io import read_json
    from pipeline.models import targets
    from pipeline.stages import quantize_target

    run = tmp_path / "run"
    quantize_target.run(compose(["experiment=tiny-hybrid", f"run_dir={run}", f"target.path={wrapped}",
                                 f"target.tokenizer={wrapped}", "target_quant=w4a16"]))
    out = run / "target" / "w4a16"
    conf = AutoConfig.from_pretrained(wrapped)
    expect = set()
    for i, kind in enumerate(targets.layer_types(conf)):
        mixer = (["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
                 if kind == "linear_attention" else [f"self_attn.{p}_proj" for p in "qkvo"])
        expect |= {f"model.language_model.layers.{i}.{m}" for m in mixer + ["mlp.gate_proj", "mlp.up_proj",
                                                                              "mlp.down_proj"]}
    assert set(read_json(run / "checks" / "target-w4a16.json")["weight_error"]) == expect
    # the carried MTP tensors sit in a shard of their own, named by the index; the written shard is not rewritten
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {"model.safetensors", quantize_target.CARRIED_SHARD}
    assert {k for k, f in weight_map.items() if f == quantize_target.CARRIED_SHARD} == \
        {k for k in weight_map if k.startswith("mtp.")}
    with safe_open(str(wrapped / "model.safetensors"), "pt") as src:
        kept = [k for k in src.keys() if k.startswith(("model.visual.", "mtp."))]
        assert any(k.startswith("mtp.") for k in kept) and any(k.startswith("model.visual.") for k in kept)
        assert set(kept) <= set(weight_map)
        for k in kept:
            with safe_open(str(out / weight_map[k]), "pt") as got:
                a, b = got.get_tensor(k), src.get_tensor(k)
            assert a.dtype == b.dtype and torch.equal(a, b), k
    with safe_open(str(out / "model.safetensors"), "pt") as got:
        assert set(got.keys()) == {k for k, f in weight_map.items() if f == "model.safetensors"}
        quantized_prefixes = {k.rsplit(".", 1)[0] for k in got.keys() if k.endswith("weight_packed")}
    assert quantized_prefixes == expect
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    # vLLM builds the vision tower with the checkpoint's quant config: it stays dense because the ignore list
    # names every one of its Linears (and both DeltaNet gates of each fused in_proj_ba)
    ignore = set(written["quantization_config"]["ignore"])
    visual = {k.rsplit(".", 1)[0] for k in kept if k.startswith("model.visual.") and k.endswith(".weight")}
    model = targets.model_class(conf).from_config(conf)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert visual & linears and visual & linears <= ignore


def test_serving_worker_reads_the_head_of_either_layout(wrapped):
    """The vLLM worker's `_target_head` (what a DFlash drafter borrows in the engine), given the names the project
    side puts in its job (`targets.head_lookup`), finds the text tower's embedding and head in the wrapper, never
    the MTP head's, equal to the text-only checkpoint's."""
    from pipeline.models import targets
    from pipeline.serving.worker_load_probe import _target_head

    def lookup(path):
        return targets.head_lookup(json.loads((Path(path) / "config.json").read_text()))

    assert lookup(wrapped)["embed"] == "model.language_model.embed_tokens.weight"
    assert lookup(TEXT)["embed"] == "model.embed_tokens.weight"
    assert {"mtp.", "model.visual."} <= set(lookup(wrapped)["skip_prefixes"])
    got, ref = _target_head(str(wrapped), lookup(wrapped)), _target_head(str(TEXT), lookup(TEXT))
    assert set(got) == set(ref) == {"embed_tokens", "lm_head"}
    for k in got:
        assert torch.equal(got[k], ref[k]), k
