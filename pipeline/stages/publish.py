"""The publish stage: assemble each quantized drafter as a Hub repo folder and (optionally) push it.

For every drafter variant of the run (bf16 only when asked) the folder `publish/<variant>/`
holds the checkpoint, the manifests, `provenance/`, the evaluation report and plots, and a
model card. Both the run and the folder are verified before anything is pushed. A push is
one commit of the changed files only (compared with the remote tree by sha256 / git blob id),
then a tag; the remote tree at the new commit is compared with the local file list after.
Re-running is idempotent: an unchanged folder makes no commit, an interrupted one completes.

Dry run is the default: assemble, verify, print what would be pushed, write the record.

With a signing key configured (publish.signing_key or publish.signing_key_env), each assembled folder is
signed with OpenSSF model signing (`pipeline/provenance/signing.py`): `model.sig` covers every other file of the
folder (card, manifests and `provenance/`, the in-toto statement included) and is pushed with them; the
folder is then verified against the signature too. Without one, the card says the folder is unsigned.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tqdm import tqdm

from pipeline.artifacts import check_report, eval_results, file_list, manifests
from pipeline.artifacts.rundir import RunDir
from pipeline.artifacts.stage_record import load_record
from pipeline.core.errors import bad_value
from pipeline.core.hub import REPO_ID, hub_id
from pipeline.core.io import TMP_PREFIX, atomic_dir, atomic_write_json, confine, sha256_file
from pipeline.core.secrets import remember, scrub, scrub_obj
from pipeline.models.checkpoint_info import CheckpointInfo
from pipeline.provenance import hub_push, modelcard, signing
from pipeline.provenance import record as prov
from pipeline.serving import command, report

_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")  # weights only from safetensors
EVAL_FILES = ("report.md", "results.json", "vllm_commands.sh", "serve_check.json")
MANIFESTS = (manifests.CALIBRATION, manifests.QUANT_RUN)


# ---------------------------------------------------------------- checks before any work
def _token(cfg) -> str | None:
    pc = cfg.publish
    token = pc.token or (os.environ.get(pc.token_env) if pc.token_env else None) or None
    remember(token)
    return token


def repo_id_for(cfg, variant: str, n_variants: int) -> str:
    pc = cfg.publish
    if pc.repo_id:
        repo = str(pc.repo_id).replace("{variant}", variant)
        if n_variants > 1 and "{variant}" not in str(pc.repo_id):
            raise bad_value("publish.repo_id", pc.repo_id, f"one repo id cannot hold {n_variants} variants",
                            "put `{variant}` in it, or choose one with publish.variants=[<variant>]")
        field = "publish.repo_id"
    else:
        repo = f"{pc.namespace or 'your-namespace'}/{cfg.drafter.name}-{variant}"
        field = "publish.namespace"
    name = repo.split("/")[-1]
    if not REPO_ID.match(repo) or len(name) > 96 or "--" in repo or ".." in repo or name.endswith((".", ".git")):
        raise bad_value(field, repo, "a Hub repo id is `<namespace>/<name>` using only letters, digits, '-', '_' "
                        "and '.' (no '--' or '..', name at most 96 characters)", "rename it, e.g. my-org/tiny-dflash-nvfp4")
    return repo


def _check_push(cfg, token: str | None) -> None:
    pc = cfg.publish
    if not (pc.repo_id or pc.namespace):
        raise bad_value("publish.repo_id", pc.repo_id, "a real push (publish.dry_run=false) needs an explicit repo id",
                        "set publish.repo_id=<namespace>/<name> or publish.namespace=<namespace>")
    if not token:
        raise bad_value("publish.token_env", pc.token_env, "the variable is unset or empty, so there is no Hub token "
                        "to push with", f"export {pc.token_env}=<a write token> or keep publish.dry_run=true")
    url = urlsplit(str(pc.endpoint))
    if url.scheme not in ("http", "https") or not url.hostname:
        raise bad_value("publish.endpoint", pc.endpoint, "it is not an http(s) URL", "use e.g. https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return  # through a proxy a direct connection may fail while the client's would work
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as exc:
        raise bad_value("publish.endpoint", pc.endpoint, f"nothing answers at {url.hostname}:{port} "
                        f"({exc.strerror or exc})", "check the URL and the network, or keep publish.dry_run=true"
                        ) from None


def select_variants(cfg, rd: RunDir) -> list[str]:
    have = rd.drafter_variants()
    asked = list(cfg.publish.variants or [])
    for v in asked:
        if v not in have:
            raise bad_value("publish.variants", v, f"the run has no drafter checkpoint {rd.drafter(v)} "
                            f"(it has: {', '.join(have) or 'none'})", "choose among those or run quantize-drafter")
    chosen = asked or [v for v in have if v != "bf16"]
    if not chosen:
        raise bad_value("run_dir", str(rd.root), "it holds no quantized drafter checkpoint to publish",
                        "run `make quantize-drafter` first (bf16 is published only with publish.variants=[bf16])")
    return chosen


def _sources(rd: RunDir, variant: str) -> dict[str, Path]:
    """{path in the repo folder: source file in the run}, each confined to the run directory."""
    out: dict[str, Path] = {}
    ckpt = rd.drafter(variant)
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and not p.name.startswith(TMP_PREFIX):
            rel = p.relative_to(ckpt).as_posix()
            if p.suffix in PICKLE_SUFFIXES:
                raise bad_value("publish", f"drafter/{variant}/{rel}", "it is a pickle file, and only safetensors "
                                "weights are published", "remove it from the checkpoint folder")
            out[rel] = p
    for name in MANIFESTS:
        out[name] = rd.root / name
    for p in sorted(rd.provenance.rglob("*")) if rd.provenance.is_dir() else []:
        rel = p.relative_to(rd.root).as_posix()
        if p.is_file() and not p.name.startswith(TMP_PREFIX) and rel != prov.FILE_LIST:
            out[rel] = p
    for p in [rd.eval / n for n in EVAL_FILES] + sorted(rd.eval.glob("*.png")):
        out[f"eval/{p.name}"] = p
    for p in sorted((rd.eval / "prompts").glob("*.jsonl")):  # read by eval/vllm_commands.sh
        out[f"eval/prompts/{p.name}"] = p
    report = check_report.path_of(rd.checks, "drafter", variant)  # the file as written, copied
    out[f"{check_report.FOLDER}/{report.name}"] = report
    kept = {}
    for rel, p in out.items():
        if p.is_file() or p.is_symlink():
            kept[rel] = confine(p, rd.root, "publish")
    return kept


def _refuse_unserved(cfg, rd: RunDir, variant: str) -> None:
    """A variant whose serve check failed is never published; a pushed one must name its target by Hub id."""
    status = report.status_for(rd.root, variant)
    if status.get("checked") and not status.get("ok"):
        raise bad_value("publish.variants", variant, f"its vLLM serve check failed ({status['summary']})",
                        "fix the variant and re-run `make serve-check`, or leave it out of publish.variants")
    if not cfg.publish.dry_run:
        verifier = CheckpointInfo.read(rd.drafter(variant), f"drafter/{variant}").verifier
        cal = _calibration_target(rd, variant)
        name = _published_target(cfg, rd, variant)
        if name is not None and not hub_id(name):
            raise bad_value("publish.quantized_target_models", dict(cfg.publish.quantized_target_models or {}),
                            f"drafter `{variant}` was calibrated for the quantized target `{cal['variant']}`, which "
                            f"has no Hub id here, and a published drafter must name its target by Hub id",
                            f"set +publish.quantized_target_models.{cal['variant']}=<its Hub id> (or publish it "
                            "with publish.dry_run=true)")
        if name is None and not hub_id(verifier):
            raise bad_value(f"drafter/{variant}/config.json", verifier, "a published drafter must name its target "
                            "by Hub id (vLLM resolves a path against the user's working directory)",
                            "set publish.target_model=<target Hub id> and re-run quantize-drafter")


# ---------------------------------------------------------------- verification
def _refuse_unless_verified(path: Path, field: str, ignore_prefix: str | None = None,
                            public_key: bytes | None = None) -> None:
    from pipeline.provenance.verify import verify_dir

    # the digests of files unchanged since they were hashed are reused (pipeline.core.hashes); `verify` re-reads all
    problems = [p for p in verify_dir(path, public_key=public_key, reuse=True)
                if not (ignore_prefix and p.startswith(ignore_prefix))]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise bad_value(field, str(path),
                        f"verification failed, refusing to publish: {'; '.join(problems[:3])}{more}",
                        "restore the file or re-run the stage that writes it and `make manifest`, then publish again")


# ---------------------------------------------------------------- the folder
def card_info(cfg, rd: RunDir, variant: str, repo_id: str, folder: Path,
              signer: signing.Signer | None = None) -> dict[str, Any]:
    info = CheckpointInfo.read(folder, f"drafter/{variant}")
    ckpt, family = info.config, info.drafter_family
    # the manifests through their reader (pipeline/artifacts/manifests.py): a malformed one is one sentence
    qrm = manifests.read_quant_run(folder / manifests.QUANT_RUN) if (folder / manifests.QUANT_RUN).is_file() else None
    cal = manifests.read_calibration(folder / manifests.CALIBRATION) \
        if (folder / manifests.CALIBRATION).is_file() else None
    entry = qrm.checkpoint("drafter", variant) if qrm else None
    record = load_record(rd.root, f"quantize-drafter-{variant}")
    results = eval_results.read_results(folder / "eval")
    q = (entry.quant_config if entry else None) or (record.config("quant") if record else {})
    sources = [s.name for s in cal.sources or []] if cal else []
    pc = cfg.publish
    # a drafter calibrated on a quantized target is published for that target (_published_target)
    published_for = _published_target(cfg, rd, variant)
    vllm = (entry.vllm if entry else None) or (record.result.get("vllm") if record else None)
    target = (published_for or pc.target_model or hub_id(cfg.target.path)
              or info.verifier or cfg.target.path)
    return {
        "repo_id": repo_id, "variant": variant, "run_name": cfg.run_name,
        "scheme": (entry.scheme if entry else None) or q.get("scheme") or variant,
        "base_model": pc.base_model or hub_id(cfg.drafter.path), "source_drafter": pc.base_model or cfg.drafter.path,
        "license": cfg.drafter.license, "library_name": pc.library_name,
        "target": target, "target_revision": cfg.target.revision,
        "block_size": ckpt.get("block_size"),
        # the drafter family's words on the card (pipeline.models.families): its name, what it keeps dense
        "family": family.card_name, "family_lines": family.card_lines(),
        # the serving command's drafter settings, read from the published checkpoint as every command reads them
        "serving_command": {**dict(zip(("num_speculative_tokens", "quantized"), command.drafter_settings(folder))),
                            # the configured target's pinned revision; a quantized target's repo has its own
                            "revision": None if published_for else cfg.target.revision},
        "aux_layer_ids": ckpt.get("aux_hidden_state_layer_ids") or (cal.cache.aux_layer_ids if cal and cal.cache
                                                                     else None),
        "calibration": {"num_samples": q.get("num_samples"), "anchors": q.get("anchors_per_sequence"),
                        "max_seq_len": q.get("max_seq_len"), "calibration": q.get("calibration"),
                        "seed": entry.seeds["seed"] if entry else record.seed if record else None,
                        "observer": (entry.observer if entry else None) or q.get("observer"),
                        "observer_kwargs": (entry.observer_kwargs if entry else None) or q.get("observer_kwargs"),
                        "algorithm": q.get("algorithm"), "group_size": q.get("group_size"),
                        "ignore": (entry.ignore if entry else None) or q.get("ignore"),
                        "data": ", ".join(sources) if sources else None},
        "acceptance_table": modelcard.acceptance_table(results, variant),
        "calibration_comparison": modelcard.calibration_lines(results, variant),
        "plots": sorted(p.relative_to(folder).as_posix() for p in (folder / "eval").glob("*.png")),
        "serving": report.status_for(rd.root, variant),
        # the vLLM range the checkpoint is written and checked for: the manifest's copy of the quantize-drafter
        # record's (pipeline.serving.contract.Profile.record), the record's own where the manifest has none
        "vllm": vllm,
        "family_versions": family.recorded_versions(vllm or {}),
        "pairing": pairing_info(cfg, rd, variant, target, results),
        "signature": {"file": signing.SIGNATURE, "public_key_sha256": signer.fingerprint,
                      "tool": f"model-signing {signing.tool_version()}",
                      "certificate": signer.certificate.info() if signer.certificate else None} if signer else None,
    }


REFERENCE_TARGET = "bf16"


def _calibration_target(rd: RunDir, variant: str) -> dict | None:
    from pipeline.quant import pairing

    return pairing.drafter_record(rd, variant)


def _published_target(cfg, rd: RunDir, variant: str) -> str | None:
    """The target a drafter calibrated on a quantized target is published for (`pairing.calibration_target_name`:
    its configured Hub id, else its folder in the run); None for one calibrated on the bf16 target."""
    from pipeline.quant import pairing

    return pairing.calibration_target_name(cfg, _calibration_target(rd, variant))


def _name_target(folder: Path, name: str, field: str) -> None:
    """The published config.json names `name` as its verifier (the run's copy names the configured target:
    quantize-drafter writes one verifier for every variant); canonical JSON, as the run's file is written. The
    file is read through CheckpointInfo; only the rewrite touches its dict, a copy of what was read."""
    info = CheckpointInfo.read(folder, field)
    conf = copy.deepcopy(info.config)
    verifier = (conf.get("speculators_config") or {}).get("verifier")
    if isinstance(verifier, dict) and info.verifier != name:
        verifier["name_or_path"] = name
        atomic_write_json(folder / "config.json", conf)


def _refuse_mispaired(cfg, rd: RunDir, variant: str) -> None:
    """A drafter calibrated against a target of another vocab / hidden size / depth than the configured
    target is never published as its drafter (pipeline.quant.pairing.check_shape), before anything is assembled."""
    from pipeline.quant import pairing

    pairing.check_shape(variant, pairing.drafter_record(rd, variant),
                        pairing.target_identity(cfg.target.path, REFERENCE_TARGET, cfg.target.revision,
                                                bool(cfg.target.trust_remote_code), hashed=False))


def pairing_info(cfg, rd: RunDir, variant: str, target: str,
                 results: eval_results.EvalResults | None) -> dict[str, Any]:
    """The target the drafter was calibrated on, the targets it was measured with, and the one-sentence
    warning when the card's target is not the one it was calibrated on."""
    from pipeline.quant import pairing

    cal = pairing.drafter_record(rd, variant)
    measured = results.measured_tau(variant) if results else {}
    warning = note = None
    name = pairing.calibration_target_name(cfg, cal)
    if name is not None and target != name:
        warning = (f"drafter `{variant}` was calibrated on the hidden states of target `{cal['variant']}`, but its "
                   f"card and config name `{target}` as its target; serve it with the `{cal['variant']}` target "
                   f"(+publish.quantized_target_models.{cal['variant']}=<its Hub id> names it)")
        pairing.warn(warning, "publish")
    elif name is not None and not hub_id(name):
        note = (f"the quantized target `{cal['variant']}` it was calibrated for has no Hub id in this run "
                f"(publish.quantized_target_models has no `{cal['variant']}` entry), so its config and this card name "
                f"that target's folder in the run, `{name}` (written by quantize-target, relative to the directory "
                "the run was made from); upload that checkpoint and set "
                f"+publish.quantized_target_models.{cal['variant']}=<its Hub id> to name it on the Hub")
    table_target = results.target["variant"] if results else None
    return {"calibrated_on": cal, "measured_with": measured, "warning": warning, "note": note,
            "published_for": name, "table_target": table_target}


