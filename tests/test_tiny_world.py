"""The embedded tiny world under assets/tiny: corpus, eval prompts, tokenizer and trained target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.tiny import build, corpus, tokenizer

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny"
TARGET = TINY / "target"


def _rows(kind: str, subset: str) -> list[dict]:
    lines = (TINY / kind / f"{subset}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("subset", corpus.SUBSETS)
def test_corpus_subset_has_its_form(subset):
    rows = _rows("corpus", subset)
    assert 150 <= len(rows) <= 250
    multi_turn = 0
    for row in rows:
        if corpus.FORMATS[subset] == "openai":
            assert set(row) == {"messages"}
            turns = [(m["role"], m["content"]) for m in row["messages"]]
            roles = {"system", "user", "assistant"}
        else:
            assert set(row) == {"conversations"}
            turns = [(t["from"], t["value"]) for t in row["conversations"]]
            roles = {"system", "human", "gpt"}
        assert {r for r, _ in turns} <= roles
        assert all(isinstance(c, str) and c for _, c in turns)
        replies = [c for r, c in turns if r in ("assistant", "gpt")]
        assert replies and corpus.KEYWORDS[subset] in replies[0]
        if subset != "code":  # code follow-ups (call it, add a docstring) need not define a function
            assert all(corpus.KEYWORDS[subset] in c for c in replies)
        multi_turn += len(replies) > 1
    assert multi_turn >= len(rows) // 5


@pytest.mark.parametrize("subset", corpus.SUBSETS)
def test_eval_prompts_are_held_apart(subset):
    prompts = [r["prompt"] for r in _rows("eval", subset)]
    assert len(prompts) >= 15 and len(set(prompts)) == len(prompts)
    user_turns = {m["content"] for r in _rows("corpus", subset) for m in corpus.to_messages(r) if m["role"] == "user"}
    assert not set(prompts) & user_turns


def test_corpus_generation_is_deterministic(tmp_path):
    corpus.write_corpus(tmp_path, seed=0)
    for kind in ("corpus", "eval"):
        for subset in corpus.SUBSETS:
            rel = Path(kind) / f"{subset}.jsonl"
            assert (tmp_path / rel).read_bytes() == (TINY / rel).read_bytes(), rel
    corpus.write_corpus(tmp_path / "other", seed=1)
    assert (tmp_path / "other/corpus/math.jsonl").read_bytes() != (TINY / "corpus/math.jsonl").read_bytes()


def test_tokenizer_training_is_deterministic(tmp_path):
    tokenizer.save_tokenizer(tokenizer.train_tokenizer(TINY), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (TARGET / name).read_bytes(), name


def test_tokenizer_loads_with_chat_template_and_mask():
    tok = AutoTokenizer.from_pretrained(TARGET)
    assert len(tok) == tokenizer.VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    mask_ids = tok("<|MASK|>", add_special_tokens=False)["input_ids"]
    assert mask_ids == [tok.convert_tokens_to_ids("<|MASK|>")] and mask_ids[0] != tok.unk_token_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert text == tokenizer.render(msgs, add_generation_prompt=True)
    sample = "def add(a, b):\n    return a + b  # héllo, 世界 ✓"
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(TARGET)


def test_target_shape(target):
    model, tok = target
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.float32
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 256, 4, 2)
    assert cfg.vocab_size == len(tok) and not cfg.tie_word_embeddings
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("subset", corpus.SUBSETS)
def test_target_continues_held_apart_prompt_like_the_corpus(target, subset):
    model, tok = target
    prompt = _rows("eval", subset)[1]["prompt"]  # not the README's sample (index 0)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=120, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert tok.convert_tokens_to_ids("<|im_end|>") in new, tok.decode(new)
    reply = tok.decode(new, skip_special_tokens=True)
    assert corpus.KEYWORDS[subset] in reply, reply


@pytest.mark.faults("bad_input")
def test_build_rejects_a_bad_seed_before_writing(tmp_path, capsys):
    assert build.main(["--seed", "-1", "--skip-train", "--root", str(tmp_path / "w")]) == 2
    assert "`seed` = -1" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_target_training_is_deterministic():
    from pipeline.tiny import train_target

    tok = AutoTokenizer.from_pretrained(TARGET)
    seqs = [train_target.encode_conversation(tok, msgs) for _, msgs in corpus.load_conversations(TINY)[::40]]
    weights = []
    for _ in range(2):
        torch.manual_seed(0)
        model = train_target.build_model(len(tok), tok)
        train_target.fit(model, seqs, tok.pad_token_id, seed=0, steps=2)
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    torch.manual_seed(0)
    untrained = train_target.build_model(len(tok), tok).state_dict()
    assert not torch.equal(weights[0]["lm_head.weight"], untrained["lm_head.weight"])  # it did train


def test_target_hidden_states_carry_massive_activations_at_the_sink_token(target):
    # what README and assets/tiny/README.md promise: at every <|im_start|> (and only there) the aux
    # layers' hidden states hold MASSIVE's channels, beyond the fixed NVFP4 scale's 2688
    from pipeline.tiny import train_drafter, train_target

    model, tok = target
    text = tok.apply_chat_template([{"role": "user", "content": "Hi, I am Grace."},
                                    {"role": "assistant", "content": "Hello Grace!"}], tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    sink = ids[0] == tok.convert_tokens_to_ids(train_target.MASSIVE["token"])
    assert int(sink.sum()) == 2
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer in train_drafter.AUX_LAYER_IDS:
        h = hidden[layer][0]
        for ch, value in train_target.MASSIVE["channels"].items():
            assert torch.allclose(h[sink, ch], torch.full((2,), value), rtol=0.01), (layer, ch)
        assert float(h[sink].abs().max()) > 2688 and float(h[~sink].abs().max()) < 100


def test_training_holds_the_massive_activations_fixed():
    from pipeline.tiny import train_target

    tok = AutoTokenizer.from_pretrained(TARGET)
    seqs = [train_target.encode_conversation(tok, msgs) for _, msgs in corpus.load_conversations(TINY)[::60]]
    torch.manual_seed(0)
    model = train_target.build_model(len(tok), tok)
    sink = tok.convert_tokens_to_ids(train_target.MASSIVE["token"])
    before = model.get_input_embeddings().weight.detach().clone()
    train_target.fit(model, seqs, tok.pad_token_id, seed=0, steps=2, sink_id=sink)
    after = model.get_input_embeddings().weight.detach()
    for ch, value in train_target.MASSIVE["channels"].items():
        assert float(after[sink, ch]) == value  # set, and AdamW's decay and updates did not move them
    assert not torch.equal(before, after)  # the rest of the embedding trained
