#!/root/.cache/warren/venv/bin/python3
"""Chaos harness of the replicated cluster (issue 15, point 8).

    /root/.cache/warren/venv/bin/python3 scripts/chaos.py [--seed S] [--duration 120]
        [--binary PATH] [--base-port P] [--timeout T] [--out-json FILE] [--history FILE]
        [--faults kill_leader,pause_leader,...] [--rate 150] [--keep]
    /root/.cache/warren/venv/bin/python3 scripts/chaos.py --runs 50 --seed 1 --duration 300
        [--runs-dir DIR] [--out-json FILE]      # runs seeds S, S+1, ... one after the other
    /root/.cache/warren/venv/bin/python3 scripts/chaos.py --selftest    # the proxy alone

A short variant for CI: `--duration 90` (a run then takes about 2 minutes).

Three `warren` nodes (--raft-snapshot-every 3000 by default, --snapshot-every, so that catch-ups
and re-added nodes go through snapshots too) run on loopback, each with its own data folder and log file in a temporary
folder (removed at the end unless --keep or the run failed). Ports from a base B (--base-port, or
a free block): Raft B+1..3, AMQP B+11..13, HTTP B+21..23, and B+31..33 where a TCP fault proxy
listens in front of each node's Raft port. `--peers` names the proxies, so every Raft byte to node
j goes through proxy j (the --peers address is a node's identity in the membership).

The fault proxy (asyncio, one thread of this process) reads the first frame of each new
connection, `len: u32 BE | body`, the body a postcard `Request::Hello` (src/cluster/net.rs):
varint variant 0, magic "WRNR" (4 raw bytes), version (varint), cluster id (varint length +
bytes), `from` and `to` (varints). `from` names the sender, so a connection a opened to proxy b
carries link a->b from the client and b->a back. A directed link (a, b) has three settings:
  * cut: connections carrying a->b or b->a are closed at once and new ones are closed right
    after their Hello (the connecting node sees a reset: fast failure). A cut is applied to both
    directions of a pair (a partition).
  * drop (one-way): bytes a->b are read and thrown away, on connections a opened to proxy b
    (a's requests, its Hello included: the connection hangs) and on those b opened to proxy a
    (a's answers: b's requests arrive, their answers never do). The senders see no error, only
    RPC timeouts, as with a black hole. A connection that lost bytes is out of step with its
    frames: it is closed when the drop is lifted (heal). Drop on both directions = blackhole.
  * delay N ms: each chunk read a->b is forwarded N ms after it was read (order kept; at most
    64 chunks of 64 KiB queued per direction, then the sender is held back).
A first frame that is not a Hello (or longer than 4 KiB) leaves the connection unidentified:
forwarded, no rule applies (counted). AMQP and HTTP are not proxied: a partition is a partition
of the Raft network only, clients reach every node.

Clients (4 threads): 2 publishers (pika BlockingConnection, publisher confirms, one message at
a time, --rate per second each) send persistent messages with unique ids "<publisher>-<seq>"
alternately to the durable queues chaos-0 (x-queue-type quorum) and chaos-1 (classic). Each
attempt is a copy "<id>.<n>" (the body and message_id); on a connection loss, a nack, or no
confirm within --confirm-timeout (the socket is then shut), the unconfirmed id is sent again as a
new copy (duplicates allowed). 2 consumers (manual acks, prefetch 50), one per queue, record each
delivery (copy, redelivered) before acking, and keep the latest --hold deliveries unacked (at most
3 s) so a fault finds deliveries in flight. All reconnect through any node, in turn (followers
proxy AMQP to the leader).

The nemesis follows a plan drawn from random.Random(seed) (kinds, durations, which follower, ...;
the leader is whoever leads then): before each fault it waits a gap of --min-gap..--max-gap
seconds and until the cluster is healthy (one serving leader named by all three nodes, three
voters, followers' applied index caught up with the leader's, and while publishers run a confirm
within --commit-stall seconds, so a leader that serves but never commits is caught; at most
--recover-timeout). Kinds:
  kill_leader       SIGKILL the leader, restart it (same data) 0.5-4 s later
  pause_leader      SIGSTOP the leader for 1.5-5 s, then SIGCONT
  partition_leader  cut (or blackhole) every Raft link to and from the leader for 2-6 s, heal
  oneway_leader     drop every link out of the leader (or into it) for 2-5 s, heal
  kill_follower     SIGKILL a follower, restart it 0.5-4 s later
  restart_all       SIGKILL all three (plan order), start all 0.2-2 s later
  wipe_follower     SIGKILL a follower, delete its data folder, `warren ctl cluster remove N` on
                    a surviving node (ctl finds the leader), start it again (a new log waits to be
                    added), `warren ctl cluster add N 127.0.0.1:<its proxy port>`
  delay             --delays ms (5, 10, 20, 50) on the leader's links, a node's, or one
                    directed link, for 3-8 s
and, with 20% odds, a background delay (--bg-delays: 2, 5, 10 ms) on one directed link during
the fault. (openraft's AppendEntries deadline is its heartbeat interval, 50 ms: a round trip
above that on a link stops replication over it, and on the leader's links elections churn.)
A node that reports role "stopped" (its Raft stopped) for 5 s ends the wait at once.
Each fault record: kind, node, start, plan parameters, leader/term before and after, serving_ms
(fault -> a node serving in a later term; any term after restart_all, where openraft restores
the old leader in its term), failover_ms (fault -> first confirm on a publisher
connection opened after it, before the next fault: as scripts/failover.py measures it),
first_confirm_ms (fault -> first confirm on any connection), max_gap_ms (longest interval with no
confirm from the fault until healthy again), recovered_ms (fault -> healthy again), deliveries
held unacked at the fault. A term change between faults is counted as a spurious election.

At the end the faults are healed, all nodes are up and healthy, the publishers stop, the
consumers close (what they hold goes back), both queues are drained through the final leader,
and every node must report them empty. The checker, over the recorded history:
  lost        confirmed ids never delivered (also by copy: a confirmed copy never delivered); 0
  lost_unacked  a confirmed copy delivered but never acked by us and never delivered again (the
              broker dropped an unacked message); must be 0
  unexpected  deliveries of copies never published, on the wrong queue, or whose message_id is
              not the body; must be 0
  violations  deliveries with redelivered=false of a copy delivered before; must be 0
  duplicates  ids delivered more than once (resent copies, redeliveries); counted, reported
  crashes     node processes that exited by themselves; must be 0
  replicas_diverge  after the drain, nodes at the same applied index report different message
              counts; must not happen
  resurrected then (all nodes settled at one applied index for 1 s, so the drain's acks are
              committed everywhere) the leader is SIGKILLed and both queues drained again
              through the new leader: whatever it delivers was not in the old leader's state;
              must be 0 (--no-final-failover skips this)
The node logs are scanned for Warren's ERROR lines, panics, and a leader serving again within
150 ms of stepping down for an expired lease (reported, not failed).
Exit status: 0 pass; 1 a check failed; 2 the run could not complete (no healthy cluster within
--recover-timeout, a drain that did not finish, a client thread that hung, the overall --timeout).

--runs N runs N seeded runs one after the other (each a child process of this script with the
same options and --seed S+i, its output in --runs-dir), then prints the aggregate: pass count,
lost/unexpected/violation totals, duplicates, failover median/p90/max by fault kind. Exit 0 if all
passed, else 1.

The binary: --binary, else $WARREN_BINARY, else /tmp/wb/warren-chaos (this script never builds).
"""
import argparse
import asyncio
import atexit
import collections
import concurrent.futures
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import pika
import pika.exceptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clusterlib import (  # noqa: E402
    PROXIED_PORT_OFFSETS, T0, Client, Cluster, ConnectionLost, free_base, log, now, params,
    pct, shut_socket, tail)
import clusterlib  # noqa: E402

QUEUES = ("chaos-0", "chaos-1")
QUEUE_ARGS = {"chaos-0": {"x-queue-type": "quorum"}, "chaos-1": None}
DEFAULT_BINARY = "/tmp/wb/warren-chaos"
STACK_TIMEOUT = 3  # AMQP connection setup (a paused node accepts TCP but never answers)

# ---------------------------------------------------------------------------------------------
# The Raft handshake, as the proxy reads it

MAGIC = b"WRNR"
MAX_HELLO = 4 << 10


def varint(buf, i):
    """A postcard (LEB128) unsigned varint at buf[i:]: (value, next index)."""
    v = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


def decode_hello(body):
    """The fields of a `Request::Hello` frame body, or None if it is not one."""
    try:
        variant, i = varint(body, 0)
        if variant != 0 or body[i:i + 4] != MAGIC:
            return None
        i += 4
        version, i = varint(body, i)
        n, i = varint(body, i)
        if i + n > len(body):
            return None
        cluster = body[i:i + n].decode("utf-8", "replace")
        i += n
        frm, i = varint(body, i)
        to, i = varint(body, i)
    except ValueError:
        return None
    return {"version": version, "cluster": cluster, "from": frm, "to": to}


def encode_hello(cluster, frm, to, version=2):
    """The inverse (for the self-test)."""
    def uv(v):
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            if v:
                out.append(b | 0x80)
            else:
                out.append(b)
                return bytes(out)
    c = cluster.encode()
    return uv(0) + MAGIC + uv(version) + uv(len(c)) + c + uv(frm) + uv(to)


# ---------------------------------------------------------------------------------------------
# The fault proxy


