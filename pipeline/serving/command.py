"""The one `vllm serve` command for a target with a DFlash drafter.

Every place that tells a user how to serve a drafter builds it here: the model card
(`pipeline/provenance/modelcard.py`), `provenance/vllm_serve.sh` (`pipeline/provenance/record.py`),
`eval/vllm_commands.sh` (`pipeline/evaluation/report.py`) and the commands shown in README.md and
docs/quickstart.md. serve-check's worker records the engine settings vLLM resolved for each pair
(`engine` in its result file, `pipeline/serving/worker.py`); tests/test_serving_command.py checks that the
commands a run writes are one command and say what serve-check ran.

The command: `vllm serve <target> --attention-backend FLASH_ATTN --speculative-config <json>
[--revision <rev>]`, the JSON `{"method": "dflash", "model": <drafter>, "num_speculative_tokens": <block
size - 1>}` plus `"quantization": "compressed-tensors"` for a quantized drafter (the draft's own
`quantization_config`, named so no reader has to know vLLM's default), compact separators. DFlash drafts
non-causally, so the attention backend is named (FLASH_ATTN supports it). Standard library only, but for
`drafter_settings`, which reads the checkpoint through `pipeline.models.checkpoint_info` (no torch either).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

METHOD = "dflash"
ATTENTION_BACKEND = "FLASH_ATTN"
QUANTIZATION = "compressed-tensors"


def speculative_config(drafter: str, num_speculative_tokens: int | str, quantized: bool) -> dict:
    """The `--speculative-config` of one drafter (a path or a Hub id)."""
    spec = {"method": METHOD, "model": str(drafter), "num_speculative_tokens": num_speculative_tokens}
    if quantized:
        spec["quantization"] = QUANTIZATION
    return spec


def serve_argv(target: str, drafter: str, num_speculative_tokens: int | str, quantized: bool,
               revision: str | None = None) -> list[str]:
    """`vllm serve` and its arguments, one word each; the target's revision last, when pinned."""
    spec = json.dumps(speculative_config(drafter, num_speculative_tokens, quantized), separators=(",", ":"))
    argv = ["vllm", "serve", str(target), "--attention-backend", ATTENTION_BACKEND, "--speculative-config", spec]
    return argv + (["--revision", str(revision)] if revision else [])


def shell_line(argv: list[str], variables: tuple[str, ...] = ()) -> str:
    """argv quoted for bash; `$NAME` of each name in `variables` stays a (double-quoted) expansion, also inside
    the JSON, so a script can say `"$RUN_DIR"/drafter/nvfp4` where the run directory is only known at run time."""
    if not variables:
        return shlex.join(argv)
    pattern = re.compile("(" + "|".join(re.escape("$" + v) + r"(?![A-Za-z0-9_])" for v in variables) + ")")

    def word(w: str) -> str:
        parts = [p for p in pattern.split(w) if p]
        return "".join(f'"{p}"' if pattern.fullmatch(p) else shlex.quote(p) for p in parts) or "''"

    return " ".join(word(w) for w in argv)


def serve_command(target: str, drafter: str, num_speculative_tokens: int | str, quantized: bool,
                  revision: str | None = None, variables: tuple[str, ...] = ()) -> str:
    """The command as one line of bash (`serve_argv` quoted by `shell_line`)."""
    return shell_line(serve_argv(target, drafter, num_speculative_tokens, quantized, revision), variables)


def drafter_settings(ckpt: str | Path) -> tuple[int | None, bool]:
    """(num_speculative_tokens, quantized) of a drafter checkpoint, from its config.json alone through
    `CheckpointInfo` (the one reader of a checkpoint's facts): block size - 1 (top level in speculators format,
    `dflash_config` in z-lab's), and whether it carries a `quantization_config` (top level or in
    `transformer_layer_config`). (None, False) without a readable config, as before a checkpoint is written."""
    from pipeline.core.errors import SpecquantError
    from pipeline.models.checkpoint_info import CheckpointInfo

    if not (Path(ckpt) / "config.json").is_file():
        return None, False
    try:
        info = CheckpointInfo.read(ckpt, "drafter")
    except SpecquantError:
        return None, False
    return (info.block_size - 1 if info.block_size else None), bool(info.quantization_config)
