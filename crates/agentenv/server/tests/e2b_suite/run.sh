#!/usr/bin/env bash
# E2B's own Python SDK suite (sync and async) against a fresh agentenv server. Fetches nothing at run time but
# the SDK and pytest from PyPI.
#   crates/agentenv/server/tests/e2b_suite/run.sh E2B_CHECKOUT
# E2B_CHECKOUT: a checkout (or `git archive`) of github.com/e2b-dev/E2B holding packages/python-sdk/tests.
# Env: E2B_SDK_VERSION (default: the checkout's packages/python-sdk/pyproject.toml), SUITES ("sync async"),
# WORK (a new temporary folder by default; kept), TEST_TIMEOUT_S (180).
# Prints one table of the server-facing tests that failed, each expected (with why, expected.tsv) or not, and
# exits 1 if one was not expected.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../../.." && pwd)
e2b=$(cd "${1:?usage: run.sh E2B_CHECKOUT}" && pwd)
sdk="$e2b/packages/python-sdk"
[ -d "$sdk/tests" ] || { echo "no $sdk/tests: not a checkout of e2b-dev/E2B" >&2; exit 2; }
version=${E2B_SDK_VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$sdk/pyproject.toml" | head -1)}
work=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/e2b-suite.XXXXXX")}
mkdir -p "$work"
log() { printf '[e2b-suite] %s\n' "$*" >&2; }
log "SDK $version, work folder $work"

log "building the server and the guest agent"
(cd "$root" && cargo build -q -p agentenv-server --bins -p agentenv-guest)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
AGENTENV_GUEST_BIN="$root/target/debug/agentenv-guest" "$root/target/debug/agentenv" \
  --state-dir "$work/state" --listen "127.0.0.1:$port" >"$work/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
key=""
for _ in $(seq 1 1800); do  # the first start builds the default template (minutes)
  kill -0 "$server" 2>/dev/null || { tail -20 "$work/server.log" >&2; echo "the server exited" >&2; exit 2; }
  key=$(cat "$work/state/server/api_key" 2>/dev/null || true)
  if [ -n "$key" ] && curl -fs -o /dev/null "http://127.0.0.1:$port/health"; then break; fi
  sleep 1
done
[ -n "$key" ] || { echo "the server did not answer within 30 min ($work/server.log)" >&2; exit 2; }
log "server on 127.0.0.1:$port"

if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "e2b==$version" "pytest>=8,<10" python-dotenv pytest-dotenv \
    "pytest-asyncio>=1.3,<2" pytest-timeout
fi
rm -rf "$work/python-sdk" && cp -r "$sdk" "$work/python-sdk"
export E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" E2B_API_KEY="$key"
xmls=()
for suite in ${SUITES:-sync async}; do
  log "tests/$suite"
  (cd "$work/python-sdk" && timeout 5400 "$work/venv/bin/python" -m pytest -o addopts=--import-mode=importlib \
    -o "timeout=${TEST_TIMEOUT_S:-180}" -p no:cacheprovider -q --junitxml="$work/$suite.xml" "tests/$suite" \
    >"$work/$suite.log" 2>&1) || true
  xmls+=("$work/$suite.xml")
done
python3 "$here/report.py" "$here/expected.tsv" "SDK $version" "${xmls[@]}"
