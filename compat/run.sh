#!/usr/bin/env bash
# Start a warren binary on a free loopback port with a fresh data folder, run the compat
# suites against it, stop it with SIGTERM. Usage: compat/run.sh WARREN_BINARY PYTHON
set -euo pipefail
cd "$(dirname "$0")"
bin="$1"
python="${2:-python3}"
port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
data=$(mktemp -d)
log="$data/warren.log"
"$bin" server --amqp-listen "127.0.0.1:$port" --data-dir "$data/data" >"$log" 2>&1 &
pid=$!
cleanup() {
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$data"
}
trap cleanup EXIT
for _ in $(seq 1 100); do
    if "$python" -c "import socket,sys; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null; then
        break
    fi
    sleep 0.1
done
status=0
AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2F" "$python" -m pytest -q -p no:cacheprovider . || status=$?
if [ $status -ne 0 ]; then
    echo "--- warren log (last 50 lines)"
    tail -n 50 "$log"
fi
exit $status
