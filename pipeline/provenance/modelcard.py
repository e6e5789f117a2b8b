"""The model card (README.md with Hub front matter) of a published quantized DFlash drafter.

Everything in the card is read from the run's files (manifests, stage records, checkpoint
config, eval results) by `pipeline.stages.publish.card_info`, each through its reader in
`pipeline/artifacts/` (the manifests: `pipeline/artifacts/manifests.py`); this module only renders that
dict. What is absent is said to be absent rather than guessed.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from pipeline.artifacts.eval_results import EvalResults
from pipeline.serving import command

SCHEME_TAGS = {"nvfp4": "nvfp4", "nvfp4a16": "nvfp4", "w4a16": "w4a16", "fp8": "fp8"}


def front_matter(info: dict[str, Any]) -> dict[str, Any]:
    scheme = str(info.get("scheme") or "")
    tags = ["speculative-decoding", "dflash", "speculators", "vllm", "compressed-tensors", "quantized"]
    for key in (scheme.lower(), scheme.lower().split("-")[0]):
        if key in SCHEME_TAGS and SCHEME_TAGS[key] not in tags:
            tags.append(SCHEME_TAGS[key])
        if key in SCHEME_TAGS and key not in tags:
            tags.append(key)
    quantized = scheme.lower() not in ("", "unquantized", "bf16")
    if not quantized:
        tags.remove("quantized")
    meta: dict[str, Any] = {}
    if info.get("base_model"):
        meta["base_model"] = info["base_model"]
        if quantized:  # the bf16 reference is the source drafter re-saved, not a quantization of it
            meta["base_model_relation"] = "quantized"
    meta["library_name"] = info.get("library_name") or "speculators"
    if info.get("license"):
        meta["license"] = info["license"]
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = tags
    return meta


def calibration_lines(results: EvalResults | None, variant: str) -> list[str]:
    """This variant against its data-free / calibration-free twin (evaluate's paired comparison), if any."""
    out = []
    for r in results.comparisons_for(variant) if results else []:
        t, tau = r.top1_heldout or {}, r.tau
        errs = r.layer_output_error_heldout or {}
        e = [((errs.get(v) or {}).get("mean")) for v in (r.calibrated, r.calibration_free)]
        boot = tau.get("paired_bootstrap") or {}
        ci = boot.get("ci95") or [None, None]
        line = (f"- `{r.calibrated}` ({r.what_is_calibrated or 'calibrated'}) vs `{r.calibration_free}`: "
                f"tau {tau.get('calibrated', float('nan')):.3f} vs {tau.get('calibration_free', float('nan')):.3f}")
        if boot:
            line += f" (difference {boot['difference']:+.3f}, 95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}])"
        if t:
            line += (f"; top-1 vs the bf16 drafter {t['top1_a']:.4f} vs {t['top1_b']:.4f} on {t['rows']} held-apart "
                     f"rows (McNemar p {t['mcnemar_p']:.3g})")
        if None not in e:
            line += f"; held-apart layer-output error {e[0]:.4f} vs {e[1]:.4f}"
        out.append(line + f"; verdict **{r.verdict}**.")
    return out


def acceptance_table(results: EvalResults | None, variant: str) -> str | None:
    """A markdown table subset x variant of mean acceptance length, from eval/results.json's `table` rows
    (`pipeline.artifacts.eval_results.TauRow`)."""
    rows = {(r.subset, r.variant): float(r.tau) for r in (results.table if results else [])}
    if not rows:
        return None
    variants = sorted({v for _, v in rows}, key=lambda v: (v != "bf16", v != variant, v))
    subsets = sorted({s for s, _ in rows})
    head = "| subset | " + " | ".join(f"**{v}**" if v == variant else v for v in variants) + " |"
    lines = [head, "|---" * (len(variants) + 1) + "|"]
    for s in subsets:
        cells = []
        for v in variants:
            tau = rows.get((s, v))
            base = rows.get((s, "bf16"))
            cell = "-" if tau is None else f"{tau:.3f}"
            if tau is not None and base and v != "bf16":
                cell += f" ({(tau / base - 1) * 100:+.1f}%)"
            cells.append(cell)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serve_command(target: str, repo_id: str, info: dict[str, Any]) -> str:
    """The card's `vllm serve`: the run's one command (pipeline.serving.command) with the Hub ids of the target
    and of this repo, its drafter settings read from the published checkpoint (card_info's `serving_command`)."""
    settings = info.get("serving_command") or {}
    k = settings.get("num_speculative_tokens")
    if k is None:  # no config.json to read it from: the block size the card states, else said to be unknown
        k = info["block_size"] - 1 if info.get("block_size") else "<block size - 1>"
    return command.serve_command(target, repo_id, k, bool(settings.get("quantized")), settings.get("revision"))


def _calibration_lines(c: dict[str, Any]) -> list[str]:
    def show(v: Any) -> str:
        return "not recorded" if v is None else f"`{v}`"

    if c.get("calibration") == "none":
        return ["- calibration: **none** (calibration-free baseline: scales from the weights only)"]
    return [f"- calibration samples: {show(c.get('num_samples'))} (anchors per sequence: {show(c.get('anchors'))})",
            f"- calibration sequence length: {show(c.get('max_seq_len'))}",
            f"- seed: {show(c.get('seed'))}",
            f"- observer: {show(c.get('observer'))}" + (f" with {json.dumps(c['observer_kwargs'], sort_keys=True)}"
                                                         if c.get("observer_kwargs") else ""),
            f"- algorithm: {show(c.get('algorithm'))}; group size: {show(c.get('group_size'))}",
            f"- calibration data: {show(c.get('data'))}",
            f"- not quantized (ignore list): {show(c.get('ignore'))}"]


def pairing_lines(p: dict[str, Any]) -> list[str]:
    """Which target precision the drafter was calibrated with, and which it was measured with."""
    cal, measured = p.get("calibrated_on"), p.get("measured_with") or {}
    if not cal and not measured:
        return []
    out = ["## Target precision: calibrated and measured with"]
    if cal:
        what = "the unquantized target" if cal.get("variant") == "bf16" else f"the quantized target `{cal.get('variant')}`"
        used = "calibrated on the cached hidden states of" if cal.get("used") else \
            "data-free (no hidden states calibrate it); its checks read the cached hidden states of"
        out.append(f"- {used[0].upper() + used[1:]} {what} (checkpoint files sha256 "
                   f"`{(cal.get('files_sha256') or 'not recorded')[:16]}`"
                   + (f", `{cal['hub_id']}`" if cal.get("hub_id") else "") + ").")
    if measured:
        out.append("- Measured with: " + "; ".join(f"target `{t}`: tau {tau:.3f}" for t, tau in measured.items())
                   + " (reference loop, all prompts; `eval/report.md` has the pair matrix).")
    if p.get("published_for"):
        out.append(f"- Published for that target: `config.json` (`speculators_config.verifier`) and this card name "
                   f"`{p['published_for']}`.")
    for key in ("warning", "note"):
        if p.get(key):
            out.append(f"- **Note:** {p[key].rstrip('.')}.")
    return out + [""]


def _pair_caveat(p: dict[str, Any]) -> list[str]:
    """At the top of the card: a drafter calibrated for a quantized target says so before any command."""
    cal = p.get("calibrated_on") or {}
    if not p.get("warning"):
        return []
    return [f"> **Calibrated for the quantized target `{cal.get('variant')}`.** It was calibrated on that target's "
            "hidden states; the target named below and in the serving command is the configured one, so serve "
            f"it beside the `{cal.get('variant')}` checkpoint instead (tau with each target: \"Target precision\" "
            "below).", ""]


def render(info: dict[str, Any]) -> str:
    """The whole README.md. `info` keys: see pipeline.stages.publish.card_info."""
    meta = yaml.safe_dump(front_matter(info), sort_keys=False, allow_unicode=True)
    repo, target, variant = info["repo_id"], info.get("target") or "<target>", info["variant"]
    scheme = info.get("scheme") or variant
    plots = info.get("plots") or []
    table = info.get("acceptance_table")
    family = info.get("family") or "DFlash"
    out = [f"---\n{meta}---", "", f"# {repo.split('/')[-1]}", "",
           (f"A {family} drafter quantized to **{scheme}**" if scheme.lower() not in ("unquantized", "bf16")
            else f"The unquantized (bf16 reference) {family} drafter")
           + f", for speculative decoding with `{target}`, produced by "
           f"specquant from the drafter `{info.get('source_drafter')}` (run `{info.get('run_name')}`, "
           f"variant `{variant}`).", "",
           *_pair_caveat(info.get("pairing") or {}),
           "## What it is and is not",
           "- It **is** a block drafter: it proposes blocks of tokens that the target verifies, so what is "
           "generated is what the target alone would generate (token for token under greedy decoding); only "
           "the speed changes.",
           "- It is **not** a chat or instruction model and cannot generate text on its own: it has no "
           "embedding or LM head of its own (it uses the target's) and reads the target's hidden states "
           f"(aux layers `{info.get('aux_layer_ids')}`, block size `{info.get('block_size')}`).",
           "- No tokenizer files are shipped: the drafter uses the target's tokenizer and vocabulary; "
           f"load the tokenizer from `{target}`.", "",
           "## Target", f"Pairs with `{target}`"
           + (f" (revision `{info['target_revision']}`)" if info.get("target_revision") else "") + ". "
           "Using it with any other target gives meaningless proposals (near-zero acceptance).", "",
           "## Quantization", f"- scheme: `{scheme}` (compressed-tensors checkpoint; `quantization_config` "
           "in `config.json`, the llm-compressor recipe in `recipe.yaml`)",
           *_calibration_lines(info.get("calibration") or {}), *(info.get("family_lines") or []), "",
           "Full details: `quant_run_manifest.json`, `calibration_manifest.json` and `provenance/`.", "",
           "## Acceptance length", ]
    if table:
        with_target = (info.get("pairing") or {}).get("table_target")
        out += ["Mean acceptance length tau (accepted tokens + 1 per verification step; relative change "
                "vs the bf16 drafter in brackets), greedy, measured by specquant's reference loop"
                + (f" with the `{with_target}` target" if with_target else "") + ":", "", table, ""]
    else:
        out += ["Not measured in this run (no `eval/results.json`).", ""]
    out += [f"![{p}]({p})" for p in plots] + ([""] if plots else [])
    if info.get("calibration_comparison"):
        out += ["## Calibrated vs data-free", "Paired on the same prompts and held-apart rows (details and the "
                "verdict rule in `eval/report.md`):", "", *info["calibration_comparison"], ""]
    out += pairing_lines(info.get("pairing") or {})
    out += _serving_lines(info, target, repo, family)
    out += ["## What was and was not measured",
            "- Measured: " + ("acceptance length per subset on the run's prompt sets with specquant's "
                              "reference greedy loop (details in `eval/report.md`); " if table else "")
            + "reload and dequantization checks of the checkpoint (`checks/`, when present)"
            + ("; loading, losslessness and tau in vLLM (`eval/serve_check.json`)."
               if (info.get("serving") or {}).get("checked") else "."),
            "- Not measured: " + ("" if _speed_measured(info) else "serving throughput or latency in vLLM, ")
            + "native FP4 kernels on Blackwell GPUs, "
            "sampling (non-greedy) acceptance, and quality on tasks other than the listed subsets.", "",
            *_verify_lines(info, repo)]
    return "\n".join(out)


def _serving_lines(info: dict[str, Any], target: str, repo: str, family: str) -> list[str]:
    """How to serve it and whether that was checked: the vLLM range it was written for, the one serving
    command, then what serve-check found, so the command never stands without its evidence."""
    vllm = info.get("vllm") or {}
    return ["## Serving with vLLM",
            (f"Written and checked for **vLLM {info['family_versions']}**, the releases of specquant's contract "
             f"profile `{vllm['profile']}` (`pipeline/serving/contract.py`) that build vLLM's {family} model class."
             if info.get("family_versions") else
             f"Written and checked for **vLLM {vllm['versions']}** (specquant's contract profile "
             f"`{vllm['profile']}`, `pipeline/serving/contract.py`)." if vllm.get("versions") else
             "The vLLM range this checkpoint was written for is not recorded."),
            "", "```bash", serve_command(target, repo, info), "```",
            "Needs an attention backend that supports non-causal attention (e.g. `flash_attn`). "
            "vLLM copies the target's quantization to the draft unless the draft's own is used; this "
            "checkpoint carries its own `quantization_config`.", "",
            "## Checked in vLLM",
            "- " + ((info.get("serving") or {}).get("summary") or "not checked in vLLM"),
            *([f"- {info['serving']['speed']}"] if (info.get("serving") or {}).get("speed") else []),
            "- The kernel named is the one vLLM built for the drafter's quantized layers: on Hopper and "
            "Ampere vLLM runs NVFP4 weight-only (Marlin), so a W4A4 figure there is from "
            "`linear_backend=emulation`; native FP4 needs Blackwell (sm100/sm120).", ""]


def _verify_lines(info: dict[str, Any], repo: str) -> list[str]:
    """How a downloader re-checks the files: the file list, the statement, and the verify command with the
    signature's trust anchor (a root certificate or a public key) when the folder is signed."""
    sig = info.get("signature")
    return ["## Verify the files",
            "Every file's sha256 is listed in `provenance/files.sha256.json` (with the run path it came "
            "from); the run's in-toto/SLSA statement is `provenance/attestation.intoto.json`. With specquant:",
            "```bash", f"hf download {repo} --revision <tag> --local-dir {repo.split('/')[-1]}",
            f"python -m pipeline verify {repo.split('/')[-1]}" + (
                "" if not sig else " --root-certs <publisher's root CA certificate>" if sig.get("certificate")
                else " --public-key <publisher's key.pub>"),
            "```", "On the Hub, LFS files show their sha256, which must equal the list.", *signature_lines(info), ""]


def _speed_measured(info: dict[str, Any]) -> bool:
    return str((info.get("serving") or {}).get("speed") or "").startswith("Speed as served")


def signature_lines(info: dict[str, Any]) -> list[str]:
    """Whether the folder is signed, and how to check it; an unsigned folder says so plainly."""
    sig = info.get("signature")
    if not sig:
        return ["", "**Unsigned**: this folder carries no signature (no `model.sig`); the sha256 list shows that "
                "its files agree with the run's records, not who published them."]
    name = info["repo_id"].split("/")[-1]
    cert = sig.get("certificate")
    if cert:
        return ["", f"**Signed** with OpenSSF model signing (OMS, `{sig.get('tool')}`) by the certificate "
                f"`{cert['subject']}` (sha256 fingerprint `{cert['sha256']}`, issued by `{cert['issuer']}`, valid "
                f"until {cert['not_after'][:10]}): `{sig['file']}` is a Sigstore bundle over the sha256 of every other "
                "file of this repo (this card, the weights, the manifests and `provenance/`, the in-toto statement "
                "included), made offline with that certificate's key, and carries the certificate and its chain. "
                "Get the issuing CA's root certificate from the publisher, then (besides the command above):",
                "```bash", f"model_signing verify certificate {name} --signature {name}/{sig['file']} "
                "--certificate_chain root-ca.pem", "```"]
    return ["", f"**Signed** with OpenSSF model signing (OMS, `{sig.get('tool')}`): `{sig['file']}` is a Sigstore "
            "bundle over the sha256 of every other file of this repo (this card, the weights, the manifests and "
            "`provenance/`, the in-toto statement included), made offline with an elliptic-curve key whose public "
            f"key has sha256 `{sig['public_key_sha256']}`. Get that public key from the publisher, then "
            "(besides the command above):", "```bash",
            f"model_signing verify key {name} --signature {name}/{sig['file']} --public_key key.pub", "```"]