def assemble(cfg, rd: RunDir, variant: str, repo_id: str, sources: dict[str, Path],
             signer: signing.Signer | None = None) -> Path:
    """Build publish/<variant>/ beside it, then swap it in (`atomic_dir`: never half-assembled); then sign it
    when a key is configured (after the swap, so the signed statement names the folder `<variant>`, not its
    temporary name; a kill in between leaves an unsigned folder, which verification with the key refuses)."""
    dest = rd.publish / variant
    previous = (dest / signing.SIGNATURE).read_bytes() if signer and (dest / signing.SIGNATURE).is_file() else None
    total = sum(p.stat().st_size for p in sources.values())
    with atomic_dir(dest) as tmp, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {variant}",
                                       disable=total < (64 << 20)) as bar:
        for rel, src in sources.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
            bar.update(src.stat().st_size)
        target = _published_target(cfg, rd, variant)
        if target is not None:  # calibrated for a quantized target: published naming that target
            _name_target(tmp, target, f"drafter/{variant}")
        card = modelcard.render(card_info(cfg, rd, variant, repo_id, tmp, signer))
        (tmp / "README.md").write_text(scrub(card), encoding="utf-8")
        # the statement cannot name itself, so its copy carries no origin
        # ... nor does a config.json that names another target than the run's copy (_name_target)
        origins = {rel: src.relative_to(rd.root.resolve()).as_posix() for rel, src in sources.items()
                   if rel != prov.ATTESTATION and not (rel == "config.json" and target is not None)}
        prov.write_file_list(tmp, kind="published", origins=origins)
    if signer:
        signing.sign_folder(dest, signer, previous)
    return dest


