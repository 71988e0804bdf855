"""Every TOML config of README.md passes ``sidecar check-config``, and its recipes
work end to end.

Each ```` ```toml ```` block (and each ``cat > NAME <<'TOML'`` here-document) is
run through ``python -m sidecar check-config`` as a user would after copying it:
exit 0, ``config ok``, and no warning once the variables it names are set. A
block marked ``<!-- toml: fragment -->`` is checked merged into the smallest
whole config (``tests/readme_blocks.py``).

The first real-provider recipe (``my.toml``) is then served by ``sidecar serve``
(a subprocess) with its upstream pointed at a fake provider on loopback
(``SIDECAR__UPSTREAMS__OPENAI__BASE_URL``), and called with the official
``openai`` SDK exactly as the README shows: the fake must see the key from
``OPENAI_API_KEY``, never the SDK's placeholder (issue 23, item 3). "A config"
must send every model but ``gpt-4o`` unchanged, and fall back for ``gpt-4o``.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import tomli_w

from sidecar.testing import FakeUpstream, Fault
from tests.readme_blocks import (
    FRAGMENT_BASE,
    README,
    ROOT,
    TomlConfig,
    blocks,
    named,
    readme_configs,
)
from tests.serve_proc import ServeProc, child_env

CONFIGS = readme_configs()
KEY = "sk-readme-recipe-key"
MESSAGES: Any = [{"role": "user", "content": "hi"}]
PORTS = {"SIDECAR__SERVER__LISTEN": "127.0.0.1:0", "SIDECAR__SERVER__ADMIN_LISTEN": "127.0.0.1:0"}


def merged(fragment: str) -> str:
    """``fragment`` merged into :data:`FRAGMENT_BASE`: tables merged key by key,
    arrays of tables (``[[routes]]``) appended."""
    doc: dict[str, Any] = tomllib.loads(FRAGMENT_BASE)

    def merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
        for k, v in extra.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            elif isinstance(v, list) and isinstance(into.get(k), list):
                into[k] = into[k] + v
            else:
                into[k] = v

    merge(doc, tomllib.loads(fragment))
    return tomli_w.dumps(doc)


def variables_named(text: str) -> dict[str, str]:
    """A value for every environment variable the config names (``*_env`` keys)."""
    names = re.findall(r'^\s*\w+_env\s*=\s*"([A-Z_][A-Z0-9_]*)"', text, re.MULTILINE)
    values = {n: "redis://127.0.0.1:1/0" if "REDIS" in n else "sk-readme-test" for n in names}
    return values


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


def test_the_readme_has_its_configs_and_marks() -> None:
    names = [c.name for c in CONFIGS]
    assert {"my.toml", "a-config.toml", "anthropic.toml"} <= set(names), names
    assert len(CONFIGS) >= 6, [c.where for c in CONFIGS]
    marked = [b for b in blocks(README.read_text()) if b.mark is not None]
    # a mark protects or names only the toml block right after it
    assert all(b.lang == "toml" for b in marked), [(b.line, b.lang) for b in marked]
    assert len(set(names) - {None}) == len([n for n in names if n]), "two configs share a name"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.where for c in CONFIGS])
def test_every_readme_config_passes_check_config(config: TomlConfig, tmp_path: Path) -> None:
    text = merged(config.text) if config.fragment else config.text
    path = tmp_path / (config.name or "readme.toml")
    path.write_text(text)
    r = check_config(path, child_env(**variables_named(text)))
    assert r.returncode == 0, f"{config.where}:\n{r.stderr}"
    assert "config ok:" in r.stderr
    assert "warning" not in r.stderr.lower(), f"{config.where}:\n{r.stderr}"


def sdk_placeholder() -> str:
    """The ``api_key`` the README's OpenAI SDK snippet passes."""
    for b in blocks(README.read_text()):
        if b.lang == "python" and "from openai import OpenAI" in b.text:
            found = re.search(r'api_key="([^"]+)"', b.text)
            assert found, b.text
            return found.group(1)
    raise AssertionError("README.md has no OpenAI SDK snippet")


def test_the_readme_serves_my_toml_with_openai_api_key() -> None:
    text = README.read_text()
    assert "OPENAI_API_KEY=sk-... .venv/bin/sidecar serve --config my.toml" in text
    assert ".venv/bin/sidecar check-config my.toml" in text


