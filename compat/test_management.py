"""The management HTTP API (RabbitMQ's rabbitmq_management on port 15672): the endpoints tools
and client test suites use to look at the broker and to close connections.

MANAGEMENT_URL names the API (default http://127.0.0.1:15672); the same tests pass against
RabbitMQ 3.10 with the management plugin enabled.
"""
import base64
import hashlib
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import pika
import pytest

from helpers import PASSWORD, USER, WARREN, make_params, open_connection, unique

MANAGEMENT_URL = os.environ.get("MANAGEMENT_URL", "http://127.0.0.1:15672")


def api(method, path, user=USER, password=PASSWORD, headers=None, data=None):
    """(status, parsed JSON body or None, response headers). `data`: raw request body."""
    h = dict(headers or {})
    if user is not None:
        token = base64.b64encode(("%s:%s" % (user, password)).encode()).decode()
        h["Authorization"] = "Basic " + token
    if data is not None:
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(MANAGEMENT_URL + path, method=method, headers=h, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
            return r.status, (json.loads(body) if body else None), r.headers
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, (json.loads(body) if body else None), e.headers


def q(s):
    return urllib.parse.quote(s, safe="")


def named_connection(name):
    params = make_params()
    params.client_properties = {"connection_name": name}
    return pika.BlockingConnection(params)


def find_connection(name, timeout=15.0):
    """The API's entry for the connection whose client named itself `name`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        status, conns, _ = api("GET", "/api/connections")
        assert status == 200
        for c in conns:
            if c.get("client_properties", {}).get("connection_name") == name:
                return c
        time.sleep(0.1)
    raise AssertionError("connection %s not listed" % name)


def test_requests_without_valid_credentials_are_refused():
    status, body, headers = api("GET", "/api/overview", user=None)
    assert status == 401
    assert "Basic" in headers.get("WWW-Authenticate", "")
    status, body, _ = api("GET", "/api/overview", password="wrong-" + PASSWORD)
    assert status == 401
    assert body["error"] == "not_authorized"
    # Changes too: nothing is made without a login.
    qn = unique("no-login")
    status, _, _ = api("PUT", "/api/queues/%2F/" + q(qn), user=None, data=b"{}")
    assert status == 401
    assert api("GET", "/api/queues/%2F/" + q(qn))[0] == 404


def test_overview_counts_objects():
    c = named_connection(unique("overview"))
    try:
        c.channel().queue_declare(unique("ov"), exclusive=True)
        # RabbitMQ's connection/channel totals lag by up to one stats interval (5 s).
        deadline = time.time() + 15
        while True:
            status, body, _ = api("GET", "/api/overview")
            assert status == 200
            totals = body["object_totals"]
            if totals["connections"] >= 1 and totals["channels"] >= 1:
                break
            assert time.time() < deadline, totals
            c.process_data_events(time_limit=0.2)
        assert body["rabbitmq_version"].startswith("3.")
        assert totals["connections"] >= 1
        assert totals["channels"] >= 1
        assert totals["queues"] >= 1
        assert totals["exchanges"] >= 6
        assert {"messages", "messages_ready", "messages_unacknowledged"} <= set(body["queue_totals"])
    finally:
        c.close()


def test_nodes_list_this_node_running():
    status, nodes, _ = api("GET", "/api/nodes")
    assert status == 200 and len(nodes) >= 1
    for n in nodes:
        assert {"name", "type", "running"} <= set(n), n
    assert any(n["running"] for n in nodes)


@pytest.mark.skipif(not WARREN, reason="Warren's cluster status endpoint")
def test_a_single_node_reports_no_cluster():
    # Issue 15: with no cluster settings a node runs no Raft; its status says so.
    status, s, _ = api("GET", "/api/cluster", user=None)
    assert status == 200
    assert s["role"] == "single" and s["serving"] is True, s
    assert s["node_id"] is None and s["leader_id"] is None and s["nodes"] == [], s


def test_whoami_and_vhosts():
    status, me, _ = api("GET", "/api/whoami")
    assert status == 200 and me["name"] == USER
    status, vhosts, _ = api("GET", "/api/vhosts")
    assert status == 200 and "/" in [v["name"] for v in vhosts]
    assert api("GET", "/api/vhosts/%2F")[0] == 200
    assert api("GET", "/api/vhosts/" + unique("novhost"))[0] == 404


def test_connections_are_listed_with_their_client_properties():
    name = unique("listed")
    c = named_connection(name)
    try:
        c.channel()
        c.channel()
        entry = find_connection(name)
        # The channel count lags by up to one stats interval too.
        deadline = time.time() + 15
        while entry["channels"] != 2 and time.time() < deadline:
            c.process_data_events(time_limit=0.2)
            entry = find_connection(name)
        assert entry["user"] == USER
        assert entry["vhost"] == "/"
        assert entry["state"] == "running"
        assert entry["protocol"] == "AMQP 0-9-1"
        assert entry["channels"] == 2
        assert entry["user_provided_name"] == name
        assert entry["client_properties"]["product"] == "Pika Python Client Library"
        status, one, _ = api("GET", "/api/connections/" + q(entry["name"]))
        assert status == 200 and one["name"] == entry["name"]
    finally:
        c.close()
    # Gone from the list once closed.
    deadline = time.time() + 5
    while time.time() < deadline:
        _, conns, _ = api("GET", "/api/connections")
        if all(x.get("client_properties", {}).get("connection_name") != name for x in conns):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("closed connection still listed")
    assert api("GET", "/api/connections/" + q(entry["name"]))[0] == 404


def closed_by_broker(conn):
    """Run the connection's I/O until the broker closes it; the (code, text) it gave."""
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            conn.process_data_events(time_limit=0.2)
        except pika.exceptions.ConnectionClosedByBroker as e:
            return e.reply_code, e.reply_text
    raise AssertionError("the broker did not close the connection")


def test_deleting_a_connection_closes_it_with_320_and_the_reason():
    name = unique("victim")
    victim = named_connection(name)
    bystander = named_connection(unique("bystander"))
    try:
        entry = find_connection(name)
        status, _, _ = api("DELETE", "/api/connections/" + q(entry["name"]),
                           headers={"X-Reason": "maintenance window"})
        assert status in (200, 204)
        code, text = closed_by_broker(victim)
        assert code == 320
        assert text == "CONNECTION_FORCED - maintenance window"
        # Other clients carry on.
        ch = bystander.channel()
        qn = ch.queue_declare(unique("still-here"), exclusive=True).method.queue
        ch.basic_publish("", qn, b"ok")
        assert ch.basic_get(qn, auto_ack=True)[2] == b"ok"
    finally:
        bystander.close()


def test_deleting_a_connection_without_a_reason():
    name = unique("victim2")
    victim = named_connection(name)
    entry = find_connection(name)
    assert api("DELETE", "/api/connections/" + q(entry["name"]))[0] in (200, 204)
    code, text = closed_by_broker(victim)
    assert (code, text) == (320, "CONNECTION_FORCED - Closed via management plugin")


def test_deleting_an_unknown_connection_is_404():
    status, body, _ = api("DELETE", "/api/connections/" + q("127.0.0.1:1 -> 127.0.0.1:2"))
    assert status == 404
    assert body["error"] == "Object Not Found"


def test_queues_show_their_counts_and_arguments():
    c = named_connection(unique("queues"))
    try:
        ch = c.channel()
        qn = unique("counted")
        ch.queue_declare(qn, arguments={"x-max-length": 10, "x-queue-mode": "default"})
        for body in (b"1", b"2"):
            ch.basic_publish("", qn, body)
        ch.basic_qos(prefetch_count=1)
        got = []
        ch.basic_consume(qn, lambda _ch, m, _p, b: got.append(m.delivery_tag))
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            c.process_data_events(time_limit=0.1)
        assert got, "no delivery"
        # RabbitMQ's API updates its numbers every few seconds; wait for them.
        deadline = time.time() + 15
        while True:
            status, queue, _ = api("GET", "/api/queues/%2F/" + q(qn))
            assert status == 200
            if (queue.get("messages_ready"), queue.get("messages_unacknowledged"),
                    queue.get("consumers")) == (1, 1, 1):
                break
            assert time.time() < deadline, queue
            c.process_data_events(time_limit=0.2)
        assert queue["name"] == qn and queue["vhost"] == "/"
        assert queue["messages"] == 2
        assert queue["consumers"] == 1
        assert queue["durable"] is False and queue["exclusive"] is False
        assert queue["arguments"]["x-max-length"] == 10
        status, listed, _ = api("GET", "/api/queues/%2F")
        assert status == 200 and qn in [x["name"] for x in listed]
        status, listed, _ = api("GET", "/api/queues")
        assert status == 200 and qn in [x["name"] for x in listed]
        ch.queue_delete(qn)
        assert api("GET", "/api/queues/%2F/" + q(qn))[0] == 404
    finally:
        c.close()
    assert api("GET", "/api/queues/" + unique("novhost"))[0] == 404


def test_exchanges_are_listed():
    c = named_connection(unique("exchanges"))
    try:
        ch = c.channel()
        x = unique("x")
        ch.exchange_declare(x, exchange_type="topic", auto_delete=True)
        status, one, _ = api("GET", "/api/exchanges/%2F/" + q(x))
        assert status == 200
        assert (one["name"], one["type"], one["auto_delete"], one["durable"]) == (x, "topic", True, False)
        status, listed, _ = api("GET", "/api/exchanges/%2F")
        names = [e["name"] for e in listed]
        assert x in names and "amq.direct" in names
        ch.exchange_delete(x)
        assert api("GET", "/api/exchanges/%2F/" + q(x))[0] == 404
    finally:
        c.close()


def put_json(path, obj):
    """(status, parsed body) of a PUT of `obj` (None: a body that is not JSON)."""
    status, body, _ = api("PUT", path, data=json.dumps(obj).encode() if obj is not None else b"{bad")
    return status, body


def get_body(ch, queue, timeout=5.0):
    """The body of the next message basic.get finds in `queue` within `timeout`, or None."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        body = ch.basic_get(queue, auto_ack=True)[2]
        if body is not None:
            return body
        time.sleep(0.02)
    return None


def message_count(ch, queue):
    return ch.queue_declare(queue, passive=True).method.message_count


def test_queues_are_declared_purged_and_deleted_through_the_api():
    qn = unique("api-q")
    path = "/api/queues/%2F/" + q(qn)
    status, _ = put_json(path, {"durable": True, "auto_delete": False,
                                "arguments": {"x-max-length": 5}})
    assert status == 201
    # The same declaration again: nothing to create.
    assert put_json(path, {"durable": True, "arguments": {"x-max-length": 5}})[0] == 204
    # A different one is refused, and the queue is unchanged.
    status, body = put_json(path, {"durable": False, "arguments": {"x-max-length": 5}})
    assert status == 400
    assert body["reason"].startswith("inequivalent arg 'durable'")
    # A name the broker keeps for itself.
    assert put_json("/api/queues/%2F/" + q("amq." + unique("api")), {})[0] == 401
    # Without a body: a non-durable queue, as RabbitMQ makes.
    plain = unique("api-plain")
    assert put_json("/api/queues/%2F/" + q(plain), {})[0] == 201
    assert api("GET", "/api/queues/%2F/" + q(plain))[1]["durable"] is False
    assert api("DELETE", "/api/queues/%2F/" + q(plain))[0] == 204
    c = named_connection(unique("api-q-client"))
    try:
        ch = c.channel()
        ch.confirm_delivery()
        # AMQP sees the queue the API made: same flags and arguments, or 406.
        ch.queue_declare(qn, durable=True, arguments={"x-max-length": 5})
        for i in range(3):
            ch.basic_publish("", qn, b"m%d" % i)
        assert message_count(ch, qn) == 3
        status, queue, _ = api("GET", path)
        assert status == 200 and queue["durable"] is True
        assert queue["arguments"] == {"x-max-length": 5}
        # if-empty refuses a queue with messages.
        status, _, _ = api("DELETE", path + "?if-empty=true")
        assert status == 400
        assert message_count(ch, qn) == 3
        assert api("DELETE", path + "/contents")[0] == 204
        assert message_count(ch, qn) == 0
        assert api("DELETE", path)[0] == 204
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare(qn, passive=True)
        assert e.value.reply_code == 404
    finally:
        c.close()
    assert api("GET", path)[0] == 404
    assert api("DELETE", path)[0] == 404
    assert api("DELETE", path + "/contents")[0] == 404


def test_exchanges_are_declared_and_deleted_through_the_api():
    x = unique("api-x")
    path = "/api/exchanges/%2F/" + q(x)
    assert put_json(path, {"type": "fanout", "durable": False})[0] == 201
    assert put_json(path, {"type": "fanout", "durable": False})[0] == 204
    assert put_json(path, {"type": "topic", "durable": False})[0] == 400
    # No type: a direct exchange, as RabbitMQ makes.
    untyped = unique("untyped")
    assert put_json("/api/exchanges/%2F/" + q(untyped), {"auto_delete": True})[0] == 201
    status, one, _ = api("GET", "/api/exchanges/%2F/" + q(untyped))
    assert status == 200 and (one["type"], one["durable"]) == ("direct", False)
    assert api("DELETE", "/api/exchanges/%2F/" + q(untyped))[0] == 204
    assert put_json("/api/exchanges/%2F/" + q(unique("bad-json")), None)[0] == 400
    c = named_connection(unique("api-x-client"))
    try:
        ch = c.channel()
        qn = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(qn, x)
        ch.basic_publish(x, "any", b"through the api's exchange")
        assert get_body(ch, qn) == b"through the api's exchange"
        status, one, _ = api("GET", path)
        assert status == 200 and one["type"] == "fanout"
        assert api("DELETE", path)[0] == 204
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.exchange_declare(x, passive=True)
        assert e.value.reply_code == 404
    finally:
        c.close()
    assert api("DELETE", path)[0] == 404


def post_json(path, obj):
    """(status, response headers) of a POST of `obj`."""
    status, _, headers = api("POST", path, data=json.dumps(obj).encode())
    return status, headers


def test_bindings_are_listed_added_and_deleted_through_the_api():
    c = named_connection(unique("bindings"))
    try:
        ch = c.channel()
        x = unique("bx")
        x2 = unique("bx2")
        ch.exchange_declare(x, exchange_type="direct", auto_delete=False)
        ch.exchange_declare(x2, exchange_type="fanout", auto_delete=False)
        qn = ch.queue_declare(unique("bq")).method.queue
        ch.queue_bind(qn, x, routing_key="from-amqp")
        # Listed: the default exchange's implicit binding and the one made over AMQP.
        status, listed, _ = api("GET", "/api/queues/%2F/" + q(qn) + "/bindings")
        assert status == 200
        keys = sorted((b["source"], b["routing_key"], b["destination_type"]) for b in listed)
        assert keys == [("", qn, "queue"), (x, "from-amqp", "queue")]
        one = [b for b in listed if b["source"] == x][0]
        assert one["properties_key"] == "from-amqp"
        # Added through the API: messages follow it.
        base = "/api/bindings/%2F/e/" + q(x) + "/q/" + q(qn)
        status, headers = post_json(base, {"routing_key": "from-api", "arguments": {}})
        assert status == 201
        assert headers.get("Location")
        ch.basic_publish(x, "from-api", b"routed by the api's binding")
        assert get_body(ch, qn) == b"routed by the api's binding"
        status, between, _ = api("GET", base)
        assert status == 200
        assert sorted(b["routing_key"] for b in between) == ["from-amqp", "from-api"]
        # Exchange to exchange.
        status, _ = post_json("/api/bindings/%2F/e/" + q(x) + "/e/" + q(x2),
                              {"routing_key": "e2e"})
        assert status == 201
        status, e2e, _ = api("GET", "/api/bindings/%2F/e/" + q(x) + "/e/" + q(x2))
        assert status == 200 and [b["destination_type"] for b in e2e] == ["exchange"]
        # Deleted by its properties_key: messages stop following it.
        assert api("DELETE", base + "/" + q("from-api"))[0] == 204
        assert api("DELETE", base + "/" + q("from-api"))[0] == 404
        ch.basic_publish(x, "from-api", b"unroutable now")
        ch.basic_publish(x, "from-amqp", b"still bound")
        assert get_body(ch, qn) == b"still bound"
        assert api("DELETE", "/api/bindings/%2F/e/" + q(x) + "/e/" + q(x2) + "/e2e")[0] == 204
        # A binding to something that does not exist is not found.
        assert post_json("/api/bindings/%2F/e/" + q(x) + "/q/" + q(unique("nope")), {})[0] == 404
        ch.exchange_delete(x)
        ch.exchange_delete(x2)
        ch.queue_delete(qn)
    finally:
        c.close()


def rabbit_hash(password, salt=b"\x90\x8d\xc6\x0a"):
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt ++ sha256(salt ++ password))."""
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def put_user(name, body):
    return api("PUT", "/api/users/" + q(name), data=json.dumps(body).encode())[0]


def allow_everything(name):
    """RabbitMQ lets a new user open no vhost until permissions are set. Warren has no
    permissions yet (issue 14): every user may use every vhost, and this path is not found."""
    api("PUT", "/api/permissions/%2F/" + q(name),
        data=json.dumps({"configure": ".*", "write": ".*", "read": ".*"}).encode())


def amqp_login(name, password):
    """Whether name/password open an AMQP connection to the default vhost."""
    try:
        pika.BlockingConnection(make_params(credentials=pika.PlainCredentials(name, password))).close()
        return True
    except pika.exceptions.AMQPConnectionError:
        return False


def test_users_are_created_changed_listed_and_deleted():
    name = unique("user")
    assert put_user(name, {"password": "first", "tags": "management"}) == 201
    allow_everything(name)
    assert amqp_login(name, "first")
    # Changed: the new password, tags as a list; the old password no longer logs in.
    assert put_user(name, {"password": "second", "tags": ["monitoring", "management"]}) == 204
    status, u, _ = api("GET", "/api/users/" + q(name))
    assert status == 200
    assert u["name"] == name and u["tags"] == ["monitoring", "management"]
    assert u["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    assert len(base64.b64decode(u["password_hash"])) == 36
    status, users, _ = api("GET", "/api/users")
    assert status == 200 and name in [x["name"] for x in users]
    assert amqp_login(name, "second") and not amqp_login(name, "first")
    # The user sees themselves with their tags, but only administrators see users.
    status, me, _ = api("GET", "/api/whoami", user=name, password="second")
    assert status == 200 and me["name"] == name
    assert sorted(me["tags"]) == ["management", "monitoring"]
    status, body, _ = api("GET", "/api/users", user=name, password="second")
    assert status == 401 and body["reason"] == "Not administrator user"
    assert api("DELETE", "/api/users/" + q(USER), user=name, password="second")[0] == 401
    # Deleted: gone from the API and from AMQP.
    assert api("DELETE", "/api/users/" + q(name))[0] == 204
    assert api("DELETE", "/api/users/" + q(name))[0] == 404
    assert api("GET", "/api/users/" + q(name))[0] == 404
    assert not amqp_login(name, "second")


def test_a_password_hash_exported_from_rabbitmq_logs_in_with_its_password():
    name = unique("imported")
    body = {"password_hash": rabbit_hash("from-rabbit"), "tags": "",
            "hashing_algorithm": "rabbit_password_hashing_sha256"}
    assert put_user(name, body) == 201
    allow_everything(name)
    status, u, _ = api("GET", "/api/users/" + q(name))
    assert status == 200 and u["password_hash"] == rabbit_hash("from-rabbit")
    assert u["tags"] == []
    assert amqp_login(name, "from-rabbit") and not amqp_login(name, "from-rabbi")
    # Without a management tag, the HTTP API is closed to them.
    status, body, _ = api("GET", "/api/overview", user=name, password="from-rabbit")
    assert status == 401 and body["reason"] == "Not management user"
    # Both a password and a hash: refused. An empty hash: no password logs in.
    assert put_user(name, {"password": "x", "password_hash": rabbit_hash("x"), "tags": ""}) == 400
    assert put_user(name, {"password_hash": "", "tags": ""}) == 204
    assert not amqp_login(name, "from-rabbit") and not amqp_login(name, "")
    # A blank password never logs in; a PUT without tags is refused.
    assert put_user(name, {"password": "", "tags": ""}) == 204
    assert not amqp_login(name, "")
    status, body, _ = api("PUT", "/api/users/" + q(name), data=json.dumps({"password": "p"}).encode())
    assert status == 400 and "tags_not_present" in body["reason"]
    assert api("DELETE", "/api/users/" + q(name))[0] == 204


def test_deleting_a_user_closes_their_connections():
    name = unique("leaving")
    assert put_user(name, {"password": "pw", "tags": ""}) == 201
    allow_everything(name)
    conn = pika.BlockingConnection(make_params(credentials=pika.PlainCredentials(name, "pw")))
    others = pika.BlockingConnection(make_params())
    try:
        assert api("DELETE", "/api/users/" + q(name))[0] == 204
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            deadline = time.time() + 10
            while time.time() < deadline:
                conn.process_data_events(time_limit=0.2)
        assert closed.value.reply_code == 320
        assert "user '%s' is deleted" % name in closed.value.reply_text
        # Everyone else carries on.
        ch = others.channel()
        ch.queue_declare(queue="", exclusive=True)
    finally:
        if conn.is_open:
            conn.close()
        others.close()


def put_vhost(name, body=None):
    data = json.dumps(body).encode() if body is not None else None
    return api("PUT", "/api/vhosts/" + q(name), data=data)[0]


def vhost_connection(vhost, **overrides):
    return pika.BlockingConnection(make_params(virtual_host=vhost, **overrides))


def test_vhosts_are_created_changed_listed_and_deleted():
    name = unique("vhost")
    assert put_vhost(name, {"description": "first", "tags": "a,b"}) == 201
    status, v, _ = api("GET", "/api/vhosts/" + q(name))
    assert status == 200
    assert v["name"] == name and v["description"] == "first" and v["tags"] == ["a", "b"]
    assert v["metadata"] == {"description": "first", "tags": ["a", "b"]}
    # Again: 204, and what the body leaves out becomes empty (RabbitMQ replaces both).
    assert put_vhost(name, {"tags": ["c"]}) == 204
    status, v, _ = api("GET", "/api/vhosts/" + q(name))
    assert v["description"] == "" and v["tags"] == ["c"]
    status, vhosts, _ = api("GET", "/api/vhosts")
    assert status == 200 and {name, "/"} <= {x["name"] for x in vhosts}
    assert api("PUT", "/api/vhosts/" + q(name), data=b"{nope")[0] == 400
    # Creating and deleting vhosts is for administrators.
    other = unique("manager")
    assert put_user(other, {"password": "pw", "tags": "management"}) == 201
    try:
        for method in ("PUT", "DELETE"):
            status, body, _ = api(method, "/api/vhosts/" + q(name), user=other, password="pw")
            assert status == 401 and body["reason"] == "Not administrator user"
    finally:
        api("DELETE", "/api/users/" + q(other))
    assert api("DELETE", "/api/vhosts/" + q(name))[0] == 204
    assert api("DELETE", "/api/vhosts/" + q(name))[0] == 404
    assert api("GET", "/api/vhosts/" + q(name))[0] == 404


def test_a_vhost_keeps_its_own_names_and_its_deletion_takes_everything_in_it():
    name = unique("vhost")
    queue = unique("q")
    assert put_vhost(name) == 201
    conn = vhost_connection(name)
    root = open_connection()
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue=queue, durable=True)
        for i in range(3):
            ch.basic_publish("", queue, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
        # The same name in "/" is another queue (none there yet).
        rch = root.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
            rch.queue_declare(queue=queue, passive=True)
        assert missing.value.reply_code == 404
        status, body, _ = api("GET", "/api/queues/%s/%s" % (q(name), q(queue)))
        assert status == 200 and body["vhost"] == name
        # Deleted: its connections are closed (320, RabbitMQ's text), its queue is gone.
        assert api("DELETE", "/api/vhosts/" + q(name))[0] == 204
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            deadline = time.time() + 10
            while time.time() < deadline:
                conn.process_data_events(time_limit=0.2)
        assert closed.value.reply_code == 320
        # RabbitMQ 3.10.8 says "is deleted", or now and then "is down" (two closers race).
        assert ("vhost '%s' is deleted" % name in closed.value.reply_text
                or "vhost '%s' is down" % name in closed.value.reply_text)
        assert api("GET", "/api/queues/%s/%s" % (q(name), q(queue)))[0] == 404
        # A connection to it is refused as RabbitMQ refuses it.
        # (pika reports a close during the handshake as a probable access denial.)
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as refused:
            vhost_connection(name)
        assert "(530) 'NOT_ALLOWED - vhost %s not found'" % name in str(refused.value)
        # Made again, it is empty.
        assert put_vhost(name) == 201
        again = vhost_connection(name)
        try:
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
                again.channel().queue_declare(queue=queue, passive=True)
            assert gone.value.reply_code == 404
        finally:
            again.close()
        # Everyone else carried on.
        root.channel().queue_declare(queue="", exclusive=True)
    finally:
        if conn.is_open:
            conn.close()
        root.close()
        api("DELETE", "/api/vhosts/" + q(name))


def put_permissions(vhost, user, configure, write, read):
    body = {"configure": configure, "write": write, "read": read}
    return api("PUT", "/api/permissions/%s/%s" % (q(vhost), q(user)),
               data=json.dumps(body).encode())[0]


def test_permissions_are_set_listed_and_cleared():
    name = unique("perm")
    assert put_user(name, {"password": "pw", "tags": ""}) == 201
    try:
        path = "/api/permissions/%2F/" + q(name)
        assert api("GET", path)[0] == 404
        # Without permissions on a vhost, a user may not open it (530, RabbitMQ's text).
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as refused:
            pika.BlockingConnection(make_params(credentials=pika.PlainCredentials(name, "pw")))
        assert ("(530) \"NOT_ALLOWED - access to vhost '/' refused for user '%s'\"" % name
                in str(refused.value) or
                "(530) 'NOT_ALLOWED - access to vhost '/' refused for user '%s''" % name
                in str(refused.value)), str(refused.value)
        assert put_permissions("/", name, ".*", ".*", ".*") == 201
        assert put_permissions("/", name, "^a", "", "^c") == 204
        status, p, _ = api("GET", path)
        assert status == 200
        assert p == {"user": name, "vhost": "/", "configure": "^a", "write": "", "read": "^c"}
        assert name in [x["user"] for x in api("GET", "/api/permissions")[1]]
        assert [x["vhost"] for x in api("GET", "/api/users/%s/permissions" % q(name))[1]] == ["/"]
        assert name in [x["user"] for x in api("GET", "/api/vhosts/%2F/permissions")[1]]
        # Refused as RabbitMQ refuses: a missing key, a bad expression, a missing vhost or user.
        status, body, _ = api("PUT", path, data=json.dumps({"configure": ".*", "write": ".*"}).encode())
        assert status == 400 and body["reason"] == "[{key_missing,read}]"
        assert put_permissions("/", name, "(", ".*", ".*") == 400
        assert put_permissions(unique("novhost"), name, ".*", ".*", ".*") == 400
        assert put_permissions("/", unique("nouser"), ".*", ".*", ".*") == 400
        assert amqp_login(name, "pw")
        assert api("DELETE", path)[0] == 204
        assert api("DELETE", path)[0] == 404
        assert not amqp_login(name, "pw")
    finally:
        api("DELETE", "/api/users/" + q(name))


def test_a_vhost_creator_gets_full_permissions_on_it():
    name = unique("vhost")
    assert put_vhost(name) == 201
    try:
        status, p, _ = api("GET", "/api/permissions/%s/%s" % (q(name), q(USER)))
        assert status == 200 and (p["configure"], p["write"], p["read"]) == (".*", ".*", ".*")
    finally:
        api("DELETE", "/api/vhosts/" + q(name))


def test_methods_are_checked_against_permissions_as_rabbitmq_checks_them():
    """RabbitMQ's access-control table, with its 403 texts (a channel error each; the
    connection carries on). User u may configure, write and read names starting with u-."""
    user = unique("u")
    prefix = user + "-"
    other = unique("other")
    assert put_user(user, {"password": "pw", "tags": "management"}) == 201
    assert put_permissions("/", user, "^" + prefix, "^" + prefix, "^" + prefix) == 201
    admin = open_connection()
    conn = pika.BlockingConnection(make_params(credentials=pika.PlainCredentials(user, "pw")))
    mine, mine_x = prefix + "q", prefix + "x"
    try:
        admin.channel().queue_declare(queue=other)

        def refused(op, kind, name):
            ch = conn.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                op(ch)
                # An asynchronous refusal (basic.publish) comes with the next round trip.
                ch.basic_qos(prefetch_count=1)
            assert e.value.reply_code == 403, e.value
            assert e.value.reply_text == (
                "ACCESS_REFUSED - access to %s '%s' in vhost '/' refused for user '%s'"
                % (kind, name, user))

        refused(lambda ch: ch.queue_declare(queue=other), "queue", other)
        refused(lambda ch: ch.exchange_declare(exchange=other + "-x"), "exchange", other + "-x")
        refused(lambda ch: ch.basic_consume(queue=other, on_message_callback=print), "queue", other)
        refused(lambda ch: ch.basic_get(queue=other), "queue", other)
        refused(lambda ch: ch.queue_purge(queue=other), "queue", other)
        refused(lambda ch: ch.queue_delete(queue=other), "queue", other)
        refused(lambda ch: ch.basic_publish("amq.direct", "k", b"x"), "exchange", "amq.direct")
        # The default exchange is checked as amq.default.
        refused(lambda ch: ch.basic_publish("", mine, b"x"), "exchange", "amq.default")
        # A server-named queue: its name is checked.
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare(queue="")
        assert e.value.reply_code == 403 and "access to queue 'amq.gen-" in e.value.reply_text
        # Passive declares are not checked.
        ok = conn.channel()
        assert ok.queue_declare(queue=other, passive=True).method.queue == other
        ok.exchange_declare(exchange="amq.direct", passive=True)
        # Allowed: their own queue and exchange, bindings between them, publish, get, purge.
        ok.queue_declare(queue=mine)
        ok.exchange_declare(exchange=mine_x)
        ok.queue_bind(queue=mine, exchange=mine_x, routing_key="k")
        ok.confirm_delivery()
        ok.basic_publish(mine_x, "k", b"hello")
        assert ok.basic_get(queue=mine, auto_ack=True)[2] == b"hello"
        ok.queue_purge(queue=mine)
        # queue.bind: the queue (write) first, then the exchange (read).
        refused(lambda ch: ch.queue_bind(queue=other, exchange="amq.fanout"), "queue", other)
        refused(lambda ch: ch.queue_bind(queue=mine, exchange="amq.fanout"), "exchange", "amq.fanout")
        # exchange.bind: the destination (write), then the source (read).
        refused(lambda ch: ch.exchange_bind(destination=mine_x, source="amq.fanout"),
                "exchange", "amq.fanout")
        # A dead-letter exchange: writing to it is checked at the declare.
        refused(lambda ch: ch.queue_declare(queue=prefix + "dl",
                                            arguments={"x-dead-letter-exchange": "amq.fanout"}),
                "exchange", "amq.fanout")
        # An alternate exchange: writing to it is checked at the declare.
        refused(lambda ch: ch.exchange_declare(exchange=prefix + "ae-x",
                                               arguments={"alternate-exchange": "amq.fanout"}),
                "exchange", "amq.fanout")
        # The same through the API (RabbitMQ makes it an AMQP declare of the user's).
        as_user = dict(user=user, password="pw")
        body = json.dumps({"durable": False, "arguments": {"x-dead-letter-exchange": "amq.fanout"}})
        status, answer, _ = api("PUT", "/api/queues/%2F/" + q(prefix + "dl2"),
                                data=body.encode(), **as_user)
        assert status == 401 and answer["reason"] == "Access refused.", answer
        # Direct reply-to needs no permission (RabbitMQ checks none there).
        rpc = conn.channel()
        rpc.basic_consume(queue="amq.rabbitmq.reply-to", on_message_callback=print, auto_ack=True)
        # A missing exchange they may write to is 404; one they may not, 403.
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.basic_publish(prefix + "missing", "k", b"x")
            ch.basic_qos(prefetch_count=1)
        assert e.value.reply_code == 404
        refused(lambda ch: ch.basic_publish("missing", "k", b"x"), "exchange", "missing")
        # Permissions changed while connected apply at the next method.
        assert put_permissions("/", user, ".*", ".*", ".*") == 204
        conn.channel().queue_declare(queue=other, passive=False)
        assert conn.is_open
        ok.queue_delete(queue=mine)
        ok.exchange_delete(exchange=mine_x)
    finally:
        if conn.is_open:
            conn.close()
        ach = admin.channel()
        ach.queue_delete(queue=other)
        admin.close()
        api("DELETE", "/api/users/" + q(user))


def test_an_impersonator_may_publish_in_another_users_name():
    for tag, accepted in (("impersonator", True), ("management", False)):
        user = unique("imp")
        assert put_user(user, {"password": "pw", "tags": tag}) == 201
        assert put_permissions("/", user, ".*", ".*", ".*") == 201
        conn = pika.BlockingConnection(make_params(credentials=pika.PlainCredentials(user, "pw")))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            queue = ch.queue_declare(queue="", exclusive=True).method.queue
            props = pika.BasicProperties(user_id="someone-else")
            if accepted:
                ch.basic_publish("", queue, b"x", props)
                assert ch.basic_get(queue=queue, auto_ack=True)[1].user_id == "someone-else"
            else:
                with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                    ch.basic_publish("", queue, b"x", props)
                assert e.value.reply_code == 406
        finally:
            if conn.is_open:
                conn.close()
            api("DELETE", "/api/users/" + q(user))


def test_definitions_are_exported_as_rabbitmq_exports_them():
    vhost, user = unique("defs"), unique("defs-user")
    assert put_vhost(vhost, {"description": "d"}) == 201
    assert put_user(user, {"password": "pw", "tags": "management"}) == 201
    assert put_permissions(vhost, user, "^a", ".*", "") == 201
    base = "/%s/" % q(vhost)
    assert put_json("/api/exchanges" + base + "x1", {"type": "topic", "durable": True})[0] == 201
    assert put_json("/api/queues" + base + "q1", {"durable": True,
                                                  "arguments": {"x-max-length": 7}})[0] == 201
    assert put_json("/api/queues" + base + "transient", {"durable": False})[0] == 201
    assert post_json("/api/bindings" + base + "e/x1/q/q1", {"routing_key": "k.#"})[0] == 201
    try:
        status, doc, headers = api("GET", "/api/definitions")
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        for key in ("rabbit_version", "users", "vhosts", "permissions", "queues", "exchanges",
                    "bindings", "policies", "parameters"):
            assert key in doc, key
        u = [x for x in doc["users"] if x["name"] == user][0]
        assert u["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert u["tags"] == ["management"] and u["password_hash"]
        assert vhost in [v["name"] for v in doc["vhosts"]]
        assert {"user": user, "vhost": vhost, "configure": "^a", "write": ".*",
                "read": ""} in doc["permissions"]
        # Every queue but exclusive ones, transient too (RabbitMQ 3.10.8 exports them).
        mine = lambda items: sorted((x for x in items if x.get("vhost") == vhost),
                                    key=lambda x: x.get("name", x.get("source", "")))
        assert mine(doc["queues"]) == [{"name": "q1", "vhost": vhost, "durable": True,
                                        "auto_delete": False,
                                        "arguments": {"x-max-length": 7}},
                                       {"name": "transient", "vhost": vhost, "durable": False,
                                        "auto_delete": False, "arguments": {}}]
        assert [x["name"] for x in mine(doc["exchanges"])] == ["x1"]
        assert mine(doc["bindings"]) == [{"source": "x1", "vhost": vhost, "destination": "q1",
                                          "destination_type": "queue", "routing_key": "k.#",
                                          "arguments": {}}]
        # Per vhost: its queues, exchanges and bindings, without vhost fields.
        status, one, _ = api("GET", "/api/definitions/" + q(vhost))
        assert status == 200 and "users" not in one
        q1 = [x for x in one["queues"] if x["name"] == "q1"]
        assert q1 == [{"name": "q1", "durable": True, "auto_delete": False,
                       "arguments": {"x-max-length": 7}}]
        # Only administrators export.
        status, body, _ = api("GET", "/api/definitions", user=user, password="pw")
        assert status == 401 and body["reason"] == "Not administrator user"
    finally:
        api("DELETE", "/api/vhosts/" + q(vhost))
        api("DELETE", "/api/users/" + q(user))


def test_a_definitions_document_imports_and_clients_work_as_before():
    """A document as RabbitMQ 3.10 exports it (compat/fixtures: made with RabbitMQ 3.10.8)
    imports, and its users log in with their passwords, its permissions hold, its topology
    routes."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "rabbitmq-3.10-definitions.json")
    with open(path, "rb") as f:
        doc = json.load(f)
    status, body, _ = api("POST", "/api/definitions", data=json.dumps(doc).encode())
    assert status in (200, 201, 204), body
    try:
        app = pika.BlockingConnection(make_params(
            virtual_host="shop", credentials=pika.PlainCredentials("shop-app", "shop-app-pw")))
        try:
            ch = app.channel()
            ch.confirm_delivery()
            ch.basic_publish("shop.events", "order.created", b"order 1",
                             pika.BasicProperties(delivery_mode=2))
            assert ch.basic_get(queue="shop.orders", auto_ack=True)[2] == b"order 1"
            # configure only on ^shop\. names.
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
                app.channel().queue_declare(queue="other")
            assert e.value.reply_code == 403
        finally:
            if app.is_open:
                app.close()
        status, orders, _ = api("GET", "/api/queues/shop/shop.orders")
        assert status == 200 and orders["arguments"]["x-dead-letter-exchange"] == "shop.dlx"
        # Again: nothing changes, nothing fails.
        status, body, _ = api("POST", "/api/definitions", data=json.dumps(doc).encode())
        assert status in (200, 201, 204), body
        # Not JSON: refused. A queue not equivalent to the one there is left as it is, and the
        # rest of the document still goes in (RabbitMQ 3.10.8 answers the same).
        assert api("POST", "/api/definitions", data=b"{nope")[0] == 400
        clash = {"queues": [{"name": "shop.orders", "vhost": "shop", "durable": True,
                             "auto_delete": False, "arguments": {"x-max-length": 5}},
                            {"name": "shop.later", "vhost": "shop", "durable": True,
                             "auto_delete": False, "arguments": {}}]}
        assert api("POST", "/api/definitions", data=json.dumps(clash).encode())[0] == 204
        status, orders, _ = api("GET", "/api/queues/shop/shop.orders")
        assert orders["arguments"]["x-max-length"] == 1000
        assert api("GET", "/api/queues/shop/shop.later")[0] == 200
        # A missing vhost stops it.
        missing = {"queues": [{"name": "q", "vhost": unique("novhost"), "durable": True}]}
        assert api("POST", "/api/definitions", data=json.dumps(missing).encode())[0] == 400
    finally:
        api("DELETE", "/api/vhosts/shop")
        api("DELETE", "/api/queues/%2F/legacy")
        for u in ("shop-admin", "shop-app", "shop-monitor"):
            api("DELETE", "/api/users/" + u)


def test_the_api_shows_and_changes_what_the_users_tags_and_permissions_allow():
    vhost = unique("tenant")
    manager, monitor = unique("manager"), unique("monitor")
    assert put_vhost(vhost) == 201
    assert put_user(manager, {"password": "pw", "tags": "management"}) == 201
    assert put_user(monitor, {"password": "pw", "tags": "monitoring"}) == 201
    assert put_permissions(vhost, manager, "^m-", ".*", ".*") == 201
    as_manager = dict(user=manager, password="pw")
    hidden = unique("hidden")
    assert put_json("/api/queues/%2F/" + q(hidden), {"durable": False})[0] == 201
    conn = open_connection()
    try:
        # A management user sees their vhosts only; a monitoring user sees everything.
        names = lambda items: {x["name"] for x in items}
        status, vhosts, _ = api("GET", "/api/vhosts", **as_manager)
        assert status == 200 and names(vhosts) == {vhost}
        status, queues, _ = api("GET", "/api/queues", **as_manager)
        assert status == 200 and hidden not in names(queues)
        # A monitoring user sees every vhost, but a vhost's queues only with permissions
        # there (RabbitMQ 3.10.8).
        status, vhosts, _ = api("GET", "/api/vhosts", user=monitor, password="pw")
        assert status == 200 and {"/", vhost} <= names(vhosts)
        status, queues, _ = api("GET", "/api/queues", user=monitor, password="pw")
        assert status == 200 and hidden not in names(queues)
        # The overview counts what they may see: not the queue in "/".
        status, overview, _ = api("GET", "/api/overview", **as_manager)
        assert status == 200 and overview["object_totals"]["queues"] == 0
        assert overview["object_totals"]["connections"] == 0
        status, overview, _ = api("GET", "/api/overview", user=monitor, password="pw")
        assert overview["object_totals"]["queues"] >= 1
        status, body, _ = api("GET", "/api/queues/%2F", **as_manager)
        assert status == 401 and body["error"] == "not_authorised"
        assert api("GET", "/api/exchanges/%2F/amq.direct", **as_manager)[0] == 401
        # Connections: their own only; the guest connection is not theirs to see or close.
        status, conns, _ = api("GET", "/api/connections", **as_manager)
        assert status == 200 and all(c["user"] == manager for c in conns)
        # (RabbitMQ lists a new connection after its statistics interval: polled.)
        deadline, guests = time.time() + 15, []
        while not guests and time.time() < deadline:
            status, conns, _ = api("GET", "/api/connections", user=monitor, password="pw")
            guests = [c for c in conns if c["user"] == USER]
            time.sleep(0.2)
        assert guests, "the monitoring user does not see guest's connection"
        status, body, _ = api("DELETE", "/api/connections/" + q(guests[0]["name"]), **as_manager)
        assert status == 401 and body["reason"] == "User not authorised to access object"
        assert conn.is_open
        # Changes follow their permissions in the vhost, as the AMQP methods would.
        base = "/api/queues/%s/" % q(vhost)
        status, _, _ = api("PUT", base + "m-q", data=b'{"durable": true}', **as_manager)
        assert status == 201
        status, body, _ = api("PUT", base + "other", data=b'{"durable": true}', **as_manager)
        assert status == 401 and body["error"] == "not_authorised"
        assert api("DELETE", base + "m-q/contents", **as_manager)[0] == 204
        assert api("DELETE", base + "m-q", **as_manager)[0] == 204
        # The monitoring user reads everything but may change nothing without permissions.
        status, _, _ = api("PUT", base + "m-x", data=b'{"durable": true}',
                           user=monitor, password="pw")
        assert status == 401
    finally:
        conn.close()
        api("DELETE", "/api/queues/%2F/" + q(hidden))
        api("DELETE", "/api/vhosts/" + q(vhost))
        for u in (manager, monitor):
            api("DELETE", "/api/users/" + q(u))


def test_vhost_limits_are_answered_as_rabbitmq_answers_them():
    vhost = unique("limited")
    other = unique("free")
    assert put_vhost(vhost) == 201 and put_vhost(other) == 201
    path = "/api/vhost-limits/%s/" % q(vhost)
    conns = []
    try:
        assert api("PUT", path + "max-connections", data=b'{"value": 2}')[0] == 204
        assert api("PUT", path + "max-queues", data=b'{"value": 1}')[0] == 204
        status, body, _ = api("GET", "/api/vhost-limits/" + q(vhost))
        assert status == 200 and body == [{"vhost": vhost,
                                           "value": {"max-connections": 2, "max-queues": 1}}]
        status, body, _ = api("PUT", path + "max-foo", data=b'{"value": 2}')
        assert status == 400 and "Unrecognised terms" in body["reason"]
        status, body, _ = api("PUT", path + "max-queues", data=b'{"value": "x"}')
        assert status == 400 and "should be a number" in body["reason"]
        # Two connections, then 530 (a connection error at connection.open).
        conns = [vhost_connection(vhost) for _ in range(2)]
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as e:
            vhost_connection(vhost)
        assert ("access to vhost '%s' refused for user '%s': connection limit (2) is reached"
                % (vhost, USER)) in str(e.value)
        # One queue, then 406 on the channel; the connection carries on, a redeclare works.
        ch = conns[0].channel()
        ch.queue_declare(queue="first")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare(queue="second")
        assert e.value.reply_code == 406
        assert e.value.reply_text == ("PRECONDITION_FAILED - cannot declare queue 'second': "
                                      "queue limit in vhost '%s' (1) is reached" % vhost)
        conns[0].channel().queue_declare(queue="first")
        # The other tenant is untouched.
        others = [vhost_connection(other) for _ in range(3)]
        for c in others:
            c.channel().queue_declare(queue="", exclusive=True)
            c.close()
        # Lifted: -1 is no limit; a removed limit is gone.
        assert api("PUT", path + "max-connections", data=b'{"value": -1}')[0] == 204
        assert api("DELETE", path + "max-queues")[0] == 204
        conns.append(vhost_connection(vhost))
        conns[0].channel().queue_declare(queue="second")
    finally:
        for c in conns:
            if c.is_open:
                c.close()
        api("DELETE", "/api/vhosts/" + q(vhost))
        api("DELETE", "/api/vhosts/" + q(other))


def test_user_limits_are_answered_as_rabbitmq_answers_them():
    user = unique("limited-user")
    assert put_user(user, {"password": "pw", "tags": ""}) == 201
    assert put_permissions("/", user, ".*", ".*", ".*") == 201
    path = "/api/user-limits/%s/" % q(user)
    params = make_params(credentials=pika.PlainCredentials(user, "pw"))
    conn = None
    try:
        assert api("PUT", path + "max-connections", data=b'{"value": 1}')[0] == 204
        assert api("PUT", path + "max-channels", data=b'{"value": 2}')[0] == 204
        status, u, _ = api("GET", "/api/users/" + q(user))
        assert u["limits"] == {"max-channels": 2, "max-connections": 1}
        conn = pika.BlockingConnection(params)
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as e:
            pika.BlockingConnection(params)
        assert ("connection refused for user '%s': user connection limit (1) is reached"
                % user) in str(e.value)
        conn.channel()
        conn.channel()
        # A third channel closes the whole connection (530).
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
            conn.channel()
        assert e.value.reply_code == 530
        assert e.value.reply_text == ("NOT_ALLOWED - number of channels opened for user '%s' "
                                      "has reached the maximum allowed user limit of (2)" % user)
        assert api("DELETE", path + "max-connections")[0] == 204
        assert api("DELETE", path + "max-channels")[0] == 204
        a, b = pika.BlockingConnection(params), pika.BlockingConnection(params)
        for _ in range(3):
            a.channel()
        a.close()
        b.close()
    finally:
        if conn is not None and conn.is_open:
            conn.close()
        api("DELETE", "/api/users/" + q(user))


def test_permissions_need_an_existing_user_and_vhost():
    # RabbitMQ 3.10: 400 {"error": "bad_request", "reason": "vhost_or_user_not_found"}.
    missing_user = unique("nobody")
    body = json.dumps({"configure": ".*", "write": ".*", "read": ".*"}).encode()
    topic = json.dumps({"exchange": "amq.topic", "write": ".*", "read": ".*"}).encode()
    for path, data in [
        ("/api/permissions/%2F/" + q(missing_user), body),
        ("/api/permissions/" + q(unique("no-vhost")) + "/guest", body),
        ("/api/topic-permissions/%2F/" + q(missing_user), topic),
        ("/api/topic-permissions/" + q(unique("no-vhost")) + "/guest", topic),
    ]:
        status, answer, _ = api("PUT", path, data=data)
        assert status == 400, path
        assert answer == {"error": "bad_request", "reason": "vhost_or_user_not_found"}, path


def test_topic_permissions_check_routing_keys_on_topic_exchanges():
    user = unique("topic-user")
    assert put_user(user, {"password": "pw", "tags": ""}) == 201
    assert put_permissions("/", user, ".*", ".*", ".*") == 201
    path = "/api/topic-permissions/%2F/" + q(user)
    body = {"exchange": "amq.topic", "write": "^{username}\\.", "read": "^public\\."}
    conn = None
    try:
        assert api("PUT", path, data=json.dumps(body).encode())[0] == 201
        status, listed, _ = api("GET", path)
        assert status == 200 and listed == [{"user": user, "vhost": "/", "exchange": "amq.topic",
                                             "write": "^{username}\\.", "read": "^public\\."}]
        status, missing, _ = api("PUT", path, data=b'{"exchange": "amq.topic", "write": ".*"}')
        assert status == 400 and missing["reason"] == "[{key_missing,read}]"
        conn = pika.BlockingConnection(make_params(credentials=pika.PlainCredentials(user, "pw")))
        ch = conn.channel()
        ch.confirm_delivery()
        queue = ch.queue_declare(queue="", exclusive=True).method.queue
        # Their own routing keys ({username} expanded), and bindings on public ones.
        ch.queue_bind(queue=queue, exchange="amq.topic", routing_key="public.#")
        ch.basic_publish("amq.topic", user + ".news", b"x")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            other = conn.channel()
            other.basic_publish("amq.topic", "other.news", b"x")
            other.basic_qos(prefetch_count=1)  # the refusal comes with the next round trip
        assert e.value.reply_code == 403
        assert e.value.reply_text == (
            "ACCESS_REFUSED - access to topic 'other.news' in exchange 'amq.topic' "
            "in vhost '/' refused for user '%s'" % user)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            conn.channel().queue_bind(queue=queue, exchange="amq.topic", routing_key="secret.#")
        assert e.value.reply_code == 403
        assert "ACCESS_REFUSED - access to topic 'secret.#'" in e.value.reply_text
        # Other exchanges are not concerned.
        conn.channel().basic_publish("amq.direct", "anything", b"x")
        assert api("DELETE", path)[0] == 204
        assert api("DELETE", path)[0] == 404
        conn.channel().basic_publish("amq.topic", "other.news", b"x")
    finally:
        if conn is not None and conn.is_open:
            conn.close()
        api("DELETE", "/api/users/" + q(user))