# ---------------------------------------------------------------- the stage
def _signature_record(signer: signing.Signer) -> dict[str, Any]:
    """What the publish record says of the signature: the key's and certificates' paths, never their content."""
    cert = signer.certificate
    rec = {"file": signing.SIGNATURE, "format": "OpenSSF model signing (OMS) bundle, "
           f"{'X.509 certificate' if cert else 'elliptic-curve key'}, offline; model-signing {signing.tool_version()}",
           "public_key_sha256": signer.fingerprint, "signing_key_path": str(signer.key_path)}
    if cert:
        rec.update(certificate=cert.info(), signing_certificate_path=str(cert.path),
                   certificate_chain_paths=[str(c) for c in cert.chain], root_certs_paths=[str(r) for r in cert.roots.paths])
    return rec


def _signature_line(signer: signing.Signer | None) -> str:
    if signer and signer.certificate:
        c = signer.certificate
        return (f"{signing.SIGNATURE}: signed with OpenSSF model signing by the certificate {c.subject} (sha256 "
                f"{c.sha256[:16]}..., issued by {c.issuer}) (verify with `python -m pipeline verify <folder> "
                "--root-certs <root CA certificate>`)")
    if signer:
        return (f"{signing.SIGNATURE}: signed with OpenSSF model signing, public key sha256 "
                f"{signer.fingerprint[:16]}... (verify with `python -m pipeline verify <folder> --public-key <key.pub>`)")
    return "unsigned (no publish.signing_key / publish.signing_key_env): no model.sig in the folder"


