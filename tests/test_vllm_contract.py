"""What vLLM reads from our drafter checkpoints, checked on CPU (the rules per vLLM range: test_vllm_profiles.py).

Every rule is pinned to vLLM 0.26.0 source lines in `pipeline/serving/contract.py`:
`qwen3_dflash.py:392/:669-670` (draft layer i is `model.layers.{i+T}`), `:185` (q/k/v fused as
`qkv_proj`), `:354` (the quant config inside `transformer_layer_config`), `compressed_tensors/utils.py:
50-103, 175-192` (ignore matching: exact or `re:` + re.match, fused shards must agree), `:441` (dense
qkv_proj for the context-KV precompute), `configs/speculators/algos.py:124-125` (causal = not
sliding_window_non_causal, for every layer), `transformers_utils/config.py:682-683` (verifier path
taken verbatim). The checkpoints are written by the real quantize-drafter stage on the fixture world;
every size (layers, target layers) is read from the fixture.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.core.errors import SpecquantError
from pipeline.core.io import read_json
from pipeline.quant import recipes
from pipeline.serving import contract
from pipeline.stages import quantize_drafter
from tests import warm
from tests._support import DRAFTER, REPO, TARGET, copy_world, run_main, w4a16_group, world_cfg

T = int(read_json(TARGET / "config.json", "target")["num_hidden_layers"])
_TLC = read_json(DRAFTER / "config.json", "drafter")["transformer_layer_config"]
LAYERS = int(_TLC["num_hidden_layers"])
W4_GROUP = w4a16_group()  # divides every quantized width of the fixture drafter


@pytest.fixture(scope="module")
def world(quantized_world, tmp_path_factory):
    """A private copy of the session's fixture world with every scheme quantize-drafter writes (conftest)."""
    return copy_world(quantized_world[0], tmp_path_factory.mktemp("vworld"))


@pytest.fixture(scope="module")
def written(world, quantized_world):
    """Every scheme quantize-drafter writes (nvfp4, nvfp4a16, w4a16): its stage result."""
    return quantized_world[1]


def _dir(world, variant):
    return world / "qw" / "drafter" / variant


@pytest.mark.parametrize("variant", ["nvfp4", "nvfp4a16", "w4a16", "bf16"])
def test_vllm_builds_every_layer_as_the_checkpoint_stores_it(world, written, variant):
    assert contract.check_dir(_dir(world, variant), T) == []


@pytest.mark.parametrize("variant", ["nvfp4", "w4a16"])
def test_the_default_patterns_hold_for_any_number_of_target_layers(world, written, variant):
    config = read_json(_dir(world, variant) / "config.json", "config")
    assert recipes.QKV_IGNORE in config["transformer_layer_config"]["quantization_config"]["ignore"]
    for n_target in (0, T, 36, 80):
        assert contract.check_dir(_dir(world, variant), n_target) == [], n_target


