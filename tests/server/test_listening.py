"""The listening sockets serve takes before its model loads: every address of the host, one free
port for all with port 0, IPv6 sockets IPv6-only, one-line errors with nothing left open; the
connections they accept send without Nagle's delay."""

import asyncio
import gc
import socket
import warnings

import pytest

from ddtree.server.listening import listen, urls


def test_port_zero_is_reported_as_the_port_got():
    sockets = listen("127.0.0.1", 0)
    try:
        (sock,) = sockets
        port = sock.getsockname()[1]
        assert port > 0 and urls(sockets) == f"http://127.0.0.1:{port}/v1"
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # listening already
            pass
    finally:
        for sock in sockets:
            sock.close()


def _accepted_nodelay(listening: socket.socket) -> int:
    """TCP_NODELAY of the connection asyncio (so uvicorn) accepts on `listening`."""

    async def accept_one() -> int:
        got = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                got.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listening)
        _, writer = await asyncio.open_connection(*listening.getsockname()[:2])
        try:
            return await asyncio.wait_for(got, 5)
        finally:
            writer.close()
            server.close()

    return asyncio.run(accept_one())


def test_accepted_connections_send_without_nagles_delay():
    """asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP: a socket made with
    proto 0 (socket.socket(AF_INET, SOCK_STREAM)) serves SSE with Nagle on, and on a kept-alive
    connection each response's first chunk waits for the client's delayed ACK of its headers (40 ms
    on Linux). listen() takes the resolver's proto."""
    (sock,) = listen("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP and _accepted_nodelay(sock) != 0
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    assert _accepted_nodelay(plain) == 0  # what the check above guards against


def test_every_address_of_the_host_on_one_port():
    addresses = {info[4][:2] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    sockets = listen("localhost", 0)
    try:
        assert len(sockets) == len({a[0] for a in addresses})
        assert len({sock.getsockname()[1] for sock in sockets}) == 1
    finally:
        for sock in sockets:
            sock.close()


def test_ipv6_sockets_are_ipv6_only():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        sockets = listen("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        (sock,) = sockets
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert urls(sockets) == f"http://[::1]:{sock.getsockname()[1]}/v1"
    finally:
        for sock in sockets:
            sock.close()


def test_a_port_in_use_is_one_line_and_leaves_nothing_open():
    held = listen("127.0.0.1", 0)
    port = held[0].getsockname()[1]
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", ResourceWarning)
            with pytest.raises(OSError, match=f"^cannot listen on 127.0.0.1:{port}: Address already in use$"):
                listen("127.0.0.1", port)
            gc.collect()  # an unclosed socket warns when it is collected
        assert not [w for w in seen if issubclass(w.category, ResourceWarning)]
    finally:
        held[0].close()
    with pytest.raises(OSError, match="--host no-such-host.invalid: not an address of this machine"):
        listen("no-such-host.invalid", 0)