def run(cfg) -> dict:
    pc = cfg.publish
    token = _token(cfg)
    rd = RunDir.from_cfg(cfg)
    if not rd.root.is_dir():
        raise bad_value("run_dir", str(rd.root), "the run directory does not exist", "fix run_name/runs_root")
    variants = select_variants(cfg, rd)
    repos = {v: repo_id_for(cfg, v, len(variants)) for v in variants}
    if pc.tag is not None and not _TAG.match(str(pc.tag)):
        raise bad_value("publish.tag", pc.tag, "a tag may use only letters, digits, '-', '_' and '.'",
                        "rename it, e.g. specquant-tiny-v1")
    if not pc.dry_run:
        _check_push(cfg, token)
    signer = signing.signer_from_config(cfg)  # None: not signing
    for v in variants:
        _refuse_unserved(cfg, rd, v)
        _refuse_mispaired(cfg, rd, v)
    sources = {v: _sources(rd, v) for v in variants}
    # publish/ is about to be rebuilt, so a stale assembled folder there is no reason to refuse
    _refuse_unless_verified(rd.root, "run_dir", ignore_prefix="publish/")
    # temp files of a killed write (a killed assemble's .partial-* folder is removed by atomic_dir)
    for p in rd.publish.glob(TMP_PREFIX + "*") if rd.publish.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    out: dict[str, Any] = {}
    for v in variants:
        folder = assemble(cfg, rd, v, repos[v], sources[v], signer)
        _refuse_unless_verified(folder, "publish", public_key=signer.trust if signer else None)
        listing = file_list.read(folder / prov.FILE_LIST)
        files = {rel: {"sha256": e.sha256, "bytes": e.bytes} for rel, e in listing.files.items()}
        for rel in (prov.FILE_LIST, signing.SIGNATURE) if signer else (prov.FILE_LIST,):
            files[rel] = {"sha256": sha256_file(folder / rel), "bytes": (folder / rel).stat().st_size}
        tag = str(pc.tag or f"specquant-{cfg.run_name}-{listing.files_sha256[:10]}")
        if not _TAG.match(tag):
            raise bad_value("run_name", cfg.run_name, f"the default tag {tag!r} is not a valid Hub tag",
                            "set publish.tag=<letters, digits, '-', '_', '.'>")
        record = {"schema": "specquant.publish_record/v1", "run_name": str(cfg.run_name), "variant": v,
                  "repo_id": repos[v], "endpoint": str(pc.endpoint), "dry_run": bool(pc.dry_run),
                  "folder": f"publish/{v}", "verifier": "pipeline.commands.verify", "files": files,
                  "files_sha256": listing.files_sha256, "tag": tag,
                  # the key's path may be recorded, never its content
                  "signature": _signature_record(signer) if signer else None}
        if pc.dry_run:
            record.update(status="dry-run", commit=None)
            size = sum(e["bytes"] for e in files.values())
            print(scrub(f"[publish] dry run: would push {len(files)} files ({size / 1e6:.2f} MB) from {folder} "
                        f"to {pc.endpoint}/{repos[v]} and tag {tag}:"))
            for rel, e in files.items():
                if not rel.startswith("provenance/source/"):
                    print(f"  {rel}  {e['bytes']} B  sha256 {e['sha256'][:16]}")
            src = [e["bytes"] for rel, e in files.items() if rel.startswith("provenance/source/")]
            print(f"  provenance/source/  {len(src)} files, {sum(src)} B (the code that ran)")
            print(f"  {_signature_line(signer)}")
        else:
            record.update(hub_push.push_or_explain(cfg, folder, files, repos[v], tag, token))
            print(scrub(f"[publish] {repos[v]}: {record['status']}; commit {record['commit']}, tag {tag}; "
                        f"{len(record['uploaded'])} uploaded, {len(record['unchanged'])} unchanged; "
                        "remote tree verified against the local file list; " + _signature_line(signer)))
        atomic_write_json(rd.publish / f"{v}.json", scrub_obj(record))
        out[v] = {k: record.get(k) for k in ("repo_id", "status", "commit", "tag", "files_sha256")}
    return {"output": str(rd.publish), "variants": out}
