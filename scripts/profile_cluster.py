#!/usr/bin/env python3
"""Where a 3-node cluster spends its work under S2's load (issue 15 point 9).

    python3 scripts/profile_cluster.py [--binary PATH] [--seconds 10]
        [--perf leader|follower] [--perf-seconds 3]

Starts three nodes on loopback (as scripts/cluster_bench.py does), runs `warren perf` with S2's
shape through the leader, and prints per node the CPU time and the bytes written (write(2)
calls, and what reached the disk) per confirmed message, from /proc. With --perf it also
records one node with perf(1) and DWARF call graphs (`apt-get install linux-perf`) into
/tmp/warren-cluster-profile.data and prints the top entries by inclusive time:
`perf report -i /tmp/warren-cluster-profile.data --children` browses it.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_bench as cb  # noqa: E402

DATA = "/tmp/warren-cluster-profile.data"


def proc_counters(pid):
    r = {}
    with open("/proc/%d/io" % pid) as f:
        for line in f:
            k, v = line.split(":")
            r[k] = int(v)
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    r["cpu_ticks"] = int(fields[11]) + int(fields[12])
    r["minflt"] = int(fields[7])
    r["ctxt"] = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, tid)) as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")):
                        r["ctxt"] += int(line.split()[1])
        except OSError:
            pass
    return r


def thread_ticks(pid):
    """{(tid, name): CPU ticks} of each thread of `pid`."""
    r = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                head, tail = f.read().rsplit(")", 1)
            fields = tail.split()
            r[(tid, head.split("(", 1)[1])] = int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return r


def machine_ticks():
    """(busy, all) CPU ticks of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--perf", choices=["leader", "follower"])
    ap.add_argument("--perf-seconds", type=int, default=3)
    a = ap.parse_args()
    binary = a.binary or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/warren/target")),
        "release", "warren")
    d = tempfile.mkdtemp(prefix="warren-cprof-")
    try:
        port = cb.start(binary, d, 3)
        children = list(cb.CHILDREN)
        leader = next(c.pid for c in children if "127.0.0.1:%d" % port in " ".join(c.args))
        before = {c.pid: proc_counters(c.pid) for c in children}
        threads_before = {c.pid: thread_ticks(c.pid) for c in children}
        started = time.time()
        uri = "amqp://guest:guest@127.0.0.1:%d/%%2f" % port
        load = subprocess.Popen(
            [binary, "perf", "--uri", uri, "--duration", str(a.seconds), "--json"] + os.environ.get("PERF_SHAPE", " ".join(cb.S2)).split() + os.environ.get("PERF_EXTRA", "").split(),
            stdout=subprocess.PIPE, text=True)
        machine_before = machine_ticks()
        if a.perf:
            time.sleep(min(2, a.seconds / 3))
            target = leader if a.perf == "leader" else next(
                c.pid for c in children if c.pid != leader)
            subprocess.run(["perf", "record"] + os.environ.get("PERF_EVENT", "-F 199").split() + ["--call-graph", "dwarf,16384",
                            "-p", str(target), "-o", DATA, "--", "sleep", str(a.perf_seconds)],
                           capture_output=True)
        # The load generator's own counters, read just before it exits.
        load_cpu = 0
        while load.poll() is None:
            try:
                load_cpu = proc_counters(load.pid)["cpu_ticks"]
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        machine_after = machine_ticks()
        wall = time.time() - started
        threads_after = {c.pid: thread_ticks(c.pid) for c in children}
        out, _ = load.communicate(timeout=a.seconds + 120)
        after = {c.pid: proc_counters(c.pid) for c in children}
        lines = [l for l in out.splitlines() if l.startswith("{")]
        if not lines:
            raise RuntimeError("warren perf printed no result")
        import json
        r = json.loads(lines[-1])
        n = max(r["confirmed"], 1)
        print("confirmed %d in %.1f s: %.0f msg/s%s" % (
            r["confirmed"], r["seconds"], r["confirmed"] / r["seconds"],
            " (perf recording slows it)" if a.perf else ""))
        tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
        for c in children:
            b, e = before[c.pid], after[c.pid]
            print("%-8s pid %d: CPU %.1f us/msg, write(2) %.0f B/msg, to disk %.0f B/msg, "
                  "%.2f page faults/msg, %.3f context switches/msg" % (
                      "leader" if c.pid == leader else "follower", c.pid,
                      (e["cpu_ticks"] - b["cpu_ticks"]) * tick_us / n,
                      (e["wchar"] - b["wchar"]) / n, (e["write_bytes"] - b["write_bytes"]) / n,
                      (e["minflt"] - b["minflt"]) / n, (e["ctxt"] - b["ctxt"]) / n))
            # The busiest threads, as a share of one core over the run (a thread near 100%
            # is a serial bottleneck whatever the machine's idle time).
            tb, ta = threads_before[c.pid], threads_after[c.pid]
            hot = sorted(((ta[k] - tb.get(k, 0), k[1]) for k in ta), reverse=True)[:6]
            print("    threads: " + ", ".join(
                "%s %.0f%%" % (name, 100.0 * t * tick_us / 1e6 / wall) for t, name in hot))
        busy = machine_after[0] - machine_before[0]
        total = max(machine_after[1] - machine_before[1], 1)
        print("load generator: CPU %.1f us/msg; machine busy %.0f%% (iowait counts as idle)" % (
            load_cpu * tick_us / n, 100.0 * busy / total))
    finally:
        cb.kill_all()
        shutil.rmtree(d, ignore_errors=True)
    if a.perf:
        rep = subprocess.run(["perf", "report", "-i", DATA, "--children", "--sort", "sym",
                              "--stdio", "--percent-limit", "5"],
                             capture_output=True, text=True)
        top = [l for l in rep.stdout.splitlines()
               if l.strip()[:1].isdigit() and ("warren" in l or "openraft" in l)]
        print("\n".join(top[:40]))


if __name__ == "__main__":
    main()
