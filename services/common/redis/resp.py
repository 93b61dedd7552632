"""A lean RESP2 client for one job: the prefix index's lookup MGET.

`LookupClient` pools plain asyncio streams to Redis and sends pre-encoded requests;
`parse_reply` parses a whole reply from one buffer (with a fast path for an MGET of short
bitmaps) and `encode_command` encodes the few commands it sends itself (AUTH, SELECT). It
speaks the URL's credentials (AUTH [user] password) and TLS (`rediss://`) as redis-py would.
`RedisPrefixIndex` uses it for lookups only; everything else goes through redis-py.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

from redis.asyncio.connection import (
    RedisSSLContext,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.exceptions import AuthenticationError, RedisError, ResponseError

_READ_CHUNK = 1 << 16


def encode_command(args: Sequence[bytes]) -> bytes:
    """One RESP command (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def parse_reply(buf: bytes, pos: int = 0) -> tuple[Any, int] | None:
    """Parse one RESP2 reply at `pos`: (value, position after it), or None while `buf` does
    not hold the whole reply yet.

    Bulk strings are bytes, nil is None, integers are int, a status is bytes, an error reply is
    returned (not raised) as a ResponseError so that the caller can consume the whole reply
    first and keep the connection usable. Arrays of bulk strings, the MGET case, take a fast
    inline path.
    """
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, head, pos = buf[pos : pos + 1], buf[pos + 1 : end], end + 2
    if kind == b"$":
        n = int(head)
        if n < 0:
            return None, pos
        if pos + n + 2 > len(buf):
            return None
        return buf[pos : pos + n], pos + n + 2
    if kind == b"*":
        items: list[Any] = []
        append, startswith, size = items.append, buf.startswith, len(buf)
        for _ in range(int(head)):
            # Fast paths for what an MGET of bitmaps returns: nil, or a bulk string of at most
            # 9 bytes ("$<digit>\r\n"); ~3x quicker than the general case below.
            if startswith(b"$-1\r\n", pos):
                append(None)
                pos += 5
                continue
            if pos + 3 < size and buf[pos] == 36 and buf[pos + 2] == 13:  # b"$", b"\r"
                start = pos + 4
                pos = start + buf[pos + 1] - 46  # digit - ord("0") + len(b"\r\n")
                if pos > size:
                    return None
                append(buf[start : pos - 2])
                continue
            parsed = parse_reply(buf, pos)
            if parsed is None:
                return None
            append(parsed[0])
            pos = parsed[1]
        return items, pos
    if kind == b"+":
        return head, pos
    if kind == b":":
        return int(head), pos
    if kind == b"-":
        return ResponseError(head.decode("utf-8", errors="replace")), pos
    raise ResponseError(f"unexpected RESP reply type {kind!r} from Redis")


def _ssl_context(params: dict[str, Any]) -> ssl.SSLContext | None:
    """The SSLContext redis-py's SSLConnection would build from a URL's `ssl_*` parameters
    (its defaults: certificate required, host name checked); None for parameters it does
    not know or files it cannot load, so that redis-py reports those itself."""
    options: dict[str, Any] = {"cert_reqs": "required", "check_hostname": True}
    options.update({key.removeprefix("ssl_"): value for key, value in params.items()})
    try:
        return RedisSSLContext(**options).get()
    except (TypeError, ValueError, OSError, RedisError):
        return None


class _Connection:
    """One plain asyncio stream to Redis, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def request(self, payload: bytes) -> Any:
        """Send one command, return its reply; raise ResponseError for an error reply (the
        connection stays usable) and ConnectionError when Redis hung up."""
        self._writer.write(payload)
        await self._writer.drain()
        buf = b""
        while True:
            chunk = await self._reader.read(_READ_CHUNK)
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            buf += chunk
            parsed = parse_reply(buf)
            if parsed is not None:
                value, end = parsed
                if end != len(buf):
                    raise ResponseError(f"{len(buf) - end} unexpected bytes after a reply")
                if isinstance(value, ResponseError):
                    raise value
                return value

    def close(self) -> None:
        self._writer.close()

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # the peer hung up first: closed either way


class LookupClient:
    """The lookup's MGET on plain asyncio streams with a small RESP2 reader.

    Why not redis-py: without hiredis (not installed here) its pure-Python parser awaits a
    readline/readexactly per array element, so a 256-block lookup takes ~1.0 ms at p50
    against ~0.28 ms with this client, which parses the whole reply from one buffer (both
    measured by benchmarks/bench_index.py on the same machine). TCP, TLS (`rediss://`, with
    redis-py's `ssl_*` URL parameters and defaults: the certificate and host name verified
    unless `ssl_cert_reqs=none`) and unix-socket URLs with optional username/password/db are
    spoken (`for_url` returns None for anything else, and the index then looks up through
    redis-py). Each new connection sends AUTH first when the URL has a password.

    Connections are pooled (up to `max_idle` kept), one request in flight each. A request
    that meets a dead pooled connection is resent on the next pooled or a new one (MGET is
    read-only, so resending is safe), which rides out connections killed by a Redis restart;
    a connection whose request failed or was cancelled midway is closed, never reused.
    """

    def __init__(
        self,
        connect_kwargs: dict[str, Any],
        timeout_s: float,
        max_idle: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._kw = connect_kwargs
        self._ssl = ssl_context
        self._timeout_s = timeout_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []

    @classmethod
    def for_url(cls, url: str, timeout_s: float, max_idle: int = 16) -> LookupClient | None:
        try:
            kw: dict[str, Any] = dict(parse_url(url))
        except ValueError:
            return None
        connection_class = kw.pop("connection_class", None)
        context = None
        if connection_class is SSLConnection:
            context = _ssl_context({k: kw.pop(k) for k in list(kw) if k.startswith("ssl_")})
            if context is None:
                return None
        elif connection_class not in (None, UnixDomainSocketConnection):
            return None  # something else we do not speak
        if set(kw) - {"host", "port", "path", "db", "username", "password"}:
            return None
        return cls(kw, timeout_s, max_idle, context)

    async def _connect(self) -> _Connection:
        kw = self._kw
        if "path" in kw:
            reader, writer = await asyncio.open_unix_connection(kw["path"])
        else:
            # With ssl, the server's certificate is checked against the host name we dial.
            reader, writer = await asyncio.open_connection(
                kw.get("host", "localhost"), kw.get("port", 6379), ssl=self._ssl
            )
        conn = _Connection(reader, writer)
        try:
            if kw.get("password") is not None:
                user = [kw["username"].encode()] if kw.get("username") else []
                try:
                    await conn.request(encode_command([b"AUTH", *user, kw["password"].encode()]))
                except ResponseError as exc:  # WRONGPASS: the same class redis-py raises
                    raise AuthenticationError(str(exc)) from None
            if kw.get("db"):
                await conn.request(encode_command([b"SELECT", str(kw["db"]).encode()]))
        except BaseException:
            conn.close()
            raise
        return conn

    async def call(self, payload: bytes) -> Any:
        """One request; raises RedisError/OSError (TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(self._timeout_s):
            while True:
                reused = bool(self._idle)
                conn = self._idle.pop() if reused else await self._connect()
                try:
                    reply = await conn.request(payload)
                except ResponseError:
                    self._release(conn)
                    raise
                except ConnectionError:
                    conn.close()
                    if reused:
                        continue  # stale pooled connection (e.g. Redis restarted): retry
                    raise
                except BaseException:
                    conn.close()  # mid-request: its stream position is unknown
                    raise
                self._release(conn)
                return reply

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        """Close the idle connections (in-flight ones close when their request ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()