def stream_chat(base_url: str, api_key: str, model: str) -> str:
    """The README's SDK call (sync client, streamed), with no SDK retry."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        parts = []
        for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)
    finally:
        client.close()


async def test_the_first_recipe_sends_the_key_from_openai_api_key(tmp_path: Path) -> None:
    config = tmp_path / "my.toml"
    config.write_text(named("my.toml").text)
    placeholder = sdk_placeholder()
    async with FakeUpstream() as fake:
        env = child_env(OPENAI_API_KEY=KEY, SIDECAR__UPSTREAMS__OPENAI__BASE_URL=fake.url, **PORTS)
        async with await ServeProc.start(config, env) as sc:
            reply = await asyncio.to_thread(
                stream_chat, sc.proxy_url + "/v1", placeholder, "gpt-4o-mini"
            )
        assert reply  # the fake's streamed text reached the SDK
        assert len(fake.requests) == 1
        seen = fake.requests[0]
        assert seen.path == "/v1/chat/completions"
        assert seen.headers.getall("authorization") == [f"Bearer {KEY}"]
        assert not any(placeholder in v for v in seen.headers.values())
        assert seen.model == "gpt-4o-mini"  # the model is not rewritten


async def test_a_config_rewrites_only_the_fallback_candidates_model(tmp_path: Path) -> None:
    config = tmp_path / "a-config.toml"
    config.write_text(named("a-config.toml").text)
    async with FakeUpstream() as openai_fake, FakeUpstream() as backup:
        env = child_env(
            OPENAI_API_KEY=KEY,
            SIDECAR__UPSTREAMS__OPENAI__BASE_URL=openai_fake.url,
            SIDECAR__UPSTREAMS__BACKUP__BASE_URL=backup.url,
            **PORTS,
        )
        async with await ServeProc.start(config, env) as sc:
            client = openai.AsyncOpenAI(base_url=sc.proxy_url + "/v1", api_key="x", max_retries=0)
            try:
                await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
                await client.embeddings.create(model="text-embedding-3-small", input="hi")
                await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
                assert [r.model for r in openai_fake.requests] == [
                    "gpt-4o-mini",
                    "text-embedding-3-small",
                    "gpt-4o",
                ]
                assert backup.requests == []
                # gpt-4o failing on OpenAI (every attempt: 1 + 2 retries) moves to the backup,
                # under the backup's model name
                openai_fake.script([Fault(status=503)] * 3)
                await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
            finally:
                await client.close()
        assert [r.model for r in openai_fake.requests[3:]] == ["gpt-4o"] * 3
        assert [r.model for r in backup.requests] == ["meta-llama/Llama-3.1-70B-Instruct"]
        assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in openai_fake.requests)


def sdk_calls_from_the_environment() -> tuple[str, str]:
    """One call per SDK, each built with no argument: base URL and key from the
    environment (``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``, ...)."""
    o = openai.OpenAI(max_retries=0)
    a = anthropic.Anthropic(max_retries=0)
    try:
        done = o.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        msg = a.messages.create(model="claude-sonnet-4-5", max_tokens=16, messages=MESSAGES)
        text = msg.content[0].text if msg.content[0].type == "text" else ""
        return done.choices[0].message.content or "", text
    finally:
        o.close()
        a.close()


async def test_the_sdks_find_the_sidecar_through_their_base_url_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's "change no code" route, with its "Anthropic too" config: each SDK
    reaches its provider, which sees the sidecar's key, never the app's placeholder."""
    config = tmp_path / "anthropic.toml"
    config.write_text(named("anthropic.toml").text)
    async with FakeUpstream() as openai_fake, FakeUpstream() as anthropic_fake:
        env = child_env(
            OPENAI_API_KEY=KEY,
            ANTHROPIC_API_KEY="sk-ant-readme-key",
            SIDECAR__UPSTREAMS__OPENAI__BASE_URL=openai_fake.url,
            SIDECAR__UPSTREAMS__ANTHROPIC__BASE_URL=anthropic_fake.url,
            **PORTS,
        )
        async with await ServeProc.start(config, env) as sc:
            monkeypatch.setenv("OPENAI_BASE_URL", sc.proxy_url + "/v1")
            monkeypatch.setenv("ANTHROPIC_BASE_URL", sc.proxy_url)
            monkeypatch.setenv("OPENAI_API_KEY", "placeholder-openai")
            monkeypatch.setenv("ANTHROPIC_API_KEY", "placeholder-anthropic")
            replies = await asyncio.to_thread(sdk_calls_from_the_environment)
        assert all(replies), replies
        assert [r.path for r in openai_fake.requests] == ["/v1/chat/completions"]
        assert [r.path for r in anthropic_fake.requests] == ["/v1/messages"]
        o, a = openai_fake.requests[0], anthropic_fake.requests[0]
        assert o.headers.getall("authorization") == [f"Bearer {KEY}"]
        assert a.headers.getall("x-api-key") == ["sk-ant-readme-key"]
        assert "authorization" not in a.headers and "x-api-key" not in o.headers
