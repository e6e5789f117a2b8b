"""llm-compressor's oneshot drives the drafter's calibration forward with our batches ("basic" pipeline),
and the fake-quantized drafter still runs the serving path (what evaluation measures)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from pipeline.models import calibration as C
from pipeline.models.formats import load_drafter, save_native
from pipeline.models.spec_decode import greedy_generate, spec_generate
from tests._support import DFLASH as FIX
from tests._support import geometry

G = geometry()
BS, MASK = G["block_size"], G["mask_token_id"]


class _Processor:  # oneshot demands a processor whenever a dataset is given
    def save_pretrained(self, *args, **kwargs):
        pass


def test_oneshot_basic_pipeline_calibrates_drafter(tmp_path):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = load_drafter(FIX / "zlab" / "checkpoint", target=FIX / "target")
    save_native(m, tmp_path / "bf16")  # oneshot re-reads the config from name_or_path via AutoConfig
    m.config.name_or_path = str(tmp_path / "bf16")
    inp = load_file(FIX / "speculators" / "inputs.safetensors")
    doc = inp["document_ids"][0]
    hs = inp["hidden_states"][0].view(doc.numel(), len(G["aux_layer_ids"]), G["hidden"])
    bounds = [(int((doc == d).nonzero().min()), int((doc == d).nonzero().max()) + 1) for d in doc.unique().tolist()]
    samples = [{"input_ids": inp["input_ids"][0, s:e], "loss_mask": inp["loss_mask"][0, s:e],
                "hidden_states": hs[s:e]} for s, e in bounds]
    g = torch.Generator().manual_seed(0)
    batches = [C.build_calibration_batch(samples, 4, BS, MASK, g) for _ in range(3)]
    n = bounds[0][1] - BS  # a context of the first document, and the block after it (bonus token + masks)
    ctx = inp["hidden_states"][:, :n]
    block = torch.full((1, BS), MASK)
    block[0, 0] = inp["input_ids"][0, n]
    pos = torch.arange(n + BS)[None]
    with torch.no_grad():
        before = m.draft_block(ctx, block, pos, None)

    oneshot(model=m, dataset=DataLoader(batches, batch_size=None), pipeline="basic", processor=_Processor(),
            recipe=QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head"]))

    k_proj = m.layers[0].self_attn.k_proj
    assert type(k_proj) is torch.nn.Linear and float(k_proj.input_global_scale) > 0
    assert not hasattr(m.lm_head, "weight_scale") and not hasattr(m.embed_tokens, "weight_scale")
    with torch.no_grad():
        after = m.draft_block(ctx, block, pos, None)
    diff = (after - before).abs().max().item()
    assert 0 < diff < 0.5 * before.abs().max().item()  # fake-quantized, not broken
    target = AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()
    prompt = inp["input_ids"][0, :6].tolist()
    assert spec_generate(target, m, prompt, 8).output_ids == greedy_generate(target, prompt, 8)
