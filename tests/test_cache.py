"""Cache stage: captured hidden states equal the target's output_hidden_states; format, reuse, fp8, import."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.core.config import compose
from pipeline.core.io import sha256_file
from tests._support import (  # noqa: F401  (one_thread: autouse, one thread for every test here)
    DFLASH,
    DRAFTER,
    REPO,
    TARGET,
    ZLAB_DRAFTER,
    geometry,
    hub_cache,
    one_thread,
    run_cache,
    stage_overrides,
    write_data,
)

SPEC_DRAFTER = DRAFTER


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    return hidden


def test_cached_states_equal_output_hidden_states(tmp_path, reference):
    """Every layer index 0..L (+1 convention, embeddings and final norm included), padded batches."""
    samples = write_data(tmp_path)
    n = geometry()["target_layers"]
    ids = [0, 2, n - 1, n]  # the embeddings, two decoder layers, the output after the final norm
    res = run_cache(tmp_path, "cache.storage_dtype=float32", f"cache.aux_layer_ids=[{','.join(map(str, ids))}]")
    from pipeline.stages.cache import CacheReader

    reader = CacheReader(tmp_path / "cache")
    assert len(reader) == len(samples) == res["num_samples"] and reader.aux_layer_ids == ids
    for s, item in zip(samples, reader, strict=True):
        ref = reference(s["input_ids"])
        assert item["id"] == s["id"]
        assert item["input_ids"].tolist() == s["input_ids"] and item["loss_mask"].tolist() == s["loss_mask"]
        assert item["hidden_states"].dtype == torch.float32
        for j, m in enumerate(ids):
            torch.testing.assert_close(item["hidden_states"][:, j], ref[m], atol=2e-5, rtol=1e-5)


def test_bf16_default_takes_the_drafters_aux_layers(tmp_path, reference):
    samples = write_data(tmp_path, n=6)
    run_cache(tmp_path)
    from pipeline.stages.cache import CacheReader

    reader = CacheReader(tmp_path / "cache")
    aux = geometry()["aux_layer_ids"]
    assert reader.index["storage_dtype"] == "bfloat16" and reader.aux_layer_ids == aux
    for s, item in zip(samples, reader, strict=True):
        ref = torch.stack([reference(s["input_ids"])[m] for m in aux], dim=1)
        err = (item["hidden_states"] - ref).abs()
        assert bool((err <= ref.abs() * 2**-7 + 1e-6).all()), float(err.max())  # bf16 rounding


def test_zlab_drafter_config_maps_to_the_same_layers():
    from pipeline.stages.cache import resolve_aux_layer_ids

    zl = compose([f"drafter.path={ZLAB_DRAFTER}", "drafter.format=zlab"])
    sp = compose([f"drafter.path={SPEC_DRAFTER}", "drafter.format=speculators"])
    assert resolve_aux_layer_ids(zl) == resolve_aux_layer_ids(sp) == geometry()["aux_layer_ids"]


def test_index_hashes_and_layout(tmp_path):
    from safetensors import safe_open

    samples = write_data(tmp_path, n=8)
    res = run_cache(tmp_path)
    index = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert index["num_shards"] == 3 == res["num_shards"] and [s["count"] for s in index["shards"]] == [3, 3, 2]
    assert index["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    for rec in index["shards"]:
        p = tmp_path / "cache" / rec["file"]
        assert sha256_file(p) == rec["sha256"] and p.stat().st_size == rec["bytes"]  # hashed while writing
        with safe_open(str(p), framework="pt") as f:  # a standard safetensors file
            assert f.metadata()["format"] == "specquant-cache"
            assert len(list(f.keys())) == 3 * rec["count"]
    assert index["inputs_hash"] == res["inputs_hash"] and len(index["content_hash"]) == 64
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_content_hash_independent_of_sharding(tmp_path):
    write_data(tmp_path / "a", n=7)
    write_data(tmp_path / "b", n=7)
    # one sample per forward so the numbers cannot depend on which samples share a batch
    a = run_cache(tmp_path / "a", "cache.batch_tokens=1", "cache.samples_per_shard=2", "cache.shards_in_flight=1")
    b = run_cache(tmp_path / "b", "cache.batch_tokens=1", "cache.samples_per_shard=5", "cache.shards_in_flight=1")
    assert (a["num_shards"], b["num_shards"]) == (4, 2)
    assert a["content_hash"] == b["content_hash"]
    # three shards written at once by three writer threads (the default is 4): the same bytes, the same index
    write_data(tmp_path / "c", n=7)
    c = run_cache(tmp_path / "c", "cache.batch_tokens=1", "cache.samples_per_shard=2", "cache.shards_in_flight=3")
    assert c["shards_written"] == 4
    assert (tmp_path / "c" / "cache" / "index.json").read_bytes() == (tmp_path / "a" / "cache" / "index.json").read_bytes()


def test_rerun_reuses_and_changed_inputs_recompute(tmp_path):
    write_data(tmp_path, n=7)
    first = run_cache(tmp_path)
    again = run_cache(tmp_path)
    assert again["reused"] and again["shards_written"] == 0 and again["content_hash"] == first["content_hash"]
    changed = run_cache(tmp_path, "cache.aux_layer_ids=[1,3,5]", "cache.samples_per_shard=4")
    assert not changed["reused"] and changed["shards_written"] == 2 and changed["inputs_hash"] != first["inputs_hash"]
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert names == ["index.json", "shard-00000.json", "shard-00000.safetensors", "shard-00001.json",
                     "shard-00001.safetensors"]  # the third shard of the stale cache is gone
    from pipeline.stages.cache import CacheReader

    assert CacheReader(tmp_path / "cache")[0]["hidden_states"].shape[1] == 3


def test_fp8_roundtrip_error_is_bounded():
    from pipeline.artifacts.cache import Layout, decode_hidden, encode_hidden

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]  # wide range per token
    layout = Layout((1, 2, 3), 64, "fp8")
    q, scale = encode_hidden(x, layout)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 3)
    y = decode_hidden(q, scale)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits -> <= 2^-4 relative on normals; subnormals bounded by the token's scale
    assert bool(((y - x).abs() <= x.abs() * 2**-4 + amax / 448 * 2**-9).all())
    assert float((y - x).abs().max() / amax.max()) > 0  # it really is lossy (the test can fail)


def test_fp8_stage_halves_the_size(tmp_path):
    write_data(tmp_path / "bf", n=6)
    write_data(tmp_path / "f8", n=6)
    bf = run_cache(tmp_path / "bf", "cache.storage_dtype=float32")
    f8 = run_cache(tmp_path / "f8", "cache.storage_dtype=fp8")
    from pipeline.stages.cache import CacheReader

    r_bf, r_f8 = CacheReader(tmp_path / "bf" / "cache"), CacheReader(tmp_path / "f8" / "cache")
    assert r_f8.index["storage_dtype"] == "fp8" and "hidden_states_scale" in r_f8.index["storage"]
    for a, b in zip(r_bf, r_f8, strict=True):
        amax = a["hidden_states"].abs().amax(-1, keepdim=True)
        assert bool(((b["hidden_states"] - a["hidden_states"]).abs() <= a["hidden_states"].abs() * 2**-4
                     + amax / 448 * 2**-9).all())
    assert f8["total_bytes"] < 0.35 * bf["total_bytes"]  # float32 -> 1 byte + a 4-byte scale per 64 values


def _write_speculators_files(src: Path, samples: list[dict], reference, layers: list[int]) -> None:
    from safetensors.torch import save_file

    src.mkdir(parents=True)
    for i, s in enumerate(samples):
        hs = torch.stack([reference(s["input_ids"])[m] for m in layers], dim=1)  # [T, n_layers, H]
        save_file({"token_ids": torch.tensor(s["input_ids"]), "hidden_states": hs.contiguous()},
                  str(src / f"hs_{i}.safetensors"))


def test_import_speculators_roundtrip(tmp_path, reference):
    from datasets import Dataset

    from pipeline.artifacts.cache_import import import_speculators
    from pipeline.core.errors import SpecquantError
    from pipeline.stages.cache import CacheReader

    samples = write_data(tmp_path, n=5)
    _write_speculators_files(tmp_path / "hs", samples, reference, layers=[2, 3, 4, 6])
    ds = Dataset.from_dict({"input_ids": [s["input_ids"] for s in samples],
                            "loss_mask": [s["loss_mask"] for s in samples]})
    ds.save_to_disk(str(tmp_path / "prepared"))
    index = import_speculators(tmp_path / "hs", tmp_path / "cache", [2, 3, 4, 6], [4, 2], tmp_path / "prepared",
                               storage_dtype="float32", samples_per_shard=2)
    assert index["num_shards"] == 3 and index["aux_layer_ids"] == [4, 2]
    for s, item in zip(samples, CacheReader(tmp_path / "cache", verify="open"), strict=True):
        ref = reference(s["input_ids"])
        assert item["input_ids"].tolist() == s["input_ids"] and item["loss_mask"].tolist() == s["loss_mask"]
        assert torch.equal(item["hidden_states"], torch.stack([ref[4], ref[2]], dim=1))
    wrong = [s["loss_mask"] for s in samples]
    wrong[3] = wrong[3][:-1]
    with pytest.raises(SpecquantError, match="hs_3.safetensors"):
        import_speculators(tmp_path / "hs", tmp_path / "c2", [2, 3, 4, 6], [2], wrong)
    with pytest.raises(SpecquantError, match="aux_layer_ids"):
        import_speculators(tmp_path / "hs", tmp_path / "c3", [2, 3, 4, 6], [5], tmp_path / "prepared")


def test_import_cli_help():
    out = subprocess.run([sys.executable, "-m", "pipeline.artifacts.cache_import", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--file-layer-ids" in out.stdout and "hs_{i}.safetensors" in out.stdout


def test_bench_smoke_on_cpu(tmp_path):
    """bench/cache_bench.py --device cpu --tiny runs every mode and reports figures."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cache_bench", REPO / "bench" / "cache_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.dflash_aux_layer_ids(36) == [2, 10, 18, 26, 34]  # z-lab's [1, 9, 17, 25, 33] + 1
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--out-dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert [(r["mode"], r.get("storage_dtype")) for r in res] == [
        ("stock", None), ("capture", "bfloat16"), ("stage", "bfloat16"), ("stage", "fp8")]
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == 4 * 2 * 64 for r in res)
    assert res[2]["bytes_written"] > res[3]["bytes_written"] > 0
    assert not list(tmp_path.glob("tmp*"))  # its scratch directories are removed


