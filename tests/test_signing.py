"""OpenSSF model signing of published folders, and the card's Hub front matter against validate-yaml.

The run is test_publish's small real one (tests/_support.make_run: the cache, quantize-drafter, evaluate and manifest stages on the fixture world); publish is
the real dry run with an elliptic-curve key generated here; verification is `python -m pipeline verify`
(in process, through `pipeline.__main__.main`, so what is printed is what a user sees).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest

from pipeline.core.io import sha256_file
from pipeline.provenance import record as prov
from pipeline.provenance import signing
from tests._support import HUB_BASE as BASE
from tests._support import HUB_TARGET as TARGET
from tests._support import download, front_matter, publish_cfg, push_cfg
from tests.hubserver import HubServer

# `pristine_runs` (the session's small real run, built once) and `run_root` (a fresh copy of it per test)
# are tests/conftest.py's fixtures, shared with test_publish

SIG = signing.SIGNATURE


class Case(str):
    """A parametrized case id carrying the sentence docs/reliability.md shows for it (`what`)."""

    def __new__(cls, name: str, what: str):
        obj = super().__new__(cls, name)
        obj.what = what
        return obj


def _keypair(d: Path, name: str, curve=None) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(curve or ec.SECP256R1())
    priv, pub = d / f"{name}.pem", d / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


# Built once per module and read-only for the tests (a test that changes files works on its own copy): the keys,
# the certificates (`pki`), and the run published once with each kind of signature, which `signed` and
# `cert_signed` copy into the test's own `run_root`.
@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")  # outside the run directory, as a real key would be
    (priv, pub), (other, other_pub) = _keypair(d, "key"), _keypair(d, "other")
    return {"priv": priv, "pub": pub, "other": other, "other_pub": other_pub}


def _published_once(pristine_runs: Path, dst: Path, *overrides: str) -> Path:
    """A copy of the session's pristine run, published (the real dry run) with `overrides`, with the token
    the run_root fixture sets."""
    import shutil

    from pipeline.stages import publish
    from tests._support import PUBLISH_TOKEN

    shutil.copytree(pristine_runs, dst, symlinks=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", PUBLISH_TOKEN)
        publish.run(publish_cfg(dst, *overrides))
    return dst


def _as_run_root(template: Path, run_root: Path) -> Path:
    """`run_root` (the test's own copy) replaced by a copy of `template`; returns its published nvfp4 folder."""
    import shutil

    shutil.rmtree(run_root)
    shutil.copytree(template, run_root, symlinks=True)
    return run_root / "tiny" / "publish" / "nvfp4"


@pytest.fixture(scope="module")
def key_signed_runs(pristine_runs, keys, tmp_path_factory) -> Path:
    return _published_once(pristine_runs, tmp_path_factory.mktemp("key_signed") / "runs",
                           f"publish.signing_key={keys['priv']}", f"publish.public_key={keys['pub']}")


@pytest.fixture
def signed(key_signed_runs, run_root) -> Path:
    """run_root published with signing_key and public_key (a copy of `key_signed_runs`)."""
    return _as_run_root(key_signed_runs, run_root)


def verify_cli(capsys, *args: str) -> tuple[int, list[str]]:
    from pipeline.__main__ import main

    capsys.readouterr()
    rc = main(["verify", *map(str, args)])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return rc, [ln for ln in (out.out + out.err).splitlines() if ln.strip()]


def _key_body(pem: Path) -> list[str]:
    return [ln for ln in pem.read_text().splitlines() if ln and not ln.startswith("-----")]


# ---------------------------------------------------------------- a good folder
def test_signed_folder_verifies_and_names_its_key(signed, keys, run_root, capsys):
    from pipeline.stages import publish

    assert (signed / SIG).is_file()
    rc, lines = verify_cli(capsys, signed, "--public-key", keys["pub"])
    assert rc == 0 and len(lines) == 1 and lines[0].startswith("verify: OK") and f"and {SIG} verifies with" in lines[0]
    # the in-toto statement, the manifests, the card and the file list are all covered by the signature
    bundle = json.loads((signed / SIG).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    covered = {r["name"] for r in statement["predicate"]["resources"]}
    for rel in (prov.ATTESTATION, prov.FILE_LIST, "quant_run_manifest.json", "calibration_manifest.json",
                "README.md", "model.safetensors"):
        assert rel in covered, rel
    assert statement["subject"][0]["name"] == "nvfp4"  # not the temporary assembly folder's name
    listing = json.loads((signed / prov.FILE_LIST).read_text())["files"]
    assert covered == set(listing) | {prov.FILE_LIST}
    # card and record say it is signed, with the public key's sha256; the key's path only in the record
    fp = signing.key_fingerprint(keys["pub"].read_bytes())
    readme = (signed / "README.md").read_text()
    assert "**Signed** with OpenSSF model signing" in readme and fp in readme and str(keys["priv"]) not in readme
    rec = json.loads((run_root / "tiny" / "publish" / "nvfp4.json").read_text())
    assert rec["signature"]["public_key_sha256"] == fp and rec["signature"]["signing_key_path"] == str(keys["priv"])
    assert SIG in rec["files"]  # pushed with the folder
    # the key's content is in no file of the run
    body = _key_body(keys["priv"])
    for p in (run_root / "tiny").rglob("*"):
        if p.is_file():
            text = p.read_bytes().decode("utf-8", "replace")
            assert "-----BEGIN PRIVATE KEY-----" not in text and not any(b in text for b in body), p
    # without a public key: one line saying the signature is present but not checked
    rc, lines = verify_cli(capsys, signed)
    assert rc == 0 and lines[-1] == f"verify: {SIG}: signature present but not checked (no public key: pass " \
                                    "--public-key PATH or set publish.public_key)"
    # a re-publish keeps the same signature bytes (no new Hub commit for an unchanged folder)
    before = (signed / SIG).read_bytes()
    publish.run(publish_cfg(run_root, f"publish.signing_key={keys['priv']}"))
    assert (signed / SIG).read_bytes() == before


def test_signed_push_downloads_and_verifies(run_root, keys, tmp_path):
    """The signature goes to the Hub with the folder; what is downloaded verifies against it."""
    from pipeline.provenance.verify import verify_dir
    from pipeline.stages import publish

    with HubServer(tmp_path / "hub") as hub:
        out = publish.run(push_cfg(run_root, hub.url, f"publish.signing_key={keys['priv']}"))["variants"]["nvfp4"]
        assert out["status"] == "pushed"
        got = download(hub.url, "specquant-test/tiny-dflash-b8-nvfp4", out["tag"], tmp_path / "cache")
        again = publish.run(push_cfg(run_root, hub.url, f"publish.signing_key={keys['priv']}"))["variants"]
    assert (got / SIG).read_bytes() == (run_root / "tiny" / "publish" / "nvfp4" / SIG).read_bytes()
    assert verify_dir(got, public_key=keys["pub"]) == []
    assert again["nvfp4"]["status"] == "no changes"  # the kept signature makes no new commit


def test_unsigned_folder_says_so(run_root, keys, capsys):
    from pipeline.stages import publish

    publish.run(publish_cfg(run_root))
    folder = run_root / "tiny" / "publish" / "nvfp4"
    assert not (folder / SIG).exists()
    assert "**Unsigned**: this folder carries no signature" in (folder / "README.md").read_text()
    rc, lines = verify_cli(capsys, folder)
    assert rc == 0 and lines[-1].startswith(f"verify: unsigned: no {SIG}")


# ---------------------------------------------------------------- tampering: one sentence each
def _flip(p: Path, at: int = 100) -> None:
    data = bytearray(p.read_bytes())
    data[at] ^= 0x01
    p.write_bytes(bytes(data))


def _rewrite_records(folder: Path, rel: str) -> None:
    """What someone with write access to the repo does: make the statement and the file list agree with
    the altered file, so every hash check passes and only the signature can tell."""
    listing = json.loads((folder / prov.FILE_LIST).read_text())
    origin = listing["files"][rel].get("origin", rel)
    att = json.loads((folder / prov.ATTESTATION).read_text())
    for s in att["subject"]:
        if s["name"] == origin:
            s["digest"]["sha256"] = sha256_file(folder / rel)
    (folder / prov.ATTESTATION).write_text(json.dumps(att, indent=2) + "\n")
    prov.write_file_list(folder, kind="published",
                         origins={r: e["origin"] for r, e in listing["files"].items() if "origin" in e})


def _tamper_manifest(folder: Path) -> None:
    doc = json.loads((folder / "quant_run_manifest.json").read_text())
    doc["checkpoints"][0]["scheme"] = "bf16"  # a "harmless" edit of the recorded scheme
    (folder / "quant_run_manifest.json").write_text(json.dumps(doc, indent=2) + "\n")


def _other_key(folder: Path, keys: dict, hint: bool = True) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"publish": {"signing_key": str(keys["other"]), "signing_key_env": None,
                                        "signing_key_password_env": None, "public_key": None}})
    (folder / SIG).unlink()
    signing.sign_folder(folder, signing.signer_from_config(cfg))
    if not hint:  # a bundle without the key hint reaches the cryptographic check itself
        doc = json.loads((folder / SIG).read_text())
        doc["verificationMaterial"]["publicKey"]["hint"] = None
        (folder / SIG).write_text(json.dumps(doc))


