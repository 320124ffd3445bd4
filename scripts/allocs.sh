#!/usr/bin/env bash
# Count the broker's heap allocations per message under `warren perf` loads, with a uprobe on
# mimalloc's allocation entry point (every Rust allocation in the server goes through it):
#   scripts/allocs.sh [--binary PATH]
# Prints allocations per published message for S1-, S2- and S3-shaped loads of a fixed count.
# Connection setup is included (a few hundred allocations, negligible over the counts used).
# Needs perf(1) with uprobe support and root (as scripts/profile.sh).
set -euo pipefail
BIN="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}/release/warren"
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) BIN="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
COPY=$(mktemp /tmp/warren-allocs-XXXXXX)
cp "$BIN" "$COPY"
chmod +x "$COPY"
EVENT="warren_allocs:alloc$$"
perf probe -q -x "$COPY" --add "$EVENT=mi_malloc_aligned"
cleanup() { perf probe -q -d "$EVENT" 2>/dev/null || true; rm -f "$COPY"; }
trap cleanup EXIT
run() {
  local name=$1 count=$2; shift 2
  local data port server
  data=$(mktemp -d /tmp/warren-allocs-data-XXXXXX)
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$COPY" server --management-listen none --amqp-listen "127.0.0.1:$port" --data-dir "$data" >/dev/null 2>&1 &
  server=$!
  for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  perf stat -x, -e "$EVENT" -p "$server" -o /tmp/warren-allocs.stat &
  local stat=$!
  sleep 0.3
  "$COPY" perf --uri "amqp://guest:guest@127.0.0.1:$port/%2f" --count "$count" --json "$@" >/dev/null
  sleep 0.3
  kill -INT $stat; wait $stat 2>/dev/null || true
  kill $server; wait $server 2>/dev/null || true
  rm -rf "$data"
  local n
  n=$(grep -v '^#' /tmp/warren-allocs.stat | grep -m1 "$EVENT" | cut -d, -f1)
  python3 -c "print('%-44s %8d messages %10d allocations %6.2f per message' % ('$name', $count, $n, $n / $count))"
}
run "S1 transient 16 B, auto-ack" 200000 --size 16 --auto-ack
run "S2 persistent 1 KiB, confirms, manual ack" 100000 --size 1024 --persistent --confirm 1000 \
  --prefetch 1000 --multi-ack-every 100
run "S3 fanout to 10 queues (per publish)" 50000 --size 1024 --queues 10 --consumers 10 \
  --exchange-type fanout --auto-ack
