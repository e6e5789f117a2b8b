"""The data stage on real tokenizers and files: blend, loss mask, determinism, bad rows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.artifacts import samples as samples_file
from pipeline.core.config import DataSource, compose
from pipeline.core.errors import SpecquantError
from tests._support import REPO, build_chat_tokenizer, run_cli, run_main

CHAT = [{"conversations": [{"from": "human", "value": f"What is {i} + {i}?"},
                           {"from": "gpt", "value": f"The answer is {2 * i}."}]} for i in range(30)]
CODE = [{"messages": [{"role": "system", "content": "You write code."},
                      {"role": "user", "content": f"Write add{i}."},
                      {"role": "assistant", "content": f"def add{i}(a, b):\n    return a + b"},
                      {"role": "user", "content": "Thanks"},
                      {"role": "assistant", "content": "You are welcome."}]} for i in range(30)]


def write_jsonl(path: Path, rows: list, extra_lines: list[bytes] = ()) -> Path:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b"".join(x + b"\n" for x in extra_lines)
    path.write_bytes(data)
    return path


def make_cfg(tmp_path: Path, tok: Path, sources: list[dict], num_samples=40, seed=0, max_seq_len=128):
    cfg = compose([f"runs_root={tmp_path / 'runs'}", f"seed={seed}", f"target.tokenizer={tok}",
                   f"data.num_samples={num_samples}", f"data.max_seq_len={max_seq_len}"])
    cfg.data.sources = [DataSource(**s) for s in sources]
    return cfg


@pytest.fixture()
def sources(tmp_path):
    return [{"name": "chat", "path": str(write_jsonl(tmp_path / "chat.jsonl", CHAT)), "format": "sharegpt"},
            {"name": "code", "path": str(write_jsonl(tmp_path / "code.jsonl", CODE)), "format": "openai",
             "weight": 3.0}]


def test_blend_counts_mask_and_determinism(tmp_path, chat_tokenizer, sources):
    from pipeline.stages import data

    cfg = make_cfg(tmp_path, chat_tokenizer, sources)
    data.run(cfg)
    out = Path(cfg.run_dir) / "data"
    first = (out / "samples.jsonl").read_bytes()
    counts = samples_file.load_counts(out)
    assert counts["chat"].kept == 10 and counts["code"].kept == 30  # weights 1:3 of 40
    samples = samples_file.load_samples(out)
    assert len(samples) == 40 and {s["source"] for s in samples} == {"chat", "code"}

    # the loss mask covers exactly the assistant turns (content + end-of-turn), nothing else
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    s = next(s for s in samples if s["source"] == "code")
    masked = tok.decode([t for t, m in zip(s["input_ids"], s["loss_mask"]) if m])
    assert "return a + b" in masked and "You are welcome." in masked
    assert "Write add" not in masked and "You write code" not in masked and "Thanks" not in masked

    data.run(cfg)  # same config + seed -> byte-identical
    assert (out / "samples.jsonl").read_bytes() == first
    cfg2 = make_cfg(tmp_path / "s1", chat_tokenizer, sources, seed=1)
    data.run(cfg2)
    assert (Path(cfg2.run_dir) / "data" / "samples.jsonl").read_bytes() != first


def test_truncation_keeps_lengths_aligned(tmp_path, chat_tokenizer, sources):
    from pipeline.stages import data

    cfg = make_cfg(tmp_path, chat_tokenizer, sources, max_seq_len=48)
    data.run(cfg)
    for s in samples_file.load_samples(Path(cfg.run_dir) / "data"):
        assert len(s["input_ids"]) == len(s["loss_mask"]) <= 48 and sum(s["loss_mask"]) >= 1


@pytest.mark.faults("bad_input")
def test_malformed_rows_are_counted_with_file_and_line(tmp_path, chat_tokenizer):
    """Malformed JSON, non-UTF-8, missing role, empty/oversized turn, no assistant, unknown format: counted with file:line."""
    bad = [
        b"{not json",
        b"\xff\xfe not utf-8",
        json.dumps({"conversations": [{"value": "no role"}, {"from": "gpt", "value": "x"}]}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "only a question"}]}).encode(),
        json.dumps({"text": "no conversation at all"}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "x" * 5000}, {"from": "gpt", "value": "y"}]}).encode(),
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", CHAT[:5], bad)
    cfg = make_cfg(tmp_path, chat_tokenizer, [{"name": "mixed", "path": str(path)}], num_samples=50)
    cfg.data.max_turn_chars = 1000
    from pipeline.stages import data

    data.run(cfg)
    counts = samples_file.load_counts(Path(cfg.run_dir) / "data")["mixed"]
    assert counts.kept == 5
    assert counts.dropped == {"malformed_json": 1, "not_utf8": 1, "missing_role": 1, "empty_turn": 1,
                                 "no_assistant_turn": 1, "unknown_format": 1, "oversized_turn": 1}
    assert counts.dropped_examples["malformed_json"] == [f"{path}:6"]
    assert counts.dropped_examples["not_utf8"] == [f"{path}:7"]


@pytest.mark.faults("bad_input")
def test_cli_rejects_unusable_source_in_one_line(tmp_path, chat_tokenizer):
    """A source with no usable row: one `error:` line naming data.sources[0], no traceback, nothing written."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"{broken\n\xff\xff\n")
    rc, _, err = run_main("data", f"runs_root={tmp_path}", f"target.tokenizer={chat_tokenizer}",
                          "data.sources=[{name: bad, path: " + str(path) + "}]")  # the entry point, in this process
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "data.sources[0]" in lines[0] and "malformed_json=1" in lines[0]
    assert not (tmp_path / "tiny" / "data" / "samples.jsonl").exists()


@pytest.mark.faults("bad_input")
def test_tokenizer_without_chat_template_is_refused_before_work(tmp_path, sources):
    """A tokenizer without a chat template is refused before any row is read."""
    tok = build_chat_tokenizer(tmp_path / "plain", chat_template=None)
    from pipeline.stages import data

    with pytest.raises(SpecquantError, match=r"`target.tokenizer`.*no chat template"):
        data.run(make_cfg(tmp_path, tok, sources))
    assert not (tmp_path / "runs" / "tiny" / "data").exists()


def test_hub_dataset_path_through_load_dataset(tmp_path, chat_tokenizer):
    """The Hub code path (datasets.load_dataset with id + revision + split) on a local dataset folder."""
    ds_dir = tmp_path / "hub_like"
    ds_dir.mkdir()
    write_jsonl(ds_dir / "train.jsonl", CHAT)
    cfg = make_cfg(tmp_path, chat_tokenizer, [{"name": "pb", "hub_id": str(ds_dir), "revision": None,
                                               "split": "train", "format": "sharegpt"}], num_samples=12)
    from pipeline.stages import data

    data.run(cfg)
    meta = samples_file.load_meta(Path(cfg.run_dir) / "data")
    assert meta.num_samples == 12 and meta.sources[0].hub_id == str(ds_dir)


@pytest.mark.faults("tamper")
def test_tampered_samples_are_refused(tmp_path, chat_tokenizer, sources):
    """A flipped byte in data/samples.jsonl is refused by the reader (hash vs meta.json)."""
    from pipeline.stages import data

    cfg = make_cfg(tmp_path, chat_tokenizer, sources)
    data.run(cfg)
    p = Path(cfg.run_dir) / "data" / "samples.jsonl"
    raw = bytearray(p.read_bytes())
    raw[10] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(SpecquantError, match="does not match meta.json"):
        samples_file.load_samples(p.parent)


@pytest.mark.faults("tamper")
def test_reader_refuses_unknown_version_and_other_keys(tmp_path, chat_tokenizer, sources):
    """meta.json of another format version, or with a renamed key, and a sample line with an alternative key
    name are each refused in one sentence naming the file and the fix."""
    from pipeline.core.io import atomic_write_json, sha256_file
    from pipeline.stages import data

    cfg = make_cfg(tmp_path, chat_tokenizer, sources)
    data.run(cfg)
    out = Path(cfg.run_dir) / "data"
    meta = json.loads((out / "meta.json").read_text())
    atomic_write_json(out / "meta.json", {**meta, "format_version": 2})
    with pytest.raises(SpecquantError) as err:
        samples_file.load_samples(out)
    msg = str(err.value)
    assert msg.startswith(f"`{out / 'meta.json'}:format_version` = 2: this reader knows data format version 1")
    assert msg.endswith("re-run `make data` with this version of specquant.") and "\n" not in msg
    renamed = {**meta, "sha256": meta["samples_sha256"]}
    del renamed["samples_sha256"]
    atomic_write_json(out / "meta.json", renamed)
    with pytest.raises(SpecquantError, match=r"unknown key\(s\) \['sha256'\]; missing key\(s\) \['samples_sha256'\]"):
        samples_file.load_meta(out)
    # a sample with `labels` for `loss_mask`, its hash recorded: refused by key, not by hash
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    rows[0]["labels"] = rows[0].pop("loss_mask")
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_json(out / "meta.json", {**meta, "samples_sha256": sha256_file(out / "samples.jsonl")})
    with pytest.raises(SpecquantError, match=r"samples.jsonl:1` = \['id', 'input_ids', 'labels', 'source'\]"):
        samples_file.load_samples(out)


@pytest.mark.parametrize("override,key", [("seed=abc", "seed"), ("data.num_samples=many", "data.num_samples"),
                                          ("+quant.bogus=1", "quant.bogus"), ("data.max_seq_lenn=3", "data.max_seq_lenn"),
                                          ("quant.name=../escape", "quant.name")])
@pytest.mark.faults("bad_input")
def test_bad_override_fails_fast_with_one_line(override, key):
    """A wrong type or unknown key in an override fails in < 5 s with one line naming the key."""
    t0 = time.time()
    res = run_cli("data", override)
    elapsed = time.time() - t0
    assert res.returncode == 2 and elapsed < 5, (elapsed, res.stderr)
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and key.split(".")[-1] in err[0] and "Traceback" not in res.stderr


def test_config_tree_composes_every_experiment():
    for exp in ("tiny", "qwen3-8b-dflash-nvfp4"):
        cfg = compose([f"experiment={exp}"])
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    real = compose(["experiment=qwen3-8b-dflash-nvfp4"])
    assert real.target.path == "Qwen/Qwen3-8B" and real.drafter.path == "z-lab/Qwen3-8B-DFlash-b16"
    assert real.quant.num_samples == 2027 and real.data.max_seq_len == 2048
    assert real.data.num_samples == 2027 + real.quant.heldout_samples and real.seed == 0
    assert real.quant.scheme == "nvfp4" and real.quant.observer == "nvfp4_expanded_mse"
    assert (REPO / "conf" / "experiment" / "tiny.yaml").is_file()


def test_tokenizer_hash_is_over_its_original_files(tmp_path, chat_tokenizer, sources, monkeypatch):
    """meta.json records the sha256 of the tokenizer's own files (those of TOKENIZER_FILES present; never
    a re-saved copy, nothing in $TMPDIR) and one digest over them; a Hub snapshot gives the same."""
    import shutil
    import tempfile

    from huggingface_hub import constants

    from pipeline.core.io import dumps_json, sha256_bytes, sha256_file
    from pipeline.quant.export import TOKENIZER_FILES
    from pipeline.stages import data
    from tests._support import hub_cache

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmpdir"))  # any temp file would fail
    cfg = make_cfg(tmp_path, chat_tokenizer, sources)
    data.run(cfg)
    tok = json.loads((Path(cfg.run_dir) / "data" / "meta.json").read_text())["tokenizer"]
    on_disk = {n: sha256_file(chat_tokenizer / n) for n in TOKENIZER_FILES if (chat_tokenizer / n).is_file()}
    assert "tokenizer.json" in on_disk and tok["files"] == on_disk
    assert tok["sha256"] == sha256_bytes(dumps_json(on_disk).encode()) == data.tokenizer_sha256(str(chat_tokenizer))
    assert data.tokenizer_hashes(chat_tokenizer) == {"files": on_disk, "sha256": tok["sha256"]}

    edited = tmp_path / "edited"
    shutil.copytree(chat_tokenizer, edited)
    conf = json.loads((edited / "tokenizer_config.json").read_text())
    (edited / "tokenizer_config.json").write_text(json.dumps({**conf, "model_max_length": 77}))
    assert data.tokenizer_hashes(edited)["sha256"] != tok["sha256"]

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "org/tok", chat_tokenizer)))
    assert data.tokenizer_hashes("org/tok") == data.tokenizer_hashes(chat_tokenizer)
    assert data.tokenizer_hashes("org/not-cached") == {"files": None, "sha256": None}
