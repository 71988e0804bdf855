#!/usr/bin/env bash
# Checks of the sidecar's Prometheus exposition and of the monitoring assets.
#
#   bash .ci/metrics-checks.sh            (from the repository root, or anywhere)
#
# Tools: the project venv (.venv, created with `pip install -e '.[test]'` when it
# cannot import the sidecar) and promtool from Debian's `prometheus` package
# (`apt-get install --no-install-recommends prometheus`, `apt-get update` first when
# the package is not found; as root only; no service is started). Both are reused
# when present. METRICS_CHECKS_PROMTOOL=0 skips promtool (to exercise the fallback).
#
#   1. scrape         deploy/tools/scrape_metrics.py: the real sidecar in-process with
#                     fake upstreams on loopback, traffic incl. retries, failures, a
#                     breaker opening and a rejection; its /metrics body
#   2. promtool       `promtool check metrics` on that scrape
#   3. python check   deploy/tools/check_metrics.py on the same scrape: parses with
#                     prometheus_client.parser, promtool's naming rules (_total on
#                     counters only, base units, HELP, snake_case, reserved suffixes),
#                     histogram consistency, and the contract's names/types/labels.
#                     Always runs; without promtool it is the exposition check.
#   4. rules          `promtool check rules` on deploy/prometheus/sidecar-alerts.yaml
#                     and sidecar-rules.yaml (the recording rules)
#   5. rule tests     `promtool test rules` on deploy/prometheus/sidecar-alerts.test.yaml
#                     and sidecar-rules.test.yaml
#   6. dashboard      every PromQL expression of deploy/grafana/sidecar-dashboard.json
#                     parsed by `promtool check rules` (deploy/tools/dashboard_exprs.py)
#   7. examples       every PromQL example of README.md and docs/metrics.md evaluated by
#                     `promtool test rules` on series built from the scrape of step 1
#                     (deploy/tools/promql_examples.py): each must return a series
#
# Steps 2, 4, 5, 6, 7 are skipped (and said so) when promtool cannot be installed; the
# alert rules' and dashboard's structure and metric names are also checked by
# tests/e2e/test_metrics_assets.py in every case. Exits non-zero when any step fails;
# every step runs regardless.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV_PY="$ROOT/.venv/bin/python"
ALERTS=deploy/prometheus/sidecar-alerts.yaml
ALERT_TESTS=deploy/prometheus/sidecar-alerts.test.yaml
RECORDING=deploy/prometheus/sidecar-rules.yaml
RECORDING_TESTS=deploy/prometheus/sidecar-rules.test.yaml
DASHBOARD=deploy/grafana/sidecar-dashboard.json
APT_TIMEOUT_S="${METRICS_CHECKS_APT_TIMEOUT_S:-900}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/metrics-checks.XXXXXX")"
POLICY_RC=/usr/sbin/policy-rc.d
CREATED_POLICY=0
cleanup() {
  rm -rf "$WORK"
  if [[ $CREATED_POLICY -eq 1 ]]; then rm -f "$POLICY_RC"; fi
}
trap cleanup EXIT

STARTED=$SECONDS
# shellcheck source=.ci/steps.sh
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

# ------------------------------------------------------------------ tools
setup_venv() {
  if [[ -x "$VENV_PY" ]] && "$VENV_PY" -c 'import sidecar.server, prometheus_client' 2>/dev/null; then
    return 0
  fi
  note "project venv missing or incomplete: installing .venv (pip install -e '.[test]')"
  [[ -x "$VENV_PY" ]] || python3 -m venv "$ROOT/.venv"
  "$ROOT/.venv/bin/pip" install -q --disable-pip-version-check -e '.[test]' >"$WORK/pip.log" 2>&1 || {
    tail -n 30 "$WORK/pip.log" >&2
    return 1
  }
}

