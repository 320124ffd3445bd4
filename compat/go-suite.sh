#!/usr/bin/env bash
# Run the integration tests of the official Go client, amqp091-go (the version Debian packages:
# golang-github-rabbitmq-amqp091-go-dev, its *_test.go files unmodified), against a warren
# binary on a free loopback port. Offline: GOPATH mode, no Go module proxy.
# Usage: compat/go-suite.sh WARREN_BINARY [test binary flags, e.g. -test.run 'Issue43$']
# Installs golang-go and the two Debian source packages when missing (as root).
# The package's goroutine leak check (goleak) runs too: a connection left open fails it.
set -euo pipefail
bin=$(readlink -f "$1")
shift
pkg=github.com/rabbitmq/amqp091-go
deb_src=/usr/share/gocode/src/$pkg
need=()
command -v go >/dev/null 2>&1 || need+=(golang-go)
[ -f "$deb_src/integration_test.go" ] || need+=(golang-github-rabbitmq-amqp091-go-dev)
[ -d /usr/share/gocode/src/go.uber.org/goleak ] || need+=(golang-uber-goleak-dev)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "please install: ${need[*]}" >&2
        exit 1
    fi
    echo "installing: ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
source "$(dirname "$0")/warren.sh"
WARREN_LOG=warn start_warren "$bin"
export GO111MODULE=off GOFLAGS= GOPROXY=off GOPATH="$work/gopath:/usr/share/gocode"
# The build cache is kept between runs (beside cargo's target folder).
export GOCACHE="${CARGO_TARGET_DIR:-$HOME/.cache/warren/target}-gocache"
src="$work/gopath/src/$pkg"
mkdir -p "$(dirname "$src")"
cp -r "$deb_src" "$src"
(cd "$src" && timeout 600 go test -c -tags integration -o "$work/amqp091.test" .)
echo "amqp091-go $(dpkg-query -W -f='${Version}' golang-github-rabbitmq-amqp091-go-dev) integration tests against warren on port $port"
status=0
(cd "$src" && AMQP_URL="amqp://guest:guest@127.0.0.1:$port/" \
    timeout -k 10 600 "$work/amqp091.test" -test.v -test.count=1 -test.timeout 590s "$@") \
    >"$work/go-suite.log" 2>&1 || status=$?
grep -E '^--- FAIL|^panic|^goleak|^FAIL' "$work/go-suite.log" || true
echo "amqp091-go: $(grep -c '^--- PASS' "$work/go-suite.log") passed, $(grep -c '^--- FAIL' "$work/go-suite.log") failed (exit $status)"
if [ $status -ne 0 ]; then
    echo "--- last 60 lines of the suite's output"
    tail -n 60 "$work/go-suite.log"
    echo "--- warren log (last 30 lines)"
    tail -n 30 "$warren_log"
fi
exit $status
