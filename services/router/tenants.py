"""Who is calling the public API, and what that means for the prefix cache: the API keys
name tenants, and each tenant's prompts hash apart (neither sharing nor probing another's
cache) unless the operator lists it as sharing."""

from __future__ import annotations

import logging

from tandem.services.common import security

log = logging.getLogger(__name__)


class Tenants:
    """`api_keys_file`: `<key> <tenant> [scopes]` per line ("": calls need no key);
    `shared_cache_tenants`: comma-separated tenants whose prompts share the common cache."""

    def __init__(self, api_keys_file: str, shared_cache_tenants: str) -> None:
        self.api_keys_file = api_keys_file
        self.shared = {t.strip() for t in shared_cache_tenants.split(",") if t.strip()}

    def load_keyring(self) -> security.KeyRing | None:
        """The public API's keys, read at start; None without api_keys_file."""
        if not self.api_keys_file:
            log.warning("no api_keys_file: the public API takes calls without a key")
            return None
        keyring = security.KeyRing.load(self.api_keys_file)
        log.info("public API keys: %d (tenants' prefix caches apart)", len(keyring))
        return keyring

    @staticmethod
    def current() -> str:
        """The calling tenant (from its API key); "" without keys."""
        principal = security.current_principal()
        return principal.tenant if principal is not None else ""

    def cache_salt(self, tenant: str) -> str:
        """Tenants get prefix caches of their own: neither shares nor probes another's."""
        if not tenant or tenant in self.shared:
            return ""
        return f"tenant:{tenant}"
