"""`make help` and `python -m pipeline <stage> --help` (issue 21): every target, every key, the presets."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest

from tests._support import REPO, run_cli


def _make_targets() -> list[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*):(?!=)", text, flags=re.M)]


def test_make_help_lists_every_target_and_make_alone_is_still_setup():
    targets = _make_targets()
    assert targets[0] == "setup"  # `make` with no target: unchanged by the help target
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(set(targets)), f"make help and the Makefile disagree: {listed} vs {targets}"
    assert all(len(line.split(None, 1)) == 2 for line in out.stdout.splitlines() if line.startswith("  "))


def test_every_config_key_has_a_description():
    from pipeline.core import config
    from pipeline.help import field_comments

    classes = [c for c in vars(config).values() if dataclasses.is_dataclass(c) and c.__module__ == config.__name__]
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)
               if not field_comments(c).get(f.name) and not dataclasses.is_dataclass(f.type)
               and f.name not in {"target", "drafter", "data", "cache", "quant", "target_quant", "eval",
                                  "publish", "serve"}]
    assert not missing, f"add a trailing comment in pipeline/core/config.py for {missing}"


def test_stage_help_prints_purpose_keys_types_values_and_presets(capsys):
    from pipeline.__main__ import main
    from pipeline.core.config import QuantConfig

    assert main(["quantize-drafter", "--help"]) == 0
    out = capsys.readouterr().out
    assert "quantize-drafter: a DFlash drafter calibrated on the target's cached hidden states." in out
    for f in dataclasses.fields(QuantConfig):
        assert re.search(rf"^    quant\.{f.name} +\S", out, flags=re.M), f.name
    assert "quant.num_samples                   int = 48" in out  # the tiny experiment's value
    assert "cached samples used for calibration" in out  # the field's comment
    for preset in ("nvfp4-nocalib", "w4a16-gptq", "qwen3-8b-dflash-nvfp4"):
        assert preset in out
    assert "key=value" in out and "group=preset" in out and "nvfp4 (now)" in out


@pytest.mark.parametrize("argv", [["cache", "-h", "cache.batch_tokens=123"], ["help", "cache", "cache.batch_tokens=123"]])
def test_help_forms_and_overrides_shape_the_values(capsys, argv):
    from pipeline.__main__ import main

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^    cache\.batch_tokens +int = 123$", out, flags=re.M)
    assert "conf groups: cache (conf/cache/, now default), target" in out


def test_help_through_the_cli_is_not_a_hydra_override():
    r = run_cli("evaluate", "--help", timeout=120)
    assert r.returncode == 0 and "LexerNoViableAltException" not in r.stderr, r.stderr
    assert r.stdout.startswith("usage: python -m pipeline evaluate") and "eval.max_new_tokens" in r.stdout
    bad = run_cli("evaluate", "--help", "eval=nope", timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


@pytest.mark.parametrize("overrides, folder", [([], "drafter/nvfp4/"),
                                               (["quant.calibration_target=nvfp4"], "drafter/nvfp4-on-nvfp4/")])
def test_quantize_drafter_help_shows_the_derived_output_folder(capsys, overrides, folder):
    """quant.name is shown as given; the output line shows the folder derive_names makes of it, and the rule."""
    from pipeline.__main__ import main

    assert main(["quantize-drafter", *overrides, "--help"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("output: "))
    assert line == f"output: runs/tiny/{folder} (the folder is quant.name, plus `-on-<quant.calibration_target>` " \
                   "when that is not bf16)", line
    assert re.search(r"^    quant\.name +str = nvfp4$", out, flags=re.M)


def _readme_block(command: str, doc: str = "README.md") -> list[str]:
    """The lines `doc` shows under `$ <command>` (up to the closing fence): the README's Help section, or the
    abridged stage help in docs/quickstart.md."""
    text = (REPO / doc).read_text(encoding="utf-8")
    block = text.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    return [ln for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("... (")]


def test_readme_shows_what_make_help_and_stage_help_print(capsys):
    """The README's `make help` and docs/quickstart.md's `quantize-drafter --help` output is what they print now (an abridged
    stage help: every line it shows is printed, in the same order)."""
    from pipeline.__main__ import main

    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert _readme_block("make help") == [ln for ln in out.splitlines() if ln.strip()]
    assert main(["quantize-drafter", "--help"]) == 0
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in _readme_block("python -m pipeline quantize-drafter --help", "docs/quickstart.md"):
        assert line in printed[at:], f"README shows a line quantize-drafter --help does not print: {line!r}"
        at = printed.index(line, at) + 1
