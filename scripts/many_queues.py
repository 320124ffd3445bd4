#!/usr/bin/env python3
"""Many durable queues: memory and time. Declares N durable queues (default 10,000), publishes
one persistent 1 KiB message to each with confirms, reports the broker's resident memory, then
restarts it (Warren: same data folder) and reports the start-up time, that every queue came back
with its message, and the memory after the restart. With --rabbit, RabbitMQ does the same
declare/publish part for comparison (no restart).

    python3 scripts/many_queues.py [--queues 10000] [--rabbit] [--binary PATH]

Needs pika (the test environment's venv has it: ~/.cache/warren/venv/bin/python).
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import pika  # noqa: E402


def rss_mb(pid):
    best = 0
    for p in [pid] + bench.children(pid):
        try:
            for line in open("/proc/%d/status" % p):
                if line.startswith("VmRSS:"):
                    best += int(line.split()[1]) // 1024
        except OSError:
            pass
    return best


def fill(port, n):
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    ch = c.channel()
    t = time.time()
    for i in range(n):
        ch.queue_declare("mq-%d" % i, durable=True)
    declare = time.time() - t
    ch.confirm_delivery()
    t = time.time()
    for i in range(n):
        ch.basic_publish("", "mq-%d" % i, b"x" * 1024, pika.BasicProperties(delivery_mode=2))
    publish = time.time() - t
    c.close()
    return declare, publish


def check(port, n):
    c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    ch = c.channel()
    missing = 0
    for i in range(n):
        if ch.queue_declare("mq-%d" % i, passive=True).method.message_count != 1:
            missing += 1
    c.close()
    return missing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--queues", type=int, default=10000)
    ap.add_argument("--rabbit", action="store_true")
    ap.add_argument("--binary", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/warren/target")),
        "release", "warren"))
    o = ap.parse_args()
    n = o.queues
    rows = []
    w = bench.Warren(o.binary)
    pid = w.start()
    base = rss_mb(pid)
    declare, publish = fill(w.port, n)
    full = rss_mb(pid)
    # Restart on the same folder: stop without deleting it.
    w.proc.terminate()
    w.proc.wait(timeout=60)
    t = time.time()
    w.proc = subprocess.Popen(
        [o.binary, "server", "--management-listen", "none", "--amqp-listen", "127.0.0.1:%d" % w.port, "--data-dir", w.dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench.wait_port(w.port, timeout=300)
    restart = time.time() - t
    after = rss_mb(w.proc.pid)
    missing = check(w.port, n)
    w.stop()
    rows.append(("Warren", declare, publish, base, full, "%.2f s, RSS %d MB, %d missing"
                 % (restart, after, missing)))
    if o.rabbit:
        r = bench.Rabbit()
        pid = r.start()
        base = rss_mb(pid)
        declare, publish = fill(r.port, n)
        full = rss_mb(pid)
        r.stop()
        rows.append(("RabbitMQ", declare, publish, base, full, "-"))
    print("| broker | %d durable queues declared | 1 persistent 1 KiB message each (confirms) "
          "| RSS empty | RSS with queues | restart |" % n)
    print("|---|---|---|---|---|---|")
    for name, d, p, b, f, rs in rows:
        print("| %s | %.1f s | %.1f s | %d MB | %d MB | %s |" % (name, d, p, b, f, rs))
    if missing:
        sys.exit("queues missing their message after the restart: %d" % missing)


if __name__ == "__main__":
    main()
