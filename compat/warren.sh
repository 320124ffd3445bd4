# Sourced by the compat runners: start a warren binary on a free loopback port with a data
# folder under $work (made here), wait until it accepts connections, and stop it (SIGTERM) and
# remove $work on exit.
#   start_warren BINARY   sets $work, $port, $mport (management API), $pid, $warren_log
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

start_warren() {
    work=$(mktemp -d)
    port=$(free_port)
    mport=$(free_port)
    warren_log="$work/warren.log"
    WARREN_LOG="${WARREN_LOG:-info}" "$1" server --amqp-listen "127.0.0.1:$port" \
        --management-listen "127.0.0.1:$mport" --data-dir "$work/data" >"$warren_log" 2>&1 &
    pid=$!
    trap stop_warren EXIT
    for _ in $(seq 1 100); do
        python3 -c "import socket; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "warren did not start listening on port $port" >&2
    tail -n 30 "$warren_log" >&2
    return 1
}

stop_warren() {
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$work"
}