class Rule:
    __slots__ = ("cut", "drop", "delay")

    def __init__(self):
        self.cut, self.drop, self.delay = False, False, 0.0

    def active(self):
        return self.cut or self.drop or self.delay > 0

    def __repr__(self):
        return "%s%s%s" % ("cut " if self.cut else "", "drop " if self.drop else "",
                           "delay %.0fms" % (self.delay * 1000) if self.delay else "")


class PConn:
    """One proxied connection: a client (node src, once its Hello is read) to node dst."""

    def __init__(self, dst, cw):
        self.src, self.dst, self.cw, self.uw = None, dst, cw, None
        self.tainted = set()  # directed links whose bytes were dropped on it
        self.closed = False

    def links(self):
        return {(self.src, self.dst), (self.dst, self.src)} if self.src is not None else set()

    def close(self):
        if self.closed:
            return
        self.closed = True
        for w in (self.cw, self.uw):
            if w is not None:
                try:
                    w.transport.abort()
                except Exception:
                    pass


class FaultProxy:
    CHUNK = 64 << 10
    QUEUED = 64  # chunks per direction
    MAX_CONNS = 256

    def __init__(self, fronts):
        """fronts: node id -> (listen port, the node's own Raft port)."""
        self.fronts = dict(fronts)
        ids = sorted(self.fronts)
        self.rules = {(a, b): Rule() for a in ids for b in ids if a != b}
        self.conns = set()
        self.stats = collections.Counter()
        self.loop = None
        self.thread = None

    # -- lifecycle (harness thread)

    def start(self):
        ready, err = threading.Event(), []

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                for nid, (lp, _) in sorted(self.fronts.items()):
                    loop.run_until_complete(asyncio.start_server(
                        lambda r, w, nid=nid: self._handle(nid, r, w), "127.0.0.1", lp,
                        reuse_address=True))
            except Exception as e:
                err.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self.thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self.thread.start()
        ready.wait(10)
        if err:
            raise err[0]

    def stop(self):
        if self.loop is not None and self.loop.is_running():
            try:
                self.call(self._close_all)
            except Exception:
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)

    def call(self, fn, *args):
        """Run fn(*args) in the proxy's loop and wait for its result."""
        fut = concurrent.futures.Future()

        def wrap():
            try:
                fut.set_result(fn(*args))
            except Exception as e:
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(wrap)
        return fut.result(timeout=10)

    # -- faults (harness thread)

    def set(self, changes):
        """changes: [(a, b, field, value)] with field cut, drop or delay (seconds)."""
        return self.call(self._apply, list(changes))

    def isolate(self, n, mode, on=True):
        """Every link of node n: mode cut (both ways), blackhole (drop both ways), out (drop
        n->others), in (drop others->n)."""
        ch = []
        for m in self.fronts:
            if m == n:
                continue
            if mode in ("cut", "blackhole"):
                f = "cut" if mode == "cut" else "drop"
                ch += [(n, m, f, on), (m, n, f, on)]
            elif mode == "out":
                ch.append((n, m, "drop", on))
            elif mode == "in":
                ch.append((m, n, "drop", on))
            else:
                raise ValueError(mode)
        return self.set(ch)

    def delay(self, links, ms):
        return self.set([(a, b, "delay", ms / 1000.0) for a, b in links])

    def heal_all(self):
        ch = []
        for (a, b), r in self.rules.items():
            if r.active():
                ch += [(a, b, "cut", False), (a, b, "drop", False), (a, b, "delay", 0.0)]
        return self.set(ch)

    def describe(self):
        return self.call(lambda: {"%d->%d" % k: repr(r) for k, r in self.rules.items()
                                  if r.active()})

    def counters(self):
        return self.call(lambda: dict(self.stats, open=len(self.conns)))

    # -- in the loop

    def _apply(self, changes):
        cut = set()
        for a, b, field, value in changes:
            r = self.rules[(a, b)]
            setattr(r, field, value)
            if field == "cut" and value:
                cut.add((a, b))
        closed = 0
        for c in list(self.conns):
            if c.closed or c.src is None:
                continue
            if c.links() & cut or any(not self.rules[t].drop for t in c.tainted):
                c.close()
                closed += 1
        self.stats["closed_by_fault"] += closed
        return closed

    def _close_all(self):
        for c in list(self.conns):
            c.close()

    def _is_cut(self, c):
        return any(self.rules[t].cut for t in c.links())

    async def _handle(self, dst, cr, cw):
        if len(self.conns) >= self.MAX_CONNS:
            self.stats["over_limit"] += 1
            cw.transport.abort()
            return
        conn = PConn(dst, cw)
        self.conns.add(conn)
        try:
            try:
                head = await asyncio.wait_for(cr.readexactly(4), 10)
                n = int.from_bytes(head, "big")
                body = await asyncio.wait_for(cr.readexactly(n), 10) if n <= MAX_HELLO else b""
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError):
                self.stats["no_hello"] += 1
                return
            hello = decode_hello(body) if body else None
            if hello is None or hello["from"] not in self.fronts or hello["from"] == dst:
                self.stats["unidentified"] += 1
            else:
                conn.src = hello["from"]
                self.stats["conns %d->%d" % (conn.src, dst)] += 1
            if conn.closed or self._is_cut(conn):
                self.stats["refused"] += 1
                return
            try:
                ur, uw = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.fronts[dst][1]), 5)
            except (OSError, asyncio.TimeoutError):
                self.stats["upstream_down"] += 1
                return
            conn.uw = uw
            if conn.closed:  # cut meanwhile
                uw.transport.abort()
                return
            await asyncio.gather(self._pump(conn, cr, uw, (conn.src, dst), head + body),
                                 self._pump(conn, ur, cw, (dst, conn.src)),
                                 return_exceptions=True)
        finally:
            conn.close()
            self.conns.discard(conn)

    async def _pump(self, conn, reader, writer, link, first=b""):
        loop = asyncio.get_running_loop()
        q = asyncio.Queue(maxsize=self.QUEUED)
        rule = self.rules.get(link)  # None when the source is unknown

        async def out():
            broken = False
            while True:
                item = await q.get()
                if item is None:
                    return
                if broken:
                    continue
                due, data = item
                d = due - loop.time()
                if d > 0:
                    await asyncio.sleep(d)
                try:
                    writer.write(data)
                    await writer.drain()
                except Exception:
                    broken = True
                    conn.close()

        task = asyncio.ensure_future(out())
        try:
            data = first
            while not conn.closed:
                if data:
                    if rule is not None and rule.drop:
                        conn.tainted.add(link)
                        self.stats["dropped_bytes"] += len(data)
                    else:
                        delay = rule.delay if rule is not None else 0.0
                        await q.put((loop.time() + delay, data))
                try:
                    data = await reader.read(self.CHUNK)
                except Exception:
                    break
                if not data:
                    break
        finally:
            await q.put(None)
            try:
                await task
            finally:
                conn.close()


def proxy_selftest():
    """The Hello decoding, and cut/drop/delay over a local echo server (no warren needed)."""
    h = encode_hello("c-3f2a", 2, 300)
    assert decode_hello(h) == {"version": 2, "cluster": "c-3f2a", "from": 2, "to": 300}, h
    assert decode_hello(b"\x01" + h[1:]) is None
    assert decode_hello(h[:-1]) is None

    async def echo(r, w):
        try:
            while True:
                d = await r.read(65536)
                if not d:
                    break
                w.write(d)
                await w.drain()
        except Exception:
            pass
        w.close()

    def free_port():
        x = socket.socket()
        x.bind(("127.0.0.1", 0))
        port = x.getsockname()[1]
        x.close()
        return port

    up_port, listen = free_port(), free_port()
    # Node 1 is the echo server behind `listen`; node 2 (the client) has a front never used.
    p = FaultProxy({1: (listen, up_port), 2: (free_port(), free_port())})
    p.start()
    p.call(lambda: p.loop.create_task(asyncio.start_server(echo, "127.0.0.1", up_port)))
    time.sleep(0.2)

    def client():
        s = socket.create_connection(("127.0.0.1", listen), timeout=2)
        body = encode_hello("x", 2, 1)
        s.sendall(len(body).to_bytes(4, "big") + body)
        got = b""
        while len(got) < 4 + len(body):
            d = s.recv(100)
            assert d, "closed"
            got += d
        return s

    s = client()
    s.sendall(b"ping")
    assert s.recv(10) == b"ping"
    p.delay([(1, 2)], 200)  # the answers, 1 -> 2
    t = now()
    s.sendall(b"slow")
    assert s.recv(10) == b"slow" and now() - t >= 0.19, now() - t
    p.heal_all()
    t = now()
    s.sendall(b"fast")
    assert s.recv(10) == b"fast" and now() - t < 0.1, now() - t
    p.set([(1, 2, "drop", True)])  # answers from 1 to 2 are dropped
    s.sendall(b"lost")
    s.settimeout(0.3)
    try:
        s.recv(10)
        raise AssertionError("dropped bytes arrived")
    except socket.timeout:
        pass
    p.heal_all()  # the tainted connection is closed
    s.settimeout(2)
    assert s.recv(10) == b"", "the tainted connection stays open"
    s = client()
    p.isolate(2, "out")  # 2 -> 1 dropped: the requests vanish
    s.sendall(b"gone")
    s.settimeout(0.3)
    try:
        s.recv(10)
        raise AssertionError("dropped requests answered")
    except socket.timeout:
        pass
    p.heal_all()
    s.settimeout(2)
    assert s.recv(10) == b"", "the tainted connection stays open"
    s = client()
    p.isolate(1, "cut")  # the open connection is closed, a new one refused after its Hello
    assert s.recv(10) == b"", "a cut left a connection open"
    s = socket.create_connection(("127.0.0.1", listen), timeout=2)
    body = encode_hello("x", 2, 1)
    s.sendall(len(body).to_bytes(4, "big") + body)
    assert s.recv(10) == b"", "a cut link accepted a connection"
    p.heal_all()
    s = client()
    s.sendall(b"back")
    assert s.recv(10) == b"back"
    s.close()
    c = p.counters()
    p.stop()
    print("proxy self-test passed:", c)


