# Sourced by the suite runners: start_server builds the server and the guest agent and starts a fresh
# server on a free loopback port with its state in $work/state, served as E2B serves sandboxes: over TLS
# (a throwaway CA in $work/tls) with host routing for `<port>-<sandbox id>.sbx.test:<port>`, the wildcard
# name resolved to loopback inside the test processes (names.py for pytest, names.cjs for node). Sets
# server (its pid, killed on exit), port, key (its API key) and url, and exports what the SDKs and the
# tests' own HTTP clients need (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, SSL_CERT_FILE,
# NODE_EXTRA_CA_CERTS, NODE_OPTIONS, PYTHONPATH). Needs root, work, here and log. js_project and vitest_run set
# up and run a JS suite for report.py.
SANDBOX_DOMAIN=sbx.test

make_tls() {  # $1: folder; a CA and a server certificate for 127.0.0.1, sbx.test and *.sbx.test
  mkdir -p "$1" && (
    cd "$1"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=e2b-suite CA" -keyout ca.key -out ca.pem \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$SANDBOX_DOMAIN" -keyout server.key -out server.csr 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:%s,DNS:*.%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' \
      "$SANDBOX_DOMAIN" "$SANDBOX_DOMAIN" >ext.cnf
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile ext.cnf \
      -out server.pem 2>/dev/null
  )
}

start_server() {
  log "building the server and the guest agent"
  (cd "$root" && cargo build -q -p agentenv-server --bins -p agentenv-guest)
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  make_tls "$work/tls"
  AGENTENV_GUEST_BIN="$root/target/debug/agentenv-guest" "$root/target/debug/agentenv" \
    --state-dir "$work/state" --listen "127.0.0.1:$port" --tls-cert "$work/tls/server.pem" \
    --tls-key "$work/tls/server.key" --sandbox-domain "$SANDBOX_DOMAIN:$port" >"$work/server.log" 2>&1 &
  server=$!
  trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
  url="https://127.0.0.1:$port"
  key=""
  for _ in $(seq 1 1800); do  # the first start builds the default template (minutes)
    kill -0 "$server" 2>/dev/null || { tail -20 "$work/server.log" >&2; echo "the server exited" >&2; exit 2; }
    key=$(cat "$work/state/server/api_key" 2>/dev/null || true)
    if [ -n "$key" ] && curl -fs --cacert "$work/tls/ca.pem" -o /dev/null "$url/health"; then break; fi
    sleep 1
  done
  [ -n "$key" ] || { echo "the server did not answer within 30 min ($work/server.log)" >&2; exit 2; }
  export E2B_API_URL="$url" E2B_SANDBOX_URL="$url" E2B_API_KEY="$key" SSL_CERT_FILE="$work/tls/ca.pem" \
    NODE_EXTRA_CA_CERTS="$work/tls/ca.pem" NODE_OPTIONS="--require $here/names.cjs ${NODE_OPTIONS:-}" \
    PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" E2B_SUITE_DOMAIN="$SANDBOX_DOMAIN"
}

js_project() {  # $1: source folder, $2: work folder, $3: package name, $4: dev dependencies kept, rest: what to copy
  # The source's package.json with its runtime dependencies and only the test tools the tests import, installed once.
  local src=$1 dir=$2 name=$3 keep=$4
  shift 4
  mkdir -p "$dir" && for f in "$@"; do rm -rf "${dir:?}/$f" && cp -r "$src/$f" "$dir/"; done
  node -e 'const fs = require("fs"), [file, name, ...keep] = process.argv.slice(1)
    const p = JSON.parse(fs.readFileSync(file)), d = p.devDependencies
    p.devDependencies = Object.fromEntries(keep.map(k => [k, d[k]]))
    p.name = name; delete p.scripts; delete p.packageManager; fs.writeFileSync(file, JSON.stringify(p, null, 1))' \
    "$dir/package.json" "$name" $keep
  [ -d "$dir/node_modules" ] || (cd "$dir" && npm install --no-audit --no-fund >"$work/npm.log" 2>&1)
}

vitest_run() {  # $1: project folder, rest: vitest options; one file at a time, into $work/js.log and $work/js.xml
  rm -f "$work/js-vitest.xml" "$work/js.xml"
  (cd "$1" && shift && timeout 5400 npx vitest run --maxWorkers=1 --no-file-parallelism --reporter=default \
    --reporter=junit --outputFile.junit="$work/js-vitest.xml" "$@" >"$work/js.log" 2>&1) || true
  # report.py reads folders as pytest writes them: tests/sandbox/x.test.ts -> tests.sandbox.x
  python3 - "$work/js-vitest.xml" "$work/js.xml" <<'PY' || true
import re, sys, xml.etree.ElementTree as ET
tree = ET.parse(sys.argv[1])
for tc in tree.iter("testcase"):
    tc.set("classname", re.sub(r"\.test\.tsx?$", "", tc.get("classname", "")).replace("/", "."))
tree.write(sys.argv[2])
PY
}
