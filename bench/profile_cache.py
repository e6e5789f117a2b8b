"""Where the cache stage's time goes: the target forward vs the device-to-host copy vs the write.

Each variant runs the same batches (batch x seq tokens of random ids) through the same target:
  stock_ohs        model(..., output_hidden_states=True), aux layers gathered, synchronous .cpu()
  hooks_stop       forward hooks on the aux layers, forward stopped after the deepest one, no copy
  hooks_stop_sync  same + synchronous pageable .cpu() of the captured layers (the naive path)
  hooks_stop_pinned same + non_blocking copy into pinned host buffers on a side stream
  d2h_pageable / d2h_pinned   the copy alone, GB/s
  write_sha        safetensors bytes of one batch written + fsynced with sha256 on the fly, GB/s
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time

import torch


class _Stop(Exception):
    pass


def _timed(fn, device: str, reps: int) -> float:
    fn()  # warm-up (kernels, allocator)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def profile(target_dir: str, aux_layer_ids: list[int], device: str, batch: int, seq: int, reps: int,
            write_dir: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, device_map=device)
    model.eval()
    load_s = time.perf_counter() - t0
    layers = model.model.layers
    deepest = max(aux_layer_ids)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    captured: dict[int, torch.Tensor] = {}

    def hook_for(m_idx: int):
        def hook(_mod, _inp, out):
            captured[m_idx] = out[0] if isinstance(out, tuple) else out
            if m_idx == deepest:
                raise _Stop
        return hook

    n_tok = batch * seq
    res: dict = {"batch": batch, "seq": seq, "tokens_per_step": n_tok, "load_s": round(load_s, 2),
                 "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}

    @torch.inference_mode()
    def stock():
        out = model(input_ids=ids, output_hidden_states=True)
        return torch.stack([out.hidden_states[i] for i in aux_layer_ids], dim=2).cpu()

    def run_hooks():
        handles = [layers[i - 1].register_forward_hook(hook_for(i)) for i in aux_layer_ids]
        try:
            with torch.inference_mode():
                model.model(input_ids=ids)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
        return torch.stack([captured[i] for i in aux_layer_ids], dim=2)

    shape = (batch, seq, len(aux_layer_ids), model.config.hidden_size)
    pinned = torch.empty(shape, dtype=torch.bfloat16, pin_memory=device.startswith("cuda"))
    side = torch.cuda.Stream() if device.startswith("cuda") else None

    def hooks_sync():
        run_hooks().cpu()

    def hooks_pinned():
        hs = run_hooks()
        if side is None:
            pinned.copy_(hs)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pinned.copy_(hs, non_blocking=True)
            hs.record_stream(side)

    for name, fn in (("stock_ohs", stock), ("hooks_stop", run_hooks), ("hooks_stop_sync", hooks_sync),
                     ("hooks_stop_pinned", hooks_pinned)):
        dt = _timed(fn, device, reps)
        res[name] = {"s_per_step": round(dt, 4), "tok_s": round(n_tok / dt)}

    hs = run_hooks()
    nbytes = hs.numel() * hs.element_size()
    res["bytes_per_step"] = nbytes
    t_pageable = _timed(lambda: hs.cpu(), device, reps)
    t_copy = _timed(lambda: pinned.copy_(hs), device, reps)
    t_write = _write_once(hs.cpu(), write_dir)
    res["d2h_pageable_GBs"] = round(nbytes / t_pageable / 1e9, 3)
    res["d2h_pinned_GBs"] = round(nbytes / t_copy / 1e9, 3)
    res["write_sha_GBs"] = round(nbytes / t_write / 1e9, 3)
    # a step's bound if forward, copy and write ran one after another vs perfectly overlapped
    t_fwd = _timed(run_hooks, device, reps)
    res["bound_serial_tok_s"] = round(n_tok / (t_fwd + t_copy + t_write))
    res["bound_overlapped_tok_s"] = round(n_tok / max(t_fwd, t_copy, t_write))
    return res


def _write_once(host: torch.Tensor, write_dir: str | None) -> float:
    from safetensors.torch import save

    t0 = time.perf_counter()
    data = save({"hidden_states": host.reshape(-1, *host.shape[2:]).contiguous()})
    h = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=write_dir, delete=True) as fh:
        view = memoryview(data)
        for i in range(0, len(view), 64 << 20):
            chunk = view[i:i + (64 << 20)]
            h.update(chunk)
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0
