"""Cache stage under faults: SIGKILL mid-run, a flipped byte, bad layer ids, and torchrun with 2 ranks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.core.config import compose
from tests import warm
from tests._support import (  # noqa: F401
    REPO,
    TARGET,
    geometry,
    one_thread,
    run_cache,
    run_main,
    stage_overrides,
    write_data,
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _shard_state(cache: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.glob("shard-*.safetensors")}


@pytest.mark.faults("kill")
def test_sigkill_mid_run_then_resume(tmp_path):
    """kill -9 while a shard is in flight; the re-run redoes only that shard and gets the same content hash.
    One shard in flight (cache.shards_in_flight=1), so which shards are done at the pause is known."""
    write_data(tmp_path / "ref", n=10)
    ref = run_cache(tmp_path / "ref")
    run_dir = tmp_path / "killed"
    write_data(run_dir, n=10)
    marker, pause_after = tmp_path / "paused", 5  # shard 0 done, shard 1 (samples 3-5) in flight
    one_lane = "cache.shards_in_flight=1"
    # the pause is patched in by tests/faults.py: the shipped writer has no test hook
    proc = warm.popen([sys.executable, "-m", "tests.faults", f"pause={pause_after}:{marker}", "--",
                       "-m", "pipeline", "cache", *stage_overrides(run_dir, one_lane)],
                      cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.time() < deadline, "the cache stage never reached the pause point"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    cache = run_dir / "cache"
    assert not (cache / "index.json").exists()
    assert list(cache.glob(".tmp-specquant-*")), "the in-flight shard's temp file should be left by the kill"
    finished = sorted(p.name for p in cache.glob("shard-*.json"))
    assert finished == ["shard-00000.json"]  # 3 samples per shard; the shard in flight has no sidecar
    before = _shard_state(cache)

    res = run_cache(run_dir, one_lane)
    assert res["shards_written"] == ref["num_shards"] - len(finished)  # only the in-flight one is redone
    assert res["content_hash"] == ref["content_hash"]
    after = _shard_state(cache)
    assert all(after[name] == before[name] for name in (f.replace(".json", ".safetensors") for f in finished))
    assert not list(cache.glob(".tmp-specquant-*"))
    assert (cache / "index.json").read_bytes() == (tmp_path / "ref" / "cache" / "index.json").read_bytes()


@pytest.mark.faults("tamper")
def test_flipped_byte_names_the_shard(tmp_path):
    """A flipped byte in one cache shard is reported as that shard's hash mismatch; other shards stay readable."""
    from pipeline.core.errors import SpecquantError
    from pipeline.stages.cache import CacheReader

    write_data(tmp_path, n=8)
    run_cache(tmp_path)
    shard = tmp_path / "cache" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    reader = CacheReader(tmp_path / "cache")  # lazy: shard 0 is still readable
    assert reader[0]["input_ids"].numel() > 0
    with pytest.raises(SpecquantError) as err:
        reader[3]
    msg = str(err.value)
    assert "shard-00001.safetensors" in msg and "sha256" in msg and "\n" not in msg
    with pytest.raises(SpecquantError, match="shard-00001.safetensors"):
        CacheReader(tmp_path / "cache", verify="open")


@pytest.mark.faults("bad_input")
def test_aux_id_beyond_depth_fails_before_loading_weights(tmp_path):
    """An aux layer id beyond the target's depth fails in one sentence before any weight is loaded."""
    from pipeline.core.errors import SpecquantError
    from pipeline.stages import cache

    shallow = tmp_path / "shallow-target"  # config only: loading weights would fail differently
    shallow.mkdir()
    conf = json.loads((TARGET / "config.json").read_text())
    deepest = max(geometry()["aux_layer_ids"])  # the drafter reads it; the shallow target stops one short
    depth = deepest - 1
    (shallow / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": depth,
                                                     "layer_types": conf["layer_types"][:depth]}))
    write_data(tmp_path, n=3)
    cfg = compose(stage_overrides(tmp_path, f"target.path={shallow}"))
    with pytest.raises(SpecquantError) as err:
        cache.run(cfg)
    msg = str(err.value)
    assert "aux_layer_ids" in msg and str(deepest) in msg and f"{depth} decoder layers" in msg and "\n" not in msg
    assert not (tmp_path / "cache").exists()
    with pytest.raises(SpecquantError, match=r"cache.aux_layer_ids"):
        cache.run(compose(stage_overrides(tmp_path, "cache.aux_layer_ids=[2,9]")))
    with pytest.raises(SpecquantError, match=r"cache.storage_dtype"):
        cache.run(compose(stage_overrides(tmp_path, "cache.storage_dtype=int8")))
    assert not (tmp_path / "cache").exists()


@pytest.mark.faults("bad_input")
def test_cli_reports_bad_layer_in_one_line(tmp_path):
    """Through the CLI, a bad aux layer id is one stderr line with exit code 2."""
    write_data(tmp_path, n=3)  # the entry point in this process (test_bad_inputs' CLI cases are real processes)
    rc, _, err = run_main("cache", *stage_overrides(tmp_path, "cache.aux_layer_ids=[0,7]"))
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: `cache.aux_layer_ids`") and "7" in lines[0]


@pytest.mark.slow
def test_torchrun_two_ranks_same_content_hash(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        torchrun = shutil.which("torchrun")
    write_data(tmp_path / "one", n=10)
    one = run_cache(tmp_path / "one")
    two_dir = tmp_path / "two"
    write_data(two_dir, n=10)
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pipeline", "cache",
                          *stage_overrides(two_dir, "cache.distributed_backend=gloo")],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    index = json.loads((two_dir / "cache" / "index.json").read_text())
    assert index["content_hash"] == one["content_hash"] and index["num_shards"] == 4
    # shards do not depend on the number of ranks, so the whole index is byte-identical
    assert (two_dir / "cache" / "index.json").read_bytes() == (tmp_path / "one" / "cache" / "index.json").read_bytes()
    record = json.loads((two_dir / "stages" / "cache.json").read_text())
    assert record["launcher"]["world_size"] == 2 and record["result"]["shards_written"] == 4
    assert torch.cuda.is_available() or record["resolved_config"]["cache"]["distributed_backend"] == "gloo"


@pytest.mark.faults("kill")
def test_shard_without_sidecar_or_truncated_is_redone(tmp_path):
    """The two states a kill can leave besides a temp file: a renamed shard whose sidecar never got
    written, and (simulated) a shard whose size disagrees with its sidecar. Only those are redone."""
    write_data(tmp_path, n=10)
    ref = run_cache(tmp_path)
    cache = tmp_path / "cache"
    (cache / "index.json").unlink()
    (cache / "shard-00001.json").unlink()
    with open(cache / "shard-00002.safetensors", "r+b") as fh:
        fh.truncate(100)
    before = _shard_state(cache)
    res = run_cache(tmp_path)
    assert res["shards_written"] == 2 and res["content_hash"] == ref["content_hash"]
    after = _shard_state(cache)
    assert after["shard-00000.safetensors"] == before["shard-00000.safetensors"]
    assert after["shard-00003.safetensors"] == before["shard-00003.safetensors"]
