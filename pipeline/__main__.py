"""`python -m pipeline <stage> [hydra overrides]` - the single entry point of every stage.

Configuration is composed (and validated against the schemas) before any heavy
import, so a wrong key or type fails in about a second with one line.
"""

from __future__ import annotations

import importlib
import os
import sys

from pipeline.stages import (
    MODULES as STAGES,  # stage name -> module exposing `run(cfg) -> dict`, in run order
)

# commands that take their own argv instead of Hydra overrides (pipeline/commands/)
COMMANDS = {
    "verify": "pipeline.commands.verify",
    "convert": "pipeline.commands.convert",
    "spec-decode": "pipeline.commands.spec_decode",
    "cache-import": "pipeline.artifacts.cache_import",
}

USAGE = (
    "usage: python -m pipeline <stage> [-m] [key=value ...]   (-m: key=a,b runs one job per value, one process)\n"
    f"  stages:   {', '.join(STAGES)}\n"
    f"  commands: {', '.join(COMMANDS)} (see `python -m pipeline <command> --help`), "
    "run-dir [key=value ...] (print where outputs land), stages (print the stages in run order)"
)


def _override_sentence(exc) -> str:
    """An override Hydra's grammar cannot parse, as one sentence (never the lexer's exception name)."""
    import re

    text = str(exc.override or "")
    key, _, value = text.partition("=")
    m = re.search(r"^([\w.]*?)\[\d+\]", key.lstrip("+~"))
    if m:  # `data.sources[0].weight=2`: the grammar has no list indexing
        whole = m.group(1)
        return (f"`{key.lstrip('+~')}` = {value!r}: a Hydra override cannot index into a list; override the whole "
                f"list instead (`{whole}=[...]` with every item written out) or change the item in its file under conf/")
    why = [ln.strip() for ln in str(exc.message or exc).splitlines()
           if ln.strip() and not ln.strip().startswith(("See https", "Error parsing override", "^"))]
    detail = why[0] if why else "it does not follow the override grammar"
    detail = detail.split(": ", 1)[0] if detail.startswith("LexerNoViableAltException") else detail
    detail = detail.split(" expecting ", 1)[0]  # the grammar's token list says nothing to a user
    return (f"the override {text!r} cannot be parsed ({detail}); write it as key=value and quote a value that "
            "holds spaces, brackets or '=' (see https://hydra.cc/docs/advanced/override_grammar/basic/)")


