"""`python -m pipeline <stage> --help`: a stage's purpose, its conf groups, every key, how to override.

Nothing heavy is imported: the purpose is the first paragraph of the stage module's docstring (read
with `ast`, the module is not imported), the keys and types come from the dataclass schemas in
`pipeline/core/config.py`, each key's one-line description from the comment beside (or the comment
block just above) its field there, and the values from composing `conf/` with the overrides given
before `--help`, so `quant=w4a16 --help` shows what that command would run with.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.core import config as schema

# the conf groups each stage reads (besides the top-level keys, which every stage reads)
STAGE_GROUPS: dict[str, tuple[str, ...]] = {
    "data": ("data", "target"),
    "cache": ("cache", "target", "drafter"),
    "quantize-drafter": ("quant", "drafter", "target"),
    "quantize-target": ("target_quant", "target"),
    "manifest": (),
    "evaluate": ("eval", "target", "drafter"),
    "serve-check": ("serve", "eval", "target", "drafter"),
    "publish": ("publish", "drafter", "target"),
}
_TOP_LEVEL = ("run_name", "seed", "runs_root", "run_dir")
_WIDTH = 100


def purpose(module: str) -> str:
    """The first paragraph of `module`'s docstring, on one line, without importing the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return ""
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


@cache
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its description} from `cls`'s source: the block of full-line comments just above
    the field and the comment at the end of its line, joined into one line."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            if lines[row - 1][:col].strip():  # code before it on the same line
                trailing[row] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for i, line in enumerate(lines, start=1):
        head = line.strip().split(":", 1)[0]
        if line.startswith("    ") and not line.startswith("     ") and head in names and head not in out:
            block, j = [], i - 2
            while j >= 0 and lines[j].strip().startswith("#"):
                block.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            out[head] = " - ".join(t for t in (" ".join(block), trailing.get(i, "")) if t)
    return out


def _type_name(hint: Any) -> str:
    if dataclasses.is_dataclass(hint):
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")


def _value(value: Any) -> str:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def keys(cls: type, node: Any, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, value, description) for every field of `cls`; list-of-dataclass fields also list
    their items' keys as `<key>[i].<field>`."""
    from omegaconf import OmegaConf

    hints = typing.get_type_hints(cls)
    notes = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if node is None or f.name not in node:
            shown = "-"  # list items: each preset lists its own
        elif OmegaConf.is_missing(node, f.name):
            shown = "??? (required)"
        else:
            try:
                shown = _value(node[f.name])
            except Exception:  # noqa: BLE001 - an interpolation that cannot resolve yet: show it as written
                shown = _value(OmegaConf.to_container(node, resolve=False)[f.name])
        rows.append((f"{prefix}{f.name}", _type_name(hint), shown, notes.get(f.name, "")))
        args = typing.get_args(hint)
        if args and dataclasses.is_dataclass(args[0]):
            rows += keys(args[0], None, f"{prefix}{f.name}[i].")
    return rows


