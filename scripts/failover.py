#!/root/.cache/warren/venv/bin/python3
"""Leader failover under a confirming load (issue 15, point 6).

    /root/.cache/warren/venv/bin/python3 scripts/failover.py [--kills 20] [--seed S]
        [--binary PATH] [--out-json FILE] [--base-port P] [--timeout 600]

Target: "SIGKILL of the leader under a confirming load: a new leader serves (first confirm on it)
within 1 s at the median and 3 s at most over 20 kills. No confirmed message is lost; messages
delivered but not acked come back with redelivered=true."

Three `warren` nodes run on loopback (Raft, AMQP and HTTP ports from --base-port, or a free block),
each with its own data folder and log file in a temporary folder. Then, all through the run:

* a publisher (pika BlockingConnection, publisher confirms, one message at a time) sends
  persistent messages with sequential ids to the durable queue `failover`, through any node
  (followers proxy to the leader). Each publish attempt has its own key "<id>.<copy>" (the body
  and message_id), so a resent id is a new copy. On a connection loss it reconnects (trying the
  nodes in turn) and resends the unconfirmed id (a duplicate if the lost attempt was committed);
* a consumer (manual acks, prefetch 50) acks what it gets but always keeps the latest --hold (20)
  deliveries unacknowledged; just before each kill it stops acking, so exactly what it holds at
  the kill is known. It reconnects likewise.

Each kill: find the serving leader through GET /api/cluster, SIGKILL it, and measure the failover
as the time from the kill to the first confirm received on a publisher connection opened after
the kill (also shown: when a surviving node first reports serving=true). Then the killed node is
restarted (same data folder and arguments) and the next kill waits until it is a follower whose
applied_index has reached the leader's, and at least 1 s (plus a seeded jitter) after the kill.

At the end publishing stops, the consumer closes (what it held goes back), the queue is drained,
and the checker reports: lost = confirmed ids of which no copy was ever delivered (must be 0);
duplicates; violations = deliveries with redelivered=false of a copy delivered before (must be
0); held copies that did not come back redelivered. It exits 1 if lost > 0, violations > 0, a
held copy came back not redelivered or a confirmed held copy never came back, 2 if the run could
not complete (no leader, a stall, the overall timeout); failover figures above the target are
reported, and fail the run (exit 1) only with --enforce-targets.

--restart-followers-first (diagnostic) SIGKILLs and restarts each follower once before the kills,
so that the first new leader is a node that was restarted but never led. The per-kill table says
whether each new leader had been restarted earlier in the run, and how the copies held at that
kill came back.

Build: without --binary the release binary is built (only) under the shared flock and copied to
/tmp/wb/warren-failover, which is then used.
"""
import argparse
import atexit
import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import pika

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clusterlib import (  # noqa: E402  (Node and the rest are shared with chaos.py)
    T0, Client, Cluster, ConnectionLost, free_base, log, now, params, pct, shut_socket, tail)
import clusterlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUEUE = "failover"
BUILT = "/tmp/wb/warren-failover"
BUILD_CMD = (
    "flock -o /tmp/wb/cargo.lock sh -c 'CARGO_TARGET_DIR=/root/.cache/warren/target cargo build "
    "--release --bin warren --message-format=json 2>/dev/null | grep -o "
    "\"\\\"executable\\\":\\\"[^\\\"]*\\\"\" | tail -1 > /tmp/wb/failover-exe; "
    "cp $(cut -d\\\" -f4 /tmp/wb/failover-exe) /tmp/wb/warren-failover'"
)


