"""Loopback sockets that fail in known ways: refused connects and connect timeouts."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable

__all__ = ["closed_port", "saturated_listener"]

LOOPBACK = "127.0.0.1"


def closed_port() -> int:
    """A loopback TCP port with nothing listening: a connect to it is refused at once.

    Binds an ephemeral port on 127.0.0.1 and closes the socket, so the port was
    free a moment ago; another process could take it in between (unlikely: the
    kernel hands out ephemeral ports round-robin).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
    return port


def _accept_queue_full(listener: socket.socket) -> bool:
    """Linux: ``TCP_INFO`` of a listening socket reports the accept queue length in
    ``tcpi_unacked`` and the backlog in ``tcpi_sacked``; the kernel drops SYNs once
    length > backlog. False where this is not available."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:
        return False
    try:
        info = listener.getsockopt(socket.IPPROTO_TCP, tcp_info, 104)
    except OSError:
        return False
    if len(info) < 32 or info[0] != 10:  # 10: TCP_LISTEN
        return False
    queued, backlog = struct.unpack_from("=II", info, 24)
    return bool(queued > backlog)


async def saturated_listener(
    *, max_fillers: int = 64, probe_timeout: float = 0.5
) -> tuple[str, int, Callable[[], None]]:
    """A loopback listener whose accept queue is full, so a further connect hangs.

    Returns ``(host, port, cleanup)``; call ``cleanup()`` (synchronous,
    idempotent) to close the filler connections and the listener.

    Mechanism (Linux): the socket listens with backlog 0 and never calls
    ``accept()``. Linux queues backlog + 1 = 1 completed connection; once the
    accept queue is full, the kernel *drops* every new SYN (no RST, whatever
    ``tcp_syncookies`` says), so the client keeps retransmitting its SYN (after
    1 s, 3 s, ...) and ``connect()`` only ends by the client's own timeout:
    a genuine connect timeout without any network beyond loopback. Filler
    connections are opened until the queue is full, read from ``TCP_INFO``
    (on Linux: after the first filler), or, where that is unavailable, until a
    filler does not connect within ``probe_timeout`` seconds (that probe is
    closed). Fillers stay open until ``cleanup()``: they are what keeps the
    queue full. Raises :class:`RuntimeError` if ``max_fillers`` all connected.
    """
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    fillers: list[socket.socket] = []

    def cleanup() -> None:
        for s in fillers:
            s.close()
        fillers.clear()
        listener.close()

    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(0)
        port: int = listener.getsockname()[1]
        for _ in range(max_fillers):
            if _accept_queue_full(listener):
                return LOOPBACK, port, cleanup
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(probe, (LOOPBACK, port)), probe_timeout)
            except TimeoutError:
                probe.close()
                return LOOPBACK, port, cleanup
            except BaseException:
                probe.close()
                raise
            fillers.append(probe)
        raise RuntimeError(f"accept queue of 127.0.0.1:{port} never filled up")
    except BaseException:
        cleanup()
        raise
