"""Routing semantics of direct, fanout, topic, headers and default exchanges,
exchange-to-exchange bindings and alternate exchanges."""

import pika
import pytest

from helpers import expect_channel_error, get, get_all, sync


def topic_match(pattern, key):
    """Reference matcher with RabbitMQ's semantics (verified against 3.10).

    Words are separated by '.', an empty string has ZERO words (so "*" does
    not match "" but "#" does), empty words are real words ("a..b" has three
    words, the middle one empty, and "*" matches an empty word).
    """
    p = pattern.split(".") if pattern else []
    k = key.split(".") if key else []

    def m(pi, ki):
        if pi == len(p):
            return ki == len(k)
        if p[pi] == "#":
            return any(m(pi + 1, j) for j in range(ki, len(k) + 1))
        if ki == len(k):
            return False
        if p[pi] == "*" or p[pi] == k[ki]:
            return m(pi + 1, ki + 1)
        return False

    return m(0, 0)


@pytest.fixture
def xname(name, cleanup):
    """Factory: declare an exchange of a type, cleaned up afterwards."""
    def _make(channel, xtype, **kw):
        x = cleanup.exchange(name("x-" + xtype))
        channel.exchange_declare(x, xtype, **kw)
        return x
    return _make


def bound_queue(ch, exchange, routing_key="", arguments=None):
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, exchange, routing_key, arguments=arguments)
    return q


def bodies(ch, q):
    return [d.body for d in get_all(ch, q)]


# --------------------------------------------------------------------------
# topic
# --------------------------------------------------------------------------

TOPIC_BINDINGS = ["#", "*", "a", "", "a.*", "a.#", "*.b", "#.b", "a.*.b", "a.#.b",
                  "#.#", "*.*", "*.#", "#.*", "a..b", "*.*.*", "#.a.#", "a.b"]
TOPIC_KEYS = ["", "a", "b", "a.b", "a.c", "b.a", "a.x.b", "a.x.y.b", "a..b", ".", "..",
              "a.", ".b", "a.b.c", "x.a.y", "A.b"]


def test_topic_routing_matrix(channel, xname):
    x = xname(channel, "topic")
    queues = {b: bound_queue(channel, x, b) for b in TOPIC_BINDINGS}
    for k in TOPIC_KEYS:
        channel.basic_publish(x, k, k.encode() or b"<empty>")
    mismatches = []
    for b, q in queues.items():
        got = bodies(channel, q)
        want = [k.encode() or b"<empty>" for k in TOPIC_KEYS if topic_match(b, k)]
        if got != want:
            mismatches.append((b, got, want))
    assert not mismatches


@pytest.mark.parametrize("binding,key,matches", [
    ("#", "", True),
    ("*", "", False),          # "" has zero words
    ("", "", True),
    ("#.#", "", True),
    ("*", ".", False),         # "." is two empty words
    ("*.*", ".", True),
    ("a.*.b", "a..b", True),   # '*' matches an empty word
    ("a..b", "a..b", True),
    ("a.#.b", "a.b", True),    # '#' matches zero words
    ("a.#.b", "a.x.y.b", True),
    ("a.#", "a", True),
    ("#.b", "b", True),
    ("*.#", "", False),
    ("#.*", "a", True),
    ("a.*", "a", False),
    ("a.*", "a.b.c", False),
    ("a.b", "A.b", False),     # case-sensitive
])
def test_topic_notable_cases(channel, xname, binding, key, matches):
    assert topic_match(binding, key) is matches  # the reference agrees...
    x = xname(channel, "topic")
    q = bound_queue(channel, x, binding)
    channel.basic_publish(x, key, b"m")
    assert (get(channel, q, timeout=0.2) is not None) is matches  # ...and so does the broker


