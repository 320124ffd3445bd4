"""Warren's definitions export imports into a real RabbitMQ 3.10 (issue 14, point 6).

A varied setup is made in Warren through its management API (a vhost, users with tags and
passwords, permissions, topic permissions, vhost and user limits, exchanges of every built-in
type, classic and quorum queues with arguments, queue and exchange bindings with arguments).
Warren's `GET /api/definitions` is POSTed as it is to a RabbitMQ node this module starts for
itself, and RabbitMQ's management API must then show every one of those objects with the same
fields. The users must log in to RabbitMQ over AMQP with the passwords they were given in
Warren: Warren's password hashes are RabbitMQ's (rabbit_password_hashing_sha256). A vhost's
export (`GET /api/definitions/{vhost}`) must import into another RabbitMQ vhost, and so must
an export holding a void argument value.

The RabbitMQ node is private to this module: a fresh folder, its own node name, cookie and
loopback ports, stopped (and killed if need be) at the end. The module is skipped where
`rabbitmq-server` is not installed (the Debian package is: /usr/lib/rabbitmq/bin). Against
RabbitMQ itself (AMQP_URL / MANAGEMENT_URL pointing to it) the same test shows RabbitMQ's own
export importing into RabbitMQ.
"""
import base64
import ctypes
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pika
import pytest

from helpers import PASSWORD, USER, WARREN, open_connection, unique

MANAGEMENT_URL = os.environ.get("MANAGEMENT_URL", "http://127.0.0.1:15672")

# The node starts in ~6 s and stops in ~6 s here, but may take longer on a busy machine; its
# start counts in the first test's time and its stop in the last's (pytest-timeout times
# fixtures too), so pytest.ini's 20 s limit is raised for this module.
pytestmark = pytest.mark.timeout(120)

# How long the node may take to answer its management API.
START_TIMEOUT = 60


def rabbitmq_scripts():
    """(rabbitmq-server, rabbitmqctl) to run, or None when RabbitMQ is not installed.

    Debian's /usr/sbin/rabbitmq-server is a wrapper that switches to the rabbitmq user with
    su (which resets HOME) and sends the output to /var/log/rabbitmq: the scripts it wraps,
    in /usr/lib/rabbitmq/bin, are run instead when they are there."""
    debian = "/usr/lib/rabbitmq/bin"
    server, ctl = os.path.join(debian, "rabbitmq-server"), os.path.join(debian, "rabbitmqctl")
    if os.access(server, os.X_OK) and os.access(ctl, os.X_OK):
        return server, ctl
    path = os.environ.get("PATH", "") + ":/usr/sbin:/usr/local/sbin"
    server = shutil.which("rabbitmq-server", path=path)
    ctl = shutil.which("rabbitmqctl", path=path)
    return (server, ctl) if server and ctl else None