class Publisher(Client):
    def __init__(self, cluster, rng, stop):
        super().__init__("publisher", cluster, rng, stop)
        self.next_id = 0
        self.copies = collections.Counter()  # id -> publishes so far
        self.confirmed = {}  # id -> time of its first confirm
        self.confirms = []  # (time, id, key, conn no)
        self.resends = 0
        self.nacks = 0
        self.unroutable = 0
        self.pending = None

    def setup(self, conn):
        ch = conn.channel()
        ch.confirm_delivery()
        return ch

    def run(self):
        props = None
        while not self.stop.is_set():
            conn, ch, info = self.connect()
            if conn is None:
                break
            try:
                while not self.stop.is_set():
                    if self.pending is None:
                        self.pending = self.next_id
                        self.next_id += 1
                    mid = self.pending
                    if self.copies[mid]:
                        self.resends += 1
                    self.copies[mid] += 1
                    key = "%d.%d" % (mid, self.copies[mid])
                    props = pika.BasicProperties(delivery_mode=2, message_id=key)
                    self.busy_since = now()
                    try:
                        ch.basic_publish("", QUEUE, key.encode(), props, mandatory=True)
                    except pika.exceptions.NackError:
                        self.nacks += 1
                        continue
                    except pika.exceptions.UnroutableError:
                        self.unroutable += 1
                        time.sleep(0.05)
                        continue
                    finally:
                        self.busy_since = None
                    t = now()
                    with self.lock:
                        self.confirmed.setdefault(mid, t)
                        self.confirms.append((t, mid, key, info["no"]))
                        if info["first_confirm"] is None:
                            info["first_confirm"] = t
                    self.pending = None
            except ConnectionLost as e:
                self.lost(info, e)
        self.close()

    def last_confirm(self):
        with self.lock:
            return self.confirms[-1][0] if self.confirms else None


class Consumer(Client):
    def __init__(self, cluster, rng, stop, hold, prefetch):
        super().__init__("consumer", cluster, rng, stop)
        self.hold, self.prefetch = hold, prefetch
        self.deliveries = []  # (time, key, redelivered, conn no)
        self.window = collections.deque()  # (delivery tag, key) not acked, this connection
        self.freeze = threading.Event()  # no acks while set (the held set is then exact)
        self.acked = {}  # key -> when its (first) ack was sent
        self.acks = 0

    def setup(self, conn):
        ch = conn.channel()
        ch.basic_qos(prefetch_count=self.prefetch)
        return ch

    def run(self):
        while not self.stop.is_set():
            conn, ch, info = self.connect()
            if conn is None:
                break
            with self.lock:
                self.window.clear()

            def on_message(ch, method, props, body, info=info):
                key = body.decode()
                with self.lock:
                    self.deliveries.append((now(), key, bool(method.redelivered), info["no"]))
                    self.window.append((method.delivery_tag, key))
                self.ack_surplus(ch)

            try:
                ch.basic_consume(QUEUE, on_message, auto_ack=False)
                while not self.stop.is_set():
                    conn.process_data_events(time_limit=0.05)
                    self.ack_surplus(ch)
            except ConnectionLost as e:
                self.lost(info, e)
        self.close()

    def ack_surplus(self, ch):
        while not self.freeze.is_set():
            with self.lock:
                if len(self.window) <= self.hold:
                    return
                tag, key = self.window.popleft()
            ch.basic_ack(tag)
            self.acked.setdefault(key, now())
            self.acks += 1

    def held(self):
        with self.lock:
            return [k for _, k in self.window]