# ---------------------------------------------------------------------------------------------
# Clients


class Publisher(Client):
    stack_timeout = STACK_TIMEOUT

    def __init__(self, idx, cluster, rng, stop, rate):
        super().__init__("publisher-%d" % idx, cluster, rng, stop)
        self.idx, self.rate = idx, rate
        self.seq = 0
        self.copies = collections.Counter()  # id -> attempts so far
        self.attempts = {}  # copy key -> queue
        self.confirmed = {}  # id -> time of its first confirm
        self.confirms = []  # (time, key, conn no)
        self.last_confirm_q = {}  # queue -> time
        self.resends = self.nacks = self.unroutable = 0
        self.pending = None
        self.surprises = []

    def setup(self, conn):
        ch = conn.channel()
        ch.confirm_delivery()
        return ch

    def run(self):
        interval = 1.0 / self.rate if self.rate else 0.0
        next_t = now()
        while not self.stop.is_set():
            conn, ch, info = self.connect()
            if conn is None:
                break
            try:
                while not self.stop.is_set():
                    if self.pending is None:
                        if interval:
                            d = next_t - now()
                            if d > 0:
                                time.sleep(d)
                            next_t = max(next_t + interval, now() - 0.5)
                        mid = "%d-%d" % (self.idx, self.seq)
                        self.pending = (mid, QUEUES[self.seq % len(QUEUES)])
                        self.seq += 1
                    mid, q = self.pending
                    if self.copies[mid]:
                        self.resends += 1
                    self.copies[mid] += 1
                    key = "%s.%d" % (mid, self.copies[mid])
                    with self.lock:
                        self.attempts[key] = q
                    props = pika.BasicProperties(delivery_mode=2, message_id=key)
                    self.busy_since = now()
                    try:
                        ch.basic_publish("", q, key.encode(), props, mandatory=True)
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
                        self.confirms.append((t, key, info["no"]))
                        self.last_confirm_q[q] = t
                        if info["first_confirm"] is None:
                            info["first_confirm"] = t
                    self.pending = None
            except ConnectionLost as e:
                self.lost(info, e)
            except Exception as e:  # a client bug or an unforeseen pika error: noted, go on
                self.lost(info, e)
                self.surprises.append("%.2f %r" % (now() - T0, e))
                time.sleep(0.1)
        self.close()


class Consumer(Client):
    stack_timeout = STACK_TIMEOUT

    def __init__(self, idx, queue, cluster, rng, stop, hold, prefetch, hold_max=3.0):
        super().__init__("consumer-%d" % idx, cluster, rng, stop)
        self.queue, self.hold, self.prefetch, self.hold_max = queue, hold, prefetch, hold_max
        self.deliveries = []  # (time, key, redelivered, conn no, message_id)
        self.window = collections.deque()  # (delivery tag, key, time) unacked, this connection
        self.acked = set()  # keys acked at least once
        self.acks = 0
        self.progress = now()  # last delivery or connection
        self.kick = threading.Event()  # reconnect (set by the watchdog)
        self.surprises = []

    def setup(self, conn):
        ch = conn.channel()
        ch.basic_qos(prefetch_count=self.prefetch)
        return ch

    def run(self):
        while not self.stop.is_set():
            conn, ch, info = self.connect()
            if conn is None:
                break
            self.kick.clear()
            with self.lock:
                self.window.clear()
                self.progress = now()

            def on_message(ch, method, props, body, info=info):
                key = body.decode("utf-8", "replace")
                t = now()
                with self.lock:
                    self.deliveries.append((t, key, bool(method.redelivered), info["no"],
                                            props.message_id))
                    self.window.append((method.delivery_tag, key, t))
                    self.progress = t
                self.ack_surplus(ch)

            try:
                ch.basic_consume(self.queue, on_message, auto_ack=False)
                while not self.stop.is_set() and not self.kick.is_set():
                    conn.process_data_events(time_limit=0.05)
                    self.ack_surplus(ch)
                if self.kick.is_set():
                    info["closed"], info["error"] = now(), "kicked (no deliveries)"
                    self.close()
            except ConnectionLost as e:
                self.lost(info, e)
            except Exception as e:
                self.lost(info, e)
                self.surprises.append("%.2f %r" % (now() - T0, e))
                time.sleep(0.1)
        self.close()

    def ack_surplus(self, ch):
        while True:
            with self.lock:
                if not self.window:
                    return
                tag, key, t = self.window[0]
                if len(self.window) <= self.hold and now() - t < self.hold_max:
                    return
                self.window.popleft()
            ch.basic_ack(tag)
            self.acked.add(key)
            self.acks += 1

    def held(self):
        with self.lock:
            return len(self.window)


# ---------------------------------------------------------------------------------------------
# The nemesis

KINDS = (("kill_leader", 3.0), ("pause_leader", 2.0), ("partition_leader", 2.0),
         ("oneway_leader", 1.5), ("kill_follower", 2.0), ("restart_all", 1.0),
         ("wipe_follower", 1.0), ("delay", 1.5))
LEADER_KINDS = ("kill_leader", "pause_leader", "partition_leader", "oneway_leader",
                "restart_all")


def plan_fault(r, kinds, min_gap, max_gap, delays=(5, 10, 20, 50), bg_delays=(2, 5, 10)):
    names = [k for k, _ in kinds]
    kind = r.choices(names, weights=[w for _, w in kinds])[0]
    p = {"kind": kind, "gap": round(r.uniform(min_gap, max_gap), 2)}
    if kind == "kill_leader":
        p["down"] = round(r.uniform(0.5, 4.0), 2)
    elif kind == "pause_leader":
        p["pause"] = round(r.uniform(1.5, 5.0), 2)
    elif kind == "partition_leader":
        p["mode"] = r.choice(["cut", "blackhole"])
        p["dur"] = round(r.uniform(2.0, 6.0), 2)
    elif kind == "oneway_leader":
        p["mode"] = r.choice(["out", "in"])
        p["dur"] = round(r.uniform(2.0, 5.0), 2)
    elif kind == "kill_follower":
        p["pick"] = r.randrange(2)
        p["down"] = round(r.uniform(0.5, 4.0), 2)
    elif kind == "restart_all":
        p["order"] = r.sample([1, 2, 3], 3)
        p["down"] = round(r.uniform(0.2, 2.0), 2)
    elif kind == "wipe_follower":
        p["pick"] = r.randrange(2)
        p["via"] = r.randrange(2)  # ctl through the leader (0) or the other follower (1)
    elif kind == "delay":
        p["scope"] = r.choice(["leader", "node", "link"])
        p["node"] = r.randrange(1, 4)
        p["peer"] = r.randrange(2)
        p["ms"] = r.choice(delays)
        p["dur"] = round(r.uniform(3.0, 8.0), 2)
    if kind != "delay" and r.random() < 0.2:
        p["bg_delay"] = [r.randrange(1, 4), r.randrange(2), r.choice(bg_delays)]
    return p


class Aborted(Exception):
    pass


