#!/usr/bin/env bash
# Run lapin's own integration tests (tests/ of the lapin crate that cargo already fetched as our
# dev-dependency) unmodified against a warren binary on a free loopback port.
# Usage: compat/lapin-suite.sh WARREN_BINARY
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$1"
version=$(cargo metadata --format-version 1 --locked 2>/dev/null \
    | python3 -c "import json,sys; print(next(p['version'] for p in json.load(sys.stdin)['packages'] if p['name']=='lapin'))")
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/lapin-"$version" | head -n 1)
work=$(mktemp -d)
cp -r "$src" "$work/lapin"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
WARREN_LOG=warn "$bin" server --amqp-listen "127.0.0.1:$port" --data-dir "$work/data" >"$work/warren.log" 2>&1 &
pid=$!
cleanup() {
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 1 100); do
    python3 -c "import socket; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null && break
    sleep 0.1
done
echo "lapin $version test suite against warren on port $port"
# Its own target folder (beside ours), so its dependency versions never disturb our build.
(cd "$work/lapin" && AMQP_ADDR="amqp://127.0.0.1:$port/%2f" \
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}-lapin" \
    cargo test --locked --no-default-features --features tokio,default-runtime --tests)
