"""What every serve-check worker shares, inside vLLM's interpreter (standard library, vLLM and torch only; see
`pipeline.serving.worker`): the log handler that keeps vLLM's kernel lines, the atomic result write, vLLM's
spec-decode counters, versions and platform, the CPU build's runtime and its emulation kernels, how a result
records a failure and ends, and what lets one process run several jobs (`--batch`): vLLM's logging set up before
the handler is added, each job's own peak resident set, and the engine released before the next."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_draft_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
KERNEL_LINE = re.compile(r"^(Using \S+ for |Selected \S+ for )|Weight-only|weight-only|emulat", re.I)


class LogLines(logging.Handler):
    """Keeps vLLM's log lines that name kernels (and the last lines, for errors)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.kernel_lines: list[str] = []
        self.tail: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed log call must not kill the check
            return
        self.tail = (self.tail + [msg])[-40:]
        if KERNEL_LINE.search(msg) and len(msg) < 400 and msg not in self.kernel_lines:
            self.kernel_lines.append(msg)


def write_result(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def spec_counters(llm) -> dict:
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    out[PER_POS] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == PER_POS:
            vals = list(m.values)
            acc = out[PER_POS] + [0] * (len(vals) - len(out[PER_POS]))
            out[PER_POS] = [a + int(v) for a, v in zip(acc, vals + [0] * (len(acc) - len(vals)))]
    return out


def counter_diff(after: dict, before: dict) -> dict:
    per = [a - (before[PER_POS][i] if i < len(before[PER_POS]) else 0) for i, a in enumerate(after[PER_POS])]
    return {"drafts": after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]],
            "accepted": after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]],
            "draft_tokens": after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]],
            "accepted_per_pos": per}


def versions() -> dict:
    import platform

    import torch
    import vllm

    v = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
         "python": sys.version.split()[0], "platform": platform_name()}
    if v["platform"] == "cpu":
        v["cpu"] = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch {torch.backends.cpu.get_cpu_capability()}"
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        from importlib.metadata import version

        v["compressed-tensors"] = version("compressed-tensors")
    except Exception:  # noqa: BLE001
        pass
    return v


def platform_name() -> str:
    """vLLM's platform in this interpreter: "cuda", "cpu", ... (vLLM's own detection)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def cpu_runtime() -> dict:
    """What an engine on the CPU build needs from its environment: the interpreter's libiomp5 to preload
    (without it generation is ~20x slower) and the cores torch may use."""
    import torch

    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    # vLLM's CPU attention stores an FP8 KV cache only on x86 with AVX-512 or AMX (0.32:
    # v1/attention/backends/cpu_attn.py:540, "FP8 KV cache on CPU requires x86 with AVX-512 or AMX")
    fp8_kv = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    return {"libiomp5": str(lib) if lib.is_file() else None, "cores": len(os.sched_getaffinity(0)), "fp8_kv_cache": fp8_kv}


def _register_cpu_nvfp4_emulation() -> str:
    """vLLM's pure-torch NVFP4 kernel, registered for the CPU platform (which lists none) in this process."""
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    return EmulationNvFp4LinearKernel.__name__


def _register_cpu_int4_emulation() -> str | None:
    """vLLM's CPU build for x86 without AVX-512 (`_C_AVX2`) lacks `cpu_gemm_wna16`, the op its only W4A16
    kernel calls (vLLM 0.32 `model_executor/kernels/linear/mixed_precision/cpu.py:198`), so every int4 layer
    fails at its first forward. There, and only there, a pure-torch W4A16 kernel is put first for the CPU
    platform: it reads vLLM's loaded compressed-tensors parameters (int32-packed uint4b8 weights, per-group
    scales) with vLLM's own unpacking and computes dequantize-then-matmul in the activation dtype. The
    checkpoint goes through vLLM's whole loading path; only the GEMM is ours. None where the op exists."""
    import torch
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.scalar_type import scalar_types

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None

    class TorchEmulationWNA16LinearKernel(MPLinearKernel):
        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c) -> tuple[bool, str | None]:
            if c.weight_type != scalar_types.uint4b8 or c.zero_points:
                return False, f"symmetric int4 (uint4b8) only, not {c.weight_type} zero_points={c.zero_points}"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed, scales = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
            q = unpack_quantized_values_into_int32(packed.data, self.config.weight_type, packed.packed_dim)
            if packed.input_dim == 0:  # to [out, in]
                q = q.t()
            s = scales.data if scales.output_dim == 0 else scales.data.t()
            group = q.shape[1] if self.config.group_size == -1 else self.config.group_size
            w = (q.float() - self.config.weight_type.bias) * s.float().repeat_interleave(group, dim=1)[:, : q.shape[1]]
            layer.register_buffer("emulated_weight", w.to(self.config.act_type).contiguous(), persistent=False)

        def apply_weights(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.emulated_weight, bias)

    _POSSIBLE_KERNELS[PlatformEnum.CPU].insert(0, TorchEmulationWNA16LinearKernel)
    return TorchEmulationWNA16LinearKernel.__name__


