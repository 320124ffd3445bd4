#!/usr/bin/env bash
# Build and start Warren with its defaults: AMQP on [::]:5672 (IPv4 and IPv6), data in ./data.
# Extra arguments go to `warren server` (see `warren server --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ensure_system_packages
cargo build --release --bin warren
exec "$CARGO_TARGET_DIR/release/warren" server "$@"