def _compose_or_exit(overrides: list[str]):
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.core.config import bad_names, compose, unknown_keys

    try:
        cfg = compose(overrides)
        # resolve every interpolation now so type errors surface before work starts
        from omegaconf import OmegaConf

        for key, value in bad_names(cfg):
            print(f"error: invalid configuration: `{key}` = {value!r} becomes a directory name; use letters, "
                  "digits, '.', '_' and '-' only (no '/' or '..').", file=sys.stderr)
            raise SystemExit(2)
        extra = unknown_keys(cfg)
        if extra:
            print(f"error: invalid configuration: unknown key `{extra[0]}`; remove it or fix its spelling "
                  "(see conf/ and pipeline/core/config.py for the valid keys).", file=sys.stderr)
            raise SystemExit(2)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        return cfg
    except OverrideParseException as exc:
        print(f"error: invalid configuration: {_override_sentence(exc)}.", file=sys.stderr)
        raise SystemExit(2) from None
    except (HydraException, OmegaConfBaseException) as exc:
        parts, e = [], exc
        while e is not None:  # Hydra wraps the useful OmegaConf message (key, value, type) as the cause
            text = str(e).split("\n")[0].strip()
            if text and text not in parts:
                parts.append(text)
            e = e.__cause__
        msg = "; ".join(parts)
        if msg.startswith("Ambiguous value for argument"):  # `key=a,b` without -m: say the three readings
            print(f"error: invalid configuration: {msg}: add -m to run one job per value in one process "
                  "(`python -m pipeline <stage> -m key=a,b`), write a list as key=[a,b], or quote a string "
                  "as key='a,b'.", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"error: invalid configuration: {msg} (check the key and value in your overrides or conf/)",
              file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `<stage> --help` / `-h` (or `help <stage>`): the stage's purpose, keys and presets, before composing
    # (Hydra would read `--help` as an override); overrides given beside it shape the values shown
    if argv and argv[0] == "help" and len(argv) > 1 and argv[1] in STAGES:
        argv = [argv[1], "--help", *argv[2:]]
    if argv and argv[0] in STAGES and any(a in {"-h", "--help"} for a in argv[1:]):
        from pipeline.help import main as stage_help

        return stage_help(argv[0], STAGES[argv[0]], [a for a in argv[1:] if a not in {"-h", "--help"}])
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]

    from pipeline.core.errors import SpecquantError

    if name in COMMANDS:
        try:
            return int(importlib.import_module(COMMANDS[name]).main(rest) or 0)
        except SpecquantError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # noqa: BLE001 - a read-only or full DST (any writer's error type): one sentence
            from pipeline.core.errors import as_os_error

            oserr = as_os_error(exc)
            if oserr is None:
                raise
            where = getattr(oserr, "path", None) or oserr.filename or "a file"
            print(f"error: `{name}` could not use {where}: {os.strerror(oserr.errno)}; fix the file system "
                  "problem (permissions, free space, the path) and run it again.", file=sys.stderr)
            return 2
    if name == "stages":  # the one list, in run order (read by `make all` and the repro check)
        print("\n".join(STAGES))
        return 0
    if name == "run-dir":  # where a configuration's outputs land (used by `make all`)
        print(_compose_or_exit(rest).run_dir)
        return 0
    if name not in STAGES:
        print(f"error: unknown stage {name!r}; choose one of {', '.join([*STAGES, *COMMANDS])}.", file=sys.stderr)
        return 2

    jobs = _sweep(rest) if {"-m", "--multirun"} & set(rest) else [rest]
    # every job's configuration is composed and checked before the first one starts
    runs = [(job, _compose_or_exit(job)) for job in jobs]
    from pipeline.core.secrets import scrub
    from pipeline.stages.runner import run_stage

    for i, (job, cfg) in enumerate(runs):
        swept = [a for a in job if a not in rest]  # the values this job took from the sweep
        which = f" (job {i + 1} of {len(runs)}: {' '.join(swept)})" if len(runs) > 1 else ""
        try:
            _check_devices(name, cfg)
            run_stage(name, STAGES[name], cfg, job)
        except KeyboardInterrupt:
            print(f"error: `{name}` was interrupted (Ctrl-C){which}; nothing half-written is kept: the next run of "
                  "the stage removes its partial files and starts that work again.", file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - only the user's errors and file-system errors end here; the rest is re-raised
            sentence = _stage_error(name, exc, cfg)
            if sentence is None:
                raise
            print(f"error: {scrub(sentence)}{which}", file=sys.stderr)
            return 2
    return 0


def _sweep(rest: list[str]) -> list[list[str]]:
    """`-m` / `--multirun` (Hydra's flag): one job per combination of the comma-separated values
    (`quant=nvfp4,w4a16` -> two jobs), in Hydra's order, all run in this one process - a variant costs its own
    work, not another interpreter, torch and llm-compressor start-up. Each job's stage record holds its own
    overrides (`command`), as if it had been run alone."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    given = [a for a in rest if a not in {"-m", "--multirun"}]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except OverrideParseException as exc:
        print(f"error: invalid configuration: {_override_sentence(exc)}.", file=sys.stderr)
        raise SystemExit(2) from None
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
               else [text] for text, o in zip(given, parsed)]
    return [list(c) for c in itertools.product(*choices)]


def _stage_error(name: str, exc: BaseException, cfg) -> str | None:
    """The one sentence for a stage that stopped on the user's input or the file system, else None.

    A file-system error is recognised whatever type its writer raised (`errors.fs_errno`: an OSError, the
    `SafetensorError` of safetensors' writer behind save_pretrained, torch.save's RuntimeError), so every
    writer of every stage ends here in one sentence: the path, the problem, the fix. The fix names the key
    that placed the run directory as the user set it (`run_dir` or `runs_root`, `config.run_dir_key`) when
    the path is inside it."""
    import errno
    from pathlib import Path

    from pipeline.core.config import run_dir_key
    from pipeline.core.errors import DiskFullError, SpecquantError, as_os_error

    if isinstance(exc, SpecquantError) and not isinstance(exc, DiskFullError):
        return str(exc)
    oserr = as_os_error(exc)
    if oserr is None:
        if isinstance(exc, OSError):  # one without an errno: its own words
            return f"`{name}` stopped on a file-system error ({exc}); fix it and run the stage again."
        return None
    code = oserr.errno
    where = Path(os.path.abspath(str(getattr(oserr, "path", None) or oserr.filename or cfg.run_dir)))
    run_dir = Path(os.path.abspath(str(cfg.run_dir)))
    inside = where == run_dir or run_dir in where.parents
    key = run_dir_key(cfg)
    move = f"point {key} at" if inside else f"write {where} on"
    fix = {errno.ENOSPC: f"free space there or {move} a larger disk",
           errno.EDQUOT: f"free space within your quota or {move} another disk",
           errno.EFBIG: f"raise the file-size limit (ulimit -f) or {move} a file system that allows larger files",
           errno.EROFS: f"{move} a writable file system",
           errno.EACCES: f"fix the permissions or {'point ' + key + ' elsewhere' if inside else 'use another path'}",
           errno.ENOENT: "restore the missing file (or re-download the checkpoint) and run the stage again"}
    if code in {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}:
        return (f"`{name}`: no space left to write {where} ({os.strerror(code)}); {fix[code]}, then run the same "
                "command again (finished files are kept, no partial output is).")
    verb = "write" if code == errno.EROFS else "use"
    return (f"`{name}` could not {verb} {where}: {os.strerror(code)}; "
            f"{fix.get(code, 'fix the file system problem and run the stage again')} (no partial output is kept).")


# stages whose configured torch device must exist (serve-check runs vLLM in its own interpreter)
_DEVICE_FIELDS = {"cache": ("target.device",), "quantize-drafter": ("quant.device",),
                  "quantize-target": ("target_quant.device",), "evaluate": ("target.device",)}


def _check_devices(stage: str, cfg) -> None:
    """A CUDA device configured on a machine without one: one sentence, before anything loads."""
    from omegaconf import OmegaConf

    from pipeline.core.errors import bad_value

    wanted = [(f, str(OmegaConf.select(cfg, f))) for f in _DEVICE_FIELDS.get(stage, ())]
    cuda = [(f, v) for f, v in wanted if v.startswith("cuda")]
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        field, value = cuda[0]
        raise bad_value(field, value, "this machine has no CUDA device (torch sees none)",
                        f"set {field}=cpu" + (" or auto" if field.endswith("quant.device") else ""))


if __name__ == "__main__":
    sys.exit(main())
