"""Train the tiny world's byte-level BPE tokenizer and save it as a transformers tokenizer.

The chat template is Qwen's (`<|im_start|>{role}\\n{content}<|im_end|>\\n`), `<|im_end|>` ends a turn
(eos), and `<|MASK|>` is the DFlash mask token the drafter fills its block with.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.tiny.corpus import load_conversations

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
MASK_TOKEN = "<|MASK|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (training text must match what the template renders)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # digits are split one by one (as Qwen does) so the tiny target can learn arithmetic digit-wise;
    # newlines stand alone so `<|im_start|>assistant\n` tokenizes the same in a generation prompt as
    # in training text
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}|\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def train_tokenizer(root: str | Path, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE trained on the chat-rendered corpus under root/corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    # the trainer does not split out special tokens, so it sees roles and contents, never the markers
    texts = [piece for _, msgs in load_conversations(root) for m in msgs for piece in (m["role"] + "\n", m["content"])]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # a templated corpus has too few distinct words for 2048 word-level merges; the remaining ids are
    # reserved tokens (as in Qwen's vocab) so the vocab, and the target's embedding, is exactly vocab_size
    n = tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - n)])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """Save as PreTrainedTokenizerFast (tokenizer.json, tokenizer_config.json, chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", MASK_TOKEN],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(str(out_dir))