def die_with_parent():
    """Run in the child before exec: on Linux, SIGTERM it when this process dies, however it
    dies (runuser passes SIGTERM on, and rabbitmq-server stops the node on SIGTERM), so even a
    killed test run leaves no node behind."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, method, path, user="guest", password="guest", body=None, timeout=30):
    """(status, parsed JSON body or raw text or None) of a management API request."""
    token = base64.b64encode(("%s:%s" % (user, password)).encode()).decode()
    headers = {"Authorization": "Basic " + token}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(base + path, method=method, headers=headers, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, (json.loads(raw) if raw else None)
    except ValueError:
        return status, raw.decode(errors="replace")


def warren(method, path, body=None):
    return call(MANAGEMENT_URL, method, path, USER, PASSWORD, body)


def q(s):
    return urllib.parse.quote(s, safe="")


class RabbitNode:
    """A RabbitMQ node of its own: folder, node name, Erlang cookie (made in its HOME, the
    folder) and loopback ports. `url`: its management API (guest/guest); `amqp_port`."""

    def __init__(self, scripts, account=None):
        self.server, self.ctl = scripts
        self.dir = tempfile.mkdtemp(prefix="warren-import-rabbitmq-")
        # Unique per run: a node left over by a killed run never clashes with this one.
        self.nodename = "warren-import-%d-%s@localhost" % (os.getpid(), uuid.uuid4().hex[:8])
        self.amqp_port, self.mgmt_port, self.dist_port = free_port(), free_port(), free_port()
        self.url = "http://127.0.0.1:%d" % self.mgmt_port
        self.proc = None
        # Root runs the node (and rabbitmqctl) as `account`, the rabbitmq user, in a folder
        # that user owns.
        self.run_as = []
        if account is not None:
            self.run_as = ["runuser", "-u", account.pw_name, "--"]
            os.chown(self.dir, account.pw_uid, account.pw_gid)
        self._write("rabbitmq.conf", "\n".join([
            "listeners.tcp.default = 127.0.0.1:%d" % self.amqp_port,
            "management.tcp.ip = 127.0.0.1",
            "management.tcp.port = %d" % self.mgmt_port,
            ""]))
        self._write("enabled_plugins", "[rabbitmq_management].\n")
        # Nothing from /etc/rabbitmq: this node's settings are all here.
        self._write("rabbitmq-env.conf", "")
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            # The node makes its Erlang cookie in HOME; rabbitmqctl reads it from there.
            "HOME": self.dir,
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONF_ENV_FILE": self._path("rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": self._path("rabbitmq"),  # rabbitmq.conf, named without .conf
            "RABBITMQ_ADVANCED_CONFIG_FILE": self._path("advanced.config"),  # none
            "RABBITMQ_ENABLED_PLUGINS_FILE": self._path("enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": self._path("mnesia"),
            "RABBITMQ_LOG_BASE": self._path("log"),
            "RABBITMQ_PID_FILE": self._path("rabbitmq.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CTL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def _path(self, name):
        return os.path.join(self.dir, name)

    def _write(self, name, text):
        with open(self._path(name), "w") as f:
            f.write(text)

    def start(self):
        """Start the node; return once its management API answers (RuntimeError, with its
        logs, if it does not within START_TIMEOUT)."""
        with open(self._path("stdout.log"), "wb") as out:
            # A session (and process group) of its own: stop() can kill all of it.
            self.proc = subprocess.Popen(self.run_as + [self.server], cwd=self.dir, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("rabbitmq-server exited with %s\n%s"
                                   % (self.proc.returncode, self.logs()))
            try:
                if call(self.url, "GET", "/api/overview", timeout=2)[0] == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise RuntimeError("RabbitMQ did not answer on %s within %d s\n%s"
                           % (self.url, START_TIMEOUT, self.logs()))

    def logs(self, lines=40):
        """The last lines of the node's output and log, for failure messages."""
        out = []
        for root, _, files in os.walk(self.dir):
            for name in files:
                if name.endswith(".log"):
                    with open(os.path.join(root, name), errors="replace") as f:
                        tail = f.read().splitlines()[-lines:]
                    out.append("--- %s\n%s" % (name, "\n".join(tail)))
        return "\n".join(out)

    def stop(self):
        """Stop the node (rabbitmqctl stop), kill what is left of it, remove its folder."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    subprocess.run(self.run_as + [self.ctl, "-n", self.nodename, "stop"],
                                   cwd=self.dir, env=self.env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   timeout=30)
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            # Whatever still runs in the node's process group (beam.smp, erl_child_setup,
            # runuser) goes now. epmd daemonised into a session of its own and stays up, as
            # it would after any Erlang node.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def rabbitmq():
    """A fresh RabbitMQ node (RabbitNode) for this module, stopped at its end."""
    scripts = rabbitmq_scripts()
    if scripts is None:
        pytest.skip("rabbitmq-server is not installed: no RabbitMQ to import Warren's export into")
    account = None
    if os.geteuid() == 0:  # RabbitMQ will not run as root
        try:
            account = pwd.getpwnam("rabbitmq")
        except KeyError:
            pytest.skip("running as root, and there is no rabbitmq user to run RabbitMQ as")
    node = RabbitNode(scripts, account)
    try:
        node.start()
        yield node
    finally:
        node.stop()


class Setup:
    """What the test makes in Warren (unique names), and checks again in RabbitMQ."""

    def __init__(self):
        self.vhost = unique("import-vhost")
        self.vhost_meta = {"description": "made in Warren", "tags": ["imported", "compat"]}
        self.manager, self.monitor = unique("import-manager"), unique("import-monitor")
        # user -> (password, tags)
        self.users = {self.manager: ("manager-pw-" + uuid.uuid4().hex[:8], ["management"]),
                      self.monitor: ("monitor-pw-" + uuid.uuid4().hex[:8], ["monitoring"])}
        # (user, vhost) -> (configure, write, read)
        self.permissions = {
            (self.manager, self.vhost): ("^import\\.", ".*", ".*"),
            (self.manager, "/"): ("", "^amq\\.topic$", ".*"),
            (self.monitor, self.vhost): ("", "", ".*"),
            (self.monitor, "/"): ("", "", "^import-"),
        }
        x = lambda kind: unique("import-x-" + kind)
        self.topic, self.direct, self.fanout = x("topic"), x("direct"), x("fanout")
        self.headers, self.ae, self.internal = x("headers"), x("ae"), x("internal")
        self.transient = x("transient")
        # (user, vhost, exchange) -> (write, read); {username} is RabbitMQ's variable.
        self.topic_permissions = {
            (self.manager, self.vhost, self.topic): ("^orders\\.{username}\\.", "^orders\\."),
            (self.manager, "/", "amq.topic"): ("^news\\.", ".*"),
        }
        self.vhost_limits = {"max-connections": 50, "max-queues": 200}
        self.user_limits = {self.manager: {"max-connections": 10, "max-channels": 20}}
        # exchange -> (type, durable, auto_delete, internal, arguments)
        self.exchanges = {
            self.topic: ("topic", True, False, False, {"alternate-exchange": self.ae}),
            self.direct: ("direct", True, False, False, {}),
            self.fanout: ("fanout", True, False, False, {}),
            self.headers: ("headers", True, False, False, {}),
            self.ae: ("fanout", True, False, False, {}),
            self.internal: ("topic", True, False, True, {}),
            self.transient: ("direct", False, True, False, {}),
        }
        queue = lambda kind: unique("import-q-" + kind)
        self.orders, self.dead, self.urgent = queue("orders"), queue("dead"), queue("urgent")
        self.quorum, self.unrouted = queue("quorum"), queue("unrouted")
        self.scratch = queue("scratch")
        # queue -> (durable, auto_delete, arguments)
        self.queues = {
            self.orders: (True, False, {"x-message-ttl": 60000, "x-max-length": 1000,
                                        "x-overflow": "reject-publish",
                                        "x-dead-letter-exchange": self.direct,
                                        "x-dead-letter-routing-key": "dead"}),
            self.dead: (True, False, {"x-max-length-bytes": 1048576, "x-overflow": "drop-head",
                                      "x-queue-mode": "lazy", "x-queue-version": 2}),
            self.urgent: (True, False, {"x-max-priority": 10, "x-expires": 3600000,
                                        "x-single-active-consumer": True}),
            self.quorum: (True, False, {"x-queue-type": "quorum", "x-delivery-limit": 5,
                                        "x-quorum-initial-group-size": 1,
                                        "x-dead-letter-exchange": self.direct,
                                        "x-dead-letter-routing-key": "dead"}),
            self.unrouted: (True, False, {}),
            # Transient queues are exported too (as RabbitMQ 3.10 exports them).
            self.scratch: (False, True, {"x-max-length": 3}),
        }
        # (source, destination, destination_type, routing_key, arguments)
        self.bindings = [
            (self.topic, self.orders, "queue", "orders.*.created", {}),
            (self.topic, self.quorum, "queue", "orders.#", {"note": "audit", "weight": 2}),
            (self.direct, self.dead, "queue", "dead", {}),
            (self.ae, self.unrouted, "queue", "", {}),
            (self.headers, self.urgent, "queue", "",
             {"x-match": "all", "priority": "high", "region": 7, "ratio": 0.5}),
            (self.headers, self.orders, "queue", "",
             {"x-match": "any", "kind": "order", "legacy": True, "codes": ["a", 1]}),
            ("amq.topic", self.orders, "queue", "orders.legacy", {}),
            (self.topic, self.fanout, "exchange", "orders.#", {}),
            (self.fanout, self.internal, "exchange", "", {"hop": "fanout-to-internal"}),
            (self.internal, self.scratch, "queue", "#", {}),
            (self.headers, self.transient, "exchange", "", {"x-match": "any", "copy": "yes"}),
            (self.transient, self.scratch, "queue", "scratch", {}),
        ]

    def make(self):
        """Make it all in Warren through its management API, checking every answer."""
        def ok(answer, *expected):
            assert answer[0] in expected, answer

        v = q(self.vhost)
        ok(warren("PUT", "/api/vhosts/" + v, self.vhost_meta), 201)
        for name, (password, tags) in self.users.items():
            ok(warren("PUT", "/api/users/" + q(name),
                      {"password": password, "tags": ",".join(tags)}), 201)
        for (user, vhost), (c, w, r) in self.permissions.items():
            ok(warren("PUT", "/api/permissions/%s/%s" % (q(vhost), q(user)),
                      {"configure": c, "write": w, "read": r}), 201)
        for (user, vhost, x), (w, r) in self.topic_permissions.items():
            ok(warren("PUT", "/api/topic-permissions/%s/%s" % (q(vhost), q(user)),
                      {"exchange": x, "write": w, "read": r}), 201, 204)
        for limit, value in self.vhost_limits.items():
            ok(warren("PUT", "/api/vhost-limits/%s/%s" % (v, limit), {"value": value}), 204)
        for user, limits in self.user_limits.items():
            for limit, value in limits.items():
                ok(warren("PUT", "/api/user-limits/%s/%s" % (q(user), limit),
                          {"value": value}), 204)
        for name, (kind, durable, auto_delete, internal, args) in self.exchanges.items():
            ok(warren("PUT", "/api/exchanges/%s/%s" % (v, q(name)),
                      {"type": kind, "durable": durable, "auto_delete": auto_delete,
                       "internal": internal, "arguments": args}), 201)
        for name, (durable, auto_delete, args) in self.queues.items():
            ok(warren("PUT", "/api/queues/%s/%s" % (v, q(name)),
                      {"durable": durable, "auto_delete": auto_delete, "arguments": args}), 201)
        for source, dest, dest_type, key, args in self.bindings:
            path = "/api/bindings/%s/e/%s/%s/%s" % (v, q(source), dest_type[0], q(dest))
            ok(warren("POST", path, {"routing_key": key, "arguments": args}), 201)

    def remove(self):
        """Remove it from Warren (the vhost takes its exchanges, queues and bindings)."""
        warren("DELETE", "/api/vhosts/" + q(self.vhost))
        for name in self.users:
            warren("DELETE", "/api/users/" + q(name))


@pytest.fixture(scope="module")
def imported(rabbitmq):
    """The setup made in Warren, and Warren's whole export POSTed to the RabbitMQ node.

    Yields (setup, Warren's export, RabbitMQ's (status, body) for the import)."""
    setup = Setup()
    try:
        setup.make()
        status, doc = warren("GET", "/api/definitions")
        assert status == 200, doc
        answer = call(rabbitmq.url, "POST", "/api/definitions", body=doc, timeout=60)
        yield setup, doc, answer
    finally:
        setup.remove()


def rabbit(node, path):
    """GET `path` from the RabbitMQ node's API (as guest): the body of its 200 answer."""
    status, body = call(node.url, "GET", path)
    assert status == 200, (path, status, body)
    return body


