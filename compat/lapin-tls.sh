#!/usr/bin/env bash
# lapin over TLS (and EXTERNAL login) against a warren binary: compat/lapin-tls/, a crate of
# its own (see its Cargo.toml), built in its own target folder. It starts its own brokers.
# Usage: compat/lapin-tls.sh WARREN_BINARY
set -euo pipefail
cd "$(dirname "$0")/lapin-tls"
bin=$(realpath "$1")
WARREN_BIN="$bin" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}-lapin-tls" \
    cargo test --locked
