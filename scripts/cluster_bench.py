#!/usr/bin/env python3
"""Issue 15 point 9: confirmed persistent publishing (S2's shape: 1 KiB persistent messages,
confirms with a window of 1000, a consumer with manual acks, prefetch 1000, a multi-ack every
100) on a single Warren node, on a 3-node Warren cluster (through the leader; a classic durable
queue and a quorum queue), and on a 3-node RabbitMQ cluster with a quorum queue, in one run, all
on this machine and loaded by the same `warren perf`.

    python3 scripts/cluster_bench.py [--binary PATH] [--seconds 10] [--rounds 2]
        [--no-rabbitmq] [--install-rabbitmq] [--random-body]

Without --binary it builds the release binary. RabbitMQ runs three nodes of Debian's
rabbitmq-server (node names warrenbench1..3@<host>, their own ports and folders, clustered with
`rabbitmqctl join_cluster`); --install-rabbitmq installs the package if it is missing
(apt-get). --random-body fills bodies with incompressible bytes (`warren perf --random-body`)
instead of zeros. Prints one row per setup (best of the rounds).
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
    # Below the ephemeral range (see clusterlib.free_base).
    import random
    import socket
    while True:
        p = random.randrange(10000, 30000)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
            return p
        except OSError:
            continue
        finally:
            s.close()


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


RABBIT_NODES = []


def rabbitmqctl(node, *args, timeout=120):
    return subprocess.run(["rabbitmqctl", "-n", node] + list(args), capture_output=True,
                          text=True, timeout=timeout)


def own_by_rabbitmq(dirpath, base):
    """Debian's rabbitmq-server runs as the rabbitmq user when started by root: its folders
    must be that user's (and the temporary folder above them open to it)."""
    import pwd
    try:
        user = pwd.getpwnam("rabbitmq")
    except KeyError:
        return
    if os.geteuid() != 0:
        return
    os.chmod(dirpath, 0o755)
    for root, dirs, files in os.walk(base):
        os.chown(root, user.pw_uid, user.pw_gid)
        for f in files:
            os.chown(os.path.join(root, f), user.pw_uid, user.pw_gid)


def start_rabbitmq(dirpath):
    """Three RabbitMQ nodes on this machine, clustered. Returns the first node's AMQP port (the
    quorum queue is declared through it, so it leads the queue)."""
    import socket
    host = socket.gethostname().split(".")[0]
    plugins = os.path.join(dirpath, "enabled_plugins")
    with open(plugins, "w") as f:
        f.write("[].\n")
    names, amqps = [], []
    for i in range(3):
        name = "warrenbench%d@%s" % (i + 1, host)
        amqp, dist = free_port(), free_port()
        base = os.path.join(dirpath, "rabbit%d" % (i + 1))
        for sub in ("mnesia", "log"):
            os.makedirs(os.path.join(base, sub), exist_ok=True)
        own_by_rabbitmq(dirpath, base)
        env = dict(os.environ, RABBITMQ_NODENAME=name, RABBITMQ_NODE_PORT=str(amqp),
                   RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", RABBITMQ_DIST_PORT=str(dist),
                   RABBITMQ_MNESIA_BASE=os.path.join(base, "mnesia"),
                   RABBITMQ_LOG_BASE=os.path.join(base, "log"),
                   RABBITMQ_PID_FILE=os.path.join(base, "pid"),
                   RABBITMQ_ENABLED_PLUGINS_FILE=plugins,
                   RABBITMQ_CONFIG_FILE=os.path.join(base, "none"))
        log = open(os.path.join(base, "stdout.log"), "w")
        CHILDREN.append(subprocess.Popen(["rabbitmq-server"], stdout=log, stderr=log, env=env))
        RABBIT_NODES.append(name)
        names.append(name)
        amqps.append(amqp)
    deadline = time.time() + 180
    for name in names:
        # await_startup fails at once while the node is not yet known to epmd: try again.
        while True:
            r = rabbitmqctl(name, "await_startup", "--timeout", "60", timeout=90)
            if r.returncode == 0:
                break
            if time.time() > deadline:
                raise RuntimeError("RabbitMQ node %s did not start: %s"
                                   % (name, r.stderr[-1000:]))
            time.sleep(1)
    for name in names[1:]:
        for args in (["stop_app"], ["join_cluster", names[0]], ["start_app"]):
            r = rabbitmqctl(name, *args)
            if r.returncode != 0:
                raise RuntimeError("rabbitmqctl %s %s: %s" % (name, args, r.stderr[-1000:]))
    r = rabbitmqctl(names[0], "cluster_status", "--formatter", "json")
    running = json.loads(r.stdout).get("running_nodes", []) if r.returncode == 0 else []
    if len(running) != 3:
        raise RuntimeError("the RabbitMQ cluster did not form: %s %s" % (r.stdout, r.stderr))
    wait_port(amqps[0])
    return amqps[0]


