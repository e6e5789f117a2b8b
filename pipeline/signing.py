"""Signing a published folder with OpenSSF model signing (OMS, the `model-signing` package), offline.

`publish` signs each assembled `publish/<variant>/` folder with an elliptic-curve private key
(PEM; P-256, P-384 or P-521) named by `publish.signing_key` (a path) or `publish.signing_key_env`
(a variable holding a path). The signature, `model.sig`, is an OMS Sigstore bundle: a DSSE envelope
around an in-toto statement listing the sha256 of every file in the folder (weights, card, manifests,
`provenance/` with the run's in-toto statement and the file list), signed offline (no transparency log).
It is the one file the signature does not cover, and the Hub client's `.cache/huggingface/` metadata
(written by `hf download --local-dir`) is left out like in `pipeline.verify`.

The key is read from its path by model_signing and never copied: only its path (in the stage
record's resolved config) and its public key's sha256 (the OMS key hint, in the card and the publish
record) are written anywhere; `pipeline.secrets` scrubs a PEM private key block from any text.

`python -m pipeline verify` checks the signature with a public key (`--public-key PATH` or
`publish.public_key`) through model_signing's own verifier, then names what fails in one sentence.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import bad_value
from pipeline.io import HF_LOCAL_DIR_CACHE, TMP_PREFIX, sha256_file
from pipeline.secrets import remember

SIGNATURE = "model.sig"
# not covered by the signature: the signature itself and the Hub client's local-dir metadata
IGNORED = (SIGNATURE, HF_LOCAL_DIR_CACHE.rstrip("/"))
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model_signing's key signer accepts


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("model-signing")
    except PackageNotFoundError:
        return "not installed"


def key_fingerprint(public_pem: bytes) -> str:
    """sha256 of the public key's PEM (SubjectPublicKeyInfo): the key hint OMS writes into the bundle."""
    return hashlib.sha256(public_pem).hexdigest()


def _public_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class Signer:
    """A configured signing key: its path (never its content) and its public half."""

    key_path: Path
    field: str
    password_env: str | None
    public_pem: bytes

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.public_pem)

    def password(self) -> bytes | None:
        value = os.environ.get(self.password_env) if self.password_env else None
        remember(value)
        return value.encode() if value else None


