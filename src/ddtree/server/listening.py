"""The server's listening sockets, taken before the model loads and handed to uvicorn.

Taken first, a port in use or an address this machine does not have is one line at once, and no
other process can take the port during the minutes the load takes (connections made meanwhile
wait in the backlog). Bound as uvicorn would bind them itself: one socket per address the host
resolves to, IPv6 sockets IPv6-only.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on every address `host` resolves to, at `port` (0: a free port, the same
    for all of them). One OSError line if any cannot be had; nothing is left open then."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"--host {host}: not an address of this machine ({err.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # distinct, in resolver order
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
                sock.listen(BACKLOG)
            except OSError as err:
                raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def urls(sockets: list[socket.socket]) -> str:
    """The API's base URLs the sockets serve, as a client writes them (IPv6 in brackets)."""
    names = [sock.getsockname()[:2] for sock in sockets]
    return ", ".join(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1" for host, port in names)
