# Sourced by the suite runners: start_server builds the server and the guest agent and starts a fresh
# server on a free loopback port with its state in $work/state. Sets server (its pid, killed on exit), port
# and key (its API key). Needs root, work and log.
start_server() {
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
}
