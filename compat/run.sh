#!/usr/bin/env bash
# Start a warren binary on a free loopback port with a fresh data folder, run the compat
# suites against it, stop it with SIGTERM. Usage: compat/run.sh WARREN_BINARY PYTHON
set -euo pipefail
cd "$(dirname "$0")"
bin="$1"
python="${2:-python3}"
source ./warren.sh
start_warren "$bin"
status=0
AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2F" MANAGEMENT_URL="http://127.0.0.1:$mport" "$python" -m pytest -q -p no:cacheprovider . || status=$?
if [ $status -ne 0 ]; then
    echo "--- warren log (last 50 lines)"
    tail -n 50 "$warren_log"
fi
exit $status
