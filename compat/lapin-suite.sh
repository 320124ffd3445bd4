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
source compat/warren.sh
WARREN_LOG=warn start_warren "$bin"
cp -r "$src" "$work/lapin"
echo "lapin $version test suite against warren on port $port"
# Its own target folder (beside ours), so its dependency versions never disturb our build.
(cd "$work/lapin" && AMQP_ADDR="amqp://127.0.0.1:$port/%2f" \
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}-lapin" \
    cargo test --locked --no-default-features --features tokio,default-runtime --tests)