class Chaos:
    def __init__(self, a, seed, cluster, proxy, pubs, cons, anomalies):
        self.a, self.seed, self.cluster, self.proxy = a, seed, cluster, proxy
        self.pubs, self.cons, self.anomalies = pubs, cons, anomalies
        self.faults = []
        self.crashes = []
        self.spurious = []  # (t, term before, term after)
        self.expected = {n.id: False for n in cluster.nodes}  # should be running
        self.ctl_log = []
        self.unhealthy = None  # why healthy() said no, last time

    # -- processes

    def spawn(self, n):
        self.cluster.spawn(n)
        self.expected[n.id] = True

    def kill(self, n):
        self.expected[n.id] = False
        if n.paused and n.alive():
            n.proc.send_signal(signal.SIGCONT)
        return self.cluster.sigkill(n)

    def check_crashes(self):
        for n in self.cluster.nodes:
            if self.expected[n.id] and n.proc is not None and n.proc.poll() is not None:
                self.expected[n.id] = False
                rec = {"t": round(now() - T0, 3), "node": n.id, "rc": n.proc.returncode,
                       "log_tail": tail(n.logpath, 30)}
                self.crashes.append(rec)
                self.anomalies.append("t=%.2f node %d exited by itself (rc %s); restarted"
                                      % (now() - T0, n.id, n.proc.returncode))
                log(self.anomalies[-1])
                log("---- node %d log tail\n%s" % (n.id, rec["log_tail"]))
                self.spawn(n)

    def ctl(self, via, *args, timeout=60):
        cmd = [self.cluster.binary, "ctl", "--url", "http://127.0.0.1:%d" % via.http] + list(args)
        t = now()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            rc, out = r.returncode, (r.stdout + r.stderr).strip()
        except subprocess.TimeoutExpired:
            rc, out = None, "timed out after %d s" % timeout
        res = {"args": " ".join(args), "via": via.id, "rc": rc, "ms": round((now() - t) * 1000),
               "out": out[-400:], "t": round(t - T0, 3)}
        self.ctl_log.append(res)
        log("ctl (via node %d) %s -> rc %s in %d ms: %s" % (via.id, res["args"], rc, res["ms"],
                                                           out[-200:]))
        return res

    # -- observation

    def watch(self, rec, old_term, exclude=()):
        """One poll: note the first node serving in a term after old_term."""
        if rec.get("serving_ms") is not None:
            return
        for n in self.cluster.nodes:
            if n.id in exclude or not n.alive() or n.paused:
                continue
            s = n.status(timeout=0.3)
            if s and s.get("serving") is True and (old_term is None
                                                   or s.get("term", 0) > old_term):
                rec["serving_ms"] = round((now() - rec["_K"]) * 1000)
                rec["new_leader"] = n.id
                rec["term_after"] = s.get("term")
                return

    def hold_for(self, seconds, rec=None, old_term=None, exclude=()):
        end = now() + seconds
        while now() < end:
            self.check_crashes()
            if rec is not None:
                self.watch(rec, old_term, exclude)
            time.sleep(min(0.05, max(0.0, end - now())))

    def healthy(self):
        """(leader id, its status) when all three run, one serves and all name it, the leader
        lists three voters and both followers have applied (0.1 s later) what the leader had
        applied. Else (None, statuses), and self.unhealthy says why."""
        if not all(n.alive() and not n.paused for n in self.cluster.nodes):
            self.unhealthy = "a node is down or paused"
            return None, {}
        lid, st = self.cluster.leader()
        if lid is None:
            self.unhealthy = "no single serving leader named by all: %s" % {
                k: (v.get("role"), v.get("leader_id"), v.get("serving"), v.get("term"))
                for k, v in st.items()}
            return None, st
        members = {n["id"]: n.get("membership") for n in st.get("nodes", [])}
        if members != {1: "voter", 2: "voter", 3: "voter"}:
            self.unhealthy = "membership %s" % members
            return None, st
        time.sleep(0.1)
        for n in self.cluster.nodes:
            if n.id == lid:
                continue
            f = n.status()
            if not f or f.get("role") != "follower" or f.get("leader_id") != lid or (
                    f.get("applied_index") or 0) < (st.get("applied_index") or 0):
                self.unhealthy = "node %d: %s (leader applied %s)" % (
                    n.id, f and {k: f.get(k) for k in ("role", "leader_id", "applied_index")},
                    st.get("applied_index"))
                return None, st
        # Commit progress while publishers run. A leader can serve (lease valid, heartbeats
        # answered, every applied index equal) and never commit again: seed 49's stalled
        # proposer (fixed in 19274fd) passed every check above. A confirm must have come within
        # --commit-stall seconds (the publishers send at --rate, so a serving cluster confirms).
        running = [p for p in self.pubs if not p.stop.is_set()]
        if running and self.a.commit_stall > 0:
            last = max((p.confirms[-1][0] for p in running if p.confirms), default=None)
            if last is None or now() - last > self.a.commit_stall:
                self.unhealthy = "no confirm for %s s while publishers run (leader %d commit %s)" % (
                    "ever" if last is None else "%.1f" % (now() - last), lid,
                    st.get("commit_index"))
                return None, st
        self.unhealthy = None
        return lid, st

    def wait_healthy(self, within, rec=None, old_term=None):
        deadline = now() + within
        st = None
        stopped_since = {}
        while now() < deadline:
            self.check_crashes()
            if rec is not None:
                self.watch(rec, old_term)
            # A node whose Raft stopped (it saw itself removed) never comes back by itself.
            for n in (self.cluster.nodes if int(now() - T0) % 2 == 0 else ()):
                s_ = n.status(timeout=0.3) if n.alive() and not n.paused else None
                if s_ and s_.get("role") == "stopped":
                    stopped_since.setdefault(n.id, now())
                    if now() - stopped_since[n.id] > 5:
                        self.unhealthy = "node %d reports role 'stopped' (its Raft stopped)" % n.id
                        return None, s_
                else:
                    stopped_since.pop(n.id, None)
            lid, st = self.healthy()
            if lid is not None:
                return lid, st
            if rec is not None:
                rec["unhealthy_last"] = self.unhealthy
            time.sleep(0.1)
        return None, st

    def diagnose(self, why):
        st = {n.id: (n.status() if n.alive() and not n.paused else
                     ("paused" if n.paused else "down")) for n in self.cluster.nodes}
        self.anomalies.append("%s (last check: %s); statuses: %s"
                              % (why, self.unhealthy, json.dumps(st)[:3000]))
        log(self.anomalies[-1])
        for n in self.cluster.nodes:
            log("---- node %d log tail (%s)\n%s" % (n.id, n.logpath, tail(n.logpath, 25)))

    # -- faults

    def run(self, duration, deadline):
        kinds = KINDS
        if self.a.faults:
            want = self.a.faults.split(",")
            bad = [k for k in want if k not in dict(KINDS)]
            if bad:
                raise SystemExit("unknown fault kinds: %s" % bad)
            kinds = tuple((k, w) for k, w in KINDS if k in want)
        plan_rng = random.Random(self.seed)
        phase_end = now() + duration
        last_term = None
        k = 0
        while now() < phase_end and now() < deadline:
            p = plan_fault(plan_rng, kinds, self.a.min_gap, self.a.max_gap,
                           [int(x) for x in self.a.delays.split(",")],
                           [int(x) for x in self.a.bg_delays.split(",")])
            k += 1
            self.hold_for(p["gap"])
            lid, st = self.wait_healthy(self.a.recover_timeout)
            if lid is None:
                self.diagnose("before fault %d: no healthy cluster within %.0f s"
                              % (k, self.a.recover_timeout))
                raise Aborted("no healthy cluster before fault %d" % k)
            if last_term is not None and st.get("term") != last_term:
                self.spurious.append((round(now() - T0, 2), last_term, st.get("term")))
                log("spurious election between faults: term %s -> %s" % (last_term,
                                                                         st.get("term")))
            rec = {"no": k, "kind": p["kind"], "plan": p, "leader_before": lid,
                   "term_before": st.get("term"), "serving_ms": None}
            if now() >= deadline - 5:
                break
            self.faults.append(rec)
            self.fault(rec, p, lid, st)
            # After restart_all openraft may restore the old leader in its term (no election).
            lid2, st2 = self.wait_healthy(self.a.recover_timeout, rec,
                                          None if p["kind"] == "restart_all" else
                                          rec["term_before"])
            if lid2 is None:
                rec["recovered_ms"] = None
                self.diagnose("fault %d (%s): no healthy cluster after its end (waited %.0f "
                              "s at most)" % (k, p["kind"], self.a.recover_timeout))
                raise Aborted("fault %d (%s) did not recover" % (k, p["kind"]))
            if p.get("bg_delay") or p["kind"] == "delay":
                self.proxy.heal_all()
            rec["_healthy"] = now()
            rec["recovered_ms"] = round((now() - rec["_K"]) * 1000)
            rec["leader_after"], rec["term_after_healthy"] = lid2, st2.get("term")
            last_term = st2.get("term")
            log("fault %2d %-16s node %s %s: serving %s ms, recovered %d ms, leader %s -> %s "
                "(term %s -> %s)" % (k, p["kind"], rec.get("node"), rec.get("detail", ""),
                                     rec.get("serving_ms"), rec["recovered_ms"], lid, lid2,
                                     rec["term_before"], last_term))
        return k

    def start_fault(self, rec, node, detail=""):
        rec["_K"] = now()
        rec["t"] = round(rec["_K"] - T0, 3)
        rec["node"] = node
        rec["detail"] = detail
        rec["held"] = sum(c.held() for c in self.cons)

    def fault(self, rec, p, lid, st):
        c, proxy = self.cluster, self.proxy
        L = c.node(lid)
        followers = [n for n in c.nodes if n.id != lid]
        old_term = st.get("term")
        if p.get("bg_delay"):
            a_, pick, ms = p["bg_delay"]
            b_ = [m for m in (1, 2, 3) if m != a_][pick]
            proxy.delay([(a_, b_)], ms)
            rec["bg_delay"] = "%d->%d %d ms" % (a_, b_, ms)
        kind = p["kind"]
        if kind == "kill_leader":
            self.start_fault(rec, lid, "down %.1f s" % p["down"])
            self.kill(L)
            self.hold_for(p["down"], rec, old_term, exclude=(lid,))
            self.spawn(L)
        elif kind == "pause_leader":
            self.start_fault(rec, lid, "paused %.1f s" % p["pause"])
            L.proc.send_signal(signal.SIGSTOP)
            L.paused = True
            self.hold_for(p["pause"], rec, old_term)
            L.proc.send_signal(signal.SIGCONT)
            L.paused = False
        elif kind in ("partition_leader", "oneway_leader"):
            self.start_fault(rec, lid, "%s %.1f s" % (p["mode"], p["dur"]))
            rec["closed_conns"] = proxy.isolate(lid, p["mode"])
            rec["rules"] = proxy.describe()
            self.hold_for(p["dur"], rec, old_term)
            proxy.heal_all()
        elif kind == "kill_follower":
            F = followers[p["pick"]]
            self.start_fault(rec, F.id, "down %.1f s" % p["down"])
            self.kill(F)
            self.hold_for(p["down"], rec, old_term)
            self.spawn(F)
        elif kind == "restart_all":
            self.start_fault(rec, "all", "order %s, down %.1f s" % (p["order"], p["down"]))
            for nid in p["order"]:
                self.kill(c.node(nid))
            self.hold_for(p["down"])
            for nid in p["order"]:
                self.spawn(c.node(nid))
        elif kind == "wipe_follower":
            F = followers[p["pick"]]
            other = followers[1 - p["pick"]]
            via = (L, other)[p["via"]]
            self.start_fault(rec, F.id, "ctl via node %d" % via.id)
            self.wipe(rec, F, via)
        elif kind == "delay":
            if p["scope"] == "leader":
                n = lid
                links = [(lid, m.id) for m in followers] + [(m.id, lid) for m in followers]
            elif p["scope"] == "node":
                n = p["node"]
                others = [m for m in (1, 2, 3) if m != n]
                links = [(n, m) for m in others] + [(m, n) for m in others]
            else:
                n = p["node"]
                links = [(n, [m for m in (1, 2, 3) if m != n][p["peer"]])]
            self.start_fault(rec, n, "%d ms on %s for %.1f s"
                             % (p["ms"], ",".join("%d->%d" % x for x in links), p["dur"]))
            proxy.delay(links, p["ms"])
            rec["rules"] = proxy.describe()
            self.hold_for(p["dur"], rec, old_term)
            proxy.heal_all()
        else:
            raise ValueError(kind)
        rec["_end"] = now()
        rec["active_ms"] = round((rec["_end"] - rec["_K"]) * 1000)

    def wipe(self, rec, F, via):
        c = self.cluster
        self.kill(F)
        shutil.rmtree(F.data, ignore_errors=True)
        rec["wiped"] = True
        ok = False
        for attempt in range(5):
            r = self.ctl(via, "cluster", "remove", str(F.id))
            if r["rc"] == 0:
                ok = True
                break
            time.sleep(1.0)
        rec["remove_ms"] = round((now() - rec["_K"]) * 1000)
        if not ok:
            self.anomalies.append("wipe: `cluster remove %d` failed 5 times" % F.id)
            raise Aborted("cluster remove failed")
        # Both members have applied the removal before the node probes them.
        t_end = now() + 20
        while now() < t_end:
            self.check_crashes()
            sts = [n.status() for n in c.nodes if n is not F]
            if all(s and F.id not in [x["id"] for x in s.get("nodes", [])] for s in sts):
                break
            time.sleep(0.05)
        else:
            self.anomalies.append("wipe: node %d still listed 20 s after its removal" % F.id)
        started = False
        for attempt in range(3):
            self.spawn(F)
            t_end = now() + 30
            while now() < t_end:
                if F.proc.poll() is not None:
                    break
                s = F.status()
                if s is not None:
                    started = True
                    rec["restarted_role"] = s.get("role")
                    break
                time.sleep(0.1)
            if started:
                break
            self.expected[F.id] = False
            self.anomalies.append("wipe: the wiped node %d did not come up (rc %s): %s"
                                  % (F.id, F.proc.poll(), tail(F.logpath, 5)[-600:]))
            log(self.anomalies[-1])
            if F.proc.poll() is None:
                self.kill(F)
            time.sleep(1.0)
        if not started:
            raise Aborted("the wiped node %d does not start" % F.id)
        rec["started_ms"] = round((now() - rec["_K"]) * 1000)
        ok = False
        for attempt in range(3):
            r = self.ctl(via, "cluster", "add", str(F.id), "127.0.0.1:%d" % F.peer, timeout=150)
            if r["rc"] == 0:
                ok = True
                break
            self.check_crashes()
            time.sleep(1.0)
        rec["added_ms"] = round((now() - rec["_K"]) * 1000)
        if not ok:
            self.anomalies.append("wipe: `cluster add %d` failed 3 times" % F.id)
            raise Aborted("cluster add failed")


