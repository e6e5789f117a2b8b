"""Quiet output and nothing left behind (issue 21): filtered third-party warnings stay filtered, written
files are 0644 and folders 0755, evaluation prompts leave no `datasets` cache, and the console script
runs from any directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests._support import DRAFTER, REPO, TARGET, copy_world, run_cli

# the lines pipeline.core.quiet mutes at their source (pipeline/quant/calibrate.py, export.py, stage.py)
FILTERED = ("No accelerator available!", "Attempted to calibrate a module",
            "Attempting to save a model with offloaded modules", "but it is recommended to use")


def _modes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix() or ".": oct(stat.S_IMODE(p.stat().st_mode))
            for p in [root, *root.rglob("*")]}


@pytest.mark.slow
def test_quantize_drafter_cli_is_quiet_and_writes_uniform_modes(fixture_world, tmp_path):
    from pipeline.core.io import _DIR_MODE, _FILE_MODE

    run_dir = copy_world(fixture_world, tmp_path) / "qw"
    r = run_cli("quantize-drafter", f"runs_root={tmp_path}", "run_name=qw", f"target.path={TARGET}",
                f"target.tokenizer={TARGET}", f"drafter.path={DRAFTER}", "drafter.format=speculators",
                "quant=nvfp4-nocalib", "quant.num_samples=4", "quant.heldout_samples=4",
                "quant.anchors_per_sequence=4", "quant.max_seq_len=64", "quant.rounding_band_factors=[]",
                timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    both = r.stdout + r.stderr  # llm-compressor logs to stdout, Python warnings go to stderr
    assert not [w for w in FILTERED if w in both], both[-3000:]
    assert "calibration-free variant: no activation statistics by design" in r.stdout
    out = run_dir / "drafter" / "nvfp4-nocalib"
    modes = _modes(out)
    assert modes["model.safetensors"] == oct(_FILE_MODE)  # safetensors' save_file alone writes 0600
    assert {m for p, m in modes.items() if (out / p).is_file()} == {oct(_FILE_MODE)}, modes
    assert {m for p, m in modes.items() if (out / p).is_dir()} == {oct(_DIR_MODE)}, modes
    umask = os.umask(0)
    os.umask(umask)
    if umask == 0o022:  # the usual umask: the modes the issue asks for
        assert (_FILE_MODE, _DIR_MODE) == (0o644, 0o755)


def test_atomic_dir_gives_every_file_and_folder_the_plain_mode(tmp_path):
    import torch
    from safetensors.torch import save_file

    from pipeline.core.io import _DIR_MODE, _FILE_MODE, atomic_dir

    final = tmp_path / "ckpt"
    with atomic_dir(final) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # 0600, as transformers' save leaves it
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "x.json").write_text("{}")
        os.chmod(tmp / "sub" / "x.json", 0o600)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o700)
    modes = _modes(final)
    assert modes == {".": oct(_DIR_MODE), "model.safetensors": oct(_FILE_MODE), "sub": oct(_DIR_MODE),
                     "sub/x.json": oct(_FILE_MODE), "run.sh": oct(_DIR_MODE)}  # executables stay executable


def test_prompt_sets_leave_no_datasets_cache_anywhere(tmp_path):
    """evaluate's prompt loading: `datasets` writes its Arrow tables to <run_dir>/.work/hf-datasets/<pid>
    and that folder is gone afterwards; nothing appears under $HOME (~/.cache/huggingface/datasets)."""
    home, runs = tmp_path / "home", tmp_path / "runs"
    home.mkdir()
    code = ("from transformers import AutoTokenizer\n"
            "from pipeline.core.config import compose\n"
            "from pipeline.evaluation.prompts import load_prompt_sets\n"
            f"cfg = compose(['runs_root={runs}', 'run_name=p', 'eval.limit=2'])\n"
            "subsets = load_prompt_sets(cfg.eval, AutoTokenizer.from_pretrained(cfg.target.tokenizer))\n"
            "assert [len(s.prompts) for s in subsets] == [2, 2, 2]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HOME", "HF_DATASETS_CACHE", "XDG_"))}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "HOME": str(home)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [p for p in home.rglob("*") if "datasets" in p.as_posix()], sorted(home.rglob("*"))
    assert not [p for p in runs.rglob("*") if p.is_file()], sorted(runs.rglob("*"))


@pytest.mark.slow
def test_console_script_runs_from_any_directory(tmp_path):
    script = Path(sys.executable).with_name("specquant")
    assert script.is_file(), "the console script is installed by `make setup` (pip install -e .)"
    help_ = subprocess.run([str(script), "data", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "data.num_samples" in help_.stdout, help_.stderr
    r = subprocess.run([str(script), "data", "run_name=anywhere", "data.num_samples=12"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "runs" / "anywhere" / "data" / "samples.jsonl").is_file()  # runs_root: the working dir
    assert not (REPO / "runs" / "anywhere").exists()


def test_repro_check_judges_its_private_home_and_tmpdir_naming_what_is_left(tmp_path, monkeypatch):
    """repro-check's leftover rule: the stages run with a HOME and TMPDIR of the check's own (`private_env`:
    new, empty, the per-user cache variables moved there); any file left there is a failure named in one
    sentence, except NOT_OURS' per-user caches. (tests/test_repro_isolation.py runs a real reduced check.)"""
    from tests import repro

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "elsewhere"))
    (tmp_path / "w" / "env" / "tmp").mkdir(parents=True)
    (tmp_path / "w" / "env" / "tmp" / "from-an-earlier-check").write_text("x")
    env, (home, tmp) = repro.private_env(tmp_path / "w")
    assert (env["HOME"], env["TMPDIR"], env["TMP"], env["TEMP"]) == (str(home), str(tmp), str(tmp), str(tmp))
    assert env["HF_HOME"].startswith(str(home)) and "XDG_CACHE_HOME" not in env and "MPLCONFIGDIR" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONHASHSEED"] == "0"
    assert repro.files_left([home, tmp]) == []  # made empty: an earlier check's files are not this one's
    for d in (home / ".cache" / "matplotlib", home / ".cache" / "huggingface" / "datasets" / "json",
              tmp / "torchelastic_abc"):
        d.mkdir(parents=True)
    for p in (home / ".cache" / "matplotlib" / "fontlist-v390.json", tmp / "torchelastic_abc" / "error.json",
              home / ".cache" / "huggingface" / "datasets" / "json" / "default-1.arrow"):
        p.write_text("x")
    found = repro.files_left([home, tmp])
    assert found == [str((home / ".cache/huggingface/datasets/json/default-1.arrow").resolve()),
                     str((tmp / "torchelastic_abc/error.json").resolve())]
    sentence = repro.leftover_sentence(found)
    assert sentence.startswith("repro-check: FAILED: 2 file(s) were left in the stages' private HOME or TMPDIR (")
    assert all(f in sentence for f in found) and "\n" not in sentence and sentence.count(". ") == 0
    assert repro.leftover_sentence([]) is None
    assert all(why.strip() for why in repro.NOT_OURS.values())  # every exclusion says why


