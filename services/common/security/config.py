"""The internal plane's settings and the keys derived from its secret (see the package)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.services.common.security")

CLUSTER_KEY_METADATA = "x-tandem-cluster-key"
AUTHORIZATION_METADATA = "authorization"
DEFAULT_SCOPE = "generate"
MIN_SECRET_BYTES = 16
MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The internal plane's credentials (the same in every service of a deployment).

    Attributes:
        cluster_secret_file: a file holding the cluster secret (any bytes, >= 16; trailing
            whitespace ignored). Internal calls carry it in metadata and servers refuse calls
            without it; it also keys the HMAC of KV hand-offs. Empty: internal auth off.
        internal_tls_cert_file, internal_tls_key_file: this service's certificate and key
            for mutual TLS on the internal plane (server and client side).
        internal_ca_file: the cluster CA that signed every service's certificate.
    """

    cluster_secret_file: str = ""
    internal_tls_cert_file: str = ""
    internal_tls_key_file: str = ""
    internal_ca_file: str = ""

    def __post_init__(self) -> None:
        tls = (self.internal_tls_cert_file, self.internal_tls_key_file, self.internal_ca_file)
        if any(tls) and not all(tls):
            raise ValueError(
                "internal TLS needs internal_tls_cert_file, internal_tls_key_file and "
                "internal_ca_file together"
            )

    @property
    def internal_tls(self) -> bool:
        return bool(self.internal_ca_file)


def load_secret(path: str | Path) -> bytes:
    """The secret in `path`. Raises ValueError when it is shorter than 16 bytes."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret in {path} has {len(secret)} bytes; need >= {MIN_SECRET_BYTES}")
    return secret


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose ("kv-handoff", "internal-auth") from the cluster secret, so
    one leaked derived key does not reveal the others."""
    return hmac.new(secret, f"tandem/{purpose}/v1".encode(), hashlib.sha256).digest()


def cluster_key(secret: bytes) -> str:
    """What internal calls carry in `x-tandem-cluster-key`: the secret itself never travels."""
    return derive_key(secret, "internal-auth").hex()