# ---------------------------------------------------------------------------------------------
# After the run


def finalize_faults(faults, pubs, phase_end):
    """failover_ms, first_confirm_ms, max_gap_ms of each fault, from the publishers' history."""
    conns = [c for p in pubs for c in p.conns]
    confirms = sorted(t for p in pubs for t, _, _ in p.confirms)
    import bisect
    for i, rec in enumerate(faults):
        K = rec.get("_K")
        if K is None:
            continue
        nxt = faults[i + 1].get("_K", phase_end) if i + 1 < len(faults) else phase_end
        fc = [c["first_confirm"] for c in conns if K < c["attempt"] < nxt
              and c["first_confirm"] is not None and c["first_confirm"] < nxt]
        rec["failover_ms"] = round((min(fc) - K) * 1000) if fc else None
        rec["publisher_reconnects"] = sum(1 for c in conns if K < c["attempt"] < nxt)
        j = bisect.bisect_right(confirms, K)
        rec["first_confirm_ms"] = (round((confirms[j] - K) * 1000)
                                   if j < len(confirms) and confirms[j] < nxt else None)
        end = rec.get("_healthy") or nxt
        ts = [K] + [t for t in confirms[j:bisect.bisect_right(confirms, end)]] + [end]
        rec["max_gap_ms"] = round(max(b - a for a, b in zip(ts, ts[1:])) * 1000)
        for key in ("_K", "_end", "_healthy"):
            rec.pop(key, None)


def check(pubs, cons, drained):
    """The checker over the recorded history."""
    published = {}
    confirmed_ids, confirmed_keys = set(), set()
    for p in pubs:
        published.update(p.attempts)
        confirmed_ids.update(p.confirmed)
        confirmed_keys.update(k for _, k, _ in p.confirms)
    deliveries = []  # (t, key, queue, redelivered, who, message_id)
    acked = set()
    for c in cons:
        deliveries += [(t, k, c.queue, r, "%s/%d" % (c.name, no), m)
                       for t, k, r, no, m in c.deliveries]
        acked |= c.acked
    deliveries += drained["deliveries"]
    acked |= drained["acked"]
    deliveries.sort(key=lambda d: d[0])

    seen = collections.Counter()
    ids = collections.Counter()
    copies_of = collections.defaultdict(set)
    unexpected, violations = [], []
    redelivered_first = 0
    for t, key, q, red, who, mid in deliveries:
        if key not in published or published[key] != q or mid != key:
            unexpected.append({"t": round(t - T0, 3), "key": key, "queue": q,
                               "message_id": mid, "published_to": published.get(key)})
            continue
        i = key.rsplit(".", 1)[0]
        if seen[key] and not red:
            violations.append({"t": round(t - T0, 3), "key": key, "earlier": seen[key],
                               "by": who})
        if not seen[key] and red:
            redelivered_first += 1
        seen[key] += 1
        ids[i] += 1
        copies_of[i].add(key)
    lost_ids = sorted(i for i in confirmed_ids if ids[i] == 0)
    lost_copies = sorted(k for k in confirmed_keys if seen[k] == 0)
    lost_unacked = sorted(k for k in confirmed_keys if seen[k] and k not in acked)
    unconfirmed_vanished = sorted(
        k for k in seen if k not in confirmed_keys and k not in acked)
    dup_ids = sum(1 for i, n in ids.items() if n > 1)
    return {
        "published_ids": sum(p.seq for p in pubs),
        "publish_attempts": len(published), "confirmed_ids": len(confirmed_ids),
        "confirmed_copies": len(confirmed_keys),
        "resends": sum(p.resends for p in pubs), "nacks": sum(p.nacks for p in pubs),
        "unroutable": sum(p.unroutable for p in pubs),
        "deliveries": len(deliveries), "drained": len(drained["deliveries"]),
        "distinct_copies_delivered": len(seen), "distinct_ids_delivered": len(ids),
        "lost": len(lost_ids), "lost_ids": lost_ids[:50],
        "lost_copies": len(lost_copies), "lost_copies_examples": lost_copies[:50],
        "lost_unacked": len(lost_unacked), "lost_unacked_examples": lost_unacked[:50],
        "unexpected": len(unexpected), "unexpected_examples": unexpected[:20],
        "violations": len(violations), "violation_examples": violations[:20],
        "duplicate_ids": dup_ids,
        "duplicate_deliveries": sum(n - 1 for n in ids.values() if n > 1),
        "redeliveries_same_copy": sum(n - 1 for n in seen.values() if n > 1),
        "ids_with_several_copies_delivered": sum(1 for s in copies_of.values() if len(s) > 1),
        "redelivered_on_first_delivery": redelivered_first,
        "unconfirmed_copies_delivered_never_acked": len(unconfirmed_vanished),
        "unconfirmed_ids_delivered": sum(1 for i in ids if i not in confirmed_ids),
    }


def summarize_failover(faults):
    """failover_ms by kind, and over every fault of the leader (LEADER_KINDS) together."""
    by = collections.defaultdict(list)
    for r in faults:
        if r.get("failover_ms") is not None:
            by[r["kind"]].append(r["failover_ms"])
            if r["kind"] in LEADER_KINDS:
                by["(leader faults)"].append(r["failover_ms"])
    out = {}
    for k, v in sorted(by.items()):
        out[k] = {"n": len(v), "median": statistics.median(v), "p90": pct(v, 90), "max": max(v)}
    return out