def signer_from_config(cfg) -> Signer | None:
    """The configured signing key, checked before any work (one sentence per problem), or None: unsigned."""
    pc = cfg.publish
    if pc.signing_key:
        raw, field = str(pc.signing_key), "publish.signing_key"
    elif pc.signing_key_env:
        raw, field = os.environ.get(str(pc.signing_key_env)) or "", "publish.signing_key_env"
        if not raw.strip():
            raise bad_value(field, pc.signing_key_env, "the variable is unset or empty, so there is no signing key",
                            f"export {pc.signing_key_env}=<path to an elliptic-curve private key (PEM)>, or set "
                            "publish.signing_key_env=null to publish unsigned")
    else:
        return None
    if "PRIVATE KEY" in raw:  # the key itself instead of its path: never echo it
        remember(raw)
        raise bad_value(field, "<a PEM private key>", "it holds the key itself, not the path of the key file",
                        "put the key in a file readable only by you and give its path")
    path = Path(raw).expanduser()
    shown = pc.signing_key_env if field.endswith("_env") else raw
    where = f" ({pc.signing_key_env}={raw})" if field.endswith("_env") else ""
    if not path.is_file():
        raise bad_value(field, shown, f"no signing key file at {path}{where}",
                        "give the path of an elliptic-curve private key (PEM), or leave signing unset to publish unsigned")
    pw_env = str(pc.signing_key_password_env) if pc.signing_key_password_env else None
    signer = Signer(path, field, pw_env, b"")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), signer.password())
    except OSError as exc:
        raise bad_value(field, shown, f"the key file {path} cannot be read ({exc.strerror or exc})",
                        "fix its permissions for the user running publish") from None
    except TypeError:  # encrypted without a password, or a password for an unencrypted key
        raise bad_value("publish.signing_key_password_env", pc.signing_key_password_env,
                        f"the key {path} is encrypted and no password was given, or it is not encrypted and one was",
                        "set publish.signing_key_password_env to a variable holding its password (or unset it)") from None
    except (ValueError, Exception) as exc:  # noqa: B014 - cryptography raises several types for a bad file
        why = "the password is wrong or " if pw_env else ""
        raise bad_value(field, shown, f"{why}{path} is not a PEM private key ({type(exc).__name__})",
                        "give an elliptic-curve private key in PEM, e.g. from "
                        "`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name not in CURVES:
        what = f"an elliptic-curve key on {key.curve.name}" if isinstance(key, ec.EllipticCurvePrivateKey) else \
            f"a {type(key).__name__.removeprefix('_').replace('PrivateKey', '')} key"
        raise bad_value(field, shown, f"{path} is {what}, and model signing takes elliptic-curve keys on "
                        "P-256, P-384 or P-521 only", "generate one with "
                        "`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`")
    signer = Signer(path, field, pw_env, _public_pem(key.public_key()))
    if pc.public_key:
        pub = load_public_key("publish.public_key", pc.public_key)
        if key_fingerprint(pub) != signer.fingerprint:
            raise bad_value("publish.public_key", pc.public_key, f"it is not the public half of the signing key "
                            f"{path} (public key sha256 {key_fingerprint(pub)[:16]}... vs {signer.fingerprint[:16]}...)",
                            "give the matching public key, or leave publish.public_key unset")
    return signer


def load_public_key(field: str, path: str | os.PathLike) -> bytes:
    """The PEM of an elliptic-curve public key file model signing can verify with (one sentence if not)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise bad_value(field, str(path), f"the public key file cannot be read ({exc.strerror or exc})",
                        "give the path of the publisher's elliptic-curve public key (PEM)") from None
    if b"PRIVATE KEY" in data:
        raise bad_value(field, str(path), "it is a private key; verifying needs only the public key",
                        "export the public key (`openssl ec -in key.pem -pubout -out key.pub`) and give that")
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as exc:  # noqa: BLE001 - ValueError or UnsupportedAlgorithm for a bad file
        raise bad_value(field, str(path), f"it is not a PEM public key ({type(exc).__name__})",
                        "give the publisher's elliptic-curve public key (PEM)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in CURVES:
        raise bad_value(field, str(path), "it is not an elliptic-curve key on P-256, P-384 or P-521",
                        "give the publisher's elliptic-curve public key (PEM)")
    return _public_pem(key)


@contextlib.contextmanager
def _public_key_file(public_key: str | os.PathLike | bytes, near: Path):
    """model_signing's verifier reads the public key from a path: the given one, or for PEM bytes (publish's
    own check) a temp file beside the folder, removed after."""
    if not isinstance(public_key, bytes):
        yield Path(public_key).expanduser()
        return
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX, dir=near) as d:
        p = Path(d) / "public.pem"
        p.write_bytes(public_key)
        yield p


def _hashing_config():
    from model_signing import hashing

    return hashing.Config().set_ignored_paths(paths=list(IGNORED), ignore_git_paths=True)


def sign_folder(folder: Path, signer: Signer, previous: bytes | None = None) -> str:
    """Write `folder/model.sig`. A previous signature by the same key over the same bytes is kept as it is
    (ECDSA signatures differ on every run, so re-signing would make every re-publish a new commit).
    Returns "kept" or "signed"."""
    from model_signing import signing

    sig = folder / SIGNATURE
    if previous is not None:
        sig.write_bytes(previous)
        if check(folder, signer.public_pem).problem is None:
            return "kept"
        sig.unlink()
    tmp = folder / f"{TMP_PREFIX}{SIGNATURE}"
    try:
        # the folder is hashed before the signature is written, and model.sig is not hashed anyway
        signing.Config().set_hashing_config(_hashing_config()).use_elliptic_key_signer(
            private_key=signer.key_path, password=signer.password()).sign(folder, tmp)
        os.chmod(tmp, 0o644)  # like every other published file
        os.replace(tmp, sig)
    finally:
        tmp.unlink(missing_ok=True)
    return "signed"


@dataclass
class Result:
    problem: str | None = None  # one sentence, or None
    note: str | None = None  # one line when nothing is checked (unsigned, or no public key)
    altered: list[str] | None = None  # files the (authentic) signature disagrees with
    signed: dict[str, str] | None = None  # {file: sha256} the signature lists
    present: dict[str, str] | None = None  # {file: sha256} in the folder now


def _signed_resources(sig: Path) -> dict[str, str]:
    """{file: sha256} from the signed statement (read after model_signing authenticated it)."""
    bundle = json.loads(sig.read_text(encoding="utf-8"))
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    return {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}


def _present(folder: Path) -> dict[str, str]:
    from pipeline.io import list_files

    def skip(rel: str) -> bool:
        return any(rel == i or rel.startswith(i + "/") for i in IGNORED) or rel.split("/")[0] in (
            ".git", ".github", ".gitattributes", ".gitignore")

    return {rel: sha256_file(folder / rel) for rel in list_files(folder, skip)}


def _names(files: list[str]) -> str:
    files = sorted(files)
    shown = files[:4] + ([f"{len(files) - 4} more"] if len(files) > 4 else [])
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def check(folder: str | os.PathLike, public_key: str | os.PathLike | bytes | None) -> Result:
    """The signature of a published folder against a public key (a path or its PEM bytes)."""
    folder = Path(folder)
    sig = folder / SIGNATURE
    if public_key is None:
        if sig.is_file():
            return Result(note=f"{SIGNATURE}: signature present but not checked (no public key: pass "
                               "--public-key PATH or set publish.public_key)")
        return Result(note=f"unsigned: no {SIGNATURE} (the hashes show the files agree with their records, "
                           "not who published them)")
    shown = "the publisher's public key" if isinstance(public_key, bytes) else str(public_key)
    if not sig.is_file():
        return Result(problem=f"{SIGNATURE}: missing; the folder is unsigned, so it cannot be verified "
                              f"with {shown}")
    pem = public_key if isinstance(public_key, bytes) else load_public_key("--public-key", public_key)
    from cryptography.exceptions import InvalidSignature
    from model_signing import verifying

    with _public_key_file(public_key, folder.parent) as key_file:
        try:
            # the verifier prints a warning for a bundle without a key hint; the sentence below says it all
            with contextlib.redirect_stdout(io.StringIO()):
                verifying.Config().use_elliptic_key_verifier(public_key=key_file).verify(folder, sig)
            return Result()
        except InvalidSignature:
            return Result(problem=f"{SIGNATURE}: its signature is not valid for {shown} (public key sha256 "
                                  f"{key_fingerprint(pem)[:16]}...): it was made by another key or altered")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            text = str(exc)
            if text.startswith("Key mismatch"):
                return Result(problem=f"{SIGNATURE}: signed by another key, not by {shown} (public key sha256 "
                                      f"{key_fingerprint(pem)[:16]}...)")
            if not text.startswith("Signature mismatch"):
                return Result(problem=f"{SIGNATURE}: not a readable OMS signature bundle "
                                      f"({type(exc).__name__}: {text.splitlines()[0][:120] if text else ''}); "
                                      "it was altered or truncated")
    # authentic signature, different content: which files
    signed, present = _signed_resources(sig), _present(folder)
    altered = sorted(r for r in set(signed) | set(present) if signed.get(r) != present.get(r))
    return Result(problem=altered_sentence(altered, signed, present) if altered else
                  f"{SIGNATURE}: the folder no longer matches its signature ({text[:200]})",
                  altered=altered, signed=signed, present=present)


def altered_sentence(altered: list[str], signed: dict[str, str], present: dict[str, str]) -> str:
    """`model.sig: the folder no longer matches its signature (<files> changed; ...)` in one sentence."""
    parts = []
    for what, files in (("changed", [r for r in altered if r in signed and r in present]),
                        ("missing", [r for r in altered if r not in present]),
                        ("not signed (added)", [r for r in altered if r not in signed])):
        if files:
            parts.append(f"{_names(files)} {what}")
    return (f"{SIGNATURE}: the folder no longer matches its signature ({'; '.join(parts)} since signing); "
            "it was altered after it was signed")
