"""How upstream connections leave the pod: an egress proxy from the environment, and the
CAs trusted (contract, "Configuration": ``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``,
``ca_file``). Decided once per upstream when its session is made, never per request.

The variables are read as Python's :func:`urllib.request.getproxies` reads them (so as
``httpx``, and with it the OpenAI and Anthropic SDKs, and ``requests`` do; curl too,
but for its uppercase ``HTTP_PROXY``):

* an ``https://`` upstream uses ``https_proxy``, an ``http://`` one ``http_proxy``, in
  any letter case; the all-lowercase name wins when both are set, and an empty
  lowercase one unsets it (``https_proxy=`` turns an inherited ``HTTPS_PROXY`` off);
  under CGI (``REQUEST_METHOD`` set) ``HTTP_PROXY`` in capitals is ignored
  (CVE-2016-1000110), as Python does; ``ALL_PROXY`` is not read (it is mostly
  ``socks5://``, which aiohttp cannot speak);
* ``no_proxy`` (any case): comma-separated entries, ``*`` for every host; an entry
  matches the host itself and its subdomains (``example.com`` and ``.example.com``
  both match ``api.example.com``), or ``host:port`` exactly
  (:func:`urllib.request.proxy_bypass_environment`); besides, as curl and
  ``requests`` do, an IP network in CIDR form (``10.0.0.0/8``) matches the upstream's
  IP address when its ``base_url`` names one;
* the proxy URL is ``http://[user:password@]host:port``: the sidecar reaches the proxy
  in plain TCP, sends ``CONNECT host:443`` for an ``https`` upstream and then speaks TLS
  to the upstream through the tunnel; an ``http`` upstream's requests go to the proxy
  in absolute form (RFC 9112 section 3.2.2). Credentials in the URL become a
  ``Proxy-Authorization: Basic`` header (RFC 9110 section 11.7.1) and are never logged.
  A proxy URL of another scheme (``https://``, ``socks5://``) is refused at start
  (:func:`problems`), not ignored: falling back to a direct connection would bypass the
  egress policy silently.

``ca_file`` (:func:`client_ssl`): a PEM bundle of CA certificates trusted *besides* the
system's (a private CA in front of a self-hosted vLLM); the system store stays trusted,
hostname checks stay on.
"""

from __future__ import annotations

import base64
import ipaddress
import ssl
import urllib.request
from collections.abc import Mapping
from typing import NamedTuple

from yarl import URL

from sidecar.config import Config

__all__ = ["EgressProxy", "bypassed", "client_ssl", "problems", "proxy_for"]


class EgressProxy(NamedTuple):
    """The egress proxy of one upstream."""

    url: URL
    """``http://host:port``, without credentials (safe to log)."""
    authorization: str | None
    """The ``Proxy-Authorization`` value (``Basic ...``, RFC 7617) made of the credentials
    the proxy URL held, or None (never logged)."""
    variable: str
    """The name of the variable it came from (``HTTPS_PROXY``...)."""


def _scheme_proxies(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{"https": (value, variable name), "no": ...}`` as :func:`urllib.request.
    getproxies_environment` builds it from ``os.environ``, from ``environ`` instead."""
    found: dict[str, tuple[str, str]] = {}
    for name, value in environ.items():  # any letter case
        low = name.lower()
        if value and low.endswith("_proxy"):
            found[low[:-6]] = (value, name)
    if "REQUEST_METHOD" in environ:  # CGI: HTTP_PROXY may come from a client's header
        found.pop("http", None)
    for name, value in environ.items():  # the all-lowercase name wins, empty unsets
        if name.endswith("_proxy"):
            low = name.lower()
            if value:
                found[low[:-6]] = (value, name)
            else:
                found.pop(low[:-6], None)
    return found


def bypassed(host: str, port: int | None, no_proxy: str) -> bool:
    """Whether ``no_proxy`` exempts ``host`` (and ``port``) from the proxy (see the module
    docstring: Python's matching of names, plus CIDR networks for an IP address)."""
    where = host if port is None else f"{host}:{port}"
    # (missing from typeshed: what urllib.request.proxy_bypass is on Linux)
    if urllib.request.proxy_bypass_environment(where, {"no": no_proxy}):  # type: ignore[attr-defined]
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    for entry in no_proxy.split(","):
        entry = entry.strip()
        if "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False


def proxy_for(base_url: str, environ: Mapping[str, str]) -> EgressProxy | None:
    """The egress proxy an upstream at ``base_url`` is reached through, or None (direct).

    :param environ: the process environment (``os.environ``).
    :raises ValueError: the variable that applies holds a URL that is not
        ``http://host[:port]`` (the message names the variable, never its value).
    """
    url = URL(base_url)
    proxies = _scheme_proxies(environ)
    chosen = proxies.get(url.scheme)
    if chosen is None:
        return None
    no_proxy = proxies.get("no")
    if url.host is not None and no_proxy is not None and bypassed(url.host, url.port, no_proxy[0]):
        return None
    value, variable = chosen
    try:
        proxy = URL(value if "://" in value else "http://" + value)  # curl takes host:port
    except ValueError:
        raise ValueError(f"{variable}: not a URL") from None
    if proxy.scheme != "http" or not proxy.host:
        raise ValueError(
            f"{variable}: the proxy must be http://host:port "
            f"(an {proxy.scheme or 'unknown'}:// proxy is not supported)"
        )
    authorization = None
    if proxy.user is not None:  # RFC 7617 section 2: user-id ":" password, UTF-8
        pair = f"{proxy.user}:{proxy.password or ''}".encode()
        authorization = "Basic " + base64.b64encode(pair).decode("ascii")
    clean = URL.build(scheme="http", host=proxy.host, port=proxy.explicit_port)
    return EgressProxy(clean, authorization, variable)


def problems(config: Config, environ: Mapping[str, str]) -> list[str]:
    """Each upstream whose proxy variable cannot be used, as ``upstreams.<name>: <why>``
    (``sidecar serve`` refuses to start with them, as with a missing ``api_key_env``)."""
    out = []
    for name, up in config.upstreams.items():
        try:
            proxy_for(up.base_url, environ)
        except ValueError as exc:
            out.append(f"upstreams.{name}: {exc}")
    return out


def client_ssl(ca_file: str) -> ssl.SSLContext | bool:
    """The TLS settings of an upstream's connections: ``True`` (aiohttp's default
    verified context: the system's CAs) without ``ca_file``, else a verifying context
    that trusts the system's CAs and those of ``ca_file`` (PEM).

    :raises OSError: the file cannot be read. :raises ssl.SSLError: it holds no PEM
        certificate (``check-config`` reports both with the key path first).
    """
    if not ca_file:
        return True
    ctx = ssl.create_default_context()
    ctx.load_verify_locations(cafile=ca_file)
    return ctx
