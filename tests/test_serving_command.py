"""One serving command (issue 37): the model card, `provenance/vllm_serve.sh` and `eval/vllm_commands.sh` of a
run give the same `vllm serve` (pipeline/serving/command.py).

The run: the publish tests' run (`pristine_runs`: the fixture world through cache, quantize-drafter nvfp4,
evaluate and manifest), copied, then manifest and a dry-run publish. Each script is run with a stand-in `vllm` on
PATH that prints its argv, the card's command is split as bash would; the three must agree word for word but for
where the target and the drafter live (Hub ids on the card, the run's paths in the scripts). That the command is
what serve-check ran (the engine settings its worker recorded) is asserted on the served tiny world with vLLM's
CPU build, tests/test_serve_cpu.py. README.md and docs/quickstart.md show the command `command.serve_command`
builds.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests import _support

VARIANT = "nvfp4"  # the variant the run quantizes


@pytest.fixture(scope="module")
def run(pristine_runs, tmp_path_factory) -> dict:
    """The publish tests' run, copied, then manifest and a dry-run publish."""
    from pipeline.stages import publish

    root = tmp_path_factory.mktemp("serving-command") / "runs"
    shutil.copytree(pristine_runs, root, symlinks=True)
    _support.remanifest(root)
    cfg = _support.publish_cfg(root)
    publish.run(cfg)
    rd = root / "tiny"
    record = json.loads((rd / "publish" / f"{VARIANT}.json").read_text(encoding="utf-8"))
    return {"rd": rd, "repo_id": record["repo_id"], "cfg": cfg,
            "card": (rd / "publish" / VARIANT / "README.md").read_text(encoding="utf-8")}


def _card_argv(card: str) -> list[str]:
    lines = [line for line in card.splitlines() if line.startswith("vllm serve ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def _checkpoint(rd: Path, variant: str) -> tuple[int, bool]:
    """(block size - 1, quantized) read from the drafter's own config.json."""
    conf = json.loads((rd / "drafter" / variant / "config.json").read_text(encoding="utf-8"))
    quantized = bool((conf.get("transformer_layer_config") or {}).get("quantization_config"))
    return int(conf["block_size"]) - 1, quantized


def test_card_provenance_and_eval_commands_are_one_command(run, tmp_path):
    rd, cfg = run["rd"], run["cfg"]
    k, quantized = _checkpoint(rd, VARIANT)
    assert quantized
    card = _support.serve_parts(_card_argv(run["card"]))
    prov = _support.serve_parts(_support.vllm_argv(rd / "provenance" / "vllm_serve.sh", VARIANT, tmp_path=tmp_path))
    evals = _support.serve_parts(_support.vllm_argv(rd / "eval" / "vllm_commands.sh", "serve", VARIANT, tmp_path=tmp_path))
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
        _, spec, _ = _support.serve_parts(_support.vllm_argv(script, *args, tmp_path=tmp_path))
        assert "quantization" not in spec and spec["num_speculative_tokens"] == _checkpoint(rd, "bf16")[0]


def test_readme_and_quickstart_show_the_command_the_function_builds():
    from pipeline.core.config import compose
    from pipeline.serving import command

    cfg = compose(["experiment=qwen3-8b-dflash-nvfp4"])
    for doc in ("README.md", "docs/quickstart.md"):
        text = (_support.REPO / doc).read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if re.match(r"vllm serve \S+ --attention-backend", line)]
        assert lines, f"{doc} shows no serving command"
        for line in lines:
            target, spec, _ = _support.serve_parts(shlex.split(line))
            assert target == cfg.publish.target_model
            assert spec["model"].endswith(f"/{cfg.drafter.name}-{VARIANT}"), spec  # publish's repo id rule
            assert line == command.serve_command(target, spec["model"], spec["num_speculative_tokens"], True,
                                                 cfg.target.revision), doc