def report(summary, faults):
    print()
    print("| # | t s | kind | node | detail | leader | serving ms | failover ms | first confirm "
          "ms | max gap ms | recovered ms | held | leader after |")
    print("|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in faults:
        def f(x):
            return "-" if r.get(x) is None else str(r.get(x))
        print("| %d | %.1f | %s | %s | %s%s | %s (t%s) | %s | %s | %s | %s | %s | %s | %s |" % (
            r["no"], r.get("t", 0), r["kind"], r.get("node"), r.get("detail", ""),
            "; bg " + r["bg_delay"] if r.get("bg_delay") else "", r["leader_before"],
            r["term_before"], f("serving_ms"), f("failover_ms"), f("first_confirm_ms"),
            f("max_gap_ms"), f("recovered_ms"), f("held"), f("leader_after")))
    print()
    fo = summary["failover_by_kind"]
    for k, v in fo.items():
        print("failover %-16s n=%-3d median %6.0f ms  p90 %6.0f ms  max %6.0f ms"
              % (k, v["n"], v["median"], v["p90"], v["max"]))
    c = summary["check"]
    print("published ids %d (%d attempts, %d resends, %d nacks), confirmed %d; deliveries %d "
          "(%d drained)" % (c["published_ids"], c["publish_attempts"], c["resends"], c["nacks"],
                            c["confirmed_ids"], c["deliveries"], c["drained"]))
    print("lost %d (copies %d, delivered never acked %d) | unexpected %d | violations %d | "
          "duplicate ids %d (%d extra deliveries; same copy again %d) | crashes %d | spurious "
          "elections %d | replicas diverge %s | resurrected after the final failover %s"
          % (c["lost"], c["lost_copies"], c["lost_unacked"], c["unexpected"],
             c["violations"], c["duplicate_ids"], c["duplicate_deliveries"],
             c["redeliveries_same_copy"], summary["crashes"],
             len(summary["spurious_elections"]), "YES" if c["replicas_diverge"] else "no",
             c["resurrected"] if c["final_failover"] else "(not checked)"))
    if c["final_failover"] and c["final_failover"]["deliveries"]:
        print("resurrected:", c["final_failover"]["deliveries"][:20])
    for name in ("lost_ids", "lost_copies_examples", "lost_unacked_examples",
                 "unexpected_examples", "violation_examples"):
        if c[name]:
            print("%s: %s" % (name, c[name]))
    lg = summary.get("logs", {})
    for k in ("panics", "warren_errors", "served_again_after_lease_expiry"):
        if lg.get(k):
            print("node logs, %s: %d" % (k, len(lg[k])))
            for x in lg[k][:10]:
                print("  " + x)
    if summary["anomalies"]:
        print("anomalies:")
        for x in summary["anomalies"]:
            print("  - " + x[:2000])
    print("RESULT: %s (seed %d, %d faults in %.0f s)" % (summary["result"], summary["seed"],
                                                        len(faults), summary["elapsed_s"]))


# ---------------------------------------------------------------------------------------------


def one_run(a):
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed ^ 0x5EED)  # the clients' (the plan has its own)
    hard_deadline = now() + a.timeout
    binary = os.path.abspath(a.binary)
    workdir = tempfile.mkdtemp(prefix="warren-chaos-")
    base = a.base_port if a.base_port is not None else free_base(PROXIED_PORT_OFFSETS)
    extra = ["--raft-snapshot-every", str(a.snapshot_every)] if a.snapshot_every else []
    cluster = Cluster(binary, base, workdir, a.log_filter, label="chaos.py", proxied=True,
                      extra_args=extra)
    proxy = FaultProxy({n.id: (n.peer, n.raft) for n in cluster.nodes})
    pub_stop, con_stop = threading.Event(), threading.Event()
    anomalies = []
    state = {"failed": True, "cleaned": False}

    def cleanup():
        if state["cleaned"]:
            return
        state["cleaned"] = True
        pub_stop.set()
        con_stop.set()
        cluster.kill_all()
        proxy.stop()
        if state["failed"] or a.keep:
            print("kept: %s (node logs n1.log n2.log n3.log)" % workdir, file=sys.stderr)
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
        if a.out_json:
            with open(a.out_json, "w") as f:
                json.dump({"summary": {"seed": seed, "result": "INCOMPLETE", "exit": 2,
                                       "anomalies": anomalies + ["overall timeout"]}}, f)
        cleanup()
        os._exit(2)

    hard = threading.Timer(a.timeout + 30, overall_timeout)  # backstop; main keeps its deadline
    hard.daemon = True
    hard.start()

    log("seed %d, binary %s, base port %d, folder %s" % (seed, binary, base, workdir))
    proxy.start()
    chaos = Chaos(a, seed, cluster, proxy, [], [], anomalies)
    for n in cluster.nodes:
        chaos.spawn(n)
    lid, st = chaos.wait_healthy(60)
    if lid is None:
        chaos.diagnose("no healthy cluster 60 s after the start")
        return finish(a, seed, chaos, None, None, anomalies, state, aborted="start")
    log("leader: node %d, term %s" % (lid, st.get("term")))

    for _ in range(50):
        try:
            conn = pika.BlockingConnection(params(cluster.node(lid).amqp))
            ch = conn.channel()
            for q in QUEUES:
                ch.queue_declare(q, durable=True, arguments=QUEUE_ARGS[q])
            conn.close()
            break
        except ConnectionLost as e:
            log("declare: %r" % (e,))
            time.sleep(0.2)
            lid, _ = cluster.wait_leader(10)
            lid = lid or 1

    pubs = [Publisher(i, cluster, rng, pub_stop, a.rate) for i in range(2)]
    cons = [Consumer(i, QUEUES[i], cluster, rng, con_stop, a.hold, a.prefetch)
            for i in range(2)]
    chaos.pubs, chaos.cons = pubs, cons
    confirm_timeouts = []
    consumer_kicks = []
    watchdog_stop = threading.Event()

    def watchdog():
        while not watchdog_stop.is_set():
            for w in pubs:
                b = w.busy_since
                if b is not None and now() - b > a.confirm_timeout:
                    conn = w.conn
                    confirm_timeouts.append((round(now() - T0, 2), w.name,
                                             w.conns[-1]["node"] if w.conns else None))
                    w.busy_since = None
                    if conn is not None:
                        shut_socket(conn)
            for w in cons:
                b = w.busy_since
                if b is not None and now() - b > 10:
                    w.busy_since = None
                    if w.conn is not None:
                        shut_socket(w.conn)
                last_conf = max((p.last_confirm_q.get(w.queue, 0) for p in pubs), default=0)
                if (now() - w.progress > a.consumer_stall and last_conf > w.progress + 1
                        and not w.kick.is_set()):
                    consumer_kicks.append((round(now() - T0, 2), w.name,
                                           w.conns[-1]["node"] if w.conns else None))
                    log("watchdog: %s got nothing for %.0f s while its queue was confirmed "
                        "to; reconnecting" % (w.name, now() - w.progress))
                    w.kick.set()
                    w.progress = now()
                    if w.conn is not None:
                        shut_socket(w.conn)
            time.sleep(0.2)

    threading.Thread(target=watchdog, name="watchdog", daemon=True).start()
    for w in pubs + cons:
        w.start()
    time.sleep(1.0)

    aborted = None
    phase_start = now()
    try:
        chaos.run(a.duration, hard_deadline - 120)
    except Aborted as e:
        aborted = str(e)
    phase_end = now()
    dead = [w.name for w in pubs + cons if not w.is_alive()]
    if dead:
        anomalies.append("client threads died during the run: %s" % dead)
        aborted = aborted or "client thread died"
    log("nemesis done (%d faults in %.0f s)%s" % (len(chaos.faults), phase_end - phase_start,
                                                 ": " + aborted if aborted else ""))

    # Heal, everything up; stop the load; the consumers' held deliveries go back; drain.
    try:
        proxy.heal_all()
    except Exception as e:
        anomalies.append("heal at the end: %r" % (e,))
    for n in cluster.nodes:
        if n.paused and n.alive():
            n.proc.send_signal(signal.SIGCONT)
            n.paused = False
        if not n.alive() and not aborted:
            chaos.spawn(n)
    lid, st = chaos.wait_healthy(max(10, min(a.recover_timeout, hard_deadline - now() - 60)))
    if lid is None and not aborted:
        chaos.diagnose("after the nemesis: no healthy cluster")
        aborted = "no healthy cluster after the nemesis"
    time.sleep(0.5)
    pub_stop.set()
    for w in pubs:
        w.join(a.confirm_timeout + 10)
    time.sleep(1.0)
    con_stop.set()
    for w in cons:
        w.join(15)
    if any(w.is_alive() for w in pubs + cons):
        anomalies.append("a client thread did not stop: %s"
                         % [w.name for w in pubs + cons if w.is_alive()])
        aborted = aborted or "client thread hung"
    watchdog_stop.set()

    drained = {"deliveries": [], "acked": set()}
    drain_ok = True
    for q in QUEUES:
        def record(body, method, props, q=q):
            drained["deliveries"].append((now(), body.decode("utf-8", "replace"), q,
                                          bool(method.redelivered), "drain", props.message_id))

        def acked(body):
            drained["acked"].add(body.decode("utf-8", "replace"))

        ok = clusterlib.drain(cluster, q, record, anomalies, max(20, hard_deadline - now() - 20),
                              STACK_TIMEOUT, acked)
        drain_ok &= ok
        log("drained %s: %s" % (q, "empty" if ok else "NOT complete"))
    # Every node agrees the queues are empty (once all have applied the same index).
    per_node, divergence = {}, None
    t_end = now() + 15
    while now() < t_end:
        per_node = {}
        for n in cluster.nodes:
            st = n.status() if n.alive() and not n.paused else None
            row = {"applied": st.get("applied_index") if st else None,
                   "role": st.get("role") if st else None}
            for q in QUEUES:
                info = n.get("/api/queues/%2f/" + q, local=True)
                row[q] = info.get("messages") if info else None
            per_node[n.id] = row
        if all(r[q] == 0 for r in per_node.values() for q in QUEUES):
            break
        time.sleep(0.25)
    if not all(r[q] == 0 for r in per_node.values() for q in QUEUES):
        groups = collections.defaultdict(list)
        for nid, r in per_node.items():
            if r["applied"] is not None:
                groups[r["applied"]].append(tuple(r[q] for q in QUEUES))
        if any(len(set(g)) > 1 for g in groups.values()):
            # Same log applied, different content: the replicas diverged.
            divergence = per_node
            anomalies.append("REPLICAS DIVERGE: nodes at the same applied index hold different "
                             "messages: %s" % per_node)
        else:
            anomalies.append("after the drain, messages per node: %s" % per_node)
            drain_ok = False
    resurrected = None
    if a.final_failover and not aborted and drain_ok:
        resurrected = final_failover(chaos, anomalies, hard_deadline)
    return finish(a, seed, chaos, pubs, cons, anomalies, state, aborted=aborted,
                  drained=drained, drain_ok=drain_ok, phase_end=phase_end,
                  resurrected=resurrected,
                  confirm_timeouts=confirm_timeouts, consumer_kicks=consumer_kicks,
                  per_node=per_node, divergence=divergence)


