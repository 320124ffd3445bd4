#!/usr/bin/env python3
"""Scaling benchmark: how Warren's (and, with --rabbit, RabbitMQ's) throughput and peak memory
change with the number of queues, the number of connections and the message size. Same load
generator (`warren perf`) and broker handling as scripts/bench.py (imported from it): every point
runs on a freshly started broker with a fresh data folder, so the peak RSS (VmHWM) is that
point's own; with --rabbit the two brokers alternate which goes first.

    python3 scripts/scale.py [--seconds 5] [--rabbit] [--sweeps queues,connections,sizes]
                             [--binary PATH] [--out FILE]

The load at every point: transient messages (delivery mode 1) to non-durable queues through the
default exchange; producers publish as fast as they can, but with publisher confirms, so no
producer is more than its confirm window ahead of the broker (Warren has no other flow control
yet, so an unconfirmed flood would only measure how fast its queues grow); consumers auto-ack.
Each point publishes for --seconds, then perf waits (at most 30 s) for the consumers to drain.
published/s is over the publish time, consumed/s up to the drain (so a broker whose consumers
fall behind shows consumed/s below published/s).

  queues       1, 10, 100, 1000 queues; 256 B bodies; producers = consumers = min(queues, 100),
               each producer publishing round-robin over its queues, each consumer subscribed to
               its queues (queues / 100 each at 1000); confirm window 100 per producer.
  connections  10, 100, 1000 connections, half producers and half consumers, one queue per
               producer/consumer pair; 256 B bodies; unthrottled, confirm window 100 each
               (--conn-rate R rate-limits each producer to R msg/s instead).
  sizes        16 B, 1 KiB, 64 KiB, 1 MiB bodies; 1 producer, 1 queue, 1 consumer; confirm
               window 16 MiB / size, between 1 and 1000 (1000, 1000, 256, 16 messages).

Every point is bounded: perf is killed after --seconds + 90 s, or as soon as the broker's RSS
exceeds --max-rss-mb (default 8192); the point is then reported as aborted. The file descriptor
limit is raised to the hard limit for the brokers and perf (1000 connections need > 1000 each).
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402 - scripts/bench.py, next to this file

SIZES = [(16, "16 B"), (1024, "1 KiB"), (65536, "64 KiB"), (1048576, "1 MiB")]


def points(sweeps, conn_rate):
    """(sweep, point label, perf arguments, what runs)."""
    out = []
    if "queues" in sweeps:
        for q in (1, 10, 100, 1000):
            w = min(q, 100)
            out.append(("queues", str(q),
                        ["--queues", str(q), "--producers", str(w), "--consumers", str(w),
                         "--size", "256", "--confirm", "100", "--auto-ack"],
                        "%dP/%dC/%dQ 256 B" % (w, w, q)))
    if "connections" in sweeps:
        for n in (10, 100, 1000):
            h = n // 2
            args = ["--queues", str(h), "--producers", str(h), "--consumers", str(h),
                    "--size", "256", "--confirm", "100", "--auto-ack"]
            if conn_rate:
                args += ["--rate", str(conn_rate)]
            out.append(("connections", str(n), args,
                        "%dP/%dC/%dQ 256 B%s" % (h, h, h,
                                                 " %d msg/s each" % conn_rate if conn_rate else "")))
    if "sizes" in sweeps:
        for size, label in SIZES:
            window = max(1, min(1000, (16 << 20) // size))
            out.append(("sizes", label,
                        ["--size", str(size), "--confirm", str(window), "--auto-ack"],
                        "1P/1C/1Q window %d" % window))
    return out


def raise_fd_limit(need):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        print("warning: open files limit %d is below the %d the largest point needs"
              % (soft, need), file=sys.stderr)


def rss_mb(pid):
    """Current resident memory of a process and its children, in MB."""
    total = 0
    for p in [pid] + bench.children(pid):
        try:
            for line in open("/proc/%d/status" % p):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) // 1024
        except OSError:
            pass
    return total


def run_point(binary, broker, pid, args, seconds, max_rss_mb):
    """Run perf against broker; returns (summary or None, note)."""
    uri = "amqp://guest:guest@127.0.0.1:%d/%%2f" % broker.port
    cmd = [binary, "perf", "--uri", uri, "--duration", str(seconds), "--json"] + args
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        perf = subprocess.Popen(cmd, stdout=out, stderr=err)
        deadline = time.time() + seconds + 90
        note = ""
        while perf.poll() is None:
            if time.time() > deadline:
                note = "aborted: over %d s" % (seconds + 90)
            elif rss_mb(pid) > max_rss_mb:
                note = "aborted: broker RSS over %d MB" % max_rss_mb
            if note:
                perf.kill()
                perf.wait()
                return None, note
            time.sleep(0.25)
        out.seek(0)
        err.seek(0)
        lines = [l for l in out.read().splitlines() if l.startswith("{")]
        errors = err.read().strip()
    if not lines:
        return None, "perf failed: %s" % errors[-300:].replace("\n", " ")
    if errors:
        print(errors[-2000:], file=sys.stderr)
        note = errors.splitlines()[-1][:120]
    return json.loads(lines[-1]), note


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5, help="publishing time per point")
    ap.add_argument("--sweeps", default="queues,connections,sizes")
    ap.add_argument("--rabbit", action="store_true",
                    help="also run RabbitMQ (rabbitmq-server must be installed)")
    ap.add_argument("--conn-rate", type=int, default=0,
                    help="messages/s per producer in the connections sweep (0: unthrottled)")
    ap.add_argument("--max-rss-mb", type=int, default=8192,
                    help="abort a point when the broker's RSS exceeds this")
    ap.add_argument("--binary", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/warren/target")),
        "release", "warren"))
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    sweeps = opts.sweeps.split(",")
    for s in sweeps:
        if s not in ("queues", "connections", "sizes"):
            ap.error("unknown sweep %s" % s)
    raise_fd_limit(1000 + 100)
    brokers = [bench.Warren(opts.binary)]
    if opts.rabbit:
        if shutil.which("rabbitmq-server"):
            brokers.append(bench.Rabbit())
        else:
            print("rabbitmq-server not installed: Warren only", file=sys.stderr)
    rows = []
    for i, (sweep, label, args, load) in enumerate(points(sweeps, opts.conn_rate)):
        order = brokers if i % 2 == 0 else list(reversed(brokers))
        for b in order:
            pid = b.start()
            cpu0 = bench.proc_cpu_seconds(pid)
            try:
                r, note = run_point(opts.binary, b, pid, args, opts.seconds, opts.max_rss_mb)
            finally:
                cpu = bench.proc_cpu_seconds(pid) - cpu0
                rss = bench.peak_rss_mb(pid)
                b.stop()
            if r is None:
                rows.append((sweep, label, load, b.name, None, None, rss, note))
                print("%-11s %-6s %-8s %s" % (sweep, label, b.name, note), file=sys.stderr)
                continue
            msgs = max(r["consumed"], r["published"], 1)
            if r["consumed"] < r["published"]:
                note = ("consumed %d of %d; " % (r["consumed"], r["published"]) + note).strip("; ")
            rows.append((sweep, label, load, b.name, r, cpu * 1e6 / msgs, rss, note))
            print("%-11s %-6s %-8s pub %8.0f/s cons %8.0f/s cpu %.2fus/msg rss %dMB %s" % (
                sweep, label, b.name, r["published_per_sec"], r["consumed_per_sec"],
                cpu * 1e6 / msgs, rss, note), file=sys.stderr)
    lines = ["| sweep | point | load | broker | published/s | consumed/s | p99 us | "
             "broker CPU us/msg | peak RSS MB | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for sweep, label, load, broker, r, cpu_per_msg, rss, note in rows:
        if r is None:
            lines.append("| %s | %s | %s | %s | - | - | - | - | %d | %s |" % (
                sweep, label, load, broker, rss, note))
        else:
            lines.append("| %s | %s | %s | %s | %.0f | %.0f | %d | %.2f | %d | %s |" % (
                sweep, label, load, broker, r["published_per_sec"], r["consumed_per_sec"],
                r["latency_us"]["p99"], cpu_per_msg, rss, note))
    table = "\n".join(lines)
    print(table)
    if opts.out:
        open(opts.out, "w").write(table + "\n")


if __name__ == "__main__":
    main()