WHAT = {
    "tampered file": "signed folder, a byte of model.safetensors flipped: verify --public-key names the file once, "
                     "with the signature failing on it too.",
    "tampered file, records rewritten to match": "signed folder, model.safetensors altered and the statement and "
                                                 "file list rewritten to match (every hash check passes): the "
                                                 "signature names the files in one sentence.",
    "tampered manifest": "signed folder, quant_run_manifest.json edited: named once, with the signature failing on it.",
    "tampered manifest, records rewritten to match": "signed folder, quant_run_manifest.json edited and the statement "
                                                     "and file list rewritten to match: the signature names them in "
                                                     "one sentence.",
    "signature by another key": "signed folder re-signed with another key: one sentence naming model.sig and the key.",
    "signature by another key, key hint removed": "re-signed with another key and the bundle's key hint removed: the "
                                                  "ECDSA check itself refuses it in one sentence.",
    "missing signature": "model.sig deleted, verified with a public key: one sentence naming model.sig.",
    "file added after signing": "a file added to a signed folder: named once (not listed, not signed).",
    "key file missing": "publish: publish.signing_key names no file.",
    "key variable unset": "publish: publish.signing_key_env names an unset variable.",
    "key content in the variable": "publish: the variable holds the PEM key itself, not its path (never echoed).",
    "rsa key": "publish: an RSA signing key (model signing takes EC keys on P-256, P-384, P-521).",
    "not a key": "publish: publish.signing_key is a public key, not a private one.",
    "public key of another key": "publish: publish.public_key is not the signing key's public half.",
}

