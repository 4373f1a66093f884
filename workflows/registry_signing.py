"""Signed versions and lifecycle records. Registration signs the digests of a version's files (its card
included) with OpenSSF model-signing (an elliptic-curve key: registry.signing_key), into the version's
`model.sig`; every reader verifies a downloaded version against registry.trusted_keys before anything of it
is loaded, and refuses an unsigned version, a changed, added or missing file, or a signature by another key,
in one line naming the model and the file.

The lifecycle's records (an alias's moves, a version's evaluation and promotion decision) are written after
registration, each by the command that makes it: each carries a signature of its own content by the same
key (sign_record), so a writer to the bucket cannot point an alias, forge a move's who, why and when, or a
gate's decision; a reader checks it before it believes the record (verified_record).

The manifest is built from the sha256 digests this module computes once per file (model-signing's own
`sign(path)` would hash the folder again), through model-signing's manifest and key signer: its public
`signing.Config` takes only a folder to hash. The files written beside a version after registration (its
evaluation, the promotion decision, the claim) are not part of the version's signature.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from workflows.errors import UserError
from workflows.storage.transfer import sha256_file

SIGNATURE_FILE = "model.sig"
MAX_SIGNATURE_BYTES = 1 << 20  # a bundle of one signature and one public key's hash: kilobytes
RECORD_SIGNATURE = "signature"  # a lifecycle record's signature, inside it (sign_record)
AUTO = "auto"
AUTO_ENV = {False: "WORKFLOWS_SIGNING_KEY", True: "WORKFLOWS_SIGNING_PUBLIC_KEY"}  # what `auto` reads first
_HASH = "sha256"


def digests(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of each file directly in `folder` (a version is flat), by name."""
    return {f.name: sha256_file(f) for f in sorted(folder.iterdir())
            if f.is_file() and f.name not in skip and f.name != SIGNATURE_FILE}


def signer(key_spec: str):
    """model-signing's signer with the private key `key_spec` names (registry.signing_key), loaded now: a
    registration checks its key before it claims a version."""
    from model_signing._signing import sign_ec_key

    return _loaded(sign_ec_key.Signer, key_spec, "registry.signing_key", public=False)


def sign(key: Any, what: str, files: dict[str, str]) -> bytes:
    """The signature (a Sigstore bundle, model-signing's format) of `files` (name -> sha256) by `key`
    (signer())."""
    from model_signing import manifest
    from model_signing._hashing import hashing
    from model_signing._signing import signing

    items = [manifest.FileManifestItem(path=PurePosixPath(name), digest=hashing.Digest(_HASH, bytes.fromhex(h)))
             for name, h in sorted(files.items())]
    payload = signing.Payload(manifest.Manifest(what, items, manifest._FileSerialization(_HASH)))
    with tempfile.TemporaryDirectory() as d:
        key.sign(payload).write(Path(d) / SIGNATURE_FILE)
        return (Path(d) / SIGNATURE_FILE).read_bytes()


class Refused(UserError):
    """What the store holds is refused: edited, unsigned, another key's or copied from elsewhere (not a key or
    config error: those are the reader's own)."""


def verify(folder: Path, subject: str, trusted: list[str], allow_unsigned: bool,
           found: dict[str, str] | None = None) -> None:
    """Refuse, in one line naming the model and the file, a downloaded version in `folder` whose files are not
    those its signature names for `subject` (NAME:vN), by one of the `trusted` keys (registry.trusted_keys).
    `found`: the files' digests as the download computed them (else each file is hashed here)."""
    what = f"model {subject}"
    signature = folder / SIGNATURE_FILE
    if not signature.is_file():
        if allow_unsigned:
            return
        raise Refused(unsigned(what))
    if signature.stat().st_size > MAX_SIGNATURE_BYTES:
        raise Refused(f"{what}: {SIGNATURE_FILE} is over {MAX_SIGNATURE_BYTES} bytes: refused")
    signed = signed_digests(signature.read_bytes(), subject, trusted, what)
    found = digests(folder) if found is None else {n: h for n, h in found.items() if n != SIGNATURE_FILE}
    for name in sorted(signed.keys() | found.keys()):
        if name not in found:
            raise Refused(f"{what}: {name} is signed but missing from the store: refused")
        if name not in signed:
            raise Refused(f"{what}: {name} was added after the version was signed: refused")
        if found[name] != signed[name]:
            raise Refused(changed(what, name))


def unsigned(what: str) -> str:
    return (f"{what} is not signed (no {SIGNATURE_FILE}: registered before signing, or its signature was removed "
            "from the store): refused; registry.allow_unsigned=true loads unsigned versions")


def changed(what: str, name: str) -> str:
    return f"{what}: {name} changed after the version was signed: refused"