def test_hub_download_metadata_does_not_change_the_cache_inputs(tmp_path):
    """A target dir with and without `.cache/huggingface/*.metadata` (written by `hf download --local-dir`,
    rewritten on every re-download) has the same cache input hash, so the finished cache is reused."""
    from pipeline.stages.cache import target_files_sha256

    target = tmp_path / "target"
    shutil.copytree(TARGET, target)
    write_data(tmp_path / "run", n=4)
    ov = [f"run_dir={tmp_path / 'run'}", f"target.path={target}", f"drafter.path={SPEC_DRAFTER}",
          "drafter.format=speculators", "cache.batch_tokens=64"]
    from pipeline.stages import cache

    first = cache.run(compose(ov))
    before = target_files_sha256(compose(ov))
    meta = target / ".cache" / "huggingface"
    (meta / "download").mkdir(parents=True)
    (meta / "x.metadata").write_text("0123abcd\n\"etag\"\n1764500000.0\n")
    (meta / "download" / "model.safetensors.metadata").write_text("0123abcd\n\"etag\"\n1764500001.5\n")
    assert target_files_sha256(compose(ov)) == before
    again = cache.run(compose(ov))
    assert again["reused"] and again["inputs_hash"] == first["inputs_hash"] and again["shards_written"] == 0
    # the files that decide the hidden states do count
    conf = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**conf, "specquant_note": "edited"}))
    assert target_files_sha256(compose(ov)) != before


