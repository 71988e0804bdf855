"""A throwaway certificate authority for the TLS tests (``trustme``, made per test).

:func:`tls_fake` starts a :class:`~sidecar.testing.FakeUpstream` speaking HTTPS on
127.0.0.1 with a certificate for that address issued by ``ca``; :func:`ca_file` writes
the CA's certificate as a PEM file, for ``ca_file``.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import trustme

from sidecar.testing import FakeUpstream


def server_context(ca: trustme.CA) -> ssl.SSLContext:
    """A server context with a certificate for ``127.0.0.1`` and ``localhost`` from ``ca``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)
    return ctx


async def tls_fake(ca: trustme.CA) -> FakeUpstream:
    """A started HTTPS fake upstream whose certificate ``ca`` issued (close it after)."""
    return await FakeUpstream(tls=server_context(ca)).start()


def ca_file(directory: Path, ca: trustme.CA, name: str = "ca.pem") -> str:
    """Write ``ca``'s certificate (PEM) under ``directory``; returns its path."""
    path = directory / name
    ca.cert_pem.write_to_path(str(path))
    return str(path)