def test_topic_many_bindings_same_queue_deliver_once(channel, xname):
    x = xname(channel, "topic")
    q = channel.queue_declare("", exclusive=True).method.queue
    for b in ["#", "a.*", "a.b", "*.b", "#.b", "a.#"]:
        channel.queue_bind(q, x, b)
    channel.basic_publish(x, "a.b", b"once")
    assert bodies(channel, q) == [b"once"]


def test_topic_unbind(channel, xname):
    x = xname(channel, "topic")
    q = bound_queue(channel, x, "a.#")
    channel.queue_bind(q, x, "b.*")
    channel.queue_unbind(q, x, "a.#")
    channel.basic_publish(x, "a.x", b"1")
    channel.basic_publish(x, "b.x", b"2")
    assert bodies(channel, q) == [b"2"]


def test_topic_binding_key_whitespace_is_literal(channel, xname):
    x = xname(channel, "topic")
    q = bound_queue(channel, x, "a b.c")
    channel.basic_publish(x, "a b.c", b"1")
    channel.basic_publish(x, "ab.c", b"2")
    assert bodies(channel, q) == [b"1"]


# --------------------------------------------------------------------------
# direct / fanout / default
# --------------------------------------------------------------------------

def test_direct_exact_match(channel, xname):
    x = xname(channel, "direct")
    qa = bound_queue(channel, x, "a")
    qb = bound_queue(channel, x, "b")
    qempty = bound_queue(channel, x, "")
    for k in ["a", "b", "A", "a.b", "", "*", "#"]:
        channel.basic_publish(x, k, k.encode() or b"<empty>")
    assert bodies(channel, qa) == [b"a"]
    assert bodies(channel, qb) == [b"b"]
    assert bodies(channel, qempty) == [b"<empty>"]


def test_direct_wildcards_are_literal(channel, xname):
    x = xname(channel, "direct")
    q = bound_queue(channel, x, "#")
    channel.basic_publish(x, "anything", b"1")
    channel.basic_publish(x, "#", b"2")
    assert bodies(channel, q) == [b"2"]


def test_direct_multiple_queues_same_key(channel, xname):
    x = xname(channel, "direct")
    qs = [bound_queue(channel, x, "k") for _ in range(3)]
    channel.basic_publish(x, "k", b"copy")
    for q in qs:
        assert bodies(channel, q) == [b"copy"]


def test_direct_queue_bound_with_two_keys(channel, xname):
    x = xname(channel, "direct")
    q = bound_queue(channel, x, "k1")
    channel.queue_bind(q, x, "k2")
    channel.basic_publish(x, "k1", b"1")
    channel.basic_publish(x, "k2", b"2")
    channel.basic_publish(x, "k3", b"3")
    assert bodies(channel, q) == [b"1", b"2"]


def test_fanout_ignores_routing_key(channel, xname):
    x = xname(channel, "fanout")
    q1 = bound_queue(channel, x, "ignored")
    q2 = bound_queue(channel, x, "")
    channel.basic_publish(x, "whatever", b"1")
    channel.basic_publish(x, "", b"2")
    assert bodies(channel, q1) == [b"1", b"2"]
    assert bodies(channel, q2) == [b"1", b"2"]


def test_fanout_bound_twice_delivers_once(channel, xname):
    x = xname(channel, "fanout")
    q = bound_queue(channel, x, "k1")
    channel.queue_bind(q, x, "k2")
    channel.basic_publish(x, "", b"once")
    assert bodies(channel, q) == [b"once"]


def test_default_exchange_routes_by_queue_name(channel, name, cleanup):
    q = cleanup.queue(name("q.with.dots"))
    channel.queue_declare(q)
    channel.basic_publish("", q, b"direct-to-queue")
    channel.basic_publish("", q.upper(), b"wrong-case")
    assert bodies(channel, q) == [b"direct-to-queue"]


def test_amq_direct_predeclared_routes(channel):
    q = bound_queue(channel, "amq.direct", "compat-rk")
    channel.basic_publish("amq.direct", "compat-rk", b"x")
    assert bodies(channel, q) == [b"x"]
    channel.queue_unbind(q, "amq.direct", "compat-rk")