_REGISTERED: dict[str, str | None] = {}  # the emulation kernels registered in this process, by kind


def register_cpu_emulation(result: dict, job: dict) -> None:
    """On the CPU build: the emulation kernels the job allows (both by default), named in the result; each
    registered once per process. A kernel registered by an earlier job of a batch cannot be taken back, so a job
    that turns it off there fails, saying so (the launcher batches only jobs with the same switches)."""
    for kind, key, register in (("nvfp4", "cpu_nvfp4_emulation", _register_cpu_nvfp4_emulation),
                                ("int4", "cpu_int4_emulation", _register_cpu_int4_emulation)):
        if job.get(key, True):
            if kind not in _REGISTERED:
                _REGISTERED[kind] = register()
            result[f"{kind}_emulation"] = _REGISTERED[kind]
        elif _REGISTERED.get(kind):
            raise RuntimeError(f"{key}=false, but an earlier job of this worker process registered "
                               f"{_REGISTERED[kind]}: run this job in its own process")


def reset_peak_rss() -> None:
    """Linux: this process's peak resident set started afresh, so a job's peak is its own (also in a batch)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """The peak resident set since `reset_peak_rss` (Linux's VmHWM), else the process's own peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def record_error(result: dict, exc: BaseException) -> None:
    """A failure in the result file: its type and first line, and the traceback's end."""
    text = str(exc).strip()
    result["error"] = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    result["traceback"] = traceback.format_exc()[-4000:]


def finish(result: dict, lines, t0: float) -> dict:
    """What every worker result ends with: the captured kernel lines and log tail, wall time, versions."""
    result["kernel_log"] = lines.kernel_lines
    result["log_tail"] = lines.tail
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    try:
        result["versions"] = versions()
    except Exception as exc:  # noqa: BLE001
        result["versions"] = {"error": str(exc)}
    return result


def settle_logging() -> None:
    """vLLM's logging configured now, as an engine's start would do it (vLLM 0.32's LLMEngine calls
    `configure_logging_if_needed`, whose dictConfig replaces the `vllm` logger's handlers, so a handler added
    before the first engine of a process heard nothing), and vLLM's once-only messages forgotten, so every engine
    of a batch logs its kernel lines as the first engine of a process does."""
    try:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed
    except ImportError:  # a vLLM that configures its logger once, when it is imported
        pass
    else:
        configure_logging_if_needed(LoggingConfig())
    import vllm.logger

    for name in ("_print_debug_once", "_print_info_once", "_print_warning_once", "_print_error_once"):
        getattr(getattr(vllm.logger, name, None), "cache_clear", lambda: None)()


def release_engine() -> None:
    """The engine of the job just run freed, with vLLM's own clean-up between engines of one process, before the
    next job of a batch builds its own (`pipeline.serving.worker --batch`)."""
    import ctypes
    import gc

    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        pass
    else:
        with contextlib.suppress(Exception):  # a failure here shows as the next engine's own error
            cleanup_dist_env_and_memory()
    with contextlib.suppress(OSError, AttributeError):  # glibc: the freed engine's memory back to the system,
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # so the next job's peak resident set is its own
