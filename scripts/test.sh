#!/usr/bin/env bash
# Run every test: formatting, lints, unit and integration tests (cargo), then the black-box
# client suites in compat/ against the built binary.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ensure_system_packages
ensure_test_packages
ensure_python_env

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace
echo "== client library suites against the warren binary"
cargo build --bin warren
bash compat/lapin-suite.sh "$CARGO_TARGET_DIR/debug/warren"
bash compat/go-suite.sh "$CARGO_TARGET_DIR/debug/warren"
bash compat/node/run.sh "$CARGO_TARGET_DIR/debug/warren"
bash compat/py-suites.sh "$CARGO_TARGET_DIR/debug/warren"
bash compat/run.sh "$CARGO_TARGET_DIR/debug/warren" "$WARREN_VENV/bin/python"
echo "== chaos: 3 nodes behind Raft fault proxies, a seeded nemesis, the history checked"
# The short variant (about 2 minutes); scripts/chaos.py --runs 50 is the long one.
"$WARREN_VENV/bin/python" scripts/chaos.py --seed "${WARREN_CHAOS_SEED:-1}" --duration 90 \
    --binary "$CARGO_TARGET_DIR/debug/warren"