def test_routing_key_max_length(channel):
    q = channel.queue_declare("", exclusive=True).method.queue
    rk = "k" * 255
    channel.queue_bind(q, "amq.direct", rk)
    channel.basic_publish("amq.direct", rk, b"long-key")
    d = get(channel, q, auto_ack=True)
    assert d.body == b"long-key" and d.method.routing_key == rk
    channel.queue_unbind(q, "amq.direct", rk)


# --------------------------------------------------------------------------
# headers
# --------------------------------------------------------------------------

def _headers_case(channel, xname, binding_args, messages):
    x = xname(channel, "headers")
    q = bound_queue(channel, x, "ignored-routing-key", arguments=binding_args)
    for i, h in enumerate(messages):
        channel.basic_publish(x, "any-key", b"%d" % i, pika.BasicProperties(headers=h))
    return [int(b) for b in bodies(channel, q)]


MSGS = [
    {"a": "1", "b": "2"},          # 0: both
    {"a": "1"},                    # 1: only a
    {"b": "2"},                    # 2: only b
    {"a": "1", "b": "2", "c": 3},  # 3: both + extra
    {"a": "2", "b": "2"},          # 4: a has wrong value
    {},                            # 5: empty headers
    None,                          # 6: no headers property at all
    {"a": 1, "b": "2"},            # 7: a is an int, binding has a string
]


def test_headers_all(channel, xname):
    assert _headers_case(channel, xname, {"x-match": "all", "a": "1", "b": "2"}, MSGS) == [0, 3]


def test_headers_default_is_all(channel, xname):
    assert _headers_case(channel, xname, {"a": "1", "b": "2"}, MSGS) == [0, 3]


def test_headers_any(channel, xname):
    assert _headers_case(channel, xname, {"x-match": "any", "a": "1", "b": "2"}, MSGS) == [0, 1, 2, 3, 4, 7]


def test_headers_all_with_no_keys_matches_everything(channel, xname):
    assert _headers_case(channel, xname, {"x-match": "all"}, MSGS) == list(range(len(MSGS)))


def test_headers_any_with_no_keys_matches_nothing(channel, xname):
    assert _headers_case(channel, xname, {"x-match": "any"}, MSGS) == []


def test_headers_void_binding_value_matches_presence(channel, xname):
    msgs = [{"a": "anything"}, {"a": 5}, {"b": "x"}, {"a": None}]
    assert _headers_case(channel, xname, {"x-match": "all", "a": None}, msgs) == [0, 1, 3]


def test_headers_non_string_values(channel, xname):
    msgs = [{"n": 42, "t": True}, {"n": 42, "t": False}, {"n": "42", "t": True}, {"n": 43, "t": True}]
    assert _headers_case(channel, xname, {"x-match": "all", "n": 42, "t": True}, msgs) == [0]


def test_headers_x_args_ignored_by_all_and_any(channel, xname):
    # x-* binding arguments are not matched by 'all'/'any'.
    msgs = [{"a": "1"}, {"a": "1", "x-foo": "bar"}, {"x-foo": "bar"}]
    assert _headers_case(channel, xname, {"x-match": "all", "a": "1", "x-foo": "bar"}, msgs) == [0, 1]
    assert _headers_case(channel, xname, {"x-match": "any", "a": "1", "x-foo": "bar"}, msgs) == [0, 1]


def test_headers_all_with_x(channel, xname):
    # Supported since RabbitMQ 3.10: x-* arguments take part in the match.
    msgs = [{"a": "1"}, {"a": "1", "x-foo": "bar"}, {"x-foo": "bar"}]
    assert _headers_case(channel, xname, {"x-match": "all-with-x", "a": "1", "x-foo": "bar"}, msgs) == [1]