PROMTOOL=""
PROMTOOL_WHY=""
apt_install_prometheus() {
  DEBIAN_FRONTEND=noninteractive timeout "$APT_TIMEOUT_S" \
    apt-get install -y -q --no-install-recommends prometheus >>"$WORK/apt.log" 2>&1
}
ensure_promtool() {
  if [[ "${METRICS_CHECKS_PROMTOOL:-1}" == "0" ]]; then
    PROMTOOL_WHY="METRICS_CHECKS_PROMTOOL=0"
    return 0
  fi
  if command -v promtool >/dev/null 2>&1; then
    PROMTOOL="$(command -v promtool)"
    return 0
  fi
  if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
    PROMTOOL_WHY="not installed, and apt-get as root is not available here"
    return 0
  fi
  # The package's postinst would start a Prometheus server where invoke-rc.d is
  # allowed to: forbid it for the install (Docker images already do).
  if [[ ! -e "$POLICY_RC" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$POLICY_RC" && chmod 755 "$POLICY_RC" && CREATED_POLICY=1
  fi
  local t0=$SECONDS
  if ! apt_install_prometheus; then
    note "apt-get install failed; apt-get update, then once more"
    DEBIAN_FRONTEND=noninteractive timeout "$APT_TIMEOUT_S" apt-get update -q >>"$WORK/apt.log" 2>&1 || true
    apt_install_prometheus || true
  fi
  if [[ $CREATED_POLICY -eq 1 ]]; then
    rm -f "$POLICY_RC"
    CREATED_POLICY=0
  fi
  if command -v promtool >/dev/null 2>&1; then
    PROMTOOL="$(command -v promtool)"
    note "installed Debian's prometheus package in $((SECONDS - t0)) s"
  else
    PROMTOOL_WHY="apt-get install prometheus failed ($((SECONDS - t0)) s): $(tail -n 1 "$WORK/apt.log")"
  fi
}

echo "metrics-checks: tools"
if ! setup_venv; then
  echo "metrics-checks: could not set up the project venv; 0 passed, 1 failed" >&2
  exit 1
fi
ensure_promtool
if [[ -n "$PROMTOOL" ]]; then
  note "promtool: $PROMTOOL ($("$PROMTOOL" --version 2>&1 | head -n1 | awk '{print $3}'))"
  note "exposition validated by promtool and by deploy/tools/check_metrics.py"
else
  note "promtool: unavailable ($PROMTOOL_WHY)"
  note "exposition validated by deploy/tools/check_metrics.py (prometheus_client.parser + promtool's naming rules)"
fi

# ------------------------------------------------------------------ 1. scrape
SCRAPE="$WORK/scrape.txt"
run_scrape() {
  # PYTHONPATH: this checkout's sidecar package, whatever the venv's editable install points at.
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV_PY" deploy/tools/scrape_metrics.py --out "$SCRAPE" || return 1
  note "$(grep -c '^sidecar_' "$SCRAPE") sidecar_* samples, $(grep -c '^# TYPE' "$SCRAPE") families"
}
step "scrape /metrics of a real sidecar after traffic" run_scrape

# ------------------------------------------------------------------ 2. promtool check metrics
run_promtool_metrics() {
  [[ -s "$SCRAPE" ]] || return 1
  # promtool prints lint problems and exits non-zero on any.
  "$PROMTOOL" check metrics <"$SCRAPE"
}
if [[ -n "$PROMTOOL" ]]; then
  step "promtool check metrics" run_promtool_metrics
else
  skip "promtool check metrics" "no promtool ($PROMTOOL_WHY)"
fi

# ------------------------------------------------------------------ 3. python check
run_python_check() {
  [[ -s "$SCRAPE" ]] || return 1
  "$VENV_PY" deploy/tools/check_metrics.py "$SCRAPE"
}
step "check_metrics.py (parser, naming rules, contract)" run_python_check

# ------------------------------------------------------------------ 4-7. rules, dashboard, examples
run_check_rules() { "$PROMTOOL" check rules "$ALERTS" "$RECORDING"; }
run_test_rules() { "$PROMTOOL" test rules "$ALERT_TESTS" "$RECORDING_TESTS"; }
run_dashboard_exprs() {
  python3 deploy/tools/dashboard_exprs.py "$DASHBOARD" >"$WORK/dashboard-rules.json" || return 1
  "$PROMTOOL" check rules "$WORK/dashboard-rules.json"
}
run_promql_examples() {
  [[ -s "$SCRAPE" ]] || return 1
  "$VENV_PY" deploy/tools/promql_examples.py "$SCRAPE" "$WORK/examples" || return 1
  "$PROMTOOL" test rules "$WORK/examples/promql-examples.test.json"
}
if [[ -n "$PROMTOOL" ]]; then
  step "promtool check rules $ALERTS $RECORDING" run_check_rules
  step "promtool test rules $ALERT_TESTS $RECORDING_TESTS" run_test_rules
  step "dashboard PromQL parses ($DASHBOARD)" run_dashboard_exprs
  step "PromQL examples of the docs on the scrape (promtool test rules)" run_promql_examples
else
  for name in "promtool check rules" "promtool test rules" "dashboard PromQL parse" \
    "PromQL examples of the docs"; do
    skip "$name" "no promtool; structure and metric names: tests/e2e/test_metrics_assets.py"
  done
fi

# ------------------------------------------------------------------ summary
if [[ $FAILED -ne 0 ]]; then
  printf 'metrics-checks: failed: %s\n' "${FAILED_NAMES[*]}"
fi
printf 'metrics-checks: took %d s\n' "$((SECONDS - STARTED))"
printf 'metrics-checks: %d passed, %d failed, %d skipped\n' "$PASSED" "$FAILED" "$SKIPPED"
[[ $FAILED -eq 0 ]]