def import_errors(node):
    """What RabbitMQ's log says went wrong in a definitions import (nothing: [])."""
    found = []
    for root, _, files in os.walk(os.path.join(node.dir, "log")):
        for name in files:
            with open(os.path.join(root, name), errors="replace") as f:
                found += [line for line in f
                          if "[error]" in line or ("mport" in line and "[warning]" in line)]
    return found


def canonical(items):
    """A list of JSON objects in an order that does not depend on the broker."""
    return sorted(items, key=lambda x: json.dumps(x, sort_keys=True))


def test_rabbitmq_accepts_warrens_export(imported, rabbitmq):
    setup, doc, (status, body) = imported
    # The document holds every object made (so nothing below passes for want of an entry).
    assert setup.vhost in [v["name"] for v in doc["vhosts"]]
    assert set(setup.users) <= {u["name"] for u in doc["users"]}
    assert set(setup.queues) <= {x["name"] for x in doc["queues"] if x["vhost"] == setup.vhost}
    assert set(setup.exchanges) <= {x["name"] for x in doc["exchanges"]
                                    if x["vhost"] == setup.vhost}
    assert 200 <= status < 300, "RabbitMQ refused Warren's export: %s %s\n%s" % (
        status, body, rabbitmq.logs())
    assert import_errors(rabbitmq) == []


