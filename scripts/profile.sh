#!/usr/bin/env bash
# Profile the broker (server process only) under one `warren perf` load with perf(1):
#   scripts/profile.sh [--binary PATH] [--seconds N] -- <warren perf arguments>
# e.g. scripts/profile.sh -- --size 16 --auto-ack            (S1)
#      scripts/profile.sh -- --size 1048576 --auto-ack --prefetch 10   (S6)
# Prints the top functions by self time and leaves the recording in /tmp/warren-profile.data
# (`perf report -i /tmp/warren-profile.data` to browse). Needs `apt-get install linux-perf`
# (or the perf package of the running kernel); the release build has debug info.
set -euo pipefail
BIN="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}/release/warren"
SECONDS_RECORD=5
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) BIN="$2"; shift 2 ;;
    --seconds) SECONDS_RECORD="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
DATA=$(mktemp -d /tmp/warren-profile-XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" server --management-listen none --amqp-listen "127.0.0.1:$PORT" --data-dir "$DATA" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$DATA"' EXIT
for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.1; done
"$BIN" perf --uri "amqp://guest:guest@127.0.0.1:$PORT/%2f" --duration $((SECONDS_RECORD + 3)) --json "$@" \
  >/tmp/warren-profile-perf.json &
LOAD=$!
sleep 1.5
perf record -F 499 -g -p "$SERVER" -o /tmp/warren-profile.data -- sleep "$SECONDS_RECORD" >/dev/null 2>&1
wait $LOAD || true
tail -1 /tmp/warren-profile-perf.json
perf report -i /tmp/warren-profile.data --no-children --percent-limit 1 --stdio 2>/dev/null \
  | grep -E '^ +[0-9]' | head -30
