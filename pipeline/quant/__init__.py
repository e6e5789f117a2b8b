"""Quantization library code: recipes, calibration, export and checks (stages call into it)."""
