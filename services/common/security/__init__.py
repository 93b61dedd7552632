"""Who may call what: the settings every service shares, the keys it loads, and the gRPC
pieces that check them (server) and present them (client).

Three planes (README "Security"):
  public    clients -> router: API keys (`authorization: Bearer <key>`), each naming a
            tenant and its scopes; optional server TLS.
  internal  router <-> workers <-> controller: a cluster secret (metadata, constant-time
            compared) or mutual TLS with a cluster CA; the same secret keys the HMAC of KV
            hand-offs (tandem.transfer.signing).
  admin     `tandem ctl` -> controller: admin keys.

Public API:
  AuthConfig                    the internal plane's files (nested as `auth` in each config)
  load_secret(path), derive_key(secret, purpose)
  Principal                     who called: key_id (a non-secret fingerprint), tenant, scopes
  KeyRing.load(path) / .parse(text)   `<key> <tenant> [scope,scope]` lines; .lookup(token)
  current_principal()           the Principal of the call being handled (None: no key used)
  Open(), Internal(), Bearer(*scopes)  rules, keyed by "/pkg.Service/Method" or "pkg.Service"
  AuthInterceptor(rules, auth=, keyring=, default=Internal())   server interceptor
  internal_channel(address, auth, options)   aio channel presenting this service's credentials
  internal_metadata(auth), bearer_metadata(key)   the same as per-call metadata
  server_port_credentials(auth) mTLS credentials for add_secure_port (None: TLS off)

Rules, checked before the handler runs (and before StatusInterceptor's checks):
  Open          anyone (gRPC health: the kubelet's probe sends no metadata; reflection).
  Internal      a service of this deployment: metadata `x-tandem-cluster-key` equal to
                derive_key(secret, "internal-auth").hex(), or, with internal TLS on, a client
                certificate the cluster CA signed (the handshake verifies it). Otherwise
                UNAUTHENTICATED.
  Bearer(s...)  `authorization: Bearer <key>` of a KeyRing key holding any one of the scopes:
                UNAUTHENTICATED "missing or invalid API key" without a known key,
                PERMISSION_DENIED "key <key_id> lacks scope <s>" without the scope. The
                handler reads the caller with current_principal().

Development mode: a rule whose credentials are not configured lets every call through.
Internal with no cluster_secret_file and no internal TLS, and Bearer with no KeyRing, check
nothing (current_principal() is None). That is `tandem up` on loopback without its key
flag; a deployment sets the files (the chart generates them).

Keys never reach a log or a status message: logs name a key by its key_id (first 8 hex
digits of its SHA-256).
"""

from tandem.services.common.security.client import (
    bearer_metadata,
    channel_credentials,
    internal_channel,
    internal_metadata,
    metadata_interceptors,
    server_port_credentials,
)
from tandem.services.common.security.config import (
    AUTHORIZATION_METADATA,
    CLUSTER_KEY_METADATA,
    DEFAULT_SCOPE,
    MIN_KEY_CHARS,
    MIN_SECRET_BYTES,
    AuthConfig,
    cluster_key,
    derive_key,
    load_secret,
)
from tandem.services.common.security.keys import KeyRing, Principal, key_id
from tandem.services.common.security.server import (
    AuthInterceptor,
    Bearer,
    Internal,
    Open,
    Refused,
    Rule,
    check_bearer,
    current_principal,
)

__all__ = [
    "AUTHORIZATION_METADATA",
    "CLUSTER_KEY_METADATA",
    "DEFAULT_SCOPE",
    "MIN_KEY_CHARS",
    "MIN_SECRET_BYTES",
    "AuthConfig",
    "AuthInterceptor",
    "Bearer",
    "Internal",
    "KeyRing",
    "Open",
    "Principal",
    "Refused",
    "Rule",
    "bearer_metadata",
    "channel_credentials",
    "check_bearer",
    "cluster_key",
    "current_principal",
    "derive_key",
    "internal_channel",
    "internal_metadata",
    "key_id",
    "load_secret",
    "metadata_interceptors",
    "server_port_credentials",
]
