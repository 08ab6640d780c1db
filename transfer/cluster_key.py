"""The cluster key: one ZeroMQ CURVE key pair that every router, worker and probe of a deployment
holds, and the file it lives in (``pdserve keygen`` writes it, ``--cluster-key FILE`` reads it).

File format: the ZeroMQ certificate format (ZPL, as czmq's ``zcert`` and pyzmq's
``zmq.auth.load_certificate`` read it), UTF-8 text, mode 0600 when ``pdserve keygen`` writes it::

    #   pdserve cluster key (ZeroMQ CURVE, Z85) ...comment lines...
    metadata
        fingerprint = "1a2b3c4d5e6f7a8b"
    curve
        public-key = "<40 Z85 characters>"
        secret-key = "<40 Z85 characters>"

Only ``public-key`` and ``secret-key`` are read; the public key must be the secret key's (a file
edited by hand or cut short is refused with the reason). The secret key alone is enough to rebuild
the pair: ``PDSERVE_CLUSTER_SECRET_KEY`` carries just it (how ``pdserve launch`` hands its
ephemeral key to its workers without putting it on a command line).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq

KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85
_LINE = re.compile(r'^\s*(public-key|secret-key)\s*=\s*"?([^"\s]*)"?\s*$')


class ClusterKeyError(ValueError):
    """A cluster key (file or value) that cannot be used; the message says what to change."""


@dataclass(frozen=True, repr=False)
class ClusterKey:
    """A CURVE key pair in Z85 (``public``/``secret``: 40 ASCII bytes each). ``repr`` shows only the
    fingerprint, so the secret never lands in a log or a traceback."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> ClusterKey:
        """A fresh random key pair (``zmq.curve_keypair``)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_secret(cls, secret: str | bytes, source: str = "the secret key") -> ClusterKey:
        """The pair of a Z85 secret key; ``ClusterKeyError`` naming ``source`` if it is not one."""
        raw = secret.encode() if isinstance(secret, str) else secret
        raw = raw.strip()
        if len(raw) != KEY_CHARS:
            raise ClusterKeyError(
                f"{source}: a CURVE key is {KEY_CHARS} Z85 characters, got {len(raw)}; "
                f"make a key with 'pdserve keygen FILE'"
            )
        try:
            public = zmq.curve_public(raw)
        except (zmq.ZMQError, ValueError) as e:
            raise ClusterKeyError(f"{source}: not a Z85 CURVE key ({e}); make one with 'pdserve keygen FILE'") from None
        return cls(public, raw)

    @property
    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 of the public key: safe to log and compare between hosts."""
        return hashlib.sha256(self.public).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"ClusterKey(fingerprint={self.fingerprint})"


def key_file_text(key: ClusterKey) -> str:
    """The file ``pdserve keygen`` writes for ``key`` (format in the module docstring)."""
    return (
        "#   pdserve cluster key (ZeroMQ CURVE, Z85): every router, worker and probe of one\n"
        "#   deployment needs this same file (--cluster-key FILE or PDSERVE_CLUSTER_KEY=FILE).\n"
        "#   Anyone who holds it can drive the workers: keep it mode 0600 and out of images and git.\n"
        "metadata\n"
        f'    fingerprint = "{key.fingerprint}"\n'
        "curve\n"
        f'    public-key = "{key.public.decode()}"\n'
        f'    secret-key = "{key.secret.decode()}"\n'
    )


def write_key_file(path: str | Path, key: ClusterKey, overwrite: bool = False) -> None:
    """Write ``key`` to ``path`` with mode 0600 (created that way: never readable by others, not even
    for a moment). An existing file is kept unless ``overwrite`` (``FileExistsError``)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # an overwritten file keeps its old mode otherwise
        f.write(key_file_text(key))


def parse_key_text(text: str, source: str) -> ClusterKey:
    """The key pair in a key file's ``text``; ``ClusterKeyError`` naming ``source`` and what is wrong."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if m := _LINE.match(line):
            found[m.group(1)] = m.group(2)
    if "secret-key" not in found:
        raise ClusterKeyError(
            f"{source}: no secret-key line (is it a public certificate, or not a key file?); "
            f"make one with 'pdserve keygen FILE'"
        )
    key = ClusterKey.from_secret(found["secret-key"], f"{source}: secret-key")
    if "public-key" in found and found["public-key"].encode() != key.public:
        raise ClusterKeyError(
            f"{source}: public-key is not the secret-key's public key (file edited or mixed "
            f"from two keys); make a new one with 'pdserve keygen FILE'"
        )
    return key


def read_key_file(path: str | Path) -> ClusterKey:
    """The key pair in the file at ``path``; ``ClusterKeyError`` if it cannot be read or parsed."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ClusterKeyError(f"cluster key file {path}: {reason}; make one with 'pdserve keygen {path}'") from None
    return parse_key_text(text, f"cluster key file {path}")
