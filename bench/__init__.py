"""Benchmarks (not tests): real-scale measurements of the pipeline's stages on GPUs."""
