"""A Hub id that is not on this machine is refused in its own sentence, with the `hf download` that fetches it;
a wrong path and a directory without config.json each keep theirs. Nothing is downloaded (HF_HUB_OFFLINE)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from huggingface_hub import constants

from pipeline.core.config import PROJECT_ROOT
from pipeline.core.errors import SpecquantError
from pipeline.models.layout import light_config as load_drafter_config
from tests._support import ENV, hub_cache

DRAFTER = PROJECT_ROOT / "assets" / "tiny" / "drafter"


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_drafter_id_not_in_the_cache_names_the_download(empty_hub_cache):
    with pytest.raises(SpecquantError) as err:
        load_drafter_config("z-lab/Qwen3-8B-DFlash-b16")
    msg = str(err.value)
    assert msg.startswith("`drafter.path` = 'z-lab/Qwen3-8B-DFlash-b16': it is not in the local Hugging Face cache")
    assert "download it with `hf download z-lab/Qwen3-8B-DFlash-b16 --local-dir downloads/Qwen3-8B-DFlash-b16`" in msg
    assert "drafter.path=downloads/Qwen3-8B-DFlash-b16" in msg and "config.json" not in msg


def test_a_wrong_path_and_a_dir_without_config_each_keep_their_sentence(tmp_path, empty_hub_cache):
    with pytest.raises(SpecquantError, match=r"`drafter.path` = '.*/nope': no such directory; point it at"):
        load_drafter_config(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecquantError, match=r"`drafter.path` = '.*/empty': it has no config.json; point it at"):
        load_drafter_config(str(tmp_path / "empty"))


def test_a_cached_drafter_id_points_at_its_snapshot(tmp_path, monkeypatch):
    root = hub_cache(tmp_path / "hub", "org/tiny-drafter", DRAFTER)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    with pytest.raises(SpecquantError) as err:
        load_drafter_config("org/tiny-drafter")
    snapshot = next((root / "models--org--tiny-drafter" / "snapshots").iterdir())
    assert f"set drafter.path={snapshot}" in str(err.value)
    assert load_drafter_config(str(snapshot)).block_size == load_drafter_config(DRAFTER).block_size  # and it loads


def test_the_cache_stage_says_it_in_one_line(tmp_path):
    """Through the entry point, as a user meets it: one line, exit 2, no traceback, nothing fetched."""
    env = {**ENV, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    def stage(name, *args):
        return subprocess.run([sys.executable, "-m", "pipeline", name, f"runs_root={tmp_path / 'runs'}", *args],
                              capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=300)

    assert stage("data").returncode == 0
    out = stage("cache", "drafter.path=z-lab/Qwen3-8B-DFlash-b16")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "not in the local Hugging Face cache" in out.stderr and "hf download z-lab/Qwen3-8B-DFlash-b16" in out.stderr


@pytest.mark.parametrize("where", ["downloads", "hub-id"])
def test_a_target_not_downloaded_names_the_download_before_any_work(where, tmp_path, empty_hub_cache):
    """The quickstart's first stage with nothing downloaded: the target's sentence names the `hf download` to run
    (the experiment's Hub id and pinned revision, into the configured directory or the Hub cache)."""
    from pipeline.core.config import compose
    from tests._support import run_main

    ov = ["experiment=qwen3-8b-dflash-nvfp4", f"runs_root={tmp_path / 'runs'}"]
    if where == "downloads":
        ov.append(f"target.path={tmp_path / 'downloads' / 'Qwen3-8B'}")
    cfg = compose(ov)
    rc, _, err = run_main("data", *ov, env={"HF_HUB_CACHE": str(empty_hub_cache)})
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"`target.path` = '{cfg.target.path}': there is no such directory, and no Hub repo" in err
    local = f" --local-dir {cfg.target.path}" if where == "downloads" else ""
    assert f"`hf download {cfg.publish.target_model} --revision {cfg.target.revision}{local}`" in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything is written


def test_a_downloads_directory_not_yet_made_is_named_as_one(tmp_path, monkeypatch):
    """The quickstart points drafter.path at downloads/<name> before the download: the sentence says to download
    into that directory, never `hf download downloads/...` as if it were a Hub id."""
    from pipeline.models.layout import not_local

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecquantError) as e:
        not_local("downloads/Qwen3-8B-DFlash-b16")
    msg = str(e.value)
    assert msg.startswith("`drafter.path` = 'downloads/Qwen3-8B-DFlash-b16': no such directory")
    assert "--local-dir downloads/Qwen3-8B-DFlash-b16" in msg and "hf download downloads/" not in msg
