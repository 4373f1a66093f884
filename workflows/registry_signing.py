"""Signed versions: registration signs the digests of a version's files (its card included) with OpenSSF
model-signing (an elliptic-curve key: registry.signing_key), into the version's `model.sig`; every reader
verifies a downloaded version against registry.trusted_keys before anything of it is loaded, and refuses an
unsigned version, a changed, added or missing file, or a signature by another key, in one line naming the
model and the file.

The manifest is built from the sha256 digests this module computes once per file (model-signing's own
`sign(path)` would hash the folder again), through model-signing's manifest and key signer: its public
`signing.Config` takes only a folder to hash. The files written beside a version after registration (its
evaluation, the promotion decision, the claim) are not part of the signature.
"""

from __future__ import annotations

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


def verify(folder: Path, what: str, trusted: list[str], allow_unsigned: bool) -> None:
    """Refuse, in one line naming `what` and the file, a downloaded version in `folder` whose files are not
    those its signature names, by one of the `trusted` keys (registry.trusted_keys)."""
    signature = folder / SIGNATURE_FILE
    if not signature.is_file():
        if allow_unsigned:
            return
        raise UserError(f"{what} is not signed (no {SIGNATURE_FILE}: registered before signing, or its signature was "
                        "removed from the store): refused; registry.allow_unsigned=true loads unsigned versions")
    signed = _signed_digests(signature, what, trusted)
    found = digests(folder)
    for name in sorted(signed.keys() | found.keys()):
        if name not in found:
            raise UserError(f"{what}: {name} is signed but missing from the store: refused")
        if name not in signed:
            raise UserError(f"{what}: {name} was added after the version was signed: refused")
        if found[name] != signed[name]:
            raise UserError(f"{what}: {name} changed after the version was signed: refused")


def _signed_digests(signature: Path, what: str, trusted: list[str]) -> dict[str, str]:
    """name -> sha256 as the signature states them, once it verifies against one of the trusted keys."""
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    if signature.stat().st_size > MAX_SIGNATURE_BYTES:
        raise UserError(f"{what}: {SIGNATURE_FILE} is over {MAX_SIGNATURE_BYTES} bytes: refused")
    try:
        bundle = sign_sigstore_pb.Signature.read(signature)
    except Exception as e:  # noqa: BLE001 - JSON, protobuf or base64 errors alike: not a bundle
        raise UserError(f"{what}: {SIGNATURE_FILE} is not a signature bundle ({type(e).__name__}): refused") from None
    for spec in trusted:
        verifier = _loaded(sign_ec_key.Verifier, spec, "registry.trusted_keys", public=True)
        try:
            stated = verifier.verify(bundle)
        except ValueError as e:
            if str(e).startswith("Key mismatch"):  # signed by another key: try the next trusted one
                continue
            raise UserError(f"{what}: {SIGNATURE_FILE} does not verify ({str(e).splitlines()[0]}): "
                            "refused") from None
        except Exception as e:  # noqa: BLE001 - cryptography's InvalidSignature and the like
            raise UserError(f"{what}: {SIGNATURE_FILE} does not verify ({type(e).__name__}): refused") from None
        out = {}
        for rd in stated.resource_descriptors():
            if rd.digest.algorithm != _HASH:
                raise UserError(f"{what}: {SIGNATURE_FILE} states {rd.digest.algorithm} digests, not {_HASH}: refused")
            out[rd.identifier] = rd.digest.digest_value.hex()
        return out
    raise UserError(f"{what} is signed by a key that is not in registry.trusted_keys: refused")


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