def presets(group: str) -> list[str]:
    folder = Path(schema.CONF_DIR) / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _compose(overrides: list[str]):
    """(cfg, {group: chosen preset}) as `python -m pipeline` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(schema.CONF_DIR).resolve()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    GlobalHydra.instance().clear()
    return cfg, choices


def _example_key(cfg, groups: tuple[str, ...]) -> str:
    """`<group>.<its first int key>=<value + 1>`, or `seed=1` for a stage without groups."""
    hints = typing.get_type_hints(schema.SpecquantConfig)
    for g in groups:
        for f in dataclasses.fields(hints[g]):
            if typing.get_type_hints(hints[g])[f.name] is int:
                return f"{g}.{f.name}={int(cfg[g][f.name]) // 2 or 1}"
    return "seed=1"


def _example_preset(choices: dict[str, str], groups: tuple[str, ...]) -> str:
    for g in groups:
        other = [p for p in presets(g) if p != choices.get(g)]
        if other:
            return f"{g}={other[0]}"
    return "experiment=tiny"


def output_line(stage: str, cfg) -> str | None:
    """Where the stage writes its named folder and how that name is derived, on one line (the name may
    differ from the key's value: pipeline.core.config.derive_names appends `-on-<target>`)."""
    from omegaconf import OmegaConf

    def value(key: str, default: str) -> str:
        try:
            found = OmegaConf.select(cfg, key, throw_on_missing=True)
        except Exception:  # noqa: BLE001 - unset (???) or an interpolation that cannot resolve: the placeholder
            return default
        return default if found is None else str(found)

    run_dir = value("run_dir", "runs/<run_name>")
    if stage == "quantize-drafter":
        names = OmegaConf.create({"quant": {"name": value("quant.name", "<quant.name>"),
                                            "calibration_target": value("quant.calibration_target", "bf16")}})
        schema.derive_names(names)  # the rule itself, not a copy of it
        return (f"output: {run_dir}/drafter/{names.quant.name}/ (the folder is quant.name, plus "
                f"`{schema.PAIR_SUFFIX}<quant.calibration_target>` when that is not bf16)")
    if stage == "quantize-target":
        return f"output: {run_dir}/target/{value('target_quant.name', '<target_quant.name>')}/ (the folder is target_quant.name)"
    if stage == "cache":
        target = value("cache.target", "bf16")
        return (f"output: {run_dir}/{'cache' if target == 'bf16' else 'cache-' + target}/ (cache/ for cache.target=bf16, "
                "else cache-<cache.target>/)")
    return None


def render(stage: str, module: str, overrides: list[str]) -> str:
    cfg, choices = _compose(overrides)
    groups = STAGE_GROUPS.get(stage, ())
    hints = typing.get_type_hints(schema.SpecquantConfig)
    out = [f"usage: python -m pipeline {stage} [-m] [key=value ...] [group=preset ...]", "", purpose(module), "",
           "-m: every comma-separated value is a job of its own, run one after the other in this one process "
           "(e.g. -m quant=nvfp4,w4a16)", ""]
    if groups:
        out.append("conf groups: " + ", ".join(f"{g} (conf/{g}/, now {choices.get(g, '-')})" for g in groups))
    else:
        out.append("conf groups: none of its own (it reads what the earlier stages wrote)")
    if (line := output_line(stage, cfg)) is not None:
        out.append(line)
    out += ["", "keys (type, value as composed now, description; from pipeline/core/config.py):"]
    sections = [("top level:", [r for r in keys(schema.SpecquantConfig, cfg, "") if r[0] in _TOP_LEVEL])]
    sections += [(f"{g}:", keys(hints[g], cfg[g], f"{g}.")) for g in groups]
    for title, rows in sections:
        out.append(f"  {title}")
        width = max(len(k) for k, *_ in rows) + 2
        for key, typ, value, note in rows:
            out.append(f"    {key:<{width}}{typ} = {value}")
            if note:
                out += textwrap.wrap(note, _WIDTH, initial_indent=" " * 8, subsequent_indent=" " * 8)
    out += ["", "override:",
            f"  key=value        one key, e.g. `run_name=my-run` or `{_example_key(cfg, groups)}`",
            f"  group=preset     a whole group from conf/<group>/<preset>.yaml, e.g. `{_example_preset(choices, groups)}`",
            "  experiment=NAME  a bundled recipe that sets several groups at once",
            "  presets:"]
    for g in (*groups, "experiment"):
        names = [f"{p} (now)" if p == choices.get(g) else p for p in presets(g)]
        out += textwrap.wrap(", ".join(names), _WIDTH, initial_indent=f"    {g + ':':<14}",
                             subsequent_indent=" " * 18)
    out.append("  through make: make " + stage + ' ARGS="key=value group=preset"')
    return "\n".join(out) + "\n"


def main(stage: str, module: str, overrides: list[str]) -> int:
    """Print the stage's help; a bad override given with it fails in one line, as a run would."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        text = render(stage, module, overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        print(f"error: invalid configuration: {str(exc).splitlines()[0]} (check the overrides given with "
              "--help)", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
