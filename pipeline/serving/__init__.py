"""Serving with vLLM: the checkpoint contract vLLM reads (`contract`), the serve-check worker that runs
inside vLLM's own interpreter (`worker`, standard library + vLLM only) and the stage's verdicts (`verdict`)."""