def test_qkv_dense_fc_and_mlp_quantized_under_vllm_names(world, written):
    config = read_json(_dir(world, "nvfp4") / "config.json", "config")
    inner = config["transformer_layer_config"]["quantization_config"]
    assert config["quantization_config"] == inner  # the top-level copy is identical
    ignore = inner["ignore"]
    for i in range(LAYERS):
        p = f"model.layers.{i + T}"
        assert contract.vllm_ignores(f"{p}.self_attn.qkv_proj", ignore)  # fused name, and ...
        assert all(contract.vllm_ignores(f"layers.{i}.self_attn.{s}_proj", ignore) for s in "qkv")  # ... HF names
        for name in (f"{p}.self_attn.o_proj", f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"):
            assert not contract.vllm_ignores(name, ignore), name
    assert not contract.vllm_ignores("model.fc", ignore)


@pytest.mark.parametrize("variant", ["nvfp4", "nvfp4a16", "w4a16"])
def test_compressed_tensors_own_ignore_list_is_what_vllm_cannot_read(world, written, variant):
    """The list compressed-tensors writes (the checkpoints of 7fc1f49 shipped it): HF names that match nothing
    in vLLM, so vLLM builds quantized qkv_proj layers over dense q/k/v tensors (`linear.py:1342`)."""
    native = written[variant]["ignore_compressed_tensors"]
    assert any(e.startswith("layers.0.self_attn.") for e in native)
    config = read_json(_dir(world, variant) / "config.json", "config")
    for qc in (config["quantization_config"], config["transformer_layer_config"]["quantization_config"]):
        qc["ignore"] = native
    config["sliding_window_non_causal"] = False
    config["speculators_config"]["verifier"]["name_or_path"] = "../target"
    from safetensors import safe_open

    with safe_open(str(_dir(world, variant) / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
    problems = contract.checkpoint_problems(config, names, T, "0.26")  # measured in vLLM 0.26.0
    assert any(f"model.layers.{T}.self_attn.qkv_proj: the checkpoint stores it dense but vLLM 0.26.0 builds it quantized"
               in p for p in problems), problems
    assert any("sliding_window_non_causal" in p for p in problems)
    assert any("verifier.name_or_path" in p for p in problems)


def test_non_causal_flag_and_verifier_path(world, written):
    for variant in ("bf16", "nvfp4", "w4a16"):
        config = read_json(_dir(world, variant) / "config.json", "config")
        assert config["sliding_window_non_causal"] is True
        # the configured target path, exactly as configured (no `../target` relative to the drafter folder)
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(TARGET)


def test_verifier_is_the_hub_id_when_one_is_configured(world):
    cfg = world_cfg(world, "quant=w4a16", f"quant.group_size={W4_GROUP}", "publish.target_model=Qwen/Qwen3-8B")
    assert quantize_drafter.drafter_config(cfg).verifier_name_or_path == "Qwen/Qwen3-8B"


def test_the_shipped_tiny_drafter_names_its_target_from_the_checkout_root():
    config = read_json(REPO / "assets" / "tiny" / "drafter" / "config.json", "config")
    assert config["sliding_window_non_causal"] is True
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    assert (REPO / verifier / "config.json").is_file() and not verifier.startswith("..")


def test_a_user_ignore_entry_is_written_under_both_names(world):
    quantize_drafter.run(world_cfg(world, "quant=w4a16", "quant.name=w4a16-keep-down0", f"quant.group_size={W4_GROUP}",
                                   "quant.ignore=[layers.0.mlp.down_proj,fc]"))
    path = _dir(world, "w4a16-keep-down0")
    ignore = read_json(path / "config.json", "config")["transformer_layer_config"]["quantization_config"]["ignore"]
    assert f"model.layers.{T}.mlp.down_proj" in ignore and "model.fc" in ignore
    assert contract.vllm_ignores(f"model.layers.{T}.mlp.down_proj", ignore)
    assert contract.check_dir(path, T) == []


def test_half_of_a_fused_pair_is_refused_before_any_work(world):
    with pytest.raises(SpecquantError, match=r"quant\.ignore.*vLLM fuses gate_proj, up_proj"):
        quantize_drafter.validate(world_cfg(world, "quant=w4a16", f"quant.group_size={W4_GROUP}",
                                            "quant.ignore=[layers.0.mlp.gate_proj]"))


def test_vllm_refuses_fused_shards_that_disagree():
    with pytest.raises(ValueError, match="not all dense or all quantized"):
        contract.vllm_ignores("model.layers.7.mlp.gate_up_proj", ["model.layers.7.mlp.gate_proj"])


def test_a_drafter_with_sliding_window_layers_is_refused():
    from pipeline.models import formats

    cfg = formats.load_drafter_config(DRAFTER)
    cfg.layer_types = ["sliding_attention"] + ["full_attention"] * (cfg.num_hidden_layers - 1)
    with pytest.raises(SpecquantError, match=r"drafter\.layer_types.*sliding-window"):
        formats.speculators_config_dict(cfg)


def test_generated_serving_commands_say_dflash_block_and_backend(world, written):
    from pipeline.provenance import record as provenance
    from pipeline.serving import command

    k = int(read_json(DRAFTER / "config.json", "d")["block_size"]) - 1
    sh = provenance.vllm_serve_sh({"path": str(TARGET)}, {"nvfp4": (k, True)})
    card = command.serve_command("Qwen/Qwen3-8B", "me/drafter", k, True)
    for text in (sh, card):
        assert '"method":"dflash"' in text and f'"num_speculative_tokens":{k}' in text
        assert "--attention-backend FLASH_ATTN" in text
        assert '"quantization":"compressed-tensors"' in text  # the draft's own config, as eval/vllm_commands.sh
    assert "quantization" not in command.serve_command("Qwen/Qwen3-8B", "me/drafter", k, quantized=False)


def test_serve_check_without_gpu_or_vllm_says_so_and_writes_nothing(world, written):
    run_dir = world / "qw"
    before = sorted((p.relative_to(run_dir).as_posix(), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    args = ["serve-check", f"runs_root={world}", "run_name=qw", f"target.path={TARGET}",
            f"target.tokenizer={TARGET}", f"drafter.path={DRAFTER}"]
    # the entry point in this process (tests/_support.run_main); the probe of serve.python is a real process
    rc, _, err = run_main(*args, env={"SPECQUANT_VLLM_PYTHON": ""})
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: `serve.python`")
    rc, _, err = run_main(*args, "serve.python=/definitely/not/python")
    assert rc == 2 and "no such interpreter" in err and err.count("\n") == 1, err
    import sys

    # an interpreter without vLLM (this one): one sentence naming the field
    rc, _, err = run_main(*args, f"serve.python={sys.executable}")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "cannot import vLLM" in err or "no CUDA GPU" in err
    after = sorted((p.relative_to(run_dir).as_posix(), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    assert after == before
    assert json.dumps(after).count("serve_check") == 0


def test_a_cuda_device_on_a_machine_without_one_is_one_sentence(world, written):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    rc, _, err = run_main("quantize-drafter", f"runs_root={world}", "run_name=qw", f"target.path={TARGET}",
                          f"target.tokenizer={TARGET}", f"drafter.path={DRAFTER}", "quant=w4a16", "quant.device=cuda")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: `quant.device` = 'cuda': this machine has no CUDA device")


def test_ctrl_c_is_one_sentence_and_exit_130(world):
    # the tiny world (its target has a chat template), in a run directory of its own
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    # as from a terminal: a shell without job control starts background commands with SIGINT ignored, and a
    # Python started that way keeps ignoring it (no KeyboardInterrupt to turn into the sentence)
    proc = warm.popen([sys.executable, "-m", "pipeline", "evaluate", f"runs_root={world / 'ctrl-c'}"],
                      cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, sigint_default=True)
    chunks: list[bytes] = []

    def read():
        while data := os.read(proc.stderr.fileno(), 4096):
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + 120
    while b"target only:" not in b"".join(chunks) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)  # until the evaluation loop runs (its first progress bar), however fast the machine
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    # (a progress bar may end without a newline, so the sentence can follow its carriage return)
    assert err.count("error:") == 1 and (
        "error: `evaluate` was interrupted (Ctrl-C); nothing half-written is kept: the next run of the "
        "stage removes its partial files and starts that work again.") in err
