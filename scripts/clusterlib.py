"""What scripts/failover.py and scripts/chaos.py share: three `warren` nodes on loopback, their
/api/cluster status, reconnecting pika clients, the final drain, small helpers.

Ports from a base B: Raft B+1..3, AMQP B+11..13, HTTP B+21..23, and with `proxied` the
addresses the nodes know each other by (--peers) B+31..33, where a fault proxy listens in front
of each node's own Raft port.
"""
import collections
import json
import math
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pika
import pika.adapters.utils.connection_workflow as pika_workflow
import pika.exceptions

now = time.monotonic
T0 = now()


def log(msg):
    print("[%7.2f] %s" % (now() - T0, msg), flush=True)


# ---------------------------------------------------------------------------------------------
# Processes

AUTH = {"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="}  # guest:guest


class Node:
    def __init__(self, nid, raft, amqp, http, data, logpath, peer=None):
        self.id, self.raft, self.amqp, self.http = nid, raft, amqp, http
        # The port of this node's address in --peers (its identity in the membership): its own
        # Raft port, or the fault proxy's in front of it.
        self.peer = peer if peer is not None else raft
        self.data, self.logpath = data, logpath
        self.proc = None
        self.starts = 0
        self.paused = False  # SIGSTOPped by the harness

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout=0.5):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/api/cluster" % self.http,
                                        timeout=timeout) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def get(self, path, timeout=1.0, local=False):
        """GET path on this node's management API. A follower forwards it to the leader, as
        any client's, unless `local`: the request is then marked as forwarded already, and the
        node answers from its own state (what a check that the replicas agree must read)."""
        headers = dict(AUTH)
        if local:
            headers["x-warren-proxied-by"] = "9"
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (self.http, path), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except Exception:
            return None


def _pdeathsig():
    # The nodes die with this script even if it is SIGKILLed.
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Cluster:
    def __init__(self, binary, base_port, workdir, log_filter, label="failover.py",
                 proxied=False, extra_args=()):
        self.binary, self.dir, self.log_filter = binary, workdir, log_filter
        self.label, self.extra_args = label, list(extra_args)
        self.nodes = []
        for nid in (1, 2, 3):
            self.nodes.append(Node(nid, base_port + nid, base_port + 10 + nid,
                                   base_port + 20 + nid, os.path.join(workdir, "n%d" % nid),
                                   os.path.join(workdir, "n%d.log" % nid),
                                   peer=base_port + 30 + nid if proxied else None))
        self.peers = ",".join("%d=127.0.0.1:%d" % (n.id, n.peer) for n in self.nodes)

    def node(self, nid):
        return self.nodes[nid - 1]

    def args(self, n):
        return [self.binary, "server", "--node-id", str(n.id),
                "--raft-listen", "127.0.0.1:%d" % n.raft, "--peers", self.peers,
                "--amqp-listen", "127.0.0.1:%d" % n.amqp,
                "--management-listen", "127.0.0.1:%d" % n.http,
                "--data-dir", n.data] + self.extra_args

    def spawn(self, n):
        n.starts += 1
        n.paused = False
        with open(n.logpath, "a") as f:
            f.write("==== %s: start %d of node %d (t=%.3f) ====\n"
                    % (self.label, n.starts, n.id, now() - T0))
        out = open(n.logpath, "a")
        n.proc = subprocess.Popen(self.args(n), stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig,
                                  env=dict(os.environ, WARREN_LOG=self.log_filter))
        out.close()

    def start(self):
        for n in self.nodes:
            self.spawn(n)

    def sigkill(self, n):
        t = now()
        n.proc.send_signal(signal.SIGKILL)
        n.proc.wait()
        n.paused = False
        return t

    def kill_all(self):
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                try:
                    n.proc.kill()
                    n.proc.wait(timeout=5)
                except Exception:
                    pass

    def statuses(self, exclude=()):
        """Status of each live node the harness has not paused (None: no answer)."""
        return {n.id: n.status() for n in self.nodes
                if n.alive() and not n.paused and n.id not in exclude}

    def leader(self, exclude=()):
        """(leader id, its status) when exactly one live node serves and every live node that
        answers names it (and a majority answers); else (None, statuses). Nodes in `exclude`
        are not asked."""
        st = {k: v for k, v in self.statuses(exclude).items() if v is not None}
        serving = [k for k, v in st.items() if v.get("serving") is True]
        if len(serving) == 1 and len(st) * 2 > len(self.nodes):
            lid = serving[0]
            if all(v.get("leader_id") == lid for v in st.values()):
                return lid, st[lid]
        return None, st

    def wait_leader(self, within, exclude=()):
        deadline = now() + within
        st = None
        while now() < deadline:
            lid, st = self.leader(exclude)
            if lid is not None:
                return lid, st
            time.sleep(0.02)
        return None, st


# ---------------------------------------------------------------------------------------------
# AMQP clients

