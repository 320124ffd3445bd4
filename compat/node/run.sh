#!/usr/bin/env bash
# amqplib (Node) compatibility suite: mocha tests that drive a live broker through
# amqplib and assert RabbitMQ 3.x behaviour (all pass against RabbitMQ 3.10.8).
#
#   run.sh WARREN_BINARY        start WARREN_BINARY on a free loopback port with a fresh
#                               data folder, run the suite, stop it
#   run.sh --url AMQP_URL       run the suite against an already running broker
#
# The connection.blocked tests (test-blocked/) need a broker in a disk alarm: with a
# binary they run against a second Warren started with a huge --disk-free-limit; with
# --url they run only if AMQP_BLOCKED_URL is set. Exit status is non-zero on any failure.
# Bounded: each mocha run is capped by `timeout` (SUITE_TIMEOUT, default 300 s) and each
# test by mocha --timeout 10000.
set -uo pipefail
cd "$(dirname "$0")"

if [ $# -lt 1 ]; then
    echo "usage: $0 WARREN_BINARY | --url AMQP_URL" >&2
    exit 2
fi

suite_timeout="${SUITE_TIMEOUT:-300}"

# Node dependencies (amqplib, mocha) from package.json, installed once.
if [ ! -d node_modules/amqplib ] || [ ! -d node_modules/mocha ]; then
    timeout 300 npm install --no-audit --no-fund --loglevel=error || { echo "npm install failed" >&2; exit 2; }
fi

free_port() {
    node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close();});'
}

wait_port() { # port [host]
    for _ in $(seq 1 100); do
        if node -e 'const s=require("net").connect(+process.argv[1],process.argv[2]);s.on("connect",()=>process.exit(0));s.on("error",()=>process.exit(1));' "$1" "${2:-127.0.0.1}" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "broker did not start listening on port $1" >&2
    return 1
}

pids=()
work=""
cleanup() {
    for p in "${pids[@]}"; do
        kill -TERM "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    if [ -n "$work" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

blocked_url="${AMQP_BLOCKED_URL:-}"
if [ "$1" = "--url" ]; then
    url="${2:?--url needs an AMQP URL}"
else
    bin="$1"
    work=$(mktemp -d)
    port=$(free_port)
    "$bin" server --management-listen none --amqp-listen "127.0.0.1:$port" --data-dir "$work/data" >"$work/warren.log" 2>&1 &
    pids+=($!)
    wait_port "$port" || { cat "$work/warren.log"; exit 1; }
    url="amqp://guest:guest@127.0.0.1:$port/%2F"
    # A second Warren, permanently in a disk alarm, for the connection.blocked tests.
    bport=$(free_port)
    "$bin" server --management-listen none --amqp-listen "127.0.0.1:$bport" --data-dir "$work/data-blocked" \
        --disk-free-limit 1000000000000000000 >"$work/warren-blocked.log" 2>&1 &
    pids+=($!)
    wait_port "$bport" && blocked_url="amqp://guest:guest@127.0.0.1:$bport/%2F"
    # A third on IPv6 loopback, for the IPv6 test (tests listen on loopback only).
    v6port=$(free_port)
    "$bin" server --management-listen none --amqp-listen "[::1]:$v6port" --data-dir "$work/data-v6" \
        >"$work/warren-v6.log" 2>&1 &
    pids+=($!)
    wait_port "$v6port" ::1 && export AMQP_IPV6_URL="amqp://guest:guest@[::1]:$v6port/%2F"
fi

out=$(mktemp)
status=0
echo "amqplib $(node -p 'JSON.parse(require("fs").readFileSync("node_modules/amqplib/package.json")).version') suite against $url"
AMQP_URL="$url" AMQP_BLOCKED_URL="$blocked_url" timeout "$suite_timeout" \
    npx --no-install mocha --exit --timeout 10000 --reporter spec 'test/*.test.js' 'test-blocked/*.test.js' 2>&1 | tee "$out"
status=${PIPESTATUS[0]}

passed=$(grep -Eo '^ +[0-9]+ passing' "$out" | grep -Eo '[0-9]+' || echo 0)
failed=$(grep -Eo '^ +[0-9]+ failing' "$out" | grep -Eo '[0-9]+' || echo 0)
skipped=$(grep -Eo '^ +[0-9]+ pending' "$out" | grep -Eo '[0-9]+' || echo 0)
rm -f "$out"
if [ "$status" -eq 124 ]; then echo "suite timed out after ${suite_timeout}s"; fi
if [ "$status" -ne 0 ] && [ -n "$work" ] && [ -f "$work/warren.log" ]; then
    echo "--- warren log (last 30 lines)"
    tail -n 30 "$work/warren.log"
fi
echo "amqplib-compat: $passed passed, $failed failed, $skipped skipped"
exit "$status"