def signed_digests(signature: bytes, subject: str, trusted: list[str], what: str,
                   label: str = SIGNATURE_FILE) -> dict[str, str]:
    """name -> sha256 as `signature` (a bundle, model-signing's format) states them, once it verifies against one
    of the trusted keys and signs `subject` (a signature copied from another version or record signs another);
    `label` names the signature in refusals."""
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    if len(signature) > MAX_SIGNATURE_BYTES:
        raise Refused(f"{what}: {label} is over {MAX_SIGNATURE_BYTES} bytes: refused")
    with tempfile.TemporaryDirectory() as d:  # model-signing reads bundles from files
        (Path(d) / SIGNATURE_FILE).write_bytes(signature)
        try:
            bundle = sign_sigstore_pb.Signature.read(Path(d) / SIGNATURE_FILE)
        except Exception as e:  # noqa: BLE001 - JSON, protobuf or base64 errors alike: not a bundle
            raise Refused(f"{what}: {label} is not a signature bundle ({type(e).__name__}): refused") from None
    for spec in trusted:
        verifier = _loaded(sign_ec_key.Verifier, spec, "registry.trusted_keys", public=True)
        try:
            stated = verifier.verify(bundle)
        except ValueError as e:
            if str(e).startswith("Key mismatch"):  # signed by another key: try the next trusted one
                continue
            raise Refused(f"{what}: {label} does not verify ({str(e).splitlines()[0]}): refused") from None
        except Exception as e:  # noqa: BLE001 - cryptography's InvalidSignature and the like
            raise Refused(f"{what}: {label} does not verify ({type(e).__name__}): refused") from None
        if stated.model_name != subject:
            raise Refused(f"{what}: {label} signs {str(stated.model_name)[:80]!r}, not {subject!r}: refused (a "
                          "signature copied from elsewhere in the store)")
        out = {}
        for rd in stated.resource_descriptors():
            if rd.digest.algorithm != _HASH:
                raise Refused(f"{what}: {label} states {rd.digest.algorithm} digests, not {_HASH}: refused")
            out[rd.identifier] = rd.digest.digest_value.hex()
        return out
    raise Refused(f"{what} is signed by a key that is not in registry.trusted_keys: refused")


def sign_record(key: Any, subject: str, name: str, content: dict[str, Any]) -> dict[str, Any]:
    """A lifecycle record (an alias move, a version's evaluation or promotion decision) as stored: its content
    and, under RECORD_SIGNATURE, a signature by `key` of its content's digest as the file `name` of `subject`
    (NAME@ALIAS, NAME:vN)."""
    content = json.loads(json.dumps(content))  # as a reader parses it: tuples as lists, keys as strings
    if RECORD_SIGNATURE in content:
        raise ValueError(f"a record's content has no {RECORD_SIGNATURE!r} key")
    bundle = sign(key, subject, {name: hashlib.sha256(_canonical(content)).hexdigest()})
    return {**content, RECORD_SIGNATURE: json.loads(bundle)}


def verified_record(stored: dict[str, Any], subject: str, name: str, trusted: list[str], allow_unsigned: bool,
                    where: str) -> dict[str, Any]:
    """The content of a stored lifecycle record (sign_record), once its signature verifies against a trusted key
    for `subject` and `name`; else refused in one line naming `where` (its file)."""
    content = {k: v for k, v in stored.items() if k != RECORD_SIGNATURE}
    if RECORD_SIGNATURE not in stored:
        if allow_unsigned:
            return content
        raise Refused(f"{where} is not signed: refused (a record written before signing, or its signature "
                      "removed in the store); registry.allow_unsigned=true reads unsigned records")
    signed = signed_digests(json.dumps(stored[RECORD_SIGNATURE]).encode(), subject, trusted, where,
                            label="its signature")
    if signed != {name: hashlib.sha256(_canonical(content)).hexdigest()}:
        raise Refused(f"{where} changed after it was signed: refused; the record was edited in the store")
    return content


def _canonical(content: dict[str, Any]) -> bytes:
    """The bytes a record's signature covers: sorted, compact JSON. Not JCS (rfc8785), which refuses the NaN an
    evaluation's metrics can hold; writer and reader are both this module, and Python's float repr
    round-trips, so a parsed record gives the same bytes as the one signed."""
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _loaded(kind, spec: str, field: str, public: bool):
    """model-signing's `kind` (its EC key Signer or Verifier) built on the key `spec` names; a file that is no
    EC key in PEM is refused in one line naming the field."""
    with _key_file(spec, field, public) as key:
        try:
            return kind(key)
        except (ValueError, TypeError) as e:
            what = "public" if public else "private"
            raise UserError(f"{field}: {spec} is not an EC {what} key in PEM ({str(e).splitlines()[0][:120]})") \
                from None


@contextmanager
def _key_file(spec: str, field: str, public: bool) -> Iterator[Path]:
    """The PEM file a key spec names (model-signing reads keys from files): a path, env:NAME, whose PEM is
    written to a temporary file of mode 0600 for the call, or `auto`: env:AUTO_ENV's variable where it is
    set (a cluster's pods get the same keys from a Secret: cluster/kuberay), else auto_key_pair."""
    if spec == AUTO and os.environ.get(AUTO_ENV[public]):
        spec = f"env:{AUTO_ENV[public]}"
    if spec == AUTO:
        private, pub = auto_key_pair()
        yield pub if public else private
    elif spec.startswith("env:"):
        name = spec[len("env:"):]
        pem = os.environ.get(name)
        if not pem:
            raise UserError(f"{field} names the environment variable {name}, which is not set")
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "key.pem"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(pem)
            yield path
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"{field}: no key file at {path}")
        yield path


def auto_key_pair() -> tuple[Path, Path]:
    """The key pair `auto` names: made once under the user's config directory (the private key mode 0600),
    by whichever process needs it first; processes racing to make it all end up with the first's."""
    import platformdirs

    folder = Path(platformdirs.user_config_dir("workflows")) / "signing"
    private, public = folder / "registry-key.pem", folder / "registry-key.pub.pem"
    if not private.is_file():
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        _create_once(private, new_private_key(), 0o600)
    if not public.is_file():
        _create_once(public, public_key_of(private.read_bytes()), 0o644)
    return private, public


def new_private_key() -> bytes:
    """A new P-256 private key, as unencrypted PKCS8 PEM (what registry.signing_key reads)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def public_key_of(private_pem: bytes) -> bytes:
    """The public key (PEM) of a private key in PEM (what registry.trusted_keys reads)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(private_pem, password=None)
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _create_once(path: Path, data: bytes, mode: int) -> None:
    """`path` with `data`, whole, unless another process created it first (a hard link cannot replace)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