def test_the_vhost_keeps_its_limits(imported, rabbitmq):
    setup = imported[0]
    # Vhost limits travel as "vhost-limits" runtime parameters.
    limits = rabbit(rabbitmq, "/api/vhost-limits/" + q(setup.vhost))
    assert limits == [{"vhost": setup.vhost, "value": setup.vhost_limits}]


@pytest.mark.skipif(not WARREN, reason="RabbitMQ 3.10.8 exports neither a vhost's description "
                    "nor its tags (compat/fixtures/README.md)")
def test_the_vhost_keeps_its_description_and_tags(imported, rabbitmq):
    # Warren exports them in the vhost's "metadata", which RabbitMQ 3.10.8 reads on import.
    setup = imported[0]
    vhost = rabbit(rabbitmq, "/api/vhosts/" + q(setup.vhost))
    assert vhost["description"] == setup.vhost_meta["description"]
    assert vhost["tags"] == setup.vhost_meta["tags"]


def test_users_keep_their_tags_password_hashes_and_limits(imported, rabbitmq):
    setup, doc = imported[0], imported[1]
    exported = {u["name"]: u for u in doc["users"]}
    for name, (_, tags) in setup.users.items():
        user = rabbit(rabbitmq, "/api/users/" + q(name))
        assert user["tags"] == tags
        assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        # Stored as Warren hashed it: salt and all.
        assert user["password_hash"] == exported[name]["password_hash"]
        assert user["limits"] == setup.user_limits.get(name, {})


