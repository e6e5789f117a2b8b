"""The tiny world under assets/tiny/: a templated corpus, its tokenizer, a tiny Qwen3 target (and drafter)."""
