"""The evaluate stage: prompt sets, fake-quantized checkpoints as served, report, plots and vLLM commands."""