def test_permissions_are_the_same(imported, rabbitmq):
    setup = imported[0]
    for (user, vhost), (c, w, r) in setup.permissions.items():
        got = rabbit(rabbitmq, "/api/permissions/%s/%s" % (q(vhost), q(user)))
        assert got == {"user": user, "vhost": vhost, "configure": c, "write": w, "read": r}
    # Nothing more: the users have permissions on these vhosts only.
    for user in setup.users:
        listed = rabbit(rabbitmq, "/api/users/%s/permissions" % q(user))
        assert sorted(p["vhost"] for p in listed) == sorted(
            v for (u, v) in setup.permissions if u == user)


def test_topic_permissions_are_the_same(imported, rabbitmq):
    setup = imported[0]
    listed = rabbit(rabbitmq, "/api/users/%s/topic-permissions" % q(setup.manager))
    want = [{"user": u, "vhost": v, "exchange": x, "write": w, "read": r}
            for (u, v, x), (w, r) in setup.topic_permissions.items()]
    assert canonical(listed) == canonical(want)
    assert rabbit(rabbitmq, "/api/users/%s/topic-permissions" % q(setup.monitor)) == []


def test_exchanges_keep_their_type_flags_and_arguments(imported, rabbitmq):
    setup = imported[0]
    for name, (kind, durable, auto_delete, internal, args) in setup.exchanges.items():
        x = rabbit(rabbitmq, "/api/exchanges/%s/%s" % (q(setup.vhost), q(name)))
        assert (x["type"], x["durable"], x["auto_delete"], x["internal"], x["arguments"]) == (
            kind, durable, auto_delete, internal, args), name


def test_queues_keep_their_type_flags_and_arguments(imported, rabbitmq):
    setup = imported[0]
    for name, (durable, auto_delete, args) in setup.queues.items():
        queue = rabbit(rabbitmq, "/api/queues/%s/%s" % (q(setup.vhost), q(name)))
        assert (queue["durable"], queue["auto_delete"], queue["exclusive"], queue["arguments"]) \
            == (durable, auto_delete, False, args), name
        assert queue["type"] == args.get("x-queue-type", "classic"), name


def test_bindings_keep_their_keys_and_arguments(imported, rabbitmq):
    setup = imported[0]
    listed = rabbit(rabbitmq, "/api/bindings/" + q(setup.vhost))
    got = [{"source": b["source"], "destination": b["destination"],
            "destination_type": b["destination_type"], "routing_key": b["routing_key"],
            "arguments": b["arguments"]}
           for b in listed if b["source"] != ""]  # not the default exchange's own
    want = [{"source": s, "destination": d, "destination_type": t, "routing_key": k,
             "arguments": a} for s, d, t, k, a in setup.bindings]
    assert canonical(got) == canonical(want)


def rabbit_amqp(node, user, password, vhost):
    """An AMQP connection to the RabbitMQ node."""
    return pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=node.amqp_port, virtual_host=vhost,
        credentials=pika.PlainCredentials(user, password), connection_attempts=1,
        socket_timeout=5, stack_timeout=10, blocked_connection_timeout=10))


def test_users_log_in_to_rabbitmq_with_the_passwords_set_in_warren(imported, rabbitmq):
    """Warren exports RabbitMQ's own password hashes (rabbit_password_hashing_sha256): the
    passwords given in Warren open RabbitMQ, over AMQP and over HTTP; others do not."""
    setup = imported[0]
    for name, (password, tags) in setup.users.items():
        for vhost in ("/", setup.vhost):
            rabbit_amqp(rabbitmq, name, password, vhost).close()
        with pytest.raises(pika.exceptions.ProbableAuthenticationError) as refused:
            rabbit_amqp(rabbitmq, name, password + "-wrong", setup.vhost)
        assert "ACCESS_REFUSED" in str(refused.value)
        status, me = call(rabbitmq.url, "GET", "/api/whoami", name, password)
        assert status == 200 and me["name"] == name and me["tags"] == tags
        assert call(rabbitmq.url, "GET", "/api/whoami", name, "wrong-" + password)[0] == 401


