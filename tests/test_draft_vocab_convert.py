"""`python -m pipeline convert --draft-vocab N`: a drafter with its own vocabulary-trimmed head, on the tiny world.

A small run is built in tmp_path by the real stages (data, cache, quantize-drafter w4a16), so the bf16 and the
quantized drafter are trimmed exactly as a user would trim `runs/tiny/drafter/<variant>`. The kept set is small
(1/32 of the vocabulary), so the restriction changes what the drafter proposes and the tau comparison with
bench/draft_vocab.py's masked logits has something to compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from tests import _support

TINY = _support.REPO / "assets" / "tiny"
VARIANTS = ["bf16", "w4a16"]
MAX_NEW = 48


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(autouse=True)
def _threads_kept():
    """The CLI sets torch's thread count for the process; the tests after these (same worker) must see theirs
    (stage records and manifests record it)."""
    before = torch.get_num_threads()
    yield
    assert torch.get_num_threads() == before
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """data (40 samples) + cache + quantize-drafter (w4a16, data-free) of the tiny world, via `run_stage`."""
    from pipeline.core.config import compose
    from pipeline.stages.runner import run_stage

    root = tmp_path_factory.mktemp("trim")
    ov = [f"runs_root={root}", "run_name=tiny", "data.num_samples=40", "cache.samples_per_shard=10"]
    for stage in ("data", "cache"):
        run_stage(stage, f"pipeline.stages.{stage}", compose(ov), ov)
    run_stage("quantize_drafter", "pipeline.stages.quantize_drafter", compose([*ov, "quant=w4a16"]),
              [*ov, "quant=w4a16"])
    return root / "tiny"


@pytest.fixture(scope="module")
def vocab() -> int:
    return int(_config(TINY / "target")["vocab_size"])


@pytest.fixture(scope="module")
def n(vocab) -> int:
    return vocab // 32


@pytest.fixture(scope="module")
def keep(run, vocab, n) -> list[int]:
    """The kept ids computed here from the samples (the same rule bench.draft_vocab measures)."""
    from bench import draft_vocab as bench_dv
    from pipeline.artifacts import samples as samples_file

    return bench_dv.kept_ids(bench_dv.assistant_counts(samples_file.load_samples(run / "data"), vocab), n)


@pytest.fixture(scope="module")
def trimmed(run, n, tmp_path_factory) -> dict[str, Path]:
    from pipeline.__main__ import main as pipeline_main

    out = tmp_path_factory.mktemp("trimmed")
    for v in VARIANTS:
        # the bf16 drafter counted from the run directory, the quantized one from the samples file itself
        source = run if v == "bf16" else run / "data" / "samples.jsonl"
        assert pipeline_main(["convert", "--to", "speculators", "--draft-vocab", str(n), "--target",
                              str(TINY / "target"), "--counts-from", str(source), str(run / "drafter" / v),
                              str(out / v)]) == 0
    return {v: out / v for v in VARIANTS}


@pytest.fixture(scope="module")
def target():
    from pipeline.evaluation.fakequant import load_target

    return load_target(str(TINY / "target"), torch.float32, "cpu")


@pytest.mark.parametrize("variant", VARIANTS)
def test_written_tensors_and_config(run, trimmed, keep, vocab, n, variant):
    src, dst = run / "drafter" / variant, trimmed[variant]
    tcfg = _config(TINY / "target")
    before, after = _tensors(src), _tensors(dst)
    with safe_open(str(TINY / "target" / "model.safetensors"), framework="pt") as fh:
        head = fh.get_tensor("lm_head.weight")
    # the head: the target's rows of the kept ids, in id order, in the target's stored dtype; d2t maps to them
    assert after["lm_head.weight"].shape == (n, tcfg["hidden_size"]) and after["lm_head.weight"].dtype == head.dtype
    assert after["d2t"].dtype == torch.int64 and after["d2t"].shape == (n,)
    assert (torch.arange(n) + after["d2t"]).tolist() == keep
    assert torch.equal(after["lm_head.weight"], head[torch.tensor(keep)])
    # every other tensor bit for bit; nothing of the target's embedding
    assert after.keys() - before.keys() == {"lm_head.weight", "d2t"} and "embed_tokens.weight" not in after
    for k, t in before.items():
        assert torch.equal(after[k], t), k
    cfg, old = _config(dst), _config(src)
    assert cfg["draft_vocab_size"] == n and cfg["transformer_layer_config"]["vocab_size"] == vocab
    assert old["draft_vocab_size"] == vocab
    if variant != "bf16":  # the source's config otherwise unchanged; the dense head listed as not quantized
        from pipeline.serving import contract

        assert {k: v for k, v in cfg.items() if k != "draft_vocab_size"} == \
            {k: v for k, v in old.items() if k != "draft_vocab_size"}
        for qc in (cfg["quantization_config"], cfg["transformer_layer_config"]["quantization_config"]):
            assert contract.matches("lm_head", qc["ignore"])


def test_quantized_ignore_gets_the_head(run, n, tmp_path):
    """A quantized source whose ignore list does not name lm_head: the written one does, in both places."""
    import shutil

    from pipeline.commands.convert import HEAD_IGNORE, convert
    from pipeline.serving import contract

    src = tmp_path / "src"
    shutil.copytree(run / "drafter" / "w4a16", src)
    cfg = _config(src)
    for qc in (cfg["quantization_config"], cfg["transformer_layer_config"]["quantization_config"]):
        qc["ignore"] = [e for e in qc["ignore"] if not contract.matches("lm_head", [e])]
        assert not contract.matches("lm_head", qc["ignore"])
    (src / "config.json").write_text(json.dumps(cfg))
    convert(src, tmp_path / "dst", "speculators", draft_vocab=n, target=TINY / "target", counts_from=run)
    out = _config(tmp_path / "dst")
    for qc in (out["quantization_config"], out["transformer_layer_config"]["quantization_config"]):
        assert qc["ignore"][-1] == HEAD_IGNORE and contract.matches("lm_head", qc["ignore"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_tau_equals_the_masked_logits_and_stays_lossless(run, trimmed, keep, target, variant):
    """The reference loop with the trimmed checkpoint = bench.draft_vocab's masked logits for the same kept set:
    the same drafts at every step (hence the same tau per subset); both outputs are the target's own greedy
    output; and the unrestricted drafter does propose ids outside the kept set (the restriction is not idle)."""
    from transformers import AutoTokenizer

    from bench import draft_vocab as bench_dv
    from pipeline.evaluation.fakequant import load_drafter_variant
    from pipeline.models.spec_decode import greedy_generate, load_prompts, spec_generate

    tok = AutoTokenizer.from_pretrained(TINY / "target")
    stop = [tok.eos_token_id]
    prompts = load_prompts(TINY / "eval", tok, limit=1)
    subsets = [SimpleNamespace(name=k, prompts=v) for k, v in prompts.items()]
    greedy = {s.name: [greedy_generate(target, ids, MAX_NEW, stop) for ids in s.prompts] for s in subsets}
    full, _ = load_drafter_variant(run / "drafter" / variant, target, torch.float32, "cpu")
    own, _ = load_drafter_variant(trimmed[variant], target, torch.float32, "cpu")
    assert tuple(own.lm_head.weight.shape) == (len(keep), full.config.hidden_size)
    bs = int(full.config.block_size)
    with bench_dv.restricted_head(full, keep):
        masked = bench_dv.measure(target, full, subsets, greedy, MAX_NEW, stop, bs, set(keep), "masked")
    mine = bench_dv.measure(target, own, subsets, greedy, MAX_NEW, stop, bs, set(keep), "trimmed")
    assert mine["tau"] == masked["tau"] and mine["position_acceptance"] == masked["position_acceptance"]
    assert mine["lossless"] and masked["lossless"] and mine["proposals_outside_kept"] == 0
    outside = 0
    for s in subsets:
        for ids in s.prompts:
            a = spec_generate(target, own, ids, MAX_NEW, stop, trace=True)
            with bench_dv.restricted_head(full, keep):
                b = spec_generate(target, full, ids, MAX_NEW, stop, trace=True)
            assert [c["draft_tokens"] for c in a.draft_calls] == [c["draft_tokens"] for c in b.draft_calls]
            free = spec_generate(target, full, ids, MAX_NEW, stop, trace=True)
            outside += sum(t not in set(keep) for c in free.draft_calls for t in c["draft_tokens"])
    assert outside > 0


def test_spec_decode_cli_and_format_round_trip(trimmed, n, tmp_path, capsys):
    """The trimmed checkpoint through every format and back keeps its head, d2t and draft_vocab_size; the
    reference-loop CLI reads each one losslessly with the same tau."""
    from pipeline.commands.convert import convert
    from pipeline.commands.spec_decode import main as spec_main

    z = convert(trimmed["bf16"], tmp_path / "z", "zlab")
    nat = convert(z, tmp_path / "n", "native")
    back = convert(nat, tmp_path / "s", "speculators", verifier=str(TINY / "target"))
    assert _config(z)["draft_vocab_size"] == n and _config(nat)["draft_vocab_size"] == n
    assert _config(back) == _config(trimmed["bf16"]) | {"speculators_config": _config(back)["speculators_config"]}
    first = _tensors(trimmed["bf16"])
    for d in (z, nat, back):
        got = _tensors(d)
        assert got.keys() == first.keys() and all(torch.equal(got[k], first[k]) for k in first)
    taus = []
    for d in (trimmed["bf16"], z):
        assert spec_main(["--target", str(TINY / "target"), "--drafter", str(d), "--prompts", str(TINY / "eval"),
                          "--limit", "1", "--max-new-tokens", "24", "--check-lossless", "--threads", str(torch.get_num_threads())]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["lossless_mismatches"] == 0
        taus.append(report["mean_tau"])
    assert taus[0] == taus[1]


def test_load_refuses_a_bad_d2t(trimmed, tmp_path, target):
    import shutil

    from safetensors.torch import save_file

    from pipeline.core.errors import SpecquantError
    from pipeline.models.formats import load_drafter

    bad = tmp_path / "bad"
    shutil.copytree(trimmed["bf16"], bad)
    t = _tensors(bad)
    t["d2t"] = torch.zeros_like(t["d2t"])  # every row maps to its own id: fine; now make two rows collide
    t["d2t"][1] = -1
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(SpecquantError, match="d2t does not map"):
        load_drafter(bad, target=target)


@pytest.mark.parametrize("case, words", [
    ("zero", ["`--draft-vocab` = 0", "1 to"]),
    ("whole", ["`--draft-vocab`", "1 to"]),
    ("no_samples", ["`--counts-from`", "no such run directory or samples file"]),
    ("no_data", ["`--counts-from`", "data/meta.json"]),
    ("vocab", ["`--target`", "vocabulary has"]),
    ("partial", ["`--counts-from`", "together"]),
    ("again", ["`SRC`", "already trimmed"]),
    ("quant_zlab", ["`--to`", "speculators"]),
    ("quant_plain", ["`SRC`", "quantized"]),
])
def test_bad_input_is_one_sentence_and_exit_2(run, trimmed, vocab, n, tmp_path, case, words):
    target, counts, src, to, extra = str(TINY / "target"), str(run), str(run / "drafter" / "bf16"), "speculators", []
    size = {"zero": 0, "whole": vocab}.get(case, n)
    if case == "no_samples":
        counts = str(tmp_path / "missing.jsonl")
    elif case == "no_data":
        counts = str(tmp_path)
    elif case == "vocab":
        target = str(_support.TARGET)
    elif case == "again":
        src = str(trimmed["bf16"])
    elif case.startswith("quant"):
        src, to = str(run / "drafter" / "w4a16"), "zlab" if case == "quant_zlab" else to
    args = ["--draft-vocab", str(size), "--target", target, "--counts-from", counts]
    if case == "partial":
        args = args[:4]
    elif case == "quant_plain":
        args = []
    code, out, err = _support.run_main("convert", "--to", to, *args, *extra, src, str(tmp_path / "out"))
    assert code == 2, (out, err)
    err = err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("error: "), err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "out").exists()


def test_quantize_drafter_refuses_a_trimmed_drafter(trimmed, tmp_path):
    """Quantize first, then trim: quantize-drafter would write the checkpoint without its own head."""
    from pipeline.core.config import compose
    from pipeline.core.errors import SpecquantError
    from pipeline.stages import quantize_drafter

    cfg = compose([f"runs_root={tmp_path}", "run_name=tiny", f"drafter.path={trimmed['bf16']}", "quant=w4a16"])
    with pytest.raises(SpecquantError, match="trimmed head.*convert --draft-vocab"):
        quantize_drafter.validate(cfg)


def test_spec_decode_cli_reads_a_quantized_trimmed_drafter(run, trimmed, target, capsys):
    """The reference-loop CLI reads the compressed-tensors checkpoint (untrimmed and trimmed) as evaluate does,
    losslessly, and its tau is the evaluate stage's loader's; a missing drafter is one sentence, exit 2."""
    from pipeline.commands.spec_decode import cli
    from pipeline.evaluation.fakequant import load_drafter_variant
    from pipeline.models.spec_decode import load_prompts, measure_tau

    quant = [v for v in VARIANTS if v != "bf16"][0]
    args = ["--target", str(TINY / "target"), "--prompts", str(TINY / "eval"), "--limit", "1",
            "--max-new-tokens", "24", "--check-lossless", "--threads", str(torch.get_num_threads())]
    for d in (run / "drafter" / quant, trimmed[quant]):
        assert cli(["--drafter", str(d), *args]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["lossless_mismatches"] == 0
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(TINY / "target"))
        drafter = load_drafter_variant(d, target, torch.float32, "cpu")[0]
        stop = [t for t in [tok.eos_token_id] if t is not None]
        want = measure_tau(target, drafter, load_prompts(str(TINY / "eval"), tok, 1), 24, stop, None, False)
        assert report["mean_tau"] == want["mean_tau"]
    assert cli(["--drafter", str(run / "no-such-drafter"), *args]) == 2
    err = capsys.readouterr().err.strip()  # after the target's loading bar: one sentence, no traceback
    last = err.splitlines()[-1]
    assert last.startswith("error:") and "no-such-drafter" in last and "Traceback" not in err


@pytest.mark.parametrize("row", ['{"input_ids": "abc", "loss_mask": [1]}', '{"input_ids": [1.5, 2], "loss_mask": [1, 1]}',
                                 '{"input_ids": [1, 2], "loss_mask": [1]}', '{"input_ids": null, "loss_mask": null}'])
def test_counted_samples_of_the_wrong_shape_are_one_sentence(row, tmp_path):
    from pipeline.core.errors import SpecquantError
    from pipeline.models.draft_vocab import load_count_samples

    f = tmp_path / "samples.jsonl"
    f.write_text(row + "\n")
    with pytest.raises(SpecquantError, match="integer lists of one length") as exc:
        load_count_samples(f)
    assert str(f) in str(exc.value)