def test_checkpoint_hashes_local_and_hub_snapshot(tmp_path, monkeypatch):
    """One helper hashes a model's weight + config files, from a directory or from the local Hub cache
    (repo id + revision, offline); a Hub-configured target gets the same cache input hash as its copy."""
    from huggingface_hub import constants

    from pipeline.core.errors import SpecquantError
    from pipeline.core.loading import checkpoint_hashes
    from pipeline.stages.cache import target_files_sha256

    local = checkpoint_hashes(TARGET)
    assert set(local) == {"config.json", "model.safetensors"}  # not the tokenizer, not generation_config
    assert local["model.safetensors"] == {"sha256": sha256_file(TARGET / "model.safetensors"),
                                          "bytes": (TARGET / "model.safetensors").stat().st_size}
    assert set(checkpoint_hashes(TARGET, weights_only=True)) == {"model.safetensors"}

    commit = "c0ffee" * 6 + "abcd"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "org/tiny-target", TARGET)))
    assert checkpoint_hashes("org/tiny-target") == local  # revision None = main
    assert checkpoint_hashes("org/tiny-target", commit) == local
    assert checkpoint_hashes("org/tiny-target", "f" * 40) is None  # not cached: never downloaded
    assert checkpoint_hashes("org/not-cached") is None
    hub_cfg = compose(["target.path=org/tiny-target", f"target.revision={commit}"])
    assert target_files_sha256(hub_cfg) == target_files_sha256(compose([f"target.path={TARGET}"]))
    with pytest.raises(SpecquantError, match="target.path.*not in the local Hugging Face cache"):
        target_files_sha256(compose(["target.path=org/not-cached"]))