CASES = {
    "tampered file": (lambda f, k: _flip(f / "model.safetensors"),
                      "model.safetensors: changed (", f"the signature in {SIG} no longer matches it either"),
    "tampered file, records rewritten to match": (
        lambda f, k: (_flip(f / "model.safetensors"), _rewrite_records(f, "model.safetensors")),
        f"{SIG}: the folder no longer matches its signature (model.safetensors, ", "changed since signing"),
    "tampered manifest": (lambda f, k: _tamper_manifest(f),
                          "quant_run_manifest.json: changed (", f"the signature in {SIG} no longer matches it either"),
    "tampered manifest, records rewritten to match": (
        lambda f, k: (_tamper_manifest(f), _rewrite_records(f, "quant_run_manifest.json")),
        f"{SIG}: the folder no longer matches its signature (", "quant_run_manifest.json"),
    "signature by another key": (lambda f, k: _other_key(f, k), f"{SIG}: signed by another key, not by ", ""),
    "signature by another key, key hint removed": (lambda f, k: _other_key(f, k, hint=False),
                                                   f"{SIG}: its signature is not valid for ", "another key"),
    "missing signature": (lambda f, k: (f / SIG).unlink(),
                          f"{SIG}: missing; the folder is unsigned, so it cannot be verified with ", ""),
    "file added after signing": (lambda f, k: (f / "extra.py").write_text("print('hi')\n"),
                                 "extra.py: extra file, not listed", f"the signature in {SIG} no longer matches"),
}


@pytest.mark.faults("tamper")
@pytest.mark.parametrize("case", [Case(c, WHAT[c]) for c in CASES])
def test_tampered_signed_folder_is_refused_in_one_sentence(case, signed, keys, capsys):
    """A signed folder altered after signing: `verify --public-key` refuses it in one sentence naming the file."""
    tamper, start, contains = CASES[case]
    tamper(signed, keys)
    rc, lines = verify_cli(capsys, signed, "--public-key", keys["pub"])
    assert rc == 1, lines
    assert len(lines) == 2 and lines[1] == f"verify: FAILED, 1 problem(s) in {signed}", lines
    sentence = lines[0].removeprefix("verify: ")
    assert sentence.startswith(start) and contains in sentence, sentence
    assert sentence.count(". ") == 0 and "\n" not in sentence


