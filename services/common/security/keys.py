"""API keys: Principal (who called) and KeyRing (`<key> <tenant> [scope,scope]` lines)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tandem.services.common.security.config import DEFAULT_SCOPE, MIN_KEY_CHARS

log = logging.getLogger("tandem.services.common.security")

# -- API keys ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a key names. key_id: a short non-secret fingerprint of the key, for logs."""

    key_id: str
    tenant: str
    scopes: frozenset[str]


def key_id(key: str) -> str:
    """The first 8 hex digits of the key's SHA-256: names a key in logs without revealing it."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


class KeyRing:
    """API keys, each naming a tenant and its scopes. The file format, one key a line
    (`#` starts a comment, so keys hold no `#`):

        # comment
        <key> <tenant> [scope1,scope2]      (default scope: "generate")

    Keys are >= 16 printable ASCII characters without spaces; tenants and scopes are names
    of letters, digits and `._:-` (they appear in logs and cache salts)."""

    def __init__(self, entries: Iterable[tuple[str, str, Iterable[str]]] = ()) -> None:
        """entries: (key, tenant, scopes). Raises ValueError (naming the entry's position,
        never the key) for a short or malformed key, a bad name, or a duplicate key."""
        # sha256(key) -> (key, principal, where): the dict finds the candidate and
        # compare_digest confirms it, so no time depends on how much of a guess is right.
        self._by_digest: dict[bytes, tuple[bytes, Principal, str]] = {}
        for n, (key, tenant, scopes) in enumerate(entries, start=1):
            self._add(f"entry {n}", key, tenant, frozenset(scopes))

    def _add(self, where: str, key: str, tenant: str, scopes: frozenset[str]) -> None:
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"{where}: key has {len(key)} characters; need >= {MIN_KEY_CHARS}")
        if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
            raise ValueError(f"{where}: key must be printable ASCII without spaces")
        if not _NAME.fullmatch(tenant):
            # The value is not quoted: a line with its fields swapped holds the key here.
            raise ValueError(f"{where}: tenant must be 1-64 of [A-Za-z0-9._:-]")
        if not scopes:
            raise ValueError(f"{where}: no scopes")
        for scope in sorted(scopes):
            if not _NAME.fullmatch(scope):
                raise ValueError(f"{where}: scopes must be 1-64 of [A-Za-z0-9._:-] each")
        raw = key.encode()
        digest = hashlib.sha256(raw).digest()
        if digest in self._by_digest:
            raise ValueError(f"{where}: duplicate key (also {self._by_digest[digest][2]})")
        self._by_digest[digest] = (raw, Principal(key_id(key), tenant, scopes), where)

    @classmethod
    def parse(cls, text: str, source: str = "<keys>") -> KeyRing:
        """A KeyRing from the file format above. Raises ValueError "<source> line N: ..."
        (never quoting a key), also when there is no key at all."""
        ring = cls()
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            where = f"{source} line {number}"
            if len(fields) not in (2, 3):
                raise ValueError(
                    f"{where}: need `<key> <tenant> [scope,scope]`, got {len(fields)} fields"
                )
            scopes = fields[2].split(",") if len(fields) == 3 else [DEFAULT_SCOPE]
            ring._add(where, fields[0], fields[1], frozenset(scopes))
        if not ring:
            raise ValueError(f"{source}: no keys")
        return ring

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """A KeyRing from a file (e.g. a mounted Kubernetes Secret)."""
        return cls.parse(Path(path).read_text(encoding="utf-8"), source=str(path))

    def lookup(self, token: str) -> Principal | None:
        """The principal of `token`, or None when it is no key of this ring."""
        raw = token.encode("utf-8", "surrogateescape")
        entry = self._by_digest.get(hashlib.sha256(raw).digest())
        if entry is None or not hmac.compare_digest(entry[0], raw):
            return None
        return entry[1]

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"KeyRing({len(self)} keys)"  # never the keys