def test_the_imported_permissions_hold_in_rabbitmq(imported, rabbitmq):
    """The imported permissions, topic permissions and bindings work in RabbitMQ as they did
    in Warren: the manager may publish orders under their own name only, and may not
    configure names outside ^import\\."""
    setup = imported[0]
    password = setup.users[setup.manager][0]
    conn = rabbit_amqp(rabbitmq, setup.manager, password, setup.vhost)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish(setup.topic, "orders.%s.created" % setup.manager, b"order 1")
        deadline = time.monotonic() + 5
        body = None
        while body is None and time.monotonic() < deadline:
            body = ch.basic_get(setup.orders, auto_ack=True)[2]
        assert body == b"order 1"
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.basic_publish(setup.topic, "orders.someone-else.created", b"order 2")
        assert e.value.reply_code == 403 and "access to topic" in e.value.reply_text
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_declare(unique("not-import"))
        assert e.value.reply_code == 403
    finally:
        if conn.is_open:
            conn.close()


def test_a_vhosts_export_imports_into_a_rabbitmq_vhost(imported, rabbitmq):
    """GET /api/definitions/{vhost} from Warren, POSTed to /api/definitions/{other} in
    RabbitMQ: the same queues, exchanges, bindings and limits there."""
    setup = imported[0]
    status, doc = warren("GET", "/api/definitions/" + q(setup.vhost))
    assert status == 200, doc
    copy = unique("import-copy")
    assert call(rabbitmq.url, "PUT", "/api/vhosts/" + q(copy), body={})[0] == 201
    status, body = call(rabbitmq.url, "POST", "/api/definitions/" + q(copy), body=doc)
    assert 200 <= status < 300, "RabbitMQ refused Warren's vhost export: %s %s" % (status, body)
    back = rabbit(rabbitmq, "/api/definitions/" + q(copy))
    for key in ("queues", "exchanges", "bindings"):
        assert canonical(back[key]) == canonical(doc[key]), key
    # The vhost's limits come along (RabbitMQ applies them to the vhost imported into).
    assert rabbit(rabbitmq, "/api/vhost-limits/" + q(copy)) == [
        {"vhost": copy, "value": setup.vhost_limits}]


def test_a_void_argument_value_imports(rabbitmq):
    """A client may put a void value in an argument table (pika sends None as field type
    'V'). RabbitMQ 3.10.8 takes it, and its own export writes it as the string "undefined",
    which imports. Warren's export of it must import too.

    SURPRISE (for Warren): RabbitMQ's import refuses a JSON null anywhere in an argument
    table, the whole document with it: 400 {"error": "bad_request", "reason":
    "null_not_allowed"}, after importing what came before it."""
    vhost, x, queue = unique("import-void"), unique("import-x-void"), unique("import-q-void")
    assert warren("PUT", "/api/vhosts/" + q(vhost), {})[0] == 201
    try:
        conn = open_connection(virtual_host=vhost)
        try:
            ch = conn.channel()
            ch.exchange_declare(x, exchange_type="headers", durable=True)
            ch.queue_declare(queue, durable=True)
            ch.queue_bind(queue, x, arguments={"x-match": "any", "kind": "order", "flag": None})
        finally:
            conn.close()
        status, doc = warren("GET", "/api/definitions/" + q(vhost))
        assert status == 200, doc
        assert call(rabbitmq.url, "PUT", "/api/vhosts/" + q(vhost), body={})[0] == 201
        status, body = call(rabbitmq.url, "POST", "/api/definitions/" + q(vhost), body=doc)
        assert 200 <= status < 300, (
            "RabbitMQ refused Warren's export of a binding with a void argument: %s %s; "
            "Warren exported %s" % (status, body, doc["bindings"]))
        bindings = rabbit(rabbitmq, "/api/bindings/%s/e/%s/q/%s" % (q(vhost), q(x), q(queue)))
        assert [b["arguments"]["kind"] for b in bindings] == ["order"]
    finally:
        warren("DELETE", "/api/vhosts/" + q(vhost))