def test_headers_any_with_x(channel, xname):
    msgs = [{"a": "1"}, {"a": "1", "x-foo": "bar"}, {"x-foo": "bar"}, {"x-foo": "baz"}]
    assert _headers_case(channel, xname, {"x-match": "any-with-x", "a": "1", "x-foo": "bar"},
                         msgs) == [0, 1, 2]


def test_headers_invalid_x_match_value_is_406(channel, xname):
    x = xname(channel, "headers")
    q = channel.queue_declare("", exclusive=True).method.queue
    text = expect_channel_error(channel, 406, channel.queue_bind, q, x, "", arguments={"x-match": "foo"})
    assert text == ('PRECONDITION_FAILED - Invalid x-match field value <<"foo">>; '
                    "expected all, any, all-with-x, or any-with-x")


def test_headers_invalid_x_match_type_is_406(channel, xname):
    x = xname(channel, "headers")
    q = channel.queue_declare("", exclusive=True).method.queue
    text = expect_channel_error(channel, 406, channel.queue_bind, q, x, "", arguments={"x-match": 1})
    assert text == ("PRECONDITION_FAILED - Invalid x-match field type signedint (value 1); "
                    "expected longstr")


def test_headers_two_bindings_deliver_once(channel, xname):
    x = xname(channel, "headers")
    q = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(q, x, "", arguments={"x-match": "any", "a": "1"})
    channel.queue_bind(q, x, "", arguments={"x-match": "any", "b": "2"})
    channel.basic_publish(x, "", b"m", pika.BasicProperties(headers={"a": "1", "b": "2"}))
    assert bodies(channel, q) == [b"m"]


def test_headers_unbind_needs_same_arguments(channel, xname):
    x = xname(channel, "headers")
    q = bound_queue(channel, x, "", arguments={"a": "1"})
    channel.queue_unbind(q, x, "", arguments={"a": "2"})  # different args: not removed
    channel.basic_publish(x, "", b"1", pika.BasicProperties(headers={"a": "1"}))
    assert bodies(channel, q) == [b"1"]
    channel.queue_unbind(q, x, "", arguments={"a": "1"})
    channel.basic_publish(x, "", b"2", pika.BasicProperties(headers={"a": "1"}))
    assert bodies(channel, q) == []


def test_amq_match_is_a_headers_exchange(channel):
    q = bound_queue(channel, "amq.match", "", arguments={"compat-key": "v"})
    channel.basic_publish("amq.match", "", b"1", pika.BasicProperties(headers={"compat-key": "v"}))
    channel.basic_publish("amq.match", "", b"2", pika.BasicProperties(headers={"compat-key": "w"}))
    assert bodies(channel, q) == [b"1"]
    channel.queue_unbind(q, "amq.match", "", arguments={"compat-key": "v"})


# --------------------------------------------------------------------------
# exchange-to-exchange bindings
# --------------------------------------------------------------------------

def test_exchange_bind_routes(channel, xname):
    src = xname(channel, "topic")
    dst = xname(channel, "direct")
    r = channel.exchange_bind(dst, src, "a.*")
    assert isinstance(r.method, pika.spec.Exchange.BindOk)
    q = bound_queue(channel, dst, "a.b")
    channel.basic_publish(src, "a.b", b"1")   # src matches a.*, dst matches a.b
    channel.basic_publish(src, "a.c", b"2")   # src matches, dst has no a.c binding
    channel.basic_publish(src, "b.b", b"3")   # src doesn't match
    assert bodies(channel, q) == [b"1"]


def test_exchange_unbind_stops_routing(channel, xname):
    src = xname(channel, "fanout")
    dst = xname(channel, "fanout")
    channel.exchange_bind(dst, src)
    q = bound_queue(channel, dst)
    channel.basic_publish(src, "", b"1")
    r = channel.exchange_unbind(dst, src)
    assert isinstance(r.method, pika.spec.Exchange.UnbindOk)
    channel.basic_publish(src, "", b"2")
    assert bodies(channel, q) == [b"1"]