@pytest.mark.faults("tamper")
def test_run_dir_verify_checks_each_published_signature(signed, keys, run_root):
    """A run dir verified with a public key checks each published folder's signature: a missing one is named."""
    from pipeline.provenance.verify import verify_dir

    assert verify_dir(run_root / "tiny", public_key=keys["pub"]) == []
    (signed / SIG).unlink()
    assert verify_dir(run_root / "tiny", public_key=keys["pub"]) == [
        f"publish/nvfp4/{SIG}: missing; the folder is unsigned, so it cannot be verified with {keys['pub']}"]


# ---------------------------------------------------------------- bad signing settings
def _rsa_key(d: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    p = d / "rsa.pem"
    p.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return p


BAD = {
    "key file missing": (lambda k, d: ["publish.signing_key=" + str(d / "nope.pem")], "`publish.signing_key` = ",
                         "no signing key file at"),
    "key variable unset": (lambda k, d: ["publish.signing_key_env=SPECQUANT_TEST_UNSET_KEY"],
                           "`publish.signing_key_env` = 'SPECQUANT_TEST_UNSET_KEY'", "unset or empty"),
    "key content in the variable": (lambda k, d: ["publish.signing_key_env=SPECQUANT_TEST_KEY_PEM"],
                                    "`publish.signing_key_env` = '<a PEM private key>'", "not the path"),
    "rsa key": (lambda k, d: ["publish.signing_key=" + str(_rsa_key(d))], "`publish.signing_key` = ",
                "P-256, P-384 or P-521"),
    "not a key": (lambda k, d: ["publish.signing_key=" + str(k["pub"])], "`publish.signing_key` = ",
                  "is not a PEM private key"),
    "public key of another key": (lambda k, d: [f"publish.signing_key={k['priv']}", f"publish.public_key={k['other_pub']}"],
                                  "`publish.public_key` = ", "not the public half of the signing key"),
}


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("case", [Case(c, WHAT[c]) for c in BAD])
def test_bad_signing_settings_fail_in_one_sentence_before_writing(case, run_root, keys, tmp_path, monkeypatch):
    """publish with a bad signing key setting: one sentence naming the field, nothing assembled, key never echoed."""
    from pipeline.core.errors import SpecquantError
    from pipeline.core.secrets import scrub
    from pipeline.stages import publish

    monkeypatch.delenv("SPECQUANT_TEST_UNSET_KEY", raising=False)
    monkeypatch.setenv("SPECQUANT_TEST_KEY_PEM", keys["priv"].read_text())
    overrides, start, contains = BAD[case]
    with pytest.raises(SpecquantError) as err:
        publish.run(publish_cfg(run_root, *overrides(keys, tmp_path)))
    msg = scrub(str(err.value))
    assert msg.startswith(start) and contains in msg and msg.count("\n") == 0, msg
    assert not any(b in str(err.value) for b in _key_body(keys["priv"]))
    assert not (run_root / "tiny" / "publish").exists()


@pytest.mark.faults("secret")
def test_a_pem_private_key_block_is_scrubbed(keys):
    """A PEM private key block (whole, cut short, SEC1 "EC") is masked by scrub and scrub_config_text."""
    from pipeline.core.secrets import scrub, scrub_config_text

    pem = keys["priv"].read_text()
    for text in (f"key: |\n{pem}\nnext: 1", f"error {pem[:120]}"):  # a whole block, and one cut short
        for out in (scrub(text), scrub_config_text(text)):
            assert "PRIVATE KEY" not in out and not any(b in out for b in _key_body(keys["priv"])), out
    ec = pem.replace("BEGIN PRIVATE", "BEGIN EC PRIVATE").replace("END PRIVATE", "END EC PRIVATE")
    assert scrub(f"a{ec.strip()}b") == "a***b"
    assert scrub(keys["pub"].read_text()) == keys["pub"].read_text()  # a public key is not a secret


# ---------------------------------------------------------------- Hub conventions in the card
def test_published_card_passes_hub_validate_yaml(run_root, tmp_path):
    from pipeline.provenance import modelcard
    from pipeline.stages import publish

    publish.run(publish_cfg(run_root))
    readme = (run_root / "tiny" / "publish" / "nvfp4" / "README.md").read_text()
    meta = front_matter(readme)
    assert meta["base_model"] == BASE and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "speculators" and meta["pipeline_tag"] == "text-generation"
    assert isinstance(meta["license"], str) and "nvfp4" in meta["tags"]
    assert f"vllm serve {TARGET} " in readme  # the serving command names the target by its Hub id
    with HubServer(tmp_path / "hub") as srv:
        ok = httpx.post(f"{srv.url}/api/validate-yaml", json={"content": readme, "repoType": "model"})
        assert ok.status_code == 200 and ok.json() == {"errors": [], "warnings": []}, ok.text
        broken = readme.replace("base_model_relation: quantized", "base_model_relation: quantised").replace(
            f"base_model: {BASE}", "base_model: not a repo id")
        bad = httpx.post(f"{srv.url}/api/validate-yaml", json={"content": broken, "repoType": "model"})
        assert bad.status_code == 400
        messages = [e["message"] for e in bad.json()["errors"]]
        assert any("base_model_relation" in m for m in messages) and any('"base_model"' in m for m in messages)
        for content in ("---\ntags: [a\n---\n", "---\n- a list\n---\n", "---\nlicense: mit\n"):
            assert httpx.post(f"{srv.url}/api/validate-yaml",
                              json={"content": content, "repoType": "model"}).status_code == 400, content
    # the bf16 reference is the source drafter re-saved: no base_model_relation
    bf16 = modelcard.front_matter({"scheme": "bf16", "base_model": BASE})
    assert bf16["base_model"] == BASE and "base_model_relation" not in bf16 and "quantized" not in bf16["tags"]


# ---------------------------------------------------------------- signing with an X.509 certificate
def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specquant tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(d: Path, file: str, cn: str, key, issuer_cn: str, issuer_key, *, ca: bool, days=(-1, 30),
          signing: bool = True) -> Path:
    """A certificate for `key`, issued by `issuer_key` (self-signed when it is the same key), written as PEM."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    now = dt.datetime.now(dt.UTC)
    usage = dict(digital_signature=signing and not ca, content_commitment=False, key_encipherment=not signing,
                 data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                 decipher_only=False)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(issuer_cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + dt.timedelta(days=days[0])).not_valid_after(now + dt.timedelta(days=days[1]))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(**usage), critical=True)
            .sign(issuer_key, hashes.SHA256()))
    p = d / file
    p.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return p


@pytest.fixture(scope="module")
def pki(keys) -> dict[str, Path]:
    """A throwaway CA (root and intermediate) and a leaf certificate for keys["priv"]; another CA beside it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    d = keys["priv"].parent
    leaf_key = serialization.load_pem_private_key(keys["priv"].read_bytes(), None)
    root_key, mid_key, other_root_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    out = {
        "root": _cert(d, "root-ca.pem", "Test Root CA", root_key, "Test Root CA", root_key, ca=True, days=(-60, 365)),
        "mid": _cert(d, "intermediate-ca.pem", "Test Intermediate CA", mid_key, "Test Root CA", root_key, ca=True,
                     days=(-60, 365)),
        "leaf": _cert(d, "leaf.pem", "specquant publisher", leaf_key, "Test Intermediate CA", mid_key, ca=False),
        "other_root": _cert(d, "other-root-ca.pem", "Other Root CA", other_root_key, "Other Root CA", other_root_key,
                            ca=True, days=(-60, 365)),
        # the same subject and key, issued by the other CA (someone else's CA claiming to be the publisher)
        "other_leaf": _cert(d, "other-leaf.pem", "specquant publisher", leaf_key, "Other Root CA", other_root_key,
                            ca=False),
        "expired": _cert(d, "expired.pem", "specquant publisher", leaf_key, "Test Intermediate CA", mid_key,
                         ca=False, days=(-30, -2)),
        "not_for_signing": _cert(d, "encipher-only.pem", "specquant publisher", leaf_key, "Test Intermediate CA",
                                 mid_key, ca=False, signing=False),
        "for_other_key": _cert(d, "other-key-leaf.pem", "someone else",
                               serialization.load_pem_private_key(keys["other"].read_bytes(), None),
                               "Test Intermediate CA", mid_key, ca=False),
    }
    return out


def cert_overrides(keys, pki, leaf: str = "leaf", chain: tuple[str, ...] = ("mid", "root")) -> list[str]:
    return [f"publish.signing_key={keys['priv']}", f"publish.signing_certificate={pki[leaf]}",
            f"publish.certificate_chain=[{','.join(str(pki[c]) for c in chain)}]"]


@pytest.fixture(scope="module")
def cert_signed_runs(pristine_runs, keys, pki, tmp_path_factory) -> Path:
    return _published_once(pristine_runs, tmp_path_factory.mktemp("cert_signed") / "runs",
                           *cert_overrides(keys, pki))


@pytest.fixture
def cert_signed(cert_signed_runs, run_root) -> Path:
    """run_root published with the leaf certificate and its chain (a copy of `cert_signed_runs`)."""
    return _as_run_root(cert_signed_runs, run_root)


def _subject() -> str:
    return "CN=specquant publisher,O=specquant tests"


def test_certificate_signed_folder_verifies_and_names_its_certificate(cert_signed, keys, pki, run_root, capsys):
    """Signed with a certificate: verifies against the root CA, names the certificate; the card and the record
    say so (subject, fingerprint), and no private key material reaches any file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    from pipeline.stages import publish

    fp = x509.load_pem_x509_certificate(pki["leaf"].read_bytes()).fingerprint(hashes.SHA256()).hex()
    rc, lines = verify_cli(capsys, cert_signed, "--root-certs", pki["root"])
    assert rc == 0 and len(lines) == 1, lines
    assert lines[0].startswith("verify: OK") and f"and {SIG} verifies with {pki['root']} (signed by {_subject()}, " \
        f"certificate sha256 {fp[:16]}...)" in lines[0], lines
    bundle = json.loads((cert_signed / SIG).read_text())
    chain = bundle["verificationMaterial"]["x509CertificateChain"]["certificates"]
    assert len(chain) == 3  # leaf, intermediate, root: the chain travels inside the signature
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert {prov.ATTESTATION, prov.FILE_LIST, "README.md", "model.safetensors"} <= \
        {r["name"] for r in statement["predicate"]["resources"]}
    readme = (cert_signed / "README.md").read_text()
    assert f"**Signed** with OpenSSF model signing (OMS, `model-signing {signing.tool_version()}`) by the " \
           f"certificate `{_subject()}` (sha256 fingerprint `{fp}`, issued by " \
           "`CN=Test Intermediate CA,O=specquant tests`" in readme
    assert "--root-certs <publisher's root CA certificate>" in readme and str(keys["priv"]) not in readme
    rec = json.loads((run_root / "tiny" / "publish" / "nvfp4.json").read_text())["signature"]
    assert rec["certificate"]["sha256"] == fp and rec["certificate"]["subject"] == _subject()
    assert rec["signing_certificate_path"] == str(pki["leaf"]) and rec["root_certs_paths"] == [str(pki["root"])]
    body = _key_body(keys["priv"])
    for p in (run_root / "tiny").rglob("*"):
        if p.is_file():
            text = p.read_bytes().decode("utf-8", "replace")
            assert "-----BEGIN PRIVATE KEY-----" not in text and not any(b in text for b in body), p
    # the whole run verifies too, and a re-publish keeps the signature (no new Hub commit)
    rc, lines = verify_cli(capsys, run_root / "tiny", "--root-certs", pki["root"])
    assert rc == 0 and f"publish/nvfp4/{SIG} verifies with" in lines[0], lines
    before = (cert_signed / SIG).read_bytes()
    publish.run(publish_cfg(run_root, *cert_overrides(keys, pki)))
    assert (cert_signed / SIG).read_bytes() == before


def test_certificate_signature_from_an_expired_certificate_still_verifies_and_says_so(cert_signed, keys, pki, capsys):
    """model_signing checks the chain at the certificate's start of validity (no trusted time in the bundle):
    a folder signed (directly with model_signing) by a certificate that has since expired verifies, and the
    OK line says it expired."""
    from model_signing import signing as oms

    (cert_signed / SIG).unlink()
    oms.Config().set_hashing_config(signing._hashing_config()).use_certificate_signer(
        private_key=keys["priv"], signing_certificate=pki["expired"],
        certificate_chain=[pki["mid"], pki["root"]]).sign(cert_signed, cert_signed / SIG)
    rc, lines = verify_cli(capsys, cert_signed, "--root-certs", pki["root"])
    assert rc == 0 and len(lines) == 1, lines
    assert f"its certificate {_subject()} expired on " in lines[0] and "no trusted time" in lines[0], lines


def _resign(folder: Path, keys, pki, leaf: str, chain: tuple[str, ...]) -> None:
    from model_signing import signing as oms

    (folder / SIG).unlink()
    oms.Config().set_hashing_config(signing._hashing_config()).use_certificate_signer(
        private_key=keys["priv"], signing_certificate=pki[leaf],
        certificate_chain=[pki[c] for c in chain]).sign(folder, folder / SIG)


def _key_sign(folder: Path, keys) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"publish": {"signing_key": str(keys["priv"]), "signing_key_env": None,
                                        "signing_key_password_env": None, "public_key": None}})
    (folder / SIG).unlink()
    signing.sign_folder(folder, signing.signer_from_config(cfg))


WHAT.update({
    "certificate: tampered file": "certificate-signed folder, model.safetensors altered and the statement and file "
                                  "list rewritten to match: verify --root-certs names the file in one sentence.",
    "certificate: tampered manifest": "certificate-signed folder, quant_run_manifest.json edited: named once, with "
                                      "the signature failing on it.",
    "certificate: another CA's certificate": "re-signed with a certificate of the same subject and key issued by "
                                             "another CA: verify --root-certs refuses the chain in one sentence.",
    "certificate: verified against another CA": "certificate-signed folder verified with another CA's root: one "
                                                "sentence naming the certificate and the roots.",
    "certificate: missing signature": "model.sig deleted, verified with --root-certs: one sentence naming model.sig.",
    "certificate: verified with a public key": "certificate-signed folder verified with --public-key: one sentence "
                                               "saying to use --root-certs.",
    "certificate: a bare-key signature checked with root certs": "re-signed with the bare key, verified with "
                                                                 "--root-certs: one sentence saying to use --public-key.",
    "certificate: expired": "publish: publish.signing_certificate expired two days ago.",
    "certificate: for another key": "publish: publish.signing_certificate was issued for another key.",
    "certificate: not for signing": "publish: a certificate without digitalSignature key usage.",
    "certificate: chain empty": "publish: publish.certificate_chain empty.",
    "certificate: chain of another CA": "publish: a certificate whose chain does not reach publish.root_certs.",
    "certificate: a key, not a certificate": "publish: publish.signing_certificate names a public key file.",
    "certificate: no root to check with": "publish: a chain without a root and no publish.root_certs.",
})

CERT_CASES = {
    "certificate: tampered file": (
        lambda f, k, c: (_flip(f / "model.safetensors"), _rewrite_records(f, "model.safetensors")), "root",
        f"{SIG}: the folder no longer matches its signature (model.safetensors, ", "changed since signing"),
    "certificate: tampered manifest": (lambda f, k, c: _tamper_manifest(f), "root",
                                       "quant_run_manifest.json: changed (",
                                       f"the signature in {SIG} no longer matches it either"),
    "certificate: another CA's certificate": (lambda f, k, c: _resign(f, k, c, "other_leaf", ("other_root",)), "root",
                                              f"{SIG}: its signing certificate {_subject()} (issued by "
                                              "CN=Other Root CA,O=specquant tests) does not chain to the root "
                                              "certificates ", "it was issued by another CA"),
    "certificate: verified against another CA": (lambda f, k, c: None, "other_root",
                                                 f"{SIG}: its signing certificate {_subject()} (issued by "
                                                 "CN=Test Intermediate CA,O=specquant tests) does not chain to the "
                                                 "root certificates ", "self-signed certificate in certificate chain"),
    "certificate: missing signature": (lambda f, k, c: (f / SIG).unlink(), "root",
                                       f"{SIG}: missing; the folder is unsigned, so it cannot be verified with ", ""),
    "certificate: verified with a public key": (lambda f, k, c: None, "pub",
                                                f"{SIG}: signed with the certificate {_subject()} (sha256 ",
                                                "verify it with --root-certs"),
    "certificate: a bare-key signature checked with root certs": (
        lambda f, k, c: _key_sign(f, k), "root", f"{SIG}: signed with a bare elliptic-curve key (public key sha256 ",
        "verify it with --public-key"),
}


@pytest.mark.faults("tamper")
@pytest.mark.parametrize("case", [Case(c, WHAT[c]) for c in CERT_CASES])
def test_tampered_certificate_signed_folder_is_refused_in_one_sentence(case, cert_signed, keys, pki, capsys):
    """A certificate-signed folder altered, re-signed by another CA, or checked with the wrong trust: refused in
    one sentence naming model.sig or the file."""
    tamper, trust, start, contains = CERT_CASES[case]
    tamper(cert_signed, keys, pki)
    how = ["--public-key", keys["pub"]] if trust == "pub" else ["--root-certs", pki[trust]]
    rc, lines = verify_cli(capsys, cert_signed, *how)
    assert rc == 1, lines
    assert len(lines) == 2 and lines[1] == f"verify: FAILED, 1 problem(s) in {cert_signed}", lines
    sentence = lines[0].removeprefix("verify: ")
    assert sentence.startswith(start) and contains in sentence, sentence
    assert sentence.count(". ") == 0 and "\n" not in sentence


CERT_BAD = {
    "certificate: expired": (lambda k, c: cert_overrides(k, c, "expired"), "`publish.signing_certificate` = ",
                             f"the certificate {_subject()} expired on "),
    "certificate: for another key": (lambda k, c: cert_overrides(k, c, "for_other_key"),
                                     "`publish.signing_certificate` = ", "is not for the signing key"),
    "certificate: not for signing": (lambda k, c: cert_overrides(k, c, "not_for_signing"),
                                     "`publish.signing_certificate` = ", "allows neither digital signatures"),
    "certificate: chain empty": (lambda k, c: cert_overrides(k, c, chain=()), "`publish.certificate_chain` = []: ",
                                 "needs the certificates that issued"),
    "certificate: chain of another CA": (lambda k, c: [*cert_overrides(k, c, chain=("mid",)),
                                                       f"publish.root_certs=[{c['other_root']}]"],
                                         "`publish.signing_certificate` = ",
                                         "model signing cannot verify a signature by it: it does not chain to "),
    "certificate: a key, not a certificate": (lambda k, c: [f"publish.signing_key={k['priv']}",
                                                            f"publish.signing_certificate={k['pub']}",
                                                            f"publish.certificate_chain=[{c['root']}]"],
                                              "`publish.signing_certificate` = ", "holds no PEM certificate"),
    "certificate: no root to check with": (lambda k, c: cert_overrides(k, c, chain=("mid",)),
                                           "`publish.root_certs` = None: ", "holds no root (self-signed) certificate"),
}


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("case", [Case(c, WHAT[c]) for c in CERT_BAD])
def test_bad_certificate_settings_fail_in_one_sentence_before_writing(case, run_root, keys, pki):
    """publish with a bad certificate setting: one sentence naming the field, nothing assembled."""
    from pipeline.core.errors import SpecquantError
    from pipeline.stages import publish

    overrides, start, contains = CERT_BAD[case]
    with pytest.raises(SpecquantError) as err:
        publish.run(publish_cfg(run_root, *overrides(keys, pki)))
    msg = str(err.value)
    assert msg.startswith(start) and contains in msg and msg.count("\n") == 0, msg
    assert "PRIVATE KEY" not in msg and not any(b in msg for b in _key_body(keys["priv"]))
    assert not (run_root / "tiny" / "publish").exists()


@pytest.mark.faults("bad_input")
def test_bad_root_certs_for_verify_fail_in_one_sentence(cert_signed, keys, capsys):
    """verify: --root-certs naming a private key or a missing file: one sentence, no traceback, key never echoed."""
    from pipeline.__main__ import main

    for bad, contains in ((keys["priv"], "holds a private key"), (keys["priv"].parent / "nope.pem", "cannot be read")):
        capsys.readouterr()
        rc = main(["verify", str(cert_signed), "--root-certs", str(bad)])
        out = capsys.readouterr()
        text = out.out + out.err
        assert rc != 0 and "Traceback" not in text and f"`--root-certs` = '{bad}'" in text and contains in text, text
        assert not any(b in text for b in _key_body(keys["priv"]))


def test_certificate_signature_without_roots_is_reported_not_checked(cert_signed, capsys):
    rc, lines = verify_cli(capsys, cert_signed)
    assert rc == 0 and lines[-1] == f"verify: {SIG}: certificate signature present but not checked (no root " \
                                    "certificates: pass --root-certs PATH or set publish.root_certs)", lines


def test_run_dir_verify_notes_each_unsigned_folder_by_name(run_root, capsys):
    from pipeline.stages import publish

    publish.run(publish_cfg(run_root))
    rc, lines = verify_cli(capsys, run_root / "tiny")
    assert rc == 0 and lines[-1] == f"verify: publish/nvfp4: unsigned: no {SIG} (the hashes show the files agree " \
                                    "with their records, not who published them)", lines
