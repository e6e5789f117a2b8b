"""Each drafter/target invariant violation fails fast with one sentence naming field, value and fix."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pipeline.core.errors import SpecquantError
from pipeline.models.compat import check_compatible
from pipeline.models.dflash import DFlashConfig
from pipeline.models.formats import load_drafter_config, zlab_config_dict
from tests._support import REPO as ROOT
from tests._support import TARGET as TARGET_DIR
from tests._support import ZLAB_DRAFTER, geometry

TARGET = json.loads((TARGET_DIR / "config.json").read_text())
G = geometry()  # every size from the fixture: target depth T, hidden H, vocabulary V, aux layer ids
T, H, V, AUX = G["target_layers"], G["hidden"], G["vocab"], G["aux_layer_ids"]


def tokenizer(n_tokens: int, mask: str | None = "<|MASK|>", mask_at: int | None = None):
    """A real fast tokenizer with n_tokens ids; the mask token (if any) gets id mask_at (default last)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(n_tokens)}
    if mask is not None:
        at = n_tokens - 1 if mask_at is None else mask_at
        vocab = {(mask if i == at else k): i for k, i in vocab.items()}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))


def drafter(**over) -> DFlashConfig:
    base = load_drafter_config(ZLAB_DRAFTER)
    fields = {k: getattr(base, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim", "block_size",
                                            "mask_token_id", "aux_layer_ids", "num_target_layers")}
    return DFlashConfig(**{**fields, **over})


def fails(field: str, d: DFlashConfig, target=TARGET, tok=None, mask_token=None) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SpecquantError) as exc:
        check_compatible(d, target, tok, mask_token)
    assert time.perf_counter() - t0 < 5
    msg = str(exc.value)
    assert msg.startswith(f"`{field}` = ") and "\n" not in msg and msg.endswith("."), msg
    return msg


def test_the_fixture_pair_is_compatible():
    check_compatible(drafter(), TARGET, tokenizer(V), "<|MASK|>")


@pytest.mark.faults("bad_input")
def test_fc_input_width_must_match_target_hidden_size():
    other = H * 3 // 4
    msg = fails("drafter.target_hidden_size", drafter(target_hidden_size=other))
    assert f"{len(AUX)} x {other}" in msg and str(H) in msg


@pytest.mark.faults("bad_input")
def test_drafter_hidden_size_must_match_borrowed_embedding():
    fails("drafter.hidden_size", drafter(hidden_size=H * 3 // 2, target_hidden_size=H))


@pytest.mark.faults("bad_input")
def test_vocab_size_and_tokenizer():
    fails("drafter.vocab_size", drafter(vocab_size=2 * V, mask_token_id=2 * V - 1))
    fails("target.tokenizer", drafter(), tok=tokenizer(2 * V + 44))


# the target's final layer (its output is the separate verifier state), the embeddings, beyond the depth, none
@pytest.mark.parametrize("ids", [[AUX[0], T], [0, AUX[0]], [AUX[0], T + 3], []])
@pytest.mark.faults("bad_input")
def test_aux_layer_ids_within_target_depth(ids):
    fails("drafter.aux_layer_ids", drafter(aux_layer_ids=ids))


@pytest.mark.faults("bad_input")
def test_target_depth_recorded_by_drafter():
    fails("drafter.num_target_layers", drafter(num_target_layers=T + 30))


@pytest.mark.faults("bad_input")
def test_mask_token_present_in_tokenizer():
    fails("drafter.mask_token_id", drafter(mask_token_id=V))  # one past the vocabulary
    fails("drafter.mask_token_id", drafter(mask_token_id=V - 8), tok=tokenizer(V - 28, mask=None))  # past the tokenizer
    fails("drafter.mask_token", drafter(), tok=tokenizer(V, mask_at=5), mask_token="<|MASK|>")
    fails("drafter.mask_token", drafter(), tok=tokenizer(V, mask=None), mask_token="<|MASK|>")


@pytest.mark.faults("bad_input")
def test_head_dims_consistent():
    fails("num_attention_heads", drafter(num_attention_heads=G["kv_heads"] + 1))  # not a multiple of the KV heads
    fails("head_dim", drafter(head_dim=G["head_dim"] - 1))


@pytest.mark.faults("bad_input")
def test_sliding_window_layers_need_a_window():
    kinds = ["sliding_attention"] + ["full_attention"] * (G["layers"] - 1)
    assert "positive window" in fails("drafter.sliding_window", drafter(layer_types=kinds))
    fails("drafter.sliding_window", drafter(layer_types=kinds, sliding_window=0))
    fails("drafter.layer_types", drafter(layer_types=["linear_attention"] + kinds[1:]))
    check_compatible(drafter(layer_types=kinds, sliding_window=G["block_size"]), TARGET)  # a window: accepted


@pytest.mark.faults("bad_input")
def test_block_size_at_least_two():
    fails("block_size", drafter(block_size=1))


@pytest.mark.faults("bad_input")
def test_gemma_drafter_on_qwen_target_cli(tmp_path):
    """A new user pairs a 256k-vocabulary drafter of another hidden size with a Qwen3-8B-shaped target."""
    gemma = DFlashConfig(vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_hidden_layers=5,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, block_size=16,
                         mask_token_id=262143, aux_layer_ids=[2, 10, 18, 26, 33], num_target_layers=34)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(zlab_config_dict(gemma)))
    qwen = {**TARGET, "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36,
            "layer_types": ["full_attention"] * 36}
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(qwen))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline.models.compat", str(tmp_path / "drafter"),
                           str(tmp_path / "target")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    wall = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: `drafter.target_hidden_size` = 2560")
    assert "4096" in lines[0]
    assert wall < 5, wall
