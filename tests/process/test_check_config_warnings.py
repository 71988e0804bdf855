"""check-config's warnings and hints as a user sees them (issue 23, item 6): the real
``python -m sidecar check-config`` and ``serve`` as child processes.

Warnings (an upstream no route uses, one an environment typo created, a route no
request can reach) are ``warning: key.path: message`` lines on stderr before the
summary and leave the exit code 0; ``serve`` logs each as a JSON ``config_warning``
line at ``warning`` and starts. An unknown key is still an error (exit 2), with a hint.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.configs import config, route, upstream
from tests.serve_proc import ROOT, ServeProc, child_env

SECRET = "sk-proj-pasted-into-the-file-0123456789"

FILE = config(
    server={"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
    upstreams={
        "primary": upstream("http://127.0.0.1:9"),
        "backup": upstream("http://127.0.0.1:9"),
        "spare": upstream("http://127.0.0.1:9"),
    },
    routes=[
        route("chat", "primary", "backup", path_prefix="/v1/"),
        route("chat_again", "backup", path_prefix="/v1/"),
    ],
)
TYPO = {"SIDECAR__UPSTREAMS__PRIMRY__BASE_URL": "http://127.0.0.1:8"}
WARNINGS = [
    "warning: upstreams.spare: no route uses this upstream",
    "warning: upstreams.primry: no route uses this upstream, which is not in the config "
    'file: SIDECAR__UPSTREAMS__PRIMRY__BASE_URL created it; did you mean "primary" '
    "(SIDECAR__UPSTREAMS__PRIMARY__BASE_URL)?",
    'warning: routes[1]: no request can reach route "chat_again": routes[0] ("chat") has '
    "the same path_prefix, is tried before it and takes every request it matches",
]


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )


def test_check_config_warns_on_stderr_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(FILE)
    r = check_config(path, child_env(**TYPO))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [*WARNINGS, "config ok: 4 upstreams, 2 routes, 0 breakers"]
    effective = tomllib.loads(r.stdout)  # stdout is the effective config, nothing else
    assert effective["upstreams"]["primry"]["base_url"] == "http://127.0.0.1:8"


def test_an_api_key_in_the_file_is_an_error_with_a_hint_and_no_echo(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(
        config(
            upstreams={"openai": upstream("https://api.openai.com", api_key=SECRET)},
            routes=[route("chat", "openai")],
        )
    )
    r = check_config(path, child_env())
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        'error: upstreams.openai.api_key: unknown key; did you mean "api_key_env"? (secrets '
        "never go in the config file, only in the environment: set api_key_env to the NAME "
        "of the variable that holds it)"
    ]
    assert r.stdout == ""
    assert SECRET not in r.stderr


async def test_serve_logs_each_warning_and_starts(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.toml"
    path.write_text(FILE)
    async with await ServeProc.start(path, child_env(**TYPO)) as proc:
        await proc.wait_for_event("started")
        logged = [e for e in proc.events() if e.get("event") == "config_warning"]
        assert [(e["level"], f"warning: {e['key']}: {e['detail']}") for e in logged] == [
            ("warning", w) for w in WARNINGS
        ]
        proc.signal()
        assert await proc.wait(15) == 0
    assert proc.stderr == []
