"""Which egress proxy an upstream uses (contract, "Configuration": ``HTTPS_PROXY``,
``HTTP_PROXY``, ``NO_PROXY``, any letter case, as Python's urllib and so the SDKs read
them), and ``ca_file``'s validation (``check-config`` and ``serve``)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trustme
from yarl import URL

from sidecar.config import ConfigError, parse_config
from sidecar.egress import EgressProxy, bypassed, problems, proxy_for
from tests.configs import config, route, upstream
from tests.tls_helpers import ca_file

P = "http://127.0.0.1:3128"
API = "https://api.openai.com"
PLAIN = "http://vllm.internal:8000"


@pytest.mark.parametrize(
    ("base_url", "environ", "want"),
    [
        (API, {}, None),
        (API, {"HTTPS_PROXY": P}, (P, "HTTPS_PROXY")),
        (API, {"https_proxy": P}, (P, "https_proxy")),
        (API, {"Https_Proxy": P}, (P, "Https_Proxy")),  # any letter case
        (API, {"HTTP_PROXY": P}, None),  # an https upstream reads https_proxy only
        (PLAIN, {"HTTP_PROXY": P}, (P, "HTTP_PROXY")),
        (PLAIN, {"HTTPS_PROXY": P}, None),
        # the all-lowercase name wins; an empty one turns an inherited one off
        (API, {"HTTPS_PROXY": "http://other:1", "https_proxy": P}, (P, "https_proxy")),
        (API, {"HTTPS_PROXY": P, "https_proxy": ""}, None),
        (API, {"HTTPS_PROXY": ""}, None),
        # under CGI, HTTP_PROXY in capitals may come from a client (CVE-2016-1000110)
        (PLAIN, {"HTTP_PROXY": P, "REQUEST_METHOD": "GET"}, None),
        (PLAIN, {"http_proxy": P, "REQUEST_METHOD": "GET"}, (P, "http_proxy")),
        (API, {"HTTPS_PROXY": "127.0.0.1:3128"}, (P, "HTTPS_PROXY")),  # no scheme: http
        (API, {"ALL_PROXY": P}, None),  # not read
        # NO_PROXY, any case: the host, its subdomains, or host:port
        (API, {"HTTPS_PROXY": P, "NO_PROXY": "api.openai.com"}, None),
        (API, {"HTTPS_PROXY": P, "no_proxy": ".openai.com"}, None),
        (API, {"HTTPS_PROXY": P, "NO_PROXY": "openai.com"}, None),
        (API, {"HTTPS_PROXY": P, "NO_PROXY": "notopenai.com"}, (P, "HTTPS_PROXY")),
        (API, {"HTTPS_PROXY": P, "NO_PROXY": "*"}, None),
        (API, {"HTTPS_PROXY": P, "NO_PROXY": " x.org , API.OpenAI.com "}, None),
        (PLAIN, {"HTTP_PROXY": P, "NO_PROXY": "vllm.internal:8000"}, None),
        (PLAIN, {"HTTP_PROXY": P, "NO_PROXY": "vllm.internal:9000"}, (P, "HTTP_PROXY")),
        ("https://10.1.2.3", {"HTTPS_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, None),
        ("https://11.1.2.3", {"HTTPS_PROXY": P, "NO_PROXY": "10.0.0.0/8"}, (P, "HTTPS_PROXY")),
    ],
)
def test_which_proxy(base_url: str, environ: dict[str, str], want: tuple[str, str] | None) -> None:
    got = proxy_for(base_url, environ)
    if want is None:
        assert got is None
    else:
        assert got == EgressProxy(URL(want[0]), None, want[1])


def test_credentials_leave_the_url_for_a_header() -> None:
    got = proxy_for(API, {"HTTPS_PROXY": "http://egress:p%40ss@proxy.corp:3128"})
    basic = "Basic " + base64.b64encode(b"egress:p@ss").decode()
    assert got == EgressProxy(URL("http://proxy.corp:3128"), basic, "HTTPS_PROXY")
    assert "p@ss" not in str(got.url) and "egress" not in str(got.url)


@pytest.mark.parametrize("value", ["https://proxy.corp:3128", "socks5://127.0.0.1:1080"])
def test_an_unsupported_proxy_is_refused_not_ignored(value: str) -> None:
    secret = "pw-canary-91d2"
    env = {"HTTPS_PROXY": value.replace("://", f"://u:{secret}@")}
    with pytest.raises(ValueError, match="HTTPS_PROXY: the proxy must be http://host:port") as e:
        proxy_for(API, env)
    assert secret not in str(e.value)
    cfg = parse_config(
        config(upstreams={"openai": upstream(API)}, routes=[route("r", "openai")]), {}
    )
    assert problems(cfg, env) == [f"upstreams.openai: {e.value}"]


def test_bypassed_ipv6_and_bad_entries() -> None:
    assert bypassed("::1", 443, "::1/128")
    assert not bypassed("::1", 443, "not-a-network/xx, 10.0.0.0/8")


# ---- ca_file ------------------------------------------------------------------------


def _with_ca(path: str) -> str:
    return config(
        upstreams={"vllm": upstream("https://vllm", ca_file=path)}, routes=[route("r", "vllm")]
    )


def test_ca_file_that_loads_is_accepted(tmp_path: Path) -> None:
    path = ca_file(tmp_path, trustme.CA())
    assert parse_config(_with_ca(path), {}).upstreams["vllm"].ca_file == path
    assert parse_config(_with_ca(""), {}).upstreams["vllm"].ca_file == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "file not found"),
        ("dir", "is a directory, not a PEM file"),
        (b"not a certificate\n", "holds no PEM certificate the sidecar can load"),
        (b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "holds no PEM"),
    ],
)
def test_ca_file_errors_name_the_key(
    tmp_path: Path, content: bytes | str | None, message: str
) -> None:
    path = tmp_path / "ca.pem"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        parse_config(_with_ca(str(path)), {})
    [error] = exc.value.errors
    assert error.startswith(f"upstreams.vllm.ca_file: {message}")


def test_check_config_and_serve_with_an_unusable_proxy_variable(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(config(upstreams={"openai": upstream(API)}, routes=[route("r", "openai")]))
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["HTTPS_PROXY"] = "socks5://127.0.0.1:1080"
    env = {k: v for k, v in env.items() if not k.startswith("SIDECAR")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", *args, str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )

    checked = run("check-config")
    assert checked.returncode == 0
    assert "warning: upstreams.openai: HTTPS_PROXY: the proxy must be http://host:port" in (
        checked.stderr
    )
    served = run("serve", "--config")
    assert served.returncode == 2
    assert "error: upstreams.openai: HTTPS_PROXY: the proxy must be" in served.stderr
    assert '"started"' not in served.stdout
