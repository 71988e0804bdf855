# shellcheck shell=bash
# Step bookkeeping shared by the CI check scripts (sourced, not run).
# step NAME COMMAND...: runs the command, records the result, never aborts the script.
PASSED=0
FAILED=0
SKIPPED=0
FAILED_NAMES=()

note() { printf '  %s\n' "$*"; }
skip() {
  printf -- '--- SKIP %s: %s\n' "$1" "$2"
  SKIPPED=$((SKIPPED + 1))
}
step() {
  local name="$1"
  shift
  printf -- '--- %s\n' "$name"
  if "$@"; then
    printf -- '--- PASS %s\n' "$name"
    PASSED=$((PASSED + 1))
  else
    printf -- '--- FAIL %s\n' "$name"
    FAILED=$((FAILED + 1))
    FAILED_NAMES+=("$name")
  fi
}
