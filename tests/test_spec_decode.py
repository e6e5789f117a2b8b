"""The greedy speculative loop is lossless: its output equals plain target greedy decoding."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pipeline.models.formats import load_drafter
from pipeline.models.spec_decode import greedy_generate, load_prompts, spec_generate
from tests._support import DFLASH as FIX
from tests._support import REPO, geometry

TINY = REPO / "assets" / "tiny"
G = geometry()
BS, V, MASK = G["block_size"], G["vocab"], G["mask_token_id"]


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # 2 threads oversubscribe the shared 2-core machine
    return AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafter():
    return load_drafter(FIX / "zlab" / "checkpoint", target=FIX / "target")


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


class _Cache:
    def __len__(self):
        return 0


class ScriptedDrafter(torch.nn.Module):
    """A stand-in drafter module (what evaluation passes for a quantized drafter) that proposes a
    known continuation, wrong from draft slot `wrong_from` on: exercises multi-token acceptance."""

    def __init__(self, continuation: list[int], block_size: int, wrong_from: int, vocab: int):
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)  # the loop casts context to fc's dtype
        self.config = SimpleNamespace(block_size=block_size, mask_token_id=MASK, aux_layer_ids=G["aux_layer_ids"])
        self.seq, self.wrong_from, self.vocab = continuation, wrong_from, vocab

    def new_cache(self):
        return _Cache()

    def draft_block(self, ctx, block, pos, cache):
        start = int(pos[0, -1]) - block.shape[1] + 1
        logits = torch.zeros(1, block.shape[1], self.vocab)
        for k in range(1, block.shape[1]):
            tok = self.seq[start + k] if start + k < len(self.seq) else 0
            if k >= self.wrong_from:
                tok = (tok + 1) % self.vocab
            logits[0, k, tok] = 1.0
        return logits


@pytest.mark.parametrize("wrong_from", sorted({1, 2, BS}))  # first slot wrong, second, none (all accepted)
def test_scripted_drafter_acceptance_and_losslessness(target, wrong_from):
    for ids in prompts(2, seed=wrong_from):
        ref = greedy_generate(target, ids, 16)
        d = ScriptedDrafter(ref, BS, wrong_from, V)
        res = spec_generate(target, d, ids, 16)
        assert res.output_ids == ref
        # every step accepts wrong_from - 1 drafted tokens (capped by the block) plus the bonus
        assert set(res.acceptance_lengths[:-1]) == {min(wrong_from, BS)}
        steps = len(res.acceptance_lengths)
        assert res.accepted[0] >= steps - 1 if wrong_from > 1 else res.accepted[0] == 0


def test_random_drafter_is_lossless_and_stops(target, drafter):
    for ids in prompts(2):
        ref = greedy_generate(target, ids, 16)
        res = spec_generate(target, drafter, ids, 16)
        assert res.output_ids == ref and len(ref) == len(ids) + 16
        assert all(t >= 1 for t in res.acceptance_lengths)
        assert sum(res.drafted) == (BS - 1) * len(res.acceptance_lengths)
        stop = ref[len(ids) + 5]  # a token the target emits: both loops must stop right after it
        cut = greedy_generate(target, ids, 16, stop_token_ids=[stop])
        assert spec_generate(target, drafter, ids, 16, stop_token_ids=[stop]).output_ids == cut
        assert cut[-1] == stop and len(cut) <= len(ids) + 6


@pytest.mark.faults("bad_input")
def test_block_size_override_checked(target, drafter):
    from pipeline.core.errors import SpecquantError

    with pytest.raises(SpecquantError, match="block_size"):
        spec_generate(target, drafter, [1, 2, 3], 4, block_size=BS + 1)  # more than the drafter was trained for
    assert spec_generate(target, drafter, [5, 6, 7], 8, block_size=2).output_ids == greedy_generate(target, [5, 6, 7], 8)


@pytest.mark.skipif(not (TINY / "drafter" / "config.json").is_file(), reason="tiny drafter not built yet")
def test_shipped_tiny_drafter_is_lossless_with_tau_above_1_5():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(TINY / "target")
    target = AutoModelForCausalLM.from_pretrained(TINY / "target", dtype=torch.float32).eval()
    d = load_drafter(TINY / "drafter")  # the verifier is resolved from the config (assets/tiny/target, from the checkout root)
    assert d.config.block_size == 8 and d.config.aux_layer_ids == [1, 3]
    taus = []
    for name, prompt_ids in load_prompts(TINY / "eval", tok, limit=2).items():
        for ids in prompt_ids:
            res = spec_generate(target, d, ids, 64, [tok.eos_token_id])
            assert res.output_ids == greedy_generate(target, ids, 64, [tok.eos_token_id]), name
            taus += res.acceptance_lengths
    assert sum(taus) / len(taus) > 1.5, taus
    recorded = json.loads((TINY / "drafter" / "tau.json").read_text())
    assert recorded["block_size"] == 8 and recorded["lossless_mismatches"] == 0
    assert f"Mean tau = {recorded['mean_tau']}" in (TINY / "drafter" / "README.md").read_text()


class Recording(torch.nn.Module):
    """A drafter as given, recording the context (the target's aux hidden states) of each of its drafts."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.fc, self.seen = inner, inner.config, inner.fc, []

    def new_cache(self):
        return self.inner.new_cache()

    def draft_block(self, ctx, block, pos, cache):
        self.seen.append(ctx.clone())
        return self.inner.draft_block(ctx, block, pos, cache)


def _decode_all(target, drafter, ids_list, memo):
    from pipeline.models.spec_decode import spec_generate as run

    rec = Recording(drafter)
    out = [run(target, rec, ids, 3 * BS, trace=True, memo=memo) for ids in ids_list]
    return [(r.output_ids, r.acceptance_lengths, r.drafted, r.accepted, r.draft_calls) for r in out], rec.seen


def test_shared_target_forwards_change_no_token_and_no_hidden_state(target, drafter):
    """Decodes that take target forwards from a StepMemo (pipeline.models.target_steps) give exactly the tokens,
    statistics and drafter contexts of decodes that run them all: for the drafter again (every forward reused),
    for a scripted drafter beside it (the prefills reused) and with a memo too small to hold anything."""
    from pipeline.models.target_steps import StepMemo

    ids_list = list({tuple(p): p for p in prompts(6, seed=11)}.values())[:4]  # distinct prompts
    scripted = ScriptedDrafter(greedy_generate(target, ids_list[0], 3 * BS), BS, 2, V)
    plain = {name: _decode_all(target, d, ids_list, None) for name, d in (("drafter", drafter), ("scripted", scripted))}
    memo = StepMemo(1 << 30)
    first = _decode_all(target, drafter, ids_list, memo)
    assert first[0] == plain["drafter"][0]
    assert memo.counts() == {"run": len(ids_list) + sum(len(r[1]) for r in first[0]), "reused": 0}
    for name, d in (("drafter", drafter), ("scripted", scripted)):
        before = memo.counts()
        got = _decode_all(target, d, ids_list, memo)
        assert got[0] == plain[name][0]
        assert len(got[1]) == len(plain[name][1]) and all(torch.equal(a, b) for a, b in zip(got[1], plain[name][1]))
        assert memo.counts()["reused"] - before["reused"] >= len(ids_list)  # at least every prefill
        if name == "drafter":  # the same blocks from the same states: every forward taken from the memo
            assert memo.counts()["run"] == before["run"]
    tiny = StepMemo(1)  # holds nothing: every forward runs
    assert _decode_all(target, drafter, ids_list, tiny)[0] == plain["drafter"][0]
    assert tiny.bytes == 0 and tiny.counts()["reused"] == 0
