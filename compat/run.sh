#!/usr/bin/env bash
# Start a warren binary on a free loopback port with a fresh data folder, run the compat
# suites against it, stop it with SIGTERM. Usage: compat/run.sh WARREN_BINARY PYTHON
set -euo pipefail
bin="$1"
# An absolute path: the suite runs from compat/, and test_tls.py starts brokers of its own.
case "$bin" in
    /*) ;;
    */*) bin="$PWD/$bin" ;;
    *) bin="$(command -v "$bin")" || { echo "no such program: $1" >&2; exit 1; } ;;
esac
cd "$(dirname "$0")"
python="${2:-python3}"
source ./warren.sh
start_warren "$bin"
status=0
export WARREN_BIN="$bin"
AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2F" MANAGEMENT_URL="http://127.0.0.1:$mport" "$python" -m pytest -q -p no:cacheprovider . || status=$?
if [ $status -ne 0 ]; then
    echo "--- warren log (last 50 lines)"
    tail -n 50 "$warren_log"
fi
exit $status