ConnectionLost = (pika.exceptions.AMQPError, pika_workflow.AMQPConnectorException, OSError,
                  ConnectionError, AssertionError, ValueError, TypeError, AttributeError,
                  KeyError)


def params(port, stack_timeout=8):
    return pika.ConnectionParameters(
        host="127.0.0.1", port=port, credentials=pika.PlainCredentials("guest", "guest"),
        heartbeat=10, socket_timeout=2, stack_timeout=stack_timeout,
        blocked_connection_timeout=10, connection_attempts=1, retry_delay=0)


def shut_socket(conn):
    """Break a connection from another thread (a blocked confirm wait then raises)."""
    try:
        conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)
    except Exception:
        pass


class Client(threading.Thread):
    """Common part: connect to the nodes in turn, remember every connection. A subclass
    defines setup(conn) -> channel."""

    stack_timeout = 8

    def __init__(self, name, cluster, rng, stop):
        super().__init__(name=name, daemon=True)
        self.cluster, self.stop = cluster, stop
        self.next_node = rng.randrange(3)
        self.lock = threading.Lock()
        self.conns = []  # dicts: no, node, attempt, open, first_confirm, closed, error
        self.conn = None
        self.busy_since = None  # set while blocked in a call with no timeout of its own
        self.errors = collections.Counter()

    def connect(self):
        while not self.stop.is_set():
            for _ in range(3):
                n = self.cluster.nodes[self.next_node]
                self.next_node = (self.next_node + 1) % 3
                info = {"no": len(self.conns) + 1, "node": n.id, "attempt": now(), "open": None,
                        "first_confirm": None, "closed": None, "error": None}
                try:
                    conn = pika.BlockingConnection(params(n.amqp, self.stack_timeout))
                    ch = self.setup(conn)
                except ConnectionLost as e:
                    self.errors["connect " + type(e).__name__] += 1
                    continue
                info["open"] = now()
                with self.lock:
                    self.conns.append(info)
                self.conn = conn
                return conn, ch, info
            time.sleep(0.05)
        return None, None, None

    def lost(self, info, e):
        info["closed"] = now()
        info["error"] = "%s: %s" % (type(e).__name__, str(e)[:200])
        self.errors[type(e).__name__] += 1
        self.conn = None

    def close(self):
        c = self.conn
        self.conn = None
        if c is not None:
            try:
                self.busy_since = now()
                c.close()
            except Exception:
                pass
            finally:
                self.busy_since = None


def drain(cluster, queue, record, anomalies, within=60, stack_timeout=8, acked=None):
    """Consume (and ack) everything left in `queue`, through the leader; record(body, method,
    props) is called for each delivery before its ack, acked(body) (if given) once the ack is
    sent. True once the queue is empty."""
    deadline = now() + within
    while now() < deadline:
        lid, _ = cluster.wait_leader(min(10, max(0.1, deadline - now())))
        if lid is None:
            anomalies.append("drain %s: no serving leader" % queue)
            return False
        try:
            conn = pika.BlockingConnection(params(cluster.node(lid).amqp, stack_timeout))
            ch = conn.channel()
            ch.basic_qos(prefetch_count=500)
            last = [now()]

            def on_message(ch, method, props, body):
                record(body, method, props)
                ch.basic_ack(method.delivery_tag)
                if acked is not None:
                    acked(body)
                last[0] = now()

            ch.basic_consume(queue, on_message, auto_ack=False)
            while now() < deadline:
                conn.process_data_events(time_limit=0.2)
                if now() - last[0] > 2.0:
                    ch2 = conn.channel()
                    q = ch2.queue_declare(queue, passive=True)
                    ch2.close()
                    if q.method.message_count == 0:
                        conn.close()
                        return True
            conn.close()
        except ConnectionLost as e:
            anomalies.append("drain %s: connection lost: %r" % (queue, e))
            time.sleep(0.5)
    anomalies.append("drain %s did not finish within %d s" % (queue, within))
    return False


# ---------------------------------------------------------------------------------------------

PORT_OFFSETS = (1, 2, 3, 11, 12, 13, 21, 22, 23)
PROXIED_PORT_OFFSETS = PORT_OFFSETS + (31, 32, 33)


def ephemeral_low():
    """The lowest port the kernel gives outgoing connections (their local ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_base(offsets=PORT_OFFSETS):
    # Below the ephemeral range: a port in it can be taken at any moment as the local port of
    # some outgoing connection (a client's, a node's), and a node restarted on it then fails
    # to bind (seen: a node killed by the nemesis could not come back for a minute).
    high = max(11000, ephemeral_low() - max(offsets) - 1)
    for _ in range(200):
        base = random.randrange(10000, high, 100)
        socks = []
        try:
            for off in offsets:
                s = socket.socket()
                s.bind(("127.0.0.1", base + off))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def pct(values, p):
    v = sorted(values)
    return v[max(0, math.ceil(p / 100 * len(v)) - 1)]


def tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(collections.deque(f, n))
    except OSError as e:
        return str(e)