def final_failover(chaos, anomalies, hard_deadline):
    """After the drain: once every node has applied the same index for 1 s (the drain's acks
    are committed everywhere), SIGKILL the leader and drain again through the new one. Whatever
    it delivers was acked and committed before: resurrected. None if the check could not run."""
    cluster = chaos.cluster
    t_end = min(now() + 20, hard_deadline - 30)
    same_since, last = None, None
    while now() < t_end:
        sts = {n.id: n.status() for n in cluster.nodes}
        idx = {k: v.get("applied_index") if v else None for k, v in sts.items()}
        if None not in idx.values() and len(set(idx.values())) == 1:
            if idx != last:
                same_since, last = now(), idx
            elif now() - same_since >= 1.0:
                break
        else:
            same_since, last = None, None
        time.sleep(0.1)
    else:
        anomalies.append("final failover: the nodes did not settle at one applied index: %s"
                         % last)
        return None
    lid, _ = cluster.leader()
    if lid is None:
        anomalies.append("final failover: no leader")
        return None
    victim = cluster.node(lid)
    log("final failover: SIGKILL of leader node %d (all at applied index %s), then a drain "
        "through the new leader" % (lid, list(last.values())[0]))
    chaos.kill(victim)
    got = []
    for q in QUEUES:
        def record(body, method, props, q=q):
            got.append({"t": round(now() - T0, 3), "key": body.decode("utf-8", "replace"),
                        "queue": q, "redelivered": bool(method.redelivered)})

        ok = clusterlib.drain(cluster, q, record, anomalies,
                              max(10, min(40, hard_deadline - now() - 20)), STACK_TIMEOUT)
        if not ok:
            anomalies.append("final failover: the drain of %s did not finish" % q)
    lid2, _ = cluster.leader()
    log("final failover: node %s leads; %d deliveries after the drain (must be 0)"
        % (lid2, len(got)))
    if got:
        anomalies.append("RESURRECTED after the final failover (node %d -> %s): %s"
                         % (lid, lid2, got[:20]))
    return {"killed": lid, "new_leader": lid2, "deliveries": got}


def rel_conns(conns):
    out = []
    for c in conns:
        c = dict(c)
        for k in ("attempt", "open", "first_confirm", "closed"):
            if c.get(k) is not None:
                c[k] = round(c[k] - T0, 4)
        out.append(c)
    return out


def scan_logs(cluster):
    """What the node logs say that the history cannot: Warren's own ERROR lines, panics, and a
    leader serving again within 150 ms of stepping down for an expired lease (in the same
    process: a figure of openraft's metrics read stale)."""
    import datetime
    out = {"warren_errors": [], "panics": [], "served_again_after_lease_expiry": []}
    for n in cluster.nodes:
        last_expiry = None
        try:
            f = open(n.logpath, errors="replace")
        except OSError:
            continue
        with f:
            for line in f:
                if line.startswith("===="):
                    last_expiry = None
                    continue
                if "panicked" in line:
                    out["panics"].append("node %d: %s" % (n.id, line.strip()[:300]))
                if " ERROR warren" in line:
                    out["warren_errors"].append("node %d: %s" % (n.id, line.strip()[:300]))
                if "its lease expired" in line or "leading: serving clients" in line:
                    try:
                        ts = datetime.datetime.strptime(line[:26], "%Y-%m-%dT%H:%M:%S.%f")
                    except ValueError:
                        continue
                    if "its lease expired" in line:
                        last_expiry = (ts, line.strip())
                    elif last_expiry and (ts - last_expiry[0]).total_seconds() < 0.15:
                        out["served_again_after_lease_expiry"].append(
                            "node %d: %s  ->  %s" % (n.id, last_expiry[1][:120],
                                                     line.strip()[:160]))
                        last_expiry = None
    return out


def finish(a, seed, chaos, pubs, cons, anomalies, state, aborted=None, drained=None,
           drain_ok=False, phase_end=None, confirm_timeouts=(), consumer_kicks=(),
           per_node=None, divergence=None, resurrected=None):
    pubs, cons = pubs or [], cons or []
    finalize_faults(chaos.faults, pubs, phase_end or now())
    c = check(pubs, cons, drained or {"deliveries": [], "acked": set()})
    c["replicas_diverge"] = divergence is not None
    c["resurrected"] = len(resurrected["deliveries"]) if resurrected else 0
    c["final_failover"] = resurrected
    if resurrected and pubs:
        # What the history says of each resurrected copy: its earlier deliveries and acks.
        acked = set().union(*(x.acked for x in cons), drained["acked"] if drained else set())
        for r in resurrected["deliveries"]:
            r["acked_before"] = r["key"] in acked
            r["earlier_deliveries"] = sum(1 for x in cons for d in x.deliveries
                                          if d[1] == r["key"]) + sum(
                1 for d in (drained or {"deliveries": []})["deliveries"] if d[1] == r["key"])
            r["confirmed"] = any(r["key"] == k for p in pubs for _, k, _ in p.confirms)
    bad = bool(c["lost"] or c["lost_copies"] or c["lost_unacked"] or c["unexpected"]
               or c["violations"] or chaos.crashes or divergence or c["resurrected"])
    incomplete = bool(aborted) or not drain_ok
    rc = 1 if bad else 2 if incomplete else 0
    summary = {
        "seed": seed, "result": {0: "PASS", 1: "FAIL", 2: "INCOMPLETE"}[rc], "exit": rc,
        "aborted": aborted, "duration_s": a.duration, "faults": len(chaos.faults),
        "faults_by_kind": dict(collections.Counter(r["kind"] for r in chaos.faults)),
        "failover_by_kind": summarize_failover(chaos.faults),
        "check": c, "crashes": len(chaos.crashes), "crash_records": chaos.crashes,
        "spurious_elections": chaos.spurious,
        "confirm_timeouts": list(confirm_timeouts), "consumer_kicks": list(consumer_kicks),
        "publisher_connections": sum(len(p.conns) for p in pubs),
        "consumer_connections": sum(len(x.conns) for x in cons),
        "client_surprises": [x for w in pubs + cons for x in w.surprises][:50],
        "publisher_errors": dict(sum((p.errors for p in pubs), collections.Counter())),
        "consumer_errors": dict(sum((x.errors for x in cons), collections.Counter())),
        "proxy": chaos.proxy.counters() if chaos.proxy.loop else {},
        "ctl": chaos.ctl_log, "queue_messages_after_drain": per_node,
        "drain_complete": drain_ok, "anomalies": anomalies, "elapsed_s": round(now() - T0, 1),
        "logs": scan_logs(chaos.cluster),
    }
    report(summary, chaos.faults)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump({"summary": summary, "faults": chaos.faults,
                       "publisher_connections": {p.name: rel_conns(p.conns) for p in pubs},
                       "consumer_connections": {x.name: rel_conns(x.conns) for x in cons}},
                      f, indent=1, default=str)
    if a.history:
        with open(a.history, "w") as f:
            json.dump({
                "publishers": [{"name": p.name, "attempts": p.attempts,
                                "confirms": [[round(t - T0, 4), k, n] for t, k, n in p.confirms],
                                "connections": p.conns} for p in pubs],
                "consumers": [{"name": x.name, "queue": x.queue,
                               "deliveries": [[round(t - T0, 4), k, r, n]
                                              for t, k, r, n, _ in x.deliveries]}
                              for x in cons],
                "drain": [[round(d[0] - T0, 4), d[1], d[2], d[3]]
                          for d in (drained or {"deliveries": []})["deliveries"]],
            }, f, default=str)
    state["failed"] = rc != 0
    return rc


# ---------------------------------------------------------------------------------------------
# Several runs


def strip_args(argv, names):
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in names:
            skip = True
            continue
        if any(x.startswith(n + "=") for n in names):
            continue
        out.append(x)
    return out


def many_runs(a):
    seed0 = a.seed if a.seed is not None else random.randrange(1 << 20)
    rdir = a.runs_dir or tempfile.mkdtemp(prefix="warren-chaos-runs-")
    os.makedirs(rdir, exist_ok=True)
    fwd = strip_args(sys.argv[1:], ("--runs", "--seed", "--out-json", "--runs-dir",
                                    "--history"))
    results = []
    current = {}

    def on_signal(signum, frame):
        p = current.get("p")
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # the run cleans up (kills its nodes)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        print("signal %d: stopped after %d runs (outputs in %s)" % (signum, len(results), rdir),
              file=sys.stderr)
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    log("%d runs from seed %d, outputs in %s" % (a.runs, seed0, rdir))
    for i in range(a.runs):
        s = seed0 + i
        js, lg = os.path.join(rdir, "seed-%d.json" % s), os.path.join(rdir, "seed-%d.log" % s)
        cmd = [sys.executable, os.path.abspath(__file__)] + fwd + ["--seed", str(s),
                                                                   "--out-json", js]
        if a.history:
            cmd += ["--history", os.path.join(rdir, "seed-%d.history.json" % s)]
        t = now()
        with open(lg, "w") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            current["p"] = p
            try:
                rc = p.wait(timeout=a.timeout + 90)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 2
        try:
            with open(js) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"summary": {"seed": s, "result": "INCOMPLETE", "exit": rc}, "faults": []}
        res["rc"] = rc
        results.append(res)
        sm = res["summary"]
        c = sm.get("check", {})
        log("run %d/%d seed %d: %s (rc %d) in %.0f s, %s faults, confirmed %s, lost %s, "
            "unexpected %s, violations %s, duplicate ids %s%s"
            % (i + 1, a.runs, s, sm.get("result"), rc, now() - t, sm.get("faults"),
               c.get("confirmed_ids"), c.get("lost"), c.get("unexpected"), c.get("violations"),
               c.get("duplicate_ids"), "" if rc == 0 else "  -> " + lg))
    agg = aggregate(results)
    print()
    print("%d runs (seeds %d..%d, --duration %s): " % (len(results), seed0, seed0 + a.runs - 1,
                                                       a.duration), end="")
    print_aggregate(agg)
    print("outputs: %s" % rdir)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump({"aggregate": agg, "runs": [r["summary"] for r in results]}, f,
                      indent=1, default=str)
    return 0 if agg["passed"] == len(results) else 1