def drain(cluster, deliveries, anomalies, within=60):
    """Consume (and ack) everything left in the queue, through the leader; record deliveries."""
    def record(body, method, props):
        deliveries.append((now(), body.decode(), bool(method.redelivered), "drain"))

    return clusterlib.drain(cluster, QUEUE, record, anomalies, within)



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", help="warren binary (default: build the release one)")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--enforce-targets", action="store_true",
                    help="exit 1 when the failover median exceeds 1 s or the max 3 s")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out-json")
    ap.add_argument("--base-port", type=int, default=None,
                    help="Raft ports base+1..3, AMQP base+11..13, HTTP base+21..23 "
                         "(default: a free block)")
    ap.add_argument("--timeout", type=float, default=600, help="overall limit, seconds")
    ap.add_argument("--hold", type=int, default=20, help="deliveries held unacked at each kill")
    ap.add_argument("--prefetch", type=int, default=50)
    ap.add_argument("--min-gap", type=float, default=1.0, help="seconds between kills, at least")
    ap.add_argument("--stall", type=float, default=10.0,
                    help="break a client connection blocked this long (reported)")
    ap.add_argument("--log-filter", default="info", help="WARREN_LOG of the nodes")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--restart-followers-first", action="store_true",
                    help="diagnostic: SIGKILL and restart each follower once (after the queue "
                         "is declared and some messages are in it, before the kills), so the "
                         "first new leader is a restarted node that never led")
    a = ap.parse_args()

    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    hard_deadline = now() + a.timeout

    binary = a.binary
    if binary is None:
        log("building the release binary (flock on /tmp/wb/cargo.lock)")
        os.makedirs("/tmp/wb", exist_ok=True)
        r = subprocess.run(BUILD_CMD, shell=True, cwd=ROOT)
        if r.returncode != 0 or not os.access(BUILT, os.X_OK):
            print("build failed (rerun the cargo command to see why, under the same flock), or "
                  "pass --binary", file=sys.stderr)
            return 2
        binary = BUILT
    binary = os.path.abspath(binary)

    workdir = tempfile.mkdtemp(prefix="warren-failover-")
    base = a.base_port if a.base_port is not None else free_base()
    cluster = Cluster(binary, base, workdir, a.log_filter)
    stop = threading.Event()
    anomalies = []
    state = {"failed": True, "cleaned": False}

    def cleanup():
        if state["cleaned"]:
            return
        state["cleaned"] = True
        stop.set()
        cluster.kill_all()
        if state["failed"] or a.keep:
            print("node logs (kept):", file=sys.stderr)
            for n in cluster.nodes:
                print("  node %d: %s" % (n.id, n.logpath), file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    atexit.register(cleanup)

    def on_signal(signum, frame):
        print("signal %d: stopping" % signum, file=sys.stderr)
        cleanup()
        os._exit(128 + signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    def overall_timeout():
        print("OVERALL TIMEOUT (%.0f s): killing the nodes" % a.timeout, file=sys.stderr,
              flush=True)
        cleanup()
        os._exit(2)

    hard = threading.Timer(a.timeout + 30, overall_timeout)  # backstop; main keeps its deadline
    hard.daemon = True
    hard.start()

    log("seed %d, binary %s, base port %d, folder %s" % (seed, binary, base, workdir))
    cluster.start()
    lid, st = cluster.wait_leader(30)
    if lid is None:
        anomalies.append("no serving leader 30 s after the start: %s" % json.dumps(st))
        for n in cluster.nodes:
            print("---- node %d log tail (%s)\n%s" % (n.id, n.logpath, tail(n.logpath)))
        print("\n".join(anomalies))
        return 2
    log("leader: node %d, term %s" % (lid, st.get("term")))
    # Start the load only once the leader is stable: the same one, seen by all three, for 1 s.
    first_leader = (lid, st.get("term"))
    stable_since, t_end = now(), now() + 30
    while now() < t_end and now() - stable_since < 1.0:
        l2, s2 = cluster.leader()
        if l2 is None or (l2, s2.get("term")) != (lid, st.get("term")) or len(
                [v for v in cluster.statuses().values() if v]) < 3:
            if l2 is not None:
                lid, st = l2, s2
            stable_since = now()
        time.sleep(0.05)
    if (lid, st.get("term")) != first_leader:
        anomalies.append("start: the first serving leader (node %d, term %s) was replaced by "
                         "node %d, term %s before any load" % (first_leader + (lid,
                                                                               st.get("term"))))
        log(anomalies[-1])

    # The queue, declared once.
    for _ in range(50):
        try:
            c = pika.BlockingConnection(params(cluster.node(lid).amqp))
            c.channel().queue_declare(QUEUE, durable=True)
            c.close()
            break
        except ConnectionLost as e:
            log("declare: %r" % (e,))
            time.sleep(0.2)

    pub = Publisher(cluster, rng, stop)
    con = Consumer(cluster, rng, stop, a.hold, a.prefetch)

    def watchdog():
        while not stop.is_set():
            for w in (pub, con):
                b = w.busy_since
                if b is not None and now() - b > a.stall:
                    c = w.conn
                    anomalies.append("t=%.2f %s blocked %.1f s on connection %d (node %s); "
                                     "socket shut" % (now() - T0, w.name, now() - b,
                                                      len(w.conns), w.conns[-1]["node"]
                                                      if w.conns else "?"))
                    log(anomalies[-1])
                    w.busy_since = None
                    if c is not None:
                        shut_socket(c)
            time.sleep(0.25)

    threading.Thread(target=watchdog, daemon=True).start()
    pub.start()
    con.start()

    if a.restart_followers_first:
        time.sleep(1.0)
        lid, st = cluster.wait_leader(20)
        for n in cluster.nodes:
            if n.id == lid:
                continue
            cluster.sigkill(n)
            time.sleep(0.3)
            cluster.spawn(n)
            t_end = now() + 60
            while now() < t_end:
                l_id, l_st = cluster.leader()
                f = n.status()
                if (l_id == lid and f and f.get("role") == "follower"
                        and f.get("applied_index", -1) >= l_st.get("applied_index", 0)):
                    break
                time.sleep(0.05)
            log("diagnostic: follower node %d restarted and caught up" % n.id)

    kills = []
    last_kill = now()
    loop_deadline = hard_deadline - 90  # leave time to drain and check
    aborted = None
    for k in range(1, a.kills + 1):
        if now() > loop_deadline:
            aborted = "time limit before kill %d" % k
            break
        # Under a confirming load, the consumer holding its share, past the gap.
        gap_until = last_kill + a.min_gap + rng.uniform(0, 0.5)
        t_wait = now() + 15
        while now() < t_wait and not (
                now() >= gap_until and pub.last_confirm() is not None
                and now() - pub.last_confirm() < 0.5 and len(con.held()) >= a.hold):
            time.sleep(0.01)
        lid, st = cluster.wait_leader(20)
        if lid is None:
            aborted = "no serving leader before kill %d: %s" % (k, json.dumps(st))
            break
        victim = cluster.node(lid)
        old_term = st.get("term")
        con.freeze.set()
        time.sleep(0.005)
        held = con.held()
        confirmed_before = len(pub.confirmed)
        lc = pub.last_confirm()
        K = cluster.sigkill(victim)
        last_kill = K
        rec = {"kill": k, "killed": lid, "term_before": old_term, "held": len(held),
               "restarts_before": {n.id: n.starts - 1 for n in cluster.nodes},
               "held_keys": held, "t": K - T0, "confirmed_before": confirmed_before,
               "since_last_confirm_ms": (K - lc) * 1000 if lc is not None else None}
        # Wait for a confirm on a connection opened after the kill; watch who serves meanwhile.
        serving_at = None
        new_leader = None
        conf = None
        t_end = now() + 30
        while now() < t_end and conf is None:
            if serving_at is None:
                for n in cluster.nodes:
                    if n is victim or not n.alive():
                        continue
                    s = n.status(timeout=0.2)
                    if s and s.get("serving") is True and s.get("role") == "leader":
                        serving_at, new_leader = now(), n.id
                        rec["term_after"] = s.get("term")
            with pub.lock:
                for c in pub.conns:
                    if c["attempt"] > K and c["first_confirm"] is not None:
                        conf = c
                        break
            time.sleep(0.01)
        con.freeze.clear()
        if serving_at is not None:
            rec["serving_ms"] = (serving_at - K) * 1000
            rec["new_leader"] = new_leader
        if conf is None:
            rec["failover_ms"] = None
            anomalies.append("kill %d (node %d): no confirm on a new connection within 30 s"
                             % (k, lid))
            log(anomalies[-1])
        else:
            rec["failover_ms"] = (conf["first_confirm"] - K) * 1000
            rec["connected_ms"] = (conf["open"] - K) * 1000
            rec["via_node"] = conf["node"]
        with pub.lock:
            attempts = [c for c in pub.conns if c["attempt"] > K]
        rec["publisher_connections"] = len(attempts)
        # Restart the killed node; it must come back a follower and catch up.
        t_restart = now()
        cluster.spawn(victim)
        caught = False
        t_end = now() + 60
        while now() < t_end:
            l_id, l_st = cluster.leader()
            if l_id is not None and l_id != victim.id:
                f = victim.status()
                if (f and f.get("role") == "follower" and f.get("leader_id") == l_id
                        and f.get("applied_index", -1) >= l_st.get("applied_index", 0)):
                    caught = True
                    rec["leader_after_restart"] = l_id
                    break
            time.sleep(0.05)
        rec["catch_up_ms"] = (now() - t_restart) * 1000
        if not caught:
            anomalies.append("kill %d: node %d restarted but not caught up within 60 s: %s"
                             % (k, victim.id, json.dumps(cluster.statuses())))
            log(anomalies[-1])
        elif rec.get("leader_after_restart") != rec.get("new_leader"):
            anomalies.append("kill %d: the leader changed after node %d restarted (%s -> %s)"
                             % (k, victim.id, rec.get("new_leader"),
                                rec.get("leader_after_restart")))
        kills.append(rec)
        log("kill %2d: node %d (term %s) -> node %s serving %s ms, first confirm %s ms "
            "(via node %s, %d connection attempts), held %d, caught up in %.0f ms"
            % (k, lid, old_term, rec.get("new_leader"),
               "%.0f" % rec["serving_ms"] if "serving_ms" in rec else "-",
               "%.0f" % rec["failover_ms"] if rec["failover_ms"] is not None else "NONE",
               rec.get("via_node"), len(attempts), len(held), rec["catch_up_ms"]))
        if not caught or conf is None:
            aborted = "kill %d did not recover" % k
            break

    if aborted:
        anomalies.append("kill loop stopped: " + aborted)
        log(anomalies[-1])

    # Stop the load; the consumer's held messages go back to the queue; drain it.
    time.sleep(0.5)
    stop.set()
    pub.join(a.stall + 5)
    con.join(a.stall + 5)
    if pub.is_alive() or con.is_alive():
        anomalies.append("a client thread did not stop")
    stop_clients = now()
    deliveries = list(con.deliveries)
    drained_from = len(deliveries)
    drained = drain(cluster, deliveries, anomalies, within=max(30, hard_deadline - now() - 10))
    log("drained %d deliveries (%s)" % (len(deliveries) - drained_from,
                                       "queue empty" if drained else "NOT complete"))
    # Every node agrees the queue is empty.
    nodes_empty = {}
    t_end = now() + 10
    while now() < t_end:
        for n in cluster.nodes:
            q = n.get("/api/queues/%2f/" + QUEUE, local=True)
            nodes_empty[n.id] = q.get("messages") if q else None
        if all(v == 0 for v in nodes_empty.values()):
            break
        time.sleep(0.2)
    if not all(v == 0 for v in nodes_empty.values()):
        anomalies.append("after the drain, messages of %s per node: %s" % (QUEUE, nodes_empty))

    # ---- Check.
    seen_keys = {}  # key -> deliveries so far
    ids_delivered = collections.Counter()  # id -> distinct copies delivered
    violations = []
    spurious = 0
    redeliveries = 0
    acked_then_redelivered = 0
    first_time = {}
    for t, key, redelivered, conn_no in deliveries:
        n = seen_keys.get(key, 0)
        if n == 0:
            ids_delivered[int(key.split(".")[0])] += 1
            first_time[key] = t
            if redelivered:
                spurious += 1
        else:
            redeliveries += 1
            if con.acked.get(key, t) < t:
                acked_then_redelivered += 1
            if not redelivered:
                violations.append((t - T0, key, n, conn_no))
        seen_keys[key] = n + 1
    confirmed = pub.confirmed
    lost = sorted(i for i in confirmed if ids_delivered[i] == 0)
    dup_ids = sum(1 for i, c in ids_delivered.items() if c > 1)
    unconfirmed_delivered = sum(1 for i in ids_delivered if i not in confirmed)
    by_key = collections.defaultdict(list)
    for d in deliveries:
        by_key[d[1]].append(d)
    confirmed_keys = {c[2] for c in pub.confirms}
    held_back = held_missing = held_not_redelivered = held_missing_confirmed = 0
    for rec in kills:
        K = rec["t"] + T0
        r = {"redelivered": 0, "not_redelivered": 0, "never": 0, "never_confirmed": 0}
        for key in rec["held_keys"]:
            later = [d for d in by_key[key] if d[0] > K]
            if not later:
                r["never"] += 1
                r["never_confirmed"] += key in confirmed_keys
            elif not later[0][2]:
                r["not_redelivered"] += 1
            else:
                r["redelivered"] += 1
        rec["held_back"] = r
        # Was the new leader restarted (SIGKILLed and started again) earlier in the run?
        nl = rec.get("new_leader")
        rec["new_leader_restarted_before"] = (rec["restarts_before"].get(nl, 0) > 0
                                              if nl else None)
        held_back += r["redelivered"]
        held_not_redelivered += r["not_redelivered"]
        held_missing += r["never"]
        held_missing_confirmed += r["never_confirmed"]
    # Copies delivered, never confirmed, never acked and never delivered again: the consumer
    # saw a message the cluster then forgot (the publisher resent the id as a new copy). A copy
    # delivered and acked whose confirm died with its leader is not one: it was committed.
    delivered_unconfirmed_vanished = sum(
        1 for key in by_key if key not in confirmed_keys
        and int(key.split(".")[0]) in pub.confirmed and len(by_key[key]) == 1
        and key not in con.acked
        and any(rec["t"] + T0 > by_key[key][0][0] for rec in kills))

    fo = [r["failover_ms"] for r in kills if r.get("failover_ms") is not None]
    summary = {
        "seed": seed, "kills_planned": a.kills, "kills_done": len(kills),
        "failover_ms_median": statistics.median(fo) if fo else None,
        "failover_ms_p90": pct(fo, 90) if fo else None,
        "failover_ms_max": max(fo) if fo else None,
        "target": {"median_ms": 1000, "max_ms": 3000},
        "published_ids": pub.next_id, "confirmed_ids": len(confirmed),
        "publish_attempts": sum(pub.copies.values()), "resends": pub.resends,
        "nacks": pub.nacks, "unroutable": pub.unroutable,
        "deliveries": len(deliveries), "drained": len(deliveries) - drained_from,
        "distinct_copies_delivered": len(seen_keys), "acks_sent": con.acks,
        "lost": len(lost), "lost_ids": lost[:50],
        "duplicate_ids": dup_ids, "redeliveries": redeliveries,
        "acked_then_redelivered": acked_then_redelivered,
        "violations": len(violations), "violation_examples": violations[:20],
        "redelivered_on_first_delivery": spurious,
        "unconfirmed_ids_delivered": unconfirmed_delivered,
        "held_at_kills": sum(len(r["held_keys"]) for r in kills),
        "held_came_back_redelivered": held_back, "held_came_back_not_redelivered":
            held_not_redelivered, "held_never_came_back": held_missing,
        "held_never_came_back_confirmed": held_missing_confirmed,
        "delivered_unconfirmed_copies_vanished": delivered_unconfirmed_vanished,
        "publisher_connections": len(pub.conns), "consumer_connections": len(con.conns),
        "publisher_errors": dict(pub.errors), "consumer_errors": dict(con.errors),
        "queue_messages_per_node_after_drain": nodes_empty,
        "drain_complete": drained, "anomalies": anomalies,
        "elapsed_s": now() - T0,
    }

    # ---- Report.
    print()
    print("| kill | killed | term | new leader | restarted before | serving ms "
          "| first confirm ms | via | catch-up ms | held | back redelivered | back NOT "
          "redelivered | never back |")
    print("|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in kills:
        h = r["held_back"]
        print("| %d | %d | %s | %s | %s | %s | %s | %s | %.0f | %d | %d | %d | %d |" % (
            r["kill"], r["killed"], r["term_before"], r.get("new_leader", "-"),
            {True: "yes", False: "no", None: "-"}[r["new_leader_restarted_before"]],
            "%.0f" % r["serving_ms"] if "serving_ms" in r else "-",
            "%.0f" % r["failover_ms"] if r.get("failover_ms") is not None else "NONE",
            r.get("via_node", "-"), r["catch_up_ms"], r["held"], h["redelivered"],
            h["not_redelivered"], h["never"]))
    print()
    if fo:
        print("failover (kill -> first confirm on a new connection), %d kills: median %.0f ms, "
              "p90 %.0f ms, max %.0f ms  (target: median <= 1000, max <= 3000: %s)"
              % (len(fo), summary["failover_ms_median"], summary["failover_ms_p90"],
                 summary["failover_ms_max"],
                 "met" if summary["failover_ms_median"] <= 1000
                 and summary["failover_ms_max"] <= 3000 and len(fo) == a.kills else "NOT met"))
    print("confirmed ids %d of %d published (%d attempts, %d resends, %d nacks); "
          "deliveries %d (%d drained), %d distinct copies"
          % (len(confirmed), pub.next_id, summary["publish_attempts"], pub.resends, pub.nacks,
             len(deliveries), summary["drained"], len(seen_keys)))
    print("lost %d | duplicate ids %d | redeliveries %d (of acked copies %d) | violations %d | "
          "held at kills %d: back redelivered %d, back not redelivered %d, never back %d"
          % (len(lost), dup_ids, redeliveries, acked_then_redelivered, len(violations),
             summary["held_at_kills"], held_back, held_not_redelivered, held_missing))
    print("held copies never back that were confirmed: %d; delivered copies never confirmed "
          "and never acked that vanished at a kill (publisher resent the id): %d"
          % (held_missing_confirmed, delivered_unconfirmed_vanished))
    if lost:
        print("lost ids (first 50):", lost[:50])
    if violations:
        print("violations (t, key, earlier deliveries, connection):", violations[:20])
    if anomalies:
        print("anomalies:")
        for x in anomalies:
            print("  - " + x)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump({"summary": summary, "kills": kills,
                       "publisher_connections": pub.conns,
                       "consumer_connections": con.conns,
                       "deliveries": [[round(t - T0, 4), k, r, c] for t, k, r, c in deliveries],
                       "confirms": [[round(t - T0, 4), k, c] for t, _, k, c in pub.confirms]},
                      f)
    # A copy held at a kill comes back redelivered; one that came back not redelivered, or a
    # confirmed one that never came back, fails the run as a lost id does.
    bad = bool(lost or violations or held_not_redelivered or held_missing_confirmed)
    met = (bool(fo) and summary["failover_ms_median"] <= 1000
           and summary["failover_ms_max"] <= 3000 and len(fo) == a.kills)
    if a.enforce_targets and not met:
        print("failover targets not met (--enforce-targets)")
        bad = True
    incomplete = bool(anomalies) and (aborted or not drained or len(kills) < a.kills)
    state["failed"] = bad or bool(anomalies)
    if bad:
        return 1
    if incomplete:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