def test_exchange_bind_chain(channel, xname):
    a, b, c = (xname(channel, "fanout") for _ in range(3))
    channel.exchange_bind(b, a)
    channel.exchange_bind(c, b)
    q = bound_queue(channel, c)
    channel.basic_publish(a, "", b"through-chain")
    assert bodies(channel, q) == [b"through-chain"]


def test_exchange_bind_cycle_delivers_once(channel, xname):
    a, b = xname(channel, "fanout"), xname(channel, "fanout")
    channel.exchange_bind(b, a)
    channel.exchange_bind(a, b)
    q = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(q, a)
    channel.queue_bind(q, b)
    channel.basic_publish(a, "", b"once")
    assert bodies(channel, q) == [b"once"]


def test_queue_reached_by_two_paths_gets_one_copy(channel, xname):
    src = xname(channel, "fanout")
    dst = xname(channel, "fanout")
    channel.exchange_bind(dst, src)
    q = bound_queue(channel, src)
    channel.queue_bind(q, dst)
    channel.basic_publish(src, "", b"dedup")
    assert bodies(channel, q) == [b"dedup"]


def test_exchange_bind_missing_source_or_destination_is_404(connection, xname):
    ch = connection.channel()
    x = xname(ch, "fanout")
    text = expect_channel_error(ch, 404, ch.exchange_bind, x, "compat-missing-exchange-xyz")
    assert text == "NOT_FOUND - no exchange 'compat-missing-exchange-xyz' in vhost '/'"
    ch = connection.channel()
    expect_channel_error(ch, 404, ch.exchange_bind, "compat-missing-exchange-xyz", x)


def test_exchange_bind_default_exchange_is_403(connection, xname):
    ch = connection.channel()
    x = xname(ch, "fanout")
    text = expect_channel_error(ch, 403, ch.exchange_bind, "", x)
    assert text == "ACCESS_REFUSED - operation not permitted on the default exchange"
    ch = connection.channel()
    expect_channel_error(ch, 403, ch.exchange_bind, x, "")


def test_exchange_unbind_nonexistent_is_ok(channel, xname):
    a, b = xname(channel, "fanout"), xname(channel, "fanout")
    channel.exchange_unbind(b, a, "never")
    sync(channel)


def test_headers_exchange_as_e2e_destination(channel, xname):
    src = xname(channel, "fanout")
    dst = xname(channel, "headers")
    channel.exchange_bind(dst, src)
    q = bound_queue(channel, dst, arguments={"x-match": "all", "k": "v"})
    channel.basic_publish(src, "", b"1", pika.BasicProperties(headers={"k": "v"}))
    channel.basic_publish(src, "", b"2", pika.BasicProperties(headers={"k": "w"}))
    assert bodies(channel, q) == [b"1"]


# --------------------------------------------------------------------------
# alternate exchange
# --------------------------------------------------------------------------

def test_alternate_exchange_receives_unroutable(channel, xname):
    ae = xname(channel, "fanout")
    x = xname(channel, "direct", arguments={"alternate-exchange": ae})
    q_main = bound_queue(channel, x, "known")
    q_ae = bound_queue(channel, ae)
    channel.basic_publish(x, "known", b"routed")
    channel.basic_publish(x, "unknown", b"to-ae")
    assert bodies(channel, q_main) == [b"routed"]
    got = get_all(channel, q_ae)
    assert [d.body for d in got] == [b"to-ae"]
    assert (got[0].method.exchange, got[0].method.routing_key) == (x, "unknown")


def test_alternate_exchange_prevents_mandatory_return(connection, channel, xname):
    ae = xname(channel, "fanout")
    x = xname(channel, "direct", arguments={"alternate-exchange": ae})
    q_ae = bound_queue(channel, ae)
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    channel.basic_publish(x, "unknown", b"m", mandatory=True)
    assert bodies(channel, q_ae) == [b"m"]
    connection.process_data_events(time_limit=0.2)
    assert returned == []
