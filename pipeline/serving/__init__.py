"""Serving with vLLM: the checkpoint contract vLLM reads (`contract`), the workers that run inside vLLM's own
interpreter (`worker*`, `extract`: standard library + vLLM only) and serve-check's pieces on the project side
(`launch`, `records`, `jobs`, `references`, `verdict`, `speedup`, `report`)."""
