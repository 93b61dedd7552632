"""The client side: channels and per-call metadata presenting this service's credentials."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from tandem.services.common.security.config import (
    AUTHORIZATION_METADATA,
    CLUSTER_KEY_METADATA,
    AuthConfig,
    cluster_key,
    load_secret,
)

log = logging.getLogger("tandem.services.common.security")

# -- client side -------------------------------------------------------------------------------


def internal_metadata(auth: AuthConfig) -> tuple[tuple[str, str], ...]:
    """Metadata that authenticates an internal call: the cluster key, or () when no cluster
    secret is configured. For callers that pass metadata per call (sync channels)."""
    if not auth.cluster_secret_file:
        return ()
    return ((CLUSTER_KEY_METADATA, cluster_key(load_secret(auth.cluster_secret_file))),)


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """Metadata presenting an API or admin key."""
    return ((AUTHORIZATION_METADATA, f"Bearer {key}"),)


class _AddMetadata:
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def _details(self, details: Any) -> Any:
        merged = grpc.aio.Metadata(*tuple(details.metadata or ()), *self._metadata)
        return details._replace(metadata=merged)


class _UnaryUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def metadata_interceptors(metadata: Sequence[tuple[str, str]]) -> list[Any]:
    """aio client interceptors adding `metadata` to every call of a channel (one per call
    kind: grpc.aio files each interceptor under the first kind it implements)."""
    return [cls(metadata) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def channel_credentials(auth: AuthConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the cluster CA and presenting this service's certificate;
    None when internal TLS is off."""
    if not auth.internal_tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(auth.internal_ca_file).read_bytes(),
        private_key=Path(auth.internal_tls_key_file).read_bytes(),
        certificate_chain=Path(auth.internal_tls_cert_file).read_bytes(),
    )


def internal_channel(
    address: str, auth: AuthConfig, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An aio channel to another service of the deployment: TLS with the cluster CA and this
    service's certificate when internal TLS is set (the peer's certificate must name the
    host of `address`, e.g. a SAN with the pod IP or service DNS name; the option
    ("grpc.ssl_target_name_override", name) checks another name), plaintext otherwise; every
    call carries the cluster key when a cluster secret is set. gRPC sends call credentials
    only over TLS, so the key is added by a client interceptor, which works on both."""
    interceptors = (
        metadata_interceptors(internal_metadata(auth)) if auth.cluster_secret_file else None
    )
    credentials = channel_credentials(auth)
    if credentials is not None:
        return grpc.aio.secure_channel(
            address, credentials, options=list(options), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def server_port_credentials(auth: AuthConfig) -> grpc.ServerCredentials | None:
    """Credentials for `server.add_secure_port`: this service's certificate, and client
    certificates required and verified against the cluster CA (mutual TLS). None when
    internal TLS is off (an insecure port)."""
    if not auth.internal_tls:
        return None
    return grpc.ssl_server_credentials(
        [
            (
                Path(auth.internal_tls_key_file).read_bytes(),
                Path(auth.internal_tls_cert_file).read_bytes(),
            )
        ],
        root_certificates=Path(auth.internal_ca_file).read_bytes(),
        require_client_auth=True,
    )
