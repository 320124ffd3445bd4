#!/usr/bin/env python3
"""Side-by-side benchmark: Warren and (when installed) RabbitMQ on this machine, same load
generator (`warren perf`), scenarios alternated between the brokers so machine drift cancels
out. Prints a markdown table (and writes it to --out).

    python3 scripts/bench.py [--scenarios S1,S2,S3] [--seconds 10] [--rounds 1]
                             [--s5-messages 1000000] [--binary PATH]

Each broker runs alone on loopback with a fresh data folder. For each run the broker's CPU time
(from /proc) is reported per message, and its peak resident memory (VmHWM).

S5 is not a timed run but two phases on one broker: `warren perf --consumers 0 --count N`
publishes N persistent 1 KiB messages (pseudo-random bodies, so that compression cannot shrink
them on disk) with confirms (window 1000) to one durable queue with no consumer and exits once
all are confirmed; then `warren perf --producers 0 --count N` drains them with one consumer
(manual ack, prefetch 1000, multiple ack every 100). It reports both rates,
broker CPU per message of each phase, peak RSS (after publishing and at the end), and the disk
used by the broker's data folder (allocated blocks, as du) once publishing is done. The run is
marked failed unless N were confirmed, the queue held N after publishing, N were drained and the
queue is empty at the end. S5 gets its own table.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCENARIOS = {
    # name: (description, perf arguments)
    "S1": ("transient 16 B, 1 producer, 1 queue, 1 auto-ack consumer",
           ["--size", "16", "--auto-ack"]),
    "S2": ("persistent 1 KiB, durable queue, confirms (window 1000), manual ack, prefetch 1000",
           ["--size", "1024", "--persistent", "--confirm", "1000", "--prefetch", "1000",
            "--multi-ack-every", "100"]),
    "S3": ("fanout to 10 queues, 10 consumers, 1 KiB transient",
           ["--size", "1024", "--exchange-type", "fanout", "--queues", "10", "--consumers", "10",
            "--auto-ack"]),
    "S4": ("100 connections, 50 msg/s each, own queue (latency)",
           ["--size", "64", "--producers", "100", "--consumers", "100", "--queues", "100",
            "--rate", "50", "--auto-ack"]),
    "S6": ("1 MiB messages, 1 producer, 1 consumer",
           ["--size", "1048576", "--auto-ack", "--prefetch", "10"]),
}

S5_DESC = ("persistent 1 KiB messages (random bodies) published (confirms, window 1000) to one "
           "durable queue with no consumer, then drained by one consumer (manual ack, "
           "prefetch 1000, multi-ack every 100)")
# Random bodies: a broker that compresses its store must not look smaller on disk for zeros.
S5_COMMON = ["--size", "1024", "--persistent", "--random-body", "--queues", "1",
             "--queue-prefix", "s5"]
S5_PUBLISH = ["--producers", "1", "--consumers", "0", "--confirm", "1000"]
S5_DRAIN = ["--producers", "0", "--consumers", "1", "--prefetch", "1000",
            "--multi-ack-every", "100"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def proc_cpu_seconds(pid):
    """utime + stime of a process and its children (RabbitMQ runs beam under a shell)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in [pid] + children(pid):
        try:
            with open("/proc/%d/stat" % p) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def children(pid):
    out = []
    try:
        for c in open("/proc/%d/task/%d/children" % (pid, pid)).read().split():
            out.append(int(c))
            out.extend(children(int(c)))
    except OSError:
        pass
    return out


def peak_rss_mb(pid):
    best = 0
    for p in [pid] + children(pid):
        try:
            for line in open("/proc/%d/status" % p):
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]) // 1024)
        except OSError:
            pass
    return best


