"""The fixture world itself: blend + the real cache stage on the golden DFlash target and drafter
(tests/_support.py builds it; tests/conftest.py's `fixture_world` once per session for the quant tests)."""

from __future__ import annotations

from tests._support import build_world, geometry


def test_world_builds_a_cache_the_drafter_can_read(tmp_path):
    from pipeline.stages.cache import CacheReader

    run_dir = build_world(tmp_path)
    reader = CacheReader(run_dir / "cache")
    assert len(reader) == 30
    s = reader[0]
    g = geometry()
    assert s["hidden_states"].shape[1:] == (len(g["aux_layer_ids"]), g["hidden"])
    assert s["hidden_states"].shape[0] == s["input_ids"].numel() == s["loss_mask"].numel()
