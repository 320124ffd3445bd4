#!/usr/bin/env python3
"""Issue 15 point 9: confirmed persistent publishing (S2's shape: 1 KiB persistent messages,
confirms with a window of 1000, a consumer with manual acks, prefetch 1000, a multi-ack every
100) on a single Warren node and on a 3-node Warren cluster (through the leader), in one run.

    python3 scripts/cluster_bench.py [--binary PATH] [--seconds 10] [--rounds 2]

Without --binary it builds the release binary. Prints one row per setup (best of the rounds).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import SCENARIOS, ROOT  # noqa: E402

S2 = SCENARIOS["S2"][1]
CHILDREN = []


def kill_all():
    for c in CHILDREN:
        if c.poll() is None:
            c.kill()
            c.wait()
    CHILDREN.clear()


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, timeout=30):
    import socket
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("port %d did not open" % port)


def status(http):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/api/cluster" % http, timeout=1) as r:
            return json.loads(r.read())
    except OSError:
        return None


def start(binary, dirpath, nodes):
    """nodes: 1 = a single node; 3 = a cluster. Returns the AMQP port of the serving node."""
    ports = [(free_port(), free_port(), free_port()) for _ in range(nodes)]
    peers = ",".join("%d=127.0.0.1:%d" % (i + 1, p[2]) for i, p in enumerate(ports))
    for i, (amqp, http, raft) in enumerate(ports):
        cmd = [binary, "server", "--amqp-listen", "127.0.0.1:%d" % amqp,
               "--management-listen", "127.0.0.1:%d" % http,
               "--data-dir", os.path.join(dirpath, "n%d" % (i + 1))]
        if nodes > 1:
            cmd += ["--node-id", str(i + 1), "--raft-listen", "127.0.0.1:%d" % raft,
                    "--peers", peers]
        log = open(os.path.join(dirpath, "n%d.log" % (i + 1)), "w")
        env = dict(os.environ, WARREN_LOG="warn,openraft=error")
        CHILDREN.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env))
    for amqp, _, _ in ports:
        wait_port(amqp)
    if nodes == 1:
        return ports[0][0]
    deadline = time.time() + 30
    while time.time() < deadline:
        for amqp, http, _ in ports:
            s = status(http)
            if s and s.get("serving"):
                return amqp
        time.sleep(0.05)
    raise RuntimeError("no leader")


def perf(binary, port, seconds):
    uri = "amqp://guest:guest@127.0.0.1:%d/%%2f" % port
    cmd = [binary, "perf", "--uri", uri, "--duration", str(seconds), "--json"] + S2
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError("perf failed: %s" % out.stderr[-2000:])
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    binary = a.binary
    if not binary:
        target = os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/warren/target"))
        subprocess.run(["cargo", "build", "--release", "--bin", "warren"], cwd=ROOT, check=True,
                       env=dict(os.environ, CARGO_TARGET_DIR=target))
        binary = os.path.join(target, "release", "warren")
    signal.signal(signal.SIGTERM, lambda *_: (kill_all(), sys.exit(1)))
    rows = []
    try:
        for nodes, name in [(1, "Warren, single node"), (3, "Warren, 3-node cluster (leader)")]:
            best = None
            for _ in range(a.rounds):
                d = tempfile.mkdtemp(prefix="warren-cbench-")
                try:
                    port = start(binary, d, nodes)
                    r = perf(binary, port, a.seconds)
                finally:
                    kill_all()
                    shutil.rmtree(d, ignore_errors=True)
                r["confirmed_per_sec"] = r["confirmed"] / r["seconds"]
                if best is None or r["confirmed_per_sec"] > best["confirmed_per_sec"]:
                    best = r
            rows.append((name, best))
    finally:
        kill_all()
    print("| setup | confirmed msg/s | consumed msg/s | latency p50 ms | latency p99 ms |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print("| %s | %.0f | %.0f | %.1f | %.1f |" % (
            name, r["confirmed_per_sec"], r["consumed_per_sec"],
            r["latency_us"]["p50"] / 1000, r["latency_us"]["p99"] / 1000))


if __name__ == "__main__":
    main()