def test_vllm_engine_streams_connector_files_into_the_same_cache(tmp_path, monkeypatch):
    """cache.engine=vllm reads files in vLLM's connector format as they appear and writes the cache's own
    shards; given the HF engine's states (tests/extract_producer.py stands in for vLLM, which needs a GPU:
    the real engine is measured in docs/benchmarks.md), the content hash equals the HF engine's."""
    from pipeline.serving import extract_stream as cache_vllm

    write_data(tmp_path / "hf", n=8)
    write_data(tmp_path / "vllm", n=8)
    one = ["cache.batch_tokens=1"]  # one sample per forward, as the stand-in does
    hf = run_cache(tmp_path / "hf", *one)
    monkeypatch.setattr(cache_vllm, "check_vllm_engine", lambda *a: {})
    monkeypatch.setattr(cache_vllm._Worker, "module", "tests.extract_producer")
    res = run_cache(tmp_path / "vllm", *one, "cache.engine=vllm", f"serve.python={sys.executable}",
                    "cache.shards_in_flight=2", "cache.vllm_backlog=1", f"cache.vllm_scratch={tmp_path / 'shm'}")
    assert res["content_hash"] == hf["content_hash"] and res["num_shards"] == hf["num_shards"] == 3
    assert res["inputs_hash"] != hf["inputs_hash"]  # other kernels in real use: never reused for each other
    index = json.loads((tmp_path / "vllm" / "cache" / "index.json").read_text())
    assert index["inputs"]["engine"] == "vllm" and index["engine"]["name"] == "vllm"
    for rec in index["shards"]:
        assert sha256_file(tmp_path / "vllm" / "cache" / rec["file"]) == rec["sha256"]
    assert not list((tmp_path / "shm").iterdir())  # vLLM's files, read and removed
    assert not list((tmp_path / "vllm" / ".work").glob("*vllm-extract*"))  # job and log removed
    assert "engine" not in json.loads((tmp_path / "hf" / "cache" / "index.json").read_text())["inputs"]


def test_vllm_engine_worker_dying_mid_shard_is_one_sentence(tmp_path, monkeypatch):
    """The reader waits for each sample's file while vLLM computes it; a worker that dies before writing
    one stops the stage with vLLM's own error, and no index or shard appears."""
    from pipeline.core.errors import SpecquantError
    from pipeline.serving import extract_stream as cache_vllm

    write_data(tmp_path, n=6)
    monkeypatch.setattr(cache_vllm, "check_vllm_engine", lambda *a: {})
    monkeypatch.setattr(cache_vllm._Worker, "module", "tests.extract_producer")
    monkeypatch.setenv("EXTRACT_PRODUCER_FAIL_AFTER", "3")
    with pytest.raises(SpecquantError) as err:
        run_cache(tmp_path, "cache.batch_tokens=1", "cache.engine=vllm", f"serve.python={sys.executable}",
                  "cache.samples_per_shard=2", "cache.shards_in_flight=2", f"cache.vllm_scratch={tmp_path / 'shm'}")
    msg = str(err.value)
    assert "vLLM's extraction stopped before sample" in msg and "illegal memory access" in msg, msg
    assert "cache.engine=hf" in msg
    assert not (tmp_path / "cache" / "index.json").exists()  # finished shards stay, for the resume
    assert not list((tmp_path / "shm").iterdir())  # scratch removed on the error too


def test_vllm_engine_without_vllm_is_one_sentence(tmp_path):
    from tests._support import run_main  # the entry point in this process; the vLLM probe is a real process

    write_data(tmp_path, n=3)
    rc, _, err = run_main("cache", *stage_overrides(tmp_path, "cache.engine=vllm", f"serve.python={sys.executable}"))
    assert rc != 0 and "Traceback" not in err
    assert "cache.engine=vllm needs vLLM" in err and "serve.python" in err
    assert not (tmp_path / "cache").exists()
    rc, _, err = run_main("cache", *stage_overrides(tmp_path, "cache.engine=sglang"))
    assert "cache.engine" in err and "'sglang'" in err and "Traceback" not in err