class Warren:
    name = "Warren"

    def __init__(self, binary):
        self.binary = binary

    def start(self):
        self.dir = tempfile.mkdtemp(prefix="warren-bench-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [self.binary, "server", "--management-listen", "none", "--amqp-listen", "127.0.0.1:%d" % self.port,
             "--data-dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, WARREN_LOG="warn"))
        if not wait_port(self.port):
            raise RuntimeError("warren did not start")
        self.data_dir = self.dir
        return self.proc.pid

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


class Rabbit:
    name = "RabbitMQ"

    def start(self):
        self.dir = tempfile.mkdtemp(prefix="rabbit-bench-")
        self.port = free_port()
        env = dict(os.environ,
                   RABBITMQ_NODE_PORT=str(self.port),
                   RABBITMQ_NODENAME="bench%d@localhost" % self.port,
                   RABBITMQ_MNESIA_BASE=self.dir + "/mnesia",
                   RABBITMQ_LOG_BASE=self.dir + "/log",
                   RABBITMQ_DIST_PORT=str(free_port()),
                   RABBITMQ_ENABLED_PLUGINS_FILE=self.dir + "/plugins",
                   RABBITMQ_FEATURE_FLAGS_FILE=self.dir + "/feature_flags")
        os.makedirs(self.dir + "/mnesia")
        os.makedirs(self.dir + "/log")
        open(self.dir + "/plugins", "w").write("[].\n")
        # Debian's rabbitmq-server drops to the rabbitmq user when started as root.
        subprocess.run(["chown", "-R", "rabbitmq:rabbitmq", self.dir], check=False)
        self.proc = subprocess.Popen(["rabbitmq-server"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_port(self.port, timeout=120):
            raise RuntimeError("rabbitmq did not start")
        time.sleep(2)
        self.data_dir = self.dir + "/mnesia"
        return self.proc.pid

    def stop(self):
        for p in children(self.proc.pid):
            try:
                os.kill(p, 15)
            except OSError:
                pass
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        subprocess.run(["pkill", "-f", "bench%d@localhost" % self.port], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def run_perf(binary, broker, args, seconds, timeout=None):
    uri = "amqp://guest:guest@127.0.0.1:%d/%%2f" % broker.port
    cmd = [binary, "perf", "--uri", uri, "--duration", str(seconds), "--json"] + args
    out = subprocess.run(cmd, capture_output=True, text=True,
                         timeout=timeout if timeout else seconds + 120)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError("perf failed: %s" % out.stderr[-2000:])
    if out.stderr.strip():
        print(out.stderr.strip()[-2000:], file=sys.stderr)
    return json.loads(lines[-1])


def disk_used_mb(path):
    """Space allocated to the files under path (what du reports), in MB."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total / (1024 * 1024)


def run_s5(binary, broker, pid, n):
    """S5's two phases on a started broker; returns a dict of results."""
    timeout = 300 + n // 500
    cpu0 = proc_cpu_seconds(pid)
    pub = run_perf(binary, broker, S5_COMMON + S5_PUBLISH + ["--count", str(n)], 0, timeout)
    cpu1 = proc_cpu_seconds(pid)
    rss_pub = peak_rss_mb(pid)
    disk = disk_used_mb(broker.data_dir)
    drain = run_perf(binary, broker, S5_COMMON + S5_DRAIN + ["--count", str(n)], 0, timeout)
    cpu2 = proc_cpu_seconds(pid)
    problems = []
    if pub["confirmed"] != n or pub["nacked"]:
        problems.append("confirmed %d nacked %d of %d" % (pub["confirmed"], pub["nacked"], n))
    if pub.get("messages_left") != n:
        problems.append("queue held %s after publishing" % pub.get("messages_left"))
    if drain["consumed"] != n:
        problems.append("drained %d of %d" % (drain["consumed"], n))
    if drain.get("messages_left") != 0:
        problems.append("%s left after draining" % drain.get("messages_left"))
    return {
        "messages": n,
        "publish_per_sec": pub["published"] / pub["seconds"],
        "drain_per_sec": drain["consumed_per_sec"],
        "publish_cpu_us": (cpu1 - cpu0) * 1e6 / n,
        "drain_cpu_us": (cpu2 - cpu1) * 1e6 / n,
        "rss_after_publish": rss_pub,
        "rss_peak": peak_rss_mb(pid),
        "disk_mb": disk,
        "check": "ok" if not problems else "FAILED: " + "; ".join(problems),
    }


def s5_table(rows):
    lines = ["S5: %s" % S5_DESC, "",
             "| broker | messages | publish msg/s | drain msg/s | CPU us/msg publish | "
             "CPU us/msg drain | peak RSS MB after publish | peak RSS MB | "
             "data folder MB after publish | drained = published |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for broker, r in rows:
        lines.append("| %s | %d | %.0f | %.0f | %.2f | %.2f | %d | %d | %.0f | %s |" % (
            broker, r["messages"], r["publish_per_sec"], r["drain_per_sec"],
            r["publish_cpu_us"], r["drain_cpu_us"], r["rss_after_publish"], r["rss_peak"],
            r["disk_mb"], r["check"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default="S1,S2,S3,S4,S5,S6")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--s5-messages", type=int, default=1000000,
                    help="messages published then drained in S5")
    ap.add_argument("--binary", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/warren/target")),
        "release", "warren"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--warren-only", action="store_true",
                    help="skip RabbitMQ even when it is installed")
    opts = ap.parse_args()
    brokers = [Warren(opts.binary)]
    if shutil.which("rabbitmq-server") and not opts.warren_only:
        brokers.append(Rabbit())
    else:
        print("rabbitmq-server not installed: Warren only", file=sys.stderr)
    rows = []
    s5_rows = []
    for name in opts.scenarios.split(","):
        if name != "S5" and name not in SCENARIOS:
            ap.error("unknown scenario %s" % name)
        for rnd in range(opts.rounds):
            # Alternate which broker goes first each round.
            order = brokers if rnd % 2 == 0 else list(reversed(brokers))
            for b in order:
                pid = b.start()
                if name == "S5":
                    try:
                        r = run_s5(opts.binary, b, pid, opts.s5_messages)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print("S5 %s failed: %s" % (b.name, e), file=sys.stderr)
                        b.stop()
                        continue
                    b.stop()
                    s5_rows.append((b.name, r))
                    print("S5 %-8s publish %8.0f/s drain %8.0f/s cpu %.2f/%.2fus/msg "
                          "rss %d/%dMB disk %.0fMB %s" % (
                              b.name, r["publish_per_sec"], r["drain_per_sec"],
                              r["publish_cpu_us"], r["drain_cpu_us"], r["rss_after_publish"],
                              r["rss_peak"], r["disk_mb"], r["check"]), file=sys.stderr)
                    continue
                desc, args = SCENARIOS[name]
                cpu0 = proc_cpu_seconds(pid)
                try:
                    r = run_perf(opts.binary, b, args, opts.seconds)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print("%s %s failed: %s" % (name, b.name, e), file=sys.stderr)
                    b.stop()
                    continue
                cpu = proc_cpu_seconds(pid) - cpu0
                rss = peak_rss_mb(pid)
                b.stop()
                msgs = max(r["consumed"], r["published"], 1)
                rows.append((name, desc, b.name, r, cpu * 1e6 / msgs, rss))
                print("%s %-8s pub %8.0f/s cons %8.0f/s p99 %6dus cpu %.2fus/msg rss %dMB" % (
                    name, b.name, r["published_per_sec"], r["consumed_per_sec"],
                    r["latency_us"]["p99"], cpu * 1e6 / msgs, rss), file=sys.stderr)
    lines = ["| scenario | broker | published/s | consumed/s | p50 us | p99 us | broker CPU us/msg | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for name, desc, broker, r, cpu_per_msg, rss in rows:
        lines.append("| %s: %s | %s | %.0f | %.0f | %d | %d | %.2f | %d |" % (
            name, desc, broker, r["published_per_sec"], r["consumed_per_sec"],
            r["latency_us"]["p50"], r["latency_us"]["p99"], cpu_per_msg, rss))
    table = "\n".join(lines) if rows else ""
    if s5_rows:
        table = (table + "\n\n" if table else "") + s5_table(s5_rows)
    print(table)
    if opts.out:
        open(opts.out, "w").write(table + "\n")


if __name__ == "__main__":
    main()
