#!/usr/bin/env bash
# E2B's code-interpreter SDK suites (Python and JavaScript) against `code-interpreter-v1` on a fresh agentenv
# server, which builds the template on its first create. Fetches nothing at run time but packages: from PyPI (the
# SDK, pytest; the template's own packages inside its build) and from npm (the JS SDK's `e2b`, vitest).
#   crates/agentenv/server/tests/e2b_suite/run_code_interpreter.sh CHECKOUT
# CHECKOUT: a checkout (or `git archive`) of github.com/e2b-dev/code-interpreter holding python/tests and, for
# `js`, js/ (its SDK source runs against the `e2b` release its package.json allows).
# Env: CI_SDK_VERSION (e2b-code-interpreter; default: the checkout's python/pyproject.toml), E2B_SDK_VERSION (e2b;
# default: the version python/poetry.lock pins: newer e2b releases break older code-interpreter SDKs), SUITES
# ("sync charts images timeout url async js"; timeout and url: tests/test_execute_timeout.py,
# tests/test_sandbox_url.py; js: js/tests one file at a time, as a Java test alone takes 15-20 s under TCG),
# WORK (a new temporary folder by default; kept), TEST_TIMEOUT_S (180).
# Prints one table of the tests that failed, each expected (with why: expected-code-interpreter.tsv) or not, and
# exits 1 if one was not expected.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../../.." && pwd)
checkout=$(cd "${1:?usage: run_code_interpreter.sh CHECKOUT}" && pwd)
py="$checkout/python"
[ -d "$py/tests" ] || { echo "no $py/tests: not a checkout of e2b-dev/code-interpreter" >&2; exit 2; }
version=${CI_SDK_VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$py/pyproject.toml" | head -1)}
e2b_version=${E2B_SDK_VERSION:-$(sed -n '/^name = "e2b"$/{n;s/^version = "\(.*\)"/\1/p}' "$py/poetry.lock")}
suites=${SUITES:-sync charts images timeout url async js}
case " $suites " in *" js "*) [ -d "$checkout/js/tests" ] || { echo "no $checkout/js/tests (SUITES has js)" >&2; exit 2; } ;; esac
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/ci-suite.XXXXXX")}
mkdir -p "$work"
log() { printf '[ci-suite] %s\n' "$*" >&2; }
log "e2b-code-interpreter $version, work folder $work"

sdks=""
if [ "$suites" != js ]; then
  if [ ! -x "$work/venv/bin/python" ]; then
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q "e2b-code-interpreter==$version" ${e2b_version:+"e2b==$e2b_version"} \
      "pytest>=8,<10" python-dotenv pytest-dotenv "pytest-asyncio>=1.3,<2" pytest-timeout
  fi
  sdks=$("$work/venv/bin/pip" list 2>/dev/null | awk '$1 == "e2b" || $1 == "e2b-code-interpreter" {print $1 " " $2}' \
    | paste -sd, -)
fi

. "$here/server.sh"
start_server
log "server on $url; the first create of code-interpreter-v1 builds it (minutes)"

# Creates until one succeeds: each waits up to 50 s for the build, then answers 503 while it goes on.
created=""
for _ in $(seq 1 60); do
  out=$(curl -s --cacert "$SSL_CERT_FILE" -w '\n%{http_code}' -X POST "$url/sandboxes" -H "X-API-Key: $key" \
    -H 'Content-Type: application/json' -d '{"templateID": "code-interpreter-v1", "timeout": 60}')
  case ${out##*$'\n'} in
    201) created=$(sed -n 's/.*"sandboxID": *"\([^"]*\)".*/\1/p' <<<"${out%$'\n'*}"); break ;;
    503) log "building: $(sed 's/\x1b\[[0-9;]*m//g' "$work/server.log" | grep 'template="code-interpreter-v1"' \
      | tail -1 | sed 's/.*builtin: *//; s/ template="code-interpreter-v1".*//' | cut -c1-100)" ;;
    *) echo "create of code-interpreter-v1 answered: $out" >&2; exit 2 ;;
  esac
done
[ -n "$created" ] || { echo "code-interpreter-v1 was not built within an hour ($work/server.log)" >&2; exit 2; }
curl -s --cacert "$SSL_CERT_FILE" -o /dev/null -X DELETE "$url/sandboxes/$created" -H "X-API-Key: $key"
log "code-interpreter-v1 is built"

unset E2B_DEBUG
rm -rf "$work/python" && cp -r "$py" "$work/python"
js_suite() {
  local dir="$work/js" ms=$((${TEST_TIMEOUT_S:-180} * 1000))
  js_project "$checkout/js" "$dir" ci-js-suite "vitest dotenv" src tests package.json vitest.config.mts
  vitest_run "$dir" --testTimeout=$ms --hookTimeout=$ms
  sdks="${sdks:+$sdks, }@e2b/code-interpreter $(node -p "require('$dir/package.json').version") on e2b \
$(node -p "require('$dir/node_modules/e2b/package.json').version")"
}

xmls=()
for suite in $suites; do
  log "$suite"
  if [ "$suite" = js ]; then js_suite; xmls+=("$work/js.xml"); continue; fi
  case $suite in
    timeout) paths=tests/test_execute_timeout.py ;;
    url) paths=tests/test_sandbox_url.py ;;
    *) paths=tests/$suite ;;
  esac
  (cd "$work/python" && timeout 5400 "$work/venv/bin/python" -m pytest -o addopts=--import-mode=importlib \
    -o "timeout=${TEST_TIMEOUT_S:-180}" -p no:cacheprovider -p names -q --junitxml="$work/$suite.xml" $paths \
    >"$work/$suite.log" 2>&1) || true
  xmls+=("$work/$suite.xml")
done
python3 "$here/report.py" --all "$here/expected-code-interpreter.tsv" "E2B code-interpreter suite, $sdks" "${xmls[@]}"
