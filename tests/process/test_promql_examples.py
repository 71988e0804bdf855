"""Every PromQL example of README.md and docs/metrics.md, evaluated by promtool on a real scrape.

``deploy/tools/promql_examples.py`` turns the examples into a ``promtool test rules``
file whose input series come from a real ``/metrics`` scrape
(``deploy/tools/scrape_metrics.py``); each example must return a series. CI runs it
in ``.ci/metrics-checks.sh`` too; here promtool runs when it is on PATH (CI installs
it before the tests), and the extraction is checked everywhere.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy_tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")


EX = load_tool("promql_examples")


def test_every_promql_block_is_found_and_split_into_expressions() -> None:
    text = """
```promql
# a comment
a_total
sum(rate(b_total[5m]))
  / sum(rate(c_total[5m]))

d
```
```sh
not_promql
```
"""
    assert list(EX.examples(text, "x.md")) == [
        ("x.md:4", "a_total"),
        ("x.md:5", "sum(rate(b_total[5m])) / sum(rate(c_total[5m]))"),
        ("x.md:8", "d"),
    ]
    found = EX.all_examples(ROOT)
    by_doc = {doc: [e for w, e in found if w.startswith(doc + ":")] for doc in EX.DOCS}
    assert len(by_doc["README.md"]) >= 4 and len(by_doc["docs/metrics.md"]) >= 13, by_doc
    # the retries example divides by calls (attempts - retries), not by attempts
    retries = [
        e
        for e in by_doc["docs/metrics.md"]
        if e.startswith("sum by (upstream) (rate(sidecar_retries")
    ]
    assert retries and all("- sum by (upstream) (rate(sidecar_retries_total" in e for e in retries)


@pytest.fixture(scope="module")
def scrape_text() -> str:
    text, problems = asyncio.run(load_tool("scrape_metrics").scrape())
    assert problems == []
    return str(text)


def promtool_test(doc: dict[str, object], tmp: Path) -> subprocess.CompletedProcess[str]:
    path = tmp / "examples.test.json"
    path.write_text(json.dumps(doc))
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (.ci/metrics-checks.sh)")
def test_every_example_returns_series_on_a_real_scrape(scrape_text: str, tmp_path: Path) -> None:
    found = EX.all_examples(ROOT)
    result = promtool_test(EX.rules_test(scrape_text, found), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (.ci/metrics-checks.sh)")
def test_a_wrong_example_fails(scrape_text: str, tmp_path: Path) -> None:
    for wrong in (
        'sum(rate(sidecar_requests_total{rout="chat"}[5m]))',  # a label it does not have
        "sum by (upstream) (rate(sidecar_retries_total[5m]))"
        " / sum by (route) (rate(sidecar_requests_total[5m]))",  # no matching labels
        "sum(rate(sidecar_request_total[5m]))",  # a metric it does not expose
    ):
        result = promtool_test(EX.rules_test(scrape_text, [("x", wrong)]), tmp_path)
        assert result.returncode != 0, wrong
