"""quantize-drafter's speed work (issue 20, part 2) changes where and when things are computed, never what:
the batched activation-scale search gives the same floats as one candidate at a time, read-ahead batches
are the plain batches bit for bit, parallel shard verification still names a corrupt shard, and the
stage record carries every phase's wall time. Real compressed-tensors QDQ, real cache, real oneshot."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.quant import act_scale, cache_batches
from pipeline.stages import quantize_drafter
from tests._support import copy_world, world_cfg


def _nvfp4_input_args():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4", ["Linear"]).input_activations


def _activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 30
    x[::7, 3] = 9216.0  # massive-activation channel: blocks that clip under some scales, not others
    x[1::5] = x[1::5] * 1e-4  # small blocks: FP8 subnormal block scales
    return x


SCALES = act_scale.candidates(0.3, 1.0, [0.25, 0.315, 0.397, 0.5, 0.63, 0.794, 1.26, 1.587, 2.0, 2.52, 3.175, 4.0])


@pytest.mark.parametrize("shape", [(37, 64), (3, 5, 32)])
def test_qdq_many_is_qdq_at_each_scale_bit_for_bit(shape):
    args = _nvfp4_input_args()
    x = _activations(int(torch.tensor(shape[:-1]).prod()), shape[-1]).reshape(shape)
    many = act_scale.qdq_many(x, args, torch.tensor([v for _, v in SCALES]))
    assert many.shape == (len(SCALES), *shape)
    for i, (_, g) in enumerate(SCALES):
        assert torch.equal(many[i], act_scale.qdq(x, args, torch.tensor([g], dtype=torch.float32))), SCALES[i]


def _sequential_sums(weight, args, scales, xs) -> torch.Tensor:
    """The search's error sums as they were computed before batching: one candidate QDQ at a time."""
    sums = torch.zeros(1 + len(scales), dtype=torch.float64)
    for x in xs:
        x = x.reshape(-1, x.shape[-1])
        step = max(1, act_scale.CHUNK_ELEMENTS // x.shape[-1])
        for start in range(0, x.shape[0], step):
            chunk = x[start:start + step]
            sums[0] += (chunk @ weight.T).double().square().sum()
            for i, (_, g) in enumerate(scales):
                gs = torch.tensor([g], dtype=torch.float32)
                sums[1 + i] += ((act_scale.qdq(chunk, args, gs) - chunk) @ weight.T).double().square().sum()
    return sums


@pytest.mark.parametrize("budget", [act_scale.CANDIDATE_ELEMENTS_DEFAULT, 1, 5 * 64 * 48])
def test_batched_layer_error_sums_equal_one_candidate_at_a_time(monkeypatch, budget):
    # budget 1: one candidate per call; 5 * rows * cols: candidate groups of 5, 5, 4 (a ragged last group)
    monkeypatch.setattr(act_scale, "CANDIDATE_ELEMENTS_DEFAULT", budget)
    monkeypatch.setattr(act_scale, "CHUNK_ELEMENTS", 64 * 48)  # several row chunks per call, a ragged last one
    args = _nvfp4_input_args()
    w = torch.randn(24, 48, generator=torch.Generator().manual_seed(1))
    xs = [_activations(150, 48, seed=2), _activations(9, 48, seed=3)]
    layer = act_scale.LayerError(w, args, SCALES)
    for x in xs:
        layer.add(x)
    assert torch.equal(layer._sums, _sequential_sums(w, args, SCALES, xs))
    assert layer.rows == 159


@pytest.fixture(scope="module")
def batched_and_sequential(fixture_world, tmp_path_factory):
    """The nvfp4 stage on the fixture world twice: as shipped, and with one candidate per QDQ call."""
    world = copy_world(fixture_world, tmp_path_factory.mktemp("speed"))
    batched = quantize_drafter.run(world_cfg(world, "quant=nvfp4"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(act_scale, "CANDIDATE_ELEMENTS_DEFAULT", 1)
        sequential = quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.name=nvfp4-seq"))
    return world, batched, sequential


def test_search_on_the_drafter_picks_the_same_scales_batched_or_not(batched_and_sequential):
    _, batched, sequential = batched_and_sequential
    assert batched["activation_scale_search"] == sequential["activation_scale_search"]
    assert batched["input_global_scales"] == sequential["input_global_scales"]
    assert batched["outputs"]["model.safetensors"] == sequential["outputs"]["model.safetensors"]  # same bytes
    assert batched["check"] == sequential["check"]


def test_stage_record_times_every_phase(batched_and_sequential):
    world, batched, _ = batched_and_sequential
    t = batched["timings"]
    phases = ("prepare_s", "load_s", "oneshot_s", "scale_search_s", "write_s", "check_s", "inputs_hash_wait_s")
    assert set(phases) <= set(t) and all(t[p] >= 0 for p in phases)
    assert t["total_s"] >= sum(t[p] for p in phases) - 1e-2
    if not torch.cuda.is_available():  # peak GPU memory only where there is a GPU
        assert not any(k.startswith("peak_gpu") for k in t)
    assert batched["num_calibration_samples"] == 12 and batched["num_calibration_anchors"] > 0


def test_read_ahead_batches_are_the_plain_batches(fixture_world):
    from pipeline.stages.cache import CacheReader

    cache = fixture_world / "qw" / "cache"
    plain = cache_batches.drafter_batches(CacheReader(cache), list(range(7)), 8, 4, 5, 64, 3)
    reader = CacheReader(cache, dtype=cache_batches.reader_dtype(CacheReader(cache).index))
    ahead = cache_batches.Prefetched(cache_batches.drafter_batches(reader, list(range(7)), 8, 4, 5, 64, 3), "cpu",
                                     cache_batches.ShardVerifier(reader, range(7)))
    try:
        for j in [0, 1, 2, 5, 6, 0, 3, 4]:  # in order, then out of order and again (the scale search re-reads)
            a, b = plain[j], ahead[j]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), j
        assert len(ahead) == 7 and cache_batches.count_tokens(ahead) == cache_batches.count_tokens(plain)
        twin = copy.deepcopy(ahead)  # llm-compressor keeps a deep copy of the loader, after shards were opened here
        assert isinstance(twin, cache_batches.DrafterBatches) and twin.reader is not reader
        assert all(torch.equal(twin[2][k], plain[2][k]) for k in plain[2])
    finally:
        ahead.close()


def test_calibration_reader_keeps_the_storage_dtype_except_fp8():
    # bf16 stays bf16 up to the device (the drafter's fc casts it, exactly); fp8 decodes with a float32 scale
    assert cache_batches.reader_dtype({"storage_dtype": "bfloat16"}) == torch.bfloat16
    assert cache_batches.reader_dtype({"storage_dtype": "float32"}) == torch.float32
    assert cache_batches.reader_dtype({"storage_dtype": "fp8"}) == torch.float32


def test_parallel_verification_names_the_corrupt_shard(fixture_world, tmp_path):
    from pipeline.core.errors import SpecquantError
    from pipeline.stages.cache import CacheReader

    world = copy_world(fixture_world, tmp_path)
    cache = world / "qw" / "cache"
    reader = CacheReader(cache)
    last = len(reader.index["shards"]) - 1
    shard = cache / reader.index["shards"][last]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: only the hash can tell
    shard.write_bytes(bytes(data))
    samples = [i for i, s in enumerate(reader.index["samples"]) if s["shard"] == last]
    verifier = cache_batches.ShardVerifier(reader, samples)
    ahead = cache_batches.Prefetched(cache_batches.drafter_batches(reader, samples, 8, 4, 5, 64, 0), "cpu", verifier)
    try:
        with pytest.raises(SpecquantError, match=f"cache shard {shard.name} .* does not match its sha256"):
            ahead[0]
    finally:
        ahead.close()
        verifier.close()


def test_skipping_the_output_head_leaves_every_linear_input_alone(fixture_world):
    from pipeline.models.calibration import skip_logits
    from pipeline.models.formats import load_drafter
    from pipeline.stages.cache import CacheReader
    from tests._support import DRAFTER, TARGET

    model = load_drafter(DRAFTER, target=TARGET, dtype=torch.float32, device="cpu").eval()
    batch = cache_batches.drafter_batches(CacheReader(fixture_world / "qw" / "cache"), [0], 8,
                                          model.config.block_size, int(model.config.mask_token_id), 64, 0)[0]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].clone()))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        full = model(**batch).logits
        with skip_logits(model):
            empty = model(**batch).logits
        again = model(**batch).logits
    for h in hooks:
        h.remove()
    assert empty.shape == (*full.shape[:-1], 0) and torch.equal(again, full)  # the head is back afterwards
    assert seen and all(len(v) == 3 and torch.equal(v[0], v[1]) for v in seen.values())
