#!/usr/bin/env bash
# E2B's own SDK suites, Python (sync and async) and JavaScript, against a fresh agentenv server. Fetches nothing at
# run time but packages: the Python SDK and pytest from PyPI, the JS SDK's dependencies and vitest from npm.
#   crates/agentenv/server/tests/e2b_suite/run.sh E2B_CHECKOUT
# E2B_CHECKOUT: a checkout (or `git archive`) of github.com/e2b-dev/E2B holding packages/python-sdk/tests and, for
# `js`, packages/js-sdk.
# Env: E2B_SDK_VERSION (the Python SDK; default: the checkout's pyproject.toml), E2B_JS_SDK_VERSION (an npm release
# the JS tests import instead of the checkout's SDK source; vitest.config.mts), SUITES ("sync async js"),
# WORK (a new temporary folder by default; kept), TEST_TIMEOUT_S (180).
# Prints one table of the server-facing tests that failed, each expected (with why: expected.tsv, expected-js.tsv)
# or not, and exits 1 if one was not expected.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../../.." && pwd)
e2b=$(cd "${1:?usage: run.sh E2B_CHECKOUT}" && pwd)
sdk="$e2b/packages/python-sdk"
js="$e2b/packages/js-sdk"
suites=${SUITES:-sync async js}
[ -d "$sdk/tests" ] || { echo "no $sdk/tests: not a checkout of e2b-dev/E2B" >&2; exit 2; }
case " $suites " in *" js "*) [ -d "$js/tests" ] || { echo "no $js/tests (SUITES has js)" >&2; exit 2; } ;; esac
version=${E2B_SDK_VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$sdk/pyproject.toml" | head -1)}
js_version=none
[ -f "$js/package.json" ] && js_version=$(node -p "require('$js/package.json').version")
js_version=${E2B_JS_SDK_VERSION:-$js_version}
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/e2b-suite.XXXXXX")}
mkdir -p "$work"
log() { printf '[e2b-suite] %s\n' "$*" >&2; }
log "Python SDK $version, JS SDK $js_version, work folder $work"

. "$here/server.sh"
start_server
log "server on $url (sandboxes at <port>-<id>.$SANDBOX_DOMAIN:$port)"

python_suite() {  # $1: sync or async
  if [ ! -x "$work/venv/bin/python" ]; then
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q "e2b==$version" "pytest>=8,<10" python-dotenv pytest-dotenv \
      "pytest-asyncio>=1.3,<2" pytest-timeout
  fi
  if [ -z "${python_copied:-}" ]; then  # without the checkout's own SDK source, which would shadow the installed one
    rm -rf "$work/python-sdk" && cp -r "$sdk" "$work/python-sdk" && rm -rf "$work/python-sdk"/e2b*/ && python_copied=1
  fi
  (cd "$work/python-sdk" && timeout 5400 "$work/venv/bin/python" -m pytest -o addopts=--import-mode=importlib \
    -o "timeout=${TEST_TIMEOUT_S:-180}" -p no:cacheprovider -p names -q --junitxml="$work/$1.xml" "tests/$1" \
    >"$work/$1.log" 2>&1) || true
}

js_suite() {
  local dir="$work/js-sdk"
  js_project "$js" "$dir" e2b-js-suite "vitest msw dotenv error-stack-parser-es" src tests package.json
  if [ -n "${E2B_JS_SDK_VERSION:-}" ]; then
    (cd "$dir" && npm install --no-audit --no-fund --no-save "e2b@$E2B_JS_SDK_VERSION" >>"$work/npm.log" 2>&1)
    export E2B_JS_SDK="e2b@$E2B_JS_SDK_VERSION"
  fi
  cp "$here/vitest.config.mts" "$dir/" && cp "$here/mswEnv.setup.ts" "$dir/tests/"
  TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-180} vitest_run "$dir"
}

xmls=()
for suite in $suites; do
  log "$suite"
  case $suite in js) js_suite ;; *) python_suite "$suite" ;; esac
  xmls+=("$work/$suite.xml")
done
cat "$here/expected.tsv" "$here/expected-js.tsv" >"$work/expected.tsv"  # Python names start with test_, JS names never
python3 "$here/report.py" "$work/expected.tsv" "Python SDK $version, JS SDK $js_version" "${xmls[@]}"
