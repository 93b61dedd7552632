"""The HTTP API's listener: connections it accepts send each write at once (TCP_NODELAY), so
an SSE stream's first chunk is not held back by Nagle until the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

from tandem.services.router.openai.http import listen_socket


def accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY of a connection asyncio accepts on `listener` (as uvicorn does)."""

    async def scenario() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
            return value

    return asyncio.run(scenario())


def test_accepted_connections_have_nodelay() -> None:
    listener = listen_socket("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP
    assert accepted_nodelay(listener) != 0


def test_a_plain_create_server_socket_would_not() -> None:
    """The control: what the listener replaced leaves Nagle on."""
    assert accepted_nodelay(socket.create_server(("127.0.0.1", 0))) == 0


def test_an_idle_keep_alive_connection_outlives_the_openai_clients_own() -> None:
    """The openai client (httpx) drops idle connections after 5 s; the server must keep them
    longer, or a client that waits out a 5 s Retry-After reuses a connection the server is
    closing and gets a connection error (the overload soak saw 4 such)."""
    import http.client
    import time

    import openai

    from tandem.services.router.openai.http import OpenAIServer

    client_expiry = openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    assert client_expiry is not None

    async def scenario() -> tuple[int, int]:
        server = OpenAIServer(router=None, keyring=None)  # type: ignore[arg-type]
        await server.start("127.0.0.1", 0)
        host, port = server.address.rsplit(":", 1)

        def two_requests() -> tuple[int, int]:
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/health")
            first = conn.getresponse()
            first.read()
            time.sleep(client_expiry + 0.5)  # idle longer than the client would keep it
            conn.request("GET", "/health")  # same connection: fails if the server closed it
            second = conn.getresponse()
            second.read()
            conn.close()
            return first.status, second.status

        try:
            return await asyncio.to_thread(two_requests)
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == (200, 200)
