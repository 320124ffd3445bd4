#!/usr/bin/env bash
# Run the live-broker integration suites of py-amqp (PyPI "amqp") and kombu (Celery's
# transport), unmodified (their sdists ship t/integration/), against a Warren binary.
#
#   compat/py-suites.sh WARREN_BINARY
#
# Environment (all optional):
#   PY_SUITE_DIR    work folder for venvs and sdists   (default: beside cargo's target
#                   folder, so repeated runs reuse them)
#   AMQP_VERSION    py-amqp sdist to test              (default 5.4.2)
#   KOMBU_VERSION   kombu sdist to test                (default 5.7.0)
#   AMQP_K          pytest -k filter for py-amqp       (default "not tls": the
#                   TLS cases need a TLS listener on 5671 plus certificates
#                   that the sdist does not ship, and test_tls_*_certs
#                   reach tls-v1-2.badssl.com on the internet)
#   PYTEST_ARGS     extra pytest arguments for both suites (e.g. "-rA" or
#                   "-p no:rerunfailures" to see flakiness the suites'
#                   own @flaky(reruns=5) markers would otherwise hide)
#
# Prints one summary line per suite; exit status 0 only if both suites pass.
set -u -o pipefail

if [ $# -lt 1 ] || [ ! -x "$1" ]; then
    echo "usage: $0 WARREN_BINARY" >&2
    exit 2
fi
WARREN_SRC=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
WORK=${PY_SUITE_DIR:-${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}-pysuites}
AMQP_VERSION=${AMQP_VERSION:-5.4.2}
KOMBU_VERSION=${KOMBU_VERSION:-5.7.0}
AMQP_K=${AMQP_K:-not tls}
PYTEST_ARGS=${PYTEST_ARGS:-}
PY=${PYTHON:-python3}

mkdir -p "$WORK"
LOGDIR=$WORK/logs
mkdir -p "$LOGDIR"

log() { echo "[py-suites] $*" >&2; }

# ---------------------------------------------------------------- install
SDISTS=$WORK/sdists
AMQP_SRC=$SDISTS/amqp-$AMQP_VERSION
KOMBU_SRC=$SDISTS/kombu-$KOMBU_VERSION

fetch_sdists() {
    mkdir -p "$SDISTS"
    if [ ! -d "$AMQP_SRC/t/integration" ] || [ ! -d "$KOMBU_SRC/t/integration" ]; then
        log "downloading sdists amqp==$AMQP_VERSION kombu==$KOMBU_VERSION"
        [ -x "$WORK/venv-amqp/bin/pip" ] || timeout 300 "$PY" -m venv "$WORK/venv-amqp" || return 1
        timeout 300 "$WORK/venv-amqp/bin/pip" download -q --no-binary :all: --no-deps \
            -d "$SDISTS" "amqp==$AMQP_VERSION" "kombu==$KOMBU_VERSION" || return 1
        (cd "$SDISTS" && tar xzf "amqp-$AMQP_VERSION.tar.gz" && tar xzf "kombu-$KOMBU_VERSION.tar.gz") || return 1
    fi
}

# py-amqp pins pytest<=8.0.0 (requirements/test.txt) while kombu pins
# pytest==9.1.1 (requirements/test.txt), hence one venv per suite.
make_venv() {  # name, pip args...
    local venv=$WORK/$1; shift
    if [ -f "$venv/.installed-$AMQP_VERSION-$KOMBU_VERSION" ]; then return 0; fi
    log "creating $venv"
    rm -rf "$venv"
    timeout 300 "$PY" -m venv "$venv" || return 1
    timeout 600 "$venv/bin/pip" install -q "$@" || return 1
    touch "$venv/.installed-$AMQP_VERSION-$KOMBU_VERSION"
}

fetch_sdists || { log "could not fetch sdists"; exit 3; }
make_venv venv-amqp 'pytest>=6.2.5,<=8.0.0' pytest-rerunfailures "$AMQP_SRC" \
    || { log "could not install the py-amqp venv"; exit 3; }
make_venv venv-kombu 'pytest==9.1.1' 'pytest-rerunfailures==16.7' 'hypothesis<7' \
    "$AMQP_SRC" "$KOMBU_SRC" \
    || { log "could not install the kombu venv"; exit 3; }

# ---------------------------------------------------------------- broker
RUNDIR=$(mktemp -d /tmp/py-suite-run.XXXXXX)
WARREN_PID=
cleanup() {
    if [ -n "$WARREN_PID" ] && kill -0 "$WARREN_PID" 2>/dev/null; then
        kill "$WARREN_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$WARREN_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$WARREN_PID" 2>/dev/null
        wait "$WARREN_PID" 2>/dev/null
    fi
    rm -rf "$RUNDIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A copy, so that a rebuild of the original during the run changes nothing.
cp "$WARREN_SRC" "$RUNDIR/warren"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$RUNDIR/warren" server --management-listen none --amqp-listen "127.0.0.1:$PORT" --data-dir "$RUNDIR/data" \
    >"$LOGDIR/warren.log" 2>&1 &
WARREN_PID=$!
for _ in $(seq 100); do
    "$PY" -c "import socket,sys; socket.create_connection(('127.0.0.1', $PORT), 0.2).close()" 2>/dev/null && break
    kill -0 "$WARREN_PID" 2>/dev/null || break
    sleep 0.1
done
if ! kill -0 "$WARREN_PID" 2>/dev/null; then
    log "warren did not start; see $LOGDIR/warren.log"; tail -20 "$LOGDIR/warren.log" >&2; exit 4
fi
log "warren pid $WARREN_PID on 127.0.0.1:$PORT (log $LOGDIR/warren.log)"

export RABBITMQ_HOST=127.0.0.1 RABBITMQ_5672_TCP=$PORT

# ---------------------------------------------------------------- suites
summary() {  # label, rc, logfile
    local line
    line=$(grep -E '( passed| failed| errors?| skipped| deselected| no tests ran).* in [0-9.]+s' "$3" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
    [ "$2" = 124 ] && line="TIMEOUT ${line:-(no summary)}"
    printf '%-32s rc=%-3s %s   (log %s)\n' "$1" "$2" "${line:-no pytest summary}" "$3"
}

# shellcheck disable=SC2086
(cd "$AMQP_SRC" && timeout 600 "$WORK/venv-amqp/bin/python" -m pytest \
    t/integration/test_rmq.py -k "$AMQP_K" -p no:cacheprovider -rfE \
    -W ignore::pytest.PytestUnknownMarkWarning $PYTEST_ARGS) >"$LOGDIR/amqp.log" 2>&1
AMQP_RC=$?

# shellcheck disable=SC2086
(cd "$KOMBU_SRC" && timeout 900 "$WORK/venv-kombu/bin/python" -m pytest \
    t/integration/test_py_amqp.py -p no:cacheprovider -rfE \
    -W ignore::pytest.PytestUnknownMarkWarning $PYTEST_ARGS) >"$LOGDIR/kombu.log" 2>&1
KOMBU_RC=$?

summary "py-amqp $AMQP_VERSION test_rmq.py" "$AMQP_RC" "$LOGDIR/amqp.log"
summary "kombu $KOMBU_VERSION test_py_amqp.py" "$KOMBU_RC" "$LOGDIR/kombu.log"
[ "$AMQP_RC" = 0 ] && [ "$KOMBU_RC" = 0 ]
