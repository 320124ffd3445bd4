# Shared settings for scripts/*.sh (sourced, not run).
# The cargo target folder lives outside the clone so repeated runs (and CI) reuse the build.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}"
WARREN_VENV="${WARREN_VENV:-$HOME/.cache/warren/venv}"

# Install what a fresh Debian machine lacks (we run as root there; elsewhere, say what is missing).
ensure_system_packages() {
    local missing=()
    command -v cc >/dev/null 2>&1 || missing+=(build-essential)
    # RocksDB's C++ build (the durable store) needs libclang for bindgen.
    dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "installing: ${missing[*]}"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
        else
            echo "please install: ${missing[*]}" >&2
            return 1
        fi
    fi
}

# What only the tests need: libfaketime (a node's wall clock jumps in tests/amqp/cluster_faults.rs),
# strace (holds up a node's fsyncs there, to show confirms and votes wait for them) and the
# openssl command (compat/test_tls.py makes its certificates with it).
ensure_test_packages() {
    local missing=()
    [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ] || missing+=(faketime)
    command -v strace >/dev/null 2>&1 || missing+=(strace)
    command -v openssl >/dev/null 2>&1 || missing+=(openssl)
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "installing: ${missing[*]}"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
        else
            echo "please install: ${missing[*]}" >&2
            return 1
        fi
    fi
}

ensure_python_env() {
    if [ ! -x "$WARREN_VENV/bin/python" ]; then
        python3 -m venv "$WARREN_VENV"
    fi
    "$WARREN_VENV/bin/pip" install -q --disable-pip-version-check -r compat/requirements.txt
}