def stop_rabbitmq():
    for name in RABBIT_NODES:
        try:
            rabbitmqctl(name, "stop", timeout=60)
        except subprocess.TimeoutExpired:
            pass
    RABBIT_NODES.clear()


def perf(binary, port, seconds, extra=()):
    uri = "amqp://guest:guest@127.0.0.1:%d/%%2f" % port
    cmd = [binary, "perf", "--uri", uri, "--duration", str(seconds), "--json"] + S2 + list(extra)
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
    ap.add_argument("--no-rabbitmq", action="store_true")
    ap.add_argument("--install-rabbitmq", action="store_true")
    ap.add_argument("--random-body", action="store_true")
    a = ap.parse_args()
    body = ["--random-body"] if a.random_body else []
    rabbit = not a.no_rabbitmq
    if rabbit and shutil.which("rabbitmq-server") is None:
        if a.install_rabbitmq:
            subprocess.run(["apt-get", "install", "-y", "rabbitmq-server"], check=True,
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
            # The package may start its own node: it would hold the shared Erlang cookie's
            # node name but nothing else; stop it so only the benchmark's nodes run.
            subprocess.run(["rabbitmqctl", "stop"], capture_output=True)
        else:
            print("rabbitmq-server is not installed (--install-rabbitmq, or --no-rabbitmq)")
            rabbit = False
    binary = a.binary
    if not binary:
        target = os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/warren/target"))
        subprocess.run(["cargo", "build", "--release", "--bin", "warren"], cwd=ROOT, check=True,
                       env=dict(os.environ, CARGO_TARGET_DIR=target))
        binary = os.path.join(target, "release", "warren")
    signal.signal(signal.SIGTERM, lambda *_: (stop_rabbitmq(), kill_all(), sys.exit(1)))
    rows = []
    try:
        setups = [("warren", 1, [], "Warren, single node (classic durable queue)"),
                  ("warren", 3, [], "Warren, 3-node cluster (classic durable queue)"),
                  ("warren", 3, ["--queue-type", "quorum"], "Warren, 3-node cluster (quorum queue)")]
        if rabbit:
            setups.append(("rabbitmq", 3, ["--queue-type", "quorum"],
                           "RabbitMQ 3.10, 3-node cluster (quorum queue)"))
        for broker, nodes, extra, name in setups:
            best = None
            for _ in range(a.rounds):
                d = tempfile.mkdtemp(prefix="warren-cbench-")
                try:
                    if broker == "warren":
                        port = start(binary, d, nodes)
                    else:
                        port = start_rabbitmq(d)
                    r = perf(binary, port, a.seconds, extra + body)
                finally:
                    stop_rabbitmq()
                    kill_all()
                    shutil.rmtree(d, ignore_errors=True)
                r["confirmed_per_sec"] = r["confirmed"] / r["seconds"]
                if best is None or r["confirmed_per_sec"] > best["confirmed_per_sec"]:
                    best = r
            print("%s: %.0f confirmed msg/s" % (name, best["confirmed_per_sec"]), flush=True)
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