def print_aggregate(agg):
    print("%d passed, %d failed, %d incomplete" % (agg["passed"], agg["failed"],
                                                   agg["incomplete"]))
    print("faults %d; confirmed ids %d; lost %d; lost copies %d; delivered-never-acked %d; "
          "unexpected %d; violations %d; duplicate ids %d (%d extra deliveries); crashes %d; "
          "spurious elections %d; runs whose replicas diverged %d; resurrected %d"
          % (agg["faults"], agg["confirmed_ids"], agg["lost"], agg["lost_copies"],
             agg["lost_unacked"], agg["unexpected"], agg["violations"], agg["duplicate_ids"],
             agg["duplicate_deliveries"], agg["crashes"], agg["spurious_elections"],
             agg["replicas_diverge"], agg["resurrected"]))
    print()
    print("Milliseconds from the fault to: a node serving in a later term (serving), the first "
          "confirm on any connection (first confirm), the first confirm on a publisher "
          "connection opened after the fault (failover: what a client that had to reconnect "
          "sees, its own timeouts included); median / p90 / max.")
    print()
    print("| fault | count | serving | first confirm | failover | max gap median / max | "
          "recovered median / max |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def three(v, k):
        if v[k + "_median"] is None:
            return "-"
        return "%s / %s / %s" % (v[k + "_median"], v[k + "_p90"], v[k + "_max"])
    for k, v in agg["by_kind"].items():
        print("| %s | %d | %s | %s | %s | %s / %s | %s / %s |" % (
            k, v["count"], three(v, "serving"), three(v, "first_confirm"),
            three(v, "failover"), v["gap_median"], v["gap_max"], v["recovered_median"],
            v["recovered_max"]))
    if agg["bad_seeds"]:
        print("\nnot passed: %s" % agg["bad_seeds"])


def aggregate_files(paths):
    """--aggregate: the aggregate of runs already made (their --out-json files, or folders of
    seed-*.json as --runs leaves them)."""
    import glob
    results = []
    for p in paths:
        files = sorted(glob.glob(os.path.join(p, "seed-*.json"))) if os.path.isdir(p) else [p]
        for fn in files:
            if fn.endswith(".history.json"):
                continue
            with open(fn) as f:
                res = json.load(f)
            if "summary" not in res:
                # A --runs aggregate keeps no fault records: its runs' own files are needed.
                print("%s: not the output of one run (skipped)" % fn, file=sys.stderr)
                continue
            res["rc"] = res["summary"].get("exit", 1)
            results.append(res)
    print("%d runs (seeds %s): " % (len(results), sorted(
        (r["summary"].get("seed") for r in results), key=str)), end="")
    print_aggregate(aggregate(results))
    return 0


def aggregate(results):
    def ms(v):
        return None if not v else round(statistics.median(v))

    agg = collections.Counter()
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    bad = []
    for r in results:
        sm = r["summary"]
        rc = sm.get("exit", r["rc"])
        agg[{0: "passed", 1: "failed"}.get(rc, "incomplete")] += 1
        if rc != 0:
            bad.append((sm.get("seed"), sm.get("result"), sm.get("aborted")))
        c = sm.get("check", {})
        for k in ("confirmed_ids", "lost", "lost_copies", "lost_unacked", "unexpected",
                  "violations", "duplicate_ids", "duplicate_deliveries"):
            agg[k] += c.get(k, 0) or 0
        agg["crashes"] += sm.get("crashes", 0) or 0
        agg["replicas_diverge"] += 1 if c.get("replicas_diverge") else 0
        agg["resurrected"] += c.get("resurrected", 0) or 0
        agg["spurious_elections"] += len(sm.get("spurious_elections", []) or [])
        agg["faults"] += len(r.get("faults", []))
        for f in r.get("faults", []):
            for kind in (f["kind"], "(leader faults)") if f["kind"] in LEADER_KINDS else (
                    f["kind"],):
                d = by[kind]
                d["count"].append(1)
                for key in ("serving_ms", "first_confirm_ms", "failover_ms", "max_gap_ms",
                            "recovered_ms"):
                    if f.get(key) is not None:
                        d[key].append(f[key])
    out = dict(agg)
    for k in ("passed", "failed", "incomplete"):
        out.setdefault(k, 0)
    out["bad_seeds"] = bad
    out["by_kind"] = {}
    for k, d in sorted(by.items()):
        out["by_kind"][k] = {"count": len(d["count"])}
        for key in ("serving", "first_confirm", "failover"):
            v = d[key + "_ms"]
            out["by_kind"][k].update({
                key + "_n": len(v), key + "_median": ms(v),
                key + "_p90": pct(v, 90) if v else None, key + "_max": max(v) if v else None})
        out["by_kind"][k].update({
            "gap_median": ms(d["max_gap_ms"]),
            "gap_max": max(d["max_gap_ms"]) if d["max_gap_ms"] else None,
            "recovered_median": ms(d["recovered_ms"]),
            "recovered_max": max(d["recovered_ms"]) if d["recovered_ms"] else None})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.environ.get("WARREN_BINARY", DEFAULT_BINARY))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--duration", type=float, default=120, help="nemesis phase, seconds")
    ap.add_argument("--timeout", type=float, default=None,
                    help="overall limit of a run, seconds (default: duration + 300)")
    ap.add_argument("--base-port", type=int, default=None,
                    help="Raft base+1..3, AMQP base+11..13, HTTP base+21..23, proxies "
                         "base+31..33 (default: a free block)")
    ap.add_argument("--out-json")
    ap.add_argument("--history", help="write the whole history (confirms, deliveries) here "
                    "(with --runs: any value; each run's goes in --runs-dir)")
    ap.add_argument("--faults", help="comma-separated kinds to draw from (default: all): "
                    + ",".join(k for k, _ in KINDS))
    ap.add_argument("--min-gap", type=float, default=1.0, help="seconds between faults, least")
    ap.add_argument("--max-gap", type=float, default=3.0)
    ap.add_argument("--commit-stall", type=float, default=5,
                    help="healthy needs a confirm within this many seconds while publishers "
                    "run (0: no such check)")
    ap.add_argument("--recover-timeout", type=float, default=60,
                    help="a fault's end -> healthy cluster, at most (else the run is aborted)")
    ap.add_argument("--rate", type=float, default=150, help="messages/s per publisher (0: "
                    "as fast as confirms come)")
    ap.add_argument("--confirm-timeout", type=float, default=2.0,
                    help="a publish not confirmed within this shuts the connection")
    ap.add_argument("--consumer-stall", type=float, default=15.0,
                    help="a consumer with no delivery this long while its queue gets confirms "
                         "reconnects (reported)")
    ap.add_argument("--delays", default="5,10,20,50",
                    help="one-way ms a delay fault draws from (RTT > ~50 ms: see the README)")
    ap.add_argument("--bg-delays", default="2,5,10",
                    help="one-way ms a background delay (20%% of the other faults) draws from")
    ap.add_argument("--hold", type=int, default=10, help="deliveries each consumer keeps unacked")
    ap.add_argument("--prefetch", type=int, default=50)
    ap.add_argument("--snapshot-every", type=int, default=3000,
                    help="--raft-snapshot-every of the nodes (0: the nodes' default)")
    ap.add_argument("--no-final-failover", dest="final_failover", action="store_false",
                    help="skip the last check (SIGKILL the leader after the drain, drain again)")
    ap.add_argument("--log-filter", default="info", help="WARREN_LOG of the nodes")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--runs", type=int, default=None, help="N seeded runs in sequence")
    ap.add_argument("--runs-dir", help="with --runs: where each run's log and JSON go")
    ap.add_argument("--aggregate", nargs="+", metavar="PATH",
                    help="print the aggregate of runs already made (--runs-dir folders, or "
                         "the --out-json files of single runs), then exit")
    ap.add_argument("--selftest", action="store_true",
                    help="test the Hello decoding and the proxy's faults, then exit")
    a = ap.parse_args()
    if a.timeout is None:
        a.timeout = a.duration + 300
    if a.selftest:
        proxy_selftest()
        return 0
    if a.aggregate:
        return aggregate_files(a.aggregate)
    if not os.access(a.binary, os.X_OK):
        print("no warren binary at %s: pass --binary (or set WARREN_BINARY)" % a.binary,
              file=sys.stderr)
        return 2
    if a.runs:
        return many_runs(a)
    return one_run(a)


if __name__ == "__main__":
    sys.exit(main())