def test_data_stage_hub_source_leaves_no_datasets_cache_anywhere(tmp_path):
    """data's Hub code path (datasets.load_dataset with an id and split): the Arrow tables and lock files go
    to <run_dir>/.work/hf-datasets/<pid>, gone afterwards; nothing under $HOME, nothing left in .work/."""
    import shutil

    home, runs, hub_like = tmp_path / "home", tmp_path / "runs", tmp_path / "hub_like"
    home.mkdir()
    hub_like.mkdir()
    shutil.copyfile(REPO / "assets" / "tiny" / "corpus" / "chat.jsonl", hub_like / "train.jsonl")
    code = ("from pipeline.core.config import DataSource, compose\n"
            "from pipeline.stages import data\n"
            f"cfg = compose(['runs_root={runs}', 'run_name=h', 'data.num_samples=12'])\n"
            f"cfg.data.sources = [DataSource(name='chat', hub_id='{hub_like}', split='train', format='sharegpt')]\n"
            "data.run(cfg)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HOME", "HF_DATASETS_CACHE", "XDG_"))}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "HOME": str(home)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (runs / "h" / "data" / "samples.jsonl").is_file()
    assert not [p for p in home.rglob("*") if "datasets" in p.as_posix()], sorted(home.rglob("*"))
    assert not (runs / "h" / ".work" / "hf-datasets").exists(), sorted((runs / "h" / ".work").rglob("*"))
