"""Third-party log lines a user can do nothing about, dropped where they are emitted.

Each call site mutes only the module that emits the line, only around the call that emits it, and
says why in a comment; anything else those libraries log still shows. llm-compressor and
compressed-tensors log through loguru (to stdout), so muting is loguru's own per-module switch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


def _llmcompressor_logging_off() -> bool:
    """True when the user turned llm-compressor's logging off (LLM_COMPRESSOR_LOG_DISABLED=true):
    then nothing is shown anyway, and re-enabling a module afterwards would undo their choice."""
    try:
        from llmcompressor.logger import LOGGER_CONFIG
    except ImportError:
        return False
    return bool(getattr(LOGGER_CONFIG, "disabled", False))


@contextlib.contextmanager
def loguru_muted(*modules: str) -> Iterator[None]:
    """Drop the loguru records of `modules` (exact module names, e.g. `llmcompressor.utils.dev`) while
    the block runs."""
    from loguru import logger

    if _llmcompressor_logging_off():
        yield
        return
    for name in modules:
        logger.disable(name)
    try:
        yield
    finally:
        for name in modules:
            logger.enable(name)


@contextlib.contextmanager
def warnings_ignored(*messages: str, category: type[Warning] = UserWarning) -> Iterator[None]:
    """`warnings.filterwarnings("ignore", message=...)` for each message prefix, for the block only."""
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def import_llmcompressor() -> None:
    """Import llm-compressor with its logging off, then configure its logging as its import would.

    Importing it evaluates `get_high_precision()` at module level (llmcompressor.modeling.fuse, the
    QuIP/SpinQuant defaults), which logs "No accelerator available! Compressing model on CPU instead" on
    every CPU machine before any specquant code runs; specquant chooses the device itself
    (`quant.device`), so the line is noise there. Its logger is configured inside that same import
    (so a `loguru_muted` around it would be undone), hence its own switch, LLM_COMPRESSOR_LOG_DISABLED,
    for the import only. A user's own LLM_COMPRESSOR_LOG_* settings are kept."""
    import os
    import sys

    if "llmcompressor" in sys.modules or os.environ.get("LLM_COMPRESSOR_LOG_DISABLED") is not None:
        import llmcompressor  # noqa: F401 - already imported, or the user decides about its logging
        return
    os.environ["LLM_COMPRESSOR_LOG_DISABLED"] = "true"
    try:
        import llmcompressor  # noqa: F401
    finally:
        del os.environ["LLM_COMPRESSOR_LOG_DISABLED"]
    from llmcompressor.logger import LOGGER_CONFIG, configure_logger

    LOGGER_CONFIG.disabled = False  # the import set it from the variable above
    configure_logger(LOGGER_CONFIG)
