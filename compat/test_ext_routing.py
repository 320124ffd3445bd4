"""RabbitMQ routing extensions: sender-selected distribution (CC / BCC headers)
and direct reply-to (amq.rabbitmq.reply-to).

Alternate exchanges are covered in test_routing.py.

CC/BCC (RabbitMQ 3.10): the headers "CC" and "BCC" (exact case) must be
arrays; their longstr elements are extra routing keys for the same exchange
(other element types are ignored).  A queue matched by several keys gets one
copy.  Deliveries carry the publish routing key.  "BCC" is removed from the
stored message (the headers property stays present, possibly as an empty
table); "CC" is kept.  A CC/BCC header that is not an array closes the
channel with 406.

Direct reply-to: a channel consumes (no-ack) from the pseudo-queue
amq.rabbitmq.reply-to and publishes requests with reply_to set to that name;
the broker rewrites reply_to to amq.rabbitmq.reply-to.<opaque> and replies
published to that name on the default exchange go straight to the consumer.
"""

import re

import pika
import pytest

from ext_wire import Field, raw_get
from helpers import (Collector, expect_channel_error, get, settle, sync, wait_for,
                     wait_message_count)
from helpers import warren_deviation

P = pika.BasicProperties
RT = "amq.rabbitmq.reply-to"
RT_NAME = re.compile(r"^amq\.rabbitmq\.reply-to\.\S+$")


@pytest.fixture
def xdeclare(channel, name, cleanup):
    def _xdeclare(xtype, **kw):
        x = cleanup.exchange(name("x"))
        channel.exchange_declare(x, xtype, **kw)
        return x
    return _xdeclare


@pytest.fixture
def bound(channel, name, cleanup):
    """bound(exchange, key) -> a new (non-exclusive) queue bound with key."""
    def _bound(exchange, key):
        q = cleanup.queue(name("q"))
        channel.queue_declare(q)
        channel.queue_bind(q, exchange, key)
        return q
    return _bound


def counts(ch, queues, settle_s=0.2):
    ch.connection.sleep(settle_s)
    return [ch.queue_declare(q, passive=True).method.message_count for q in queues]


# --------------------------------------------------------------------------
# CC / BCC
# --------------------------------------------------------------------------

def test_cc_and_bcc_route_with_extra_keys(channel, xdeclare, bound):
    x = xdeclare("direct")
    qa, qb, qc, qd = (bound(x, k) for k in "abcd")
    channel.basic_publish(x, "a", b"m", P(headers={"CC": ["b"], "BCC": ["c"], "other": 1}))
    assert [wait_message_count(channel, q, 1) for q in (qa, qb, qc)] == [1, 1, 1]
    assert counts(channel, [qd]) == [0]
    for q in (qa, qb, qc):
        m = raw_get(q)
        # Same message everywhere: publish routing key, CC kept, BCC gone.
        assert (m.exchange, m.routing_key, m.body) == (x, "a", b"m")
        assert m.properties["headers"] == [Field("CC", "A", [("S", b"b")]),
                                           Field("other", "I", 1)]


def test_bcc_only_leaves_empty_headers_table(channel, xdeclare, bound):
    x = xdeclare("direct")
    qa, qb = bound(x, "a"), bound(x, "b")
    channel.basic_publish(x, "a", b"m", P(headers={"BCC": ["b"]}))
    assert wait_message_count(channel, qb, 1) == 1
    for q in (qa, qb):
        m = raw_get(q)
        assert m.properties == {"headers": []}  # present, but empty


def test_cc_duplicates_deliver_once(channel, xdeclare, bound):
    x = xdeclare("direct")
    qa, qb = bound(x, "a"), bound(x, "b")
    channel.basic_publish(x, "a", b"m", P(headers={"CC": ["b", "b", "a"], "BCC": ["a"]}))
    assert counts(channel, [qa, qb]) == [1, 1]


def test_cc_keys_match_topic_patterns(channel, xdeclare, bound):
    x = xdeclare("topic")
    q = bound(x, "*.y")
    other = bound(x, "z.#")
    channel.basic_publish(x, "nomatch", b"m", P(headers={"CC": ["a.y", "b.y"]}))
    assert counts(channel, [q, other]) == [1, 0]
    assert get(channel, q, auto_ack=True).method.routing_key == "nomatch"


def test_cc_on_default_exchange(channel, name, cleanup):
    qa, qb, qc = (cleanup.queue(name("q")) for _ in range(3))
    for q in (qa, qb, qc):
        channel.queue_declare(q)
    channel.basic_publish("", qa, b"m", P(headers={"CC": [qb], "BCC": [qc]}))
    assert counts(channel, [qa, qb, qc]) == [1, 1, 1]
    d = get(channel, qc, auto_ack=True)
    assert (d.method.exchange, d.method.routing_key) == ("", qa)


def test_fanout_ignores_cc(channel, xdeclare, bound):
    x = xdeclare("fanout")
    q = bound(x, "")
    channel.basic_publish(x, "k", b"m", P(headers={"CC": ["a", "b"]}))
    assert counts(channel, [q]) == [1]


@pytest.mark.parametrize("hdr", ["CC", "BCC"])
def test_mandatory_satisfied_by_cc_or_bcc_key(connection, channel, xdeclare, bound, hdr):
    x = xdeclare("direct")
    q = bound(x, "b")
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    channel.basic_publish(x, "nomatch", b"m", P(headers={hdr: ["b"]}), mandatory=True)
    assert wait_message_count(channel, q, 1) == 1
    settle(connection, 0.2)
    assert returned == []


@warren_deviation("removing BCC re-encodes the header table sorted by key")
def test_cc_non_string_elements_and_other_case_ignored(channel, xdeclare, bound):
    x = xdeclare("direct")
    qa, qb, qc = bound(x, "a"), bound(x, "b"), bound(x, "c")
    channel.basic_publish(x, "a", b"m", P(headers={
        "zz": 1, "CC": [1, "b", True], "cc": ["c"], "BCC": ["x"], "Bcc": ["c"], "aa": 2}))
    assert counts(channel, [qa, qb, qc]) == [1, 1, 0]
    # Only BCC is removed; the rest keeps its order (no sorting here) and CC
    # keeps its non-string elements.
    assert raw_get(qb).properties["headers"] == [
        Field("zz", "I", 1), Field("CC", "A", [("I", 1), ("S", b"b"), ("t", True)]),
        Field("cc", "A", [("S", b"c")]), Field("Bcc", "A", [("S", b"c")]),
        Field("aa", "I", 2)]


@pytest.mark.parametrize("headers,detail", [
    ({"CC": "b"}, '{unacceptable_type_in_header,"CC",longstr}'),
    ({"BCC": "c"}, '{unacceptable_type_in_header,"BCC",longstr}'),
    ({"CC": None}, '{unacceptable_type_in_header,"CC",void}'),
    ({"CC": 5}, '{unacceptable_type_in_header,"CC",signedint}'),
])
def test_cc_bcc_not_an_array_is_406(channel, headers, detail):
    text = expect_channel_error(channel, 406, channel.basic_publish, "amq.direct", "k", b"m",
                                P(headers=headers))
    assert text == "PRECONDITION_FAILED - invalid message: %s" % detail


# --------------------------------------------------------------------------
# direct reply-to
# --------------------------------------------------------------------------

@pytest.fixture
def rpc(connection, name, cleanup):
    """(requester channel with a reply consumer, its collector, responder channel, server queue)."""
    req = connection.channel()
    replies = Collector()
    req.basic_consume(RT, replies, auto_ack=True)
    resp = connection.channel()
    srv = cleanup.queue(name("srv"))
    resp.queue_declare(srv)
    return req, replies, resp, srv


def test_direct_reply_to_round_trip(connection, rpc):
    req, replies, resp, srv = rpc
    req.basic_publish("", srv, b"request", P(reply_to=RT, correlation_id="c1"))
    d = get(resp, srv, auto_ack=True)
    reply_to = d.properties.reply_to
    assert RT_NAME.match(reply_to), reply_to
    assert len(reply_to.encode()) <= 255
    assert d.properties.correlation_id == "c1"
    resp.basic_publish("", reply_to, b"reply", P(correlation_id="c1"))
    assert wait_for(connection, lambda: len(replies) == 1)
    r = replies.deliveries[0]
    assert (r.method.exchange, r.method.routing_key, r.method.redelivered) == ("", reply_to,
                                                                                False)
    assert r.properties.correlation_id == "c1"
    assert r.body == b"reply"


def test_reply_to_name_stable_per_channel_and_distinct_across(connection, rpc, name, cleanup):
    req, replies, resp, srv = rpc
    other = connection.channel()
    other.basic_consume(RT, lambda *a: None, auto_ack=True)
    for ch in (req, req, other):
        ch.basic_publish("", srv, b"r", P(reply_to=RT))
    seen = [get(resp, srv, auto_ack=True).properties.reply_to for _ in range(3)]
    assert seen[0] == seen[1]
    assert seen[2] != seen[0]
    assert all(RT_NAME.match(s) for s in seen)


def test_reply_to_without_reply_consumer_is_406(channel):
    text = expect_channel_error(channel, 406, channel.basic_publish, "", "nowhere", b"x",
                                P(reply_to=RT))
    assert text == "PRECONDITION_FAILED - fast reply consumer does not exist"


def test_reply_consumer_on_other_channel_does_not_count(connection):
    connection.channel().basic_consume(RT, lambda *a: None, auto_ack=True)
    ch = connection.channel()
    text = expect_channel_error(ch, 406, ch.basic_publish, "", "nowhere", b"x",
                                P(reply_to=RT))
    assert text == "PRECONDITION_FAILED - fast reply consumer does not exist"


def test_reply_to_after_reply_consumer_cancelled_is_406(connection):
    ch = connection.channel()
    tag = ch.basic_consume(RT, lambda *a: None, auto_ack=True)
    ch.basic_publish("", "nowhere", b"x", P(reply_to=RT))
    sync(ch)
    ch.basic_cancel(tag)
    text = expect_channel_error(ch, 406, ch.basic_publish, "", "nowhere", b"x",
                                P(reply_to=RT))
    assert text == "PRECONDITION_FAILED - fast reply consumer does not exist"


@pytest.mark.parametrize("reply_to", [RT + ".foo", "amq.rabbitmq.reply-tox", "plain"])
def test_other_reply_to_values_are_not_checked(channel, reply_to):
    channel.basic_publish("", "nowhere", b"x", P(reply_to=reply_to))
    sync(channel)
    assert channel.is_open


def test_reply_consumer_must_be_no_ack(channel):
    text = expect_channel_error(channel, 406, channel.basic_consume, RT, lambda *a: None)
    assert text == "PRECONDITION_FAILED - reply consumer cannot acknowledge"


def test_second_reply_consumer_on_channel_is_406(channel):
    channel.basic_consume(RT, lambda *a: None, auto_ack=True)
    text = expect_channel_error(channel, 406, channel.basic_consume, RT, lambda *a: None,
                                auto_ack=True)
    assert text == "PRECONDITION_FAILED - reply consumer already set"


def test_reply_consumer_tag_and_exclusive_flag(channel):
    assert channel.basic_consume(RT, lambda *a: None, auto_ack=True, exclusive=True,
                                 consumer_tag="my-reply-tag") == "my-reply-tag"
    sync(channel)


@pytest.mark.parametrize("passive", [True, False])
def test_declare_reply_to_pseudo_queue(connection, passive):
    # Not 403 (amq.* prefix) nor 404: declare-ok(queue, 0 messages, 1 consumer)
    # even when this channel has no reply consumer.
    ch = connection.channel()
    ok = ch.queue_declare(RT, passive=passive).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (RT, 0, 1)


def test_passive_declare_of_issued_reply_name(connection, rpc):
    req, replies, resp, srv = rpc
    req.basic_publish("", srv, b"r", P(reply_to=RT))
    reply_to = get(resp, srv, auto_ack=True).properties.reply_to
    ok = resp.queue_declare(reply_to, passive=True).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (reply_to, 0, 1)


def test_passive_declare_of_bogus_reply_name_is_404(channel):
    text = expect_channel_error(channel, 404, channel.queue_declare, RT + ".bogus",
                                passive=True)
    assert text == "NOT_FOUND - no queue 'amq.rabbitmq.reply-to.bogus' in vhost '/'"


@pytest.mark.parametrize("op", ["bind", "get", "purge"])
def test_reply_to_pseudo_queue_is_not_a_queue(channel, op):
    fn = {"bind": lambda: channel.queue_bind(RT, "amq.direct", "k"),
          "get": lambda: channel.basic_get(RT),
          "purge": lambda: channel.queue_purge(RT)}[op]
    text = expect_channel_error(channel, 404, fn)
    assert text == "NOT_FOUND - no queue 'amq.rabbitmq.reply-to' in vhost '/'"


def test_delete_reply_to_pseudo_queue_is_ok(channel):
    assert channel.queue_delete(RT).method.message_count == 0


def test_reply_to_unknown_name_is_dropped_or_returned(connection, rpc):
    req, replies, resp, srv = rpc
    returned = []
    resp.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    resp.basic_publish("", RT + ".bogus", b"lost")
    resp.basic_publish("", RT, b"lost too")
    resp.basic_publish("", RT + ".bogus", b"returned", mandatory=True)
    assert wait_for(connection, lambda: len(returned) == 1)
    settle(connection, 0.2)
    assert (returned[0].reply_code, returned[0].reply_text, returned[0].routing_key) == (
        312, "NO_ROUTE", RT + ".bogus")
    assert replies.bodies == []
    assert resp.is_open


@warren_deviation("a mandatory direct reply that is delivered is not also returned")
def test_mandatory_reply_is_delivered_and_also_returned(connection, rpc):
    # SURPRISE: replies bypass queue routing, so a mandatory reply is both
    # delivered to the requester and returned 312 NO_ROUTE to the responder.
    req, replies, resp, srv = rpc
    returned = []
    resp.add_on_return_callback(lambda ch, m, p, b: returned.append((m, b)))
    req.basic_publish("", srv, b"r", P(reply_to=RT))
    reply_to = get(resp, srv, auto_ack=True).properties.reply_to
    resp.basic_publish("", reply_to, b"reply", mandatory=True)
    assert wait_for(connection, lambda: len(replies) == 1 and len(returned) == 1)
    m, body = returned[0]
    assert (m.exchange, m.routing_key, m.reply_code, m.reply_text, body) == (
        "", reply_to, 312, "NO_ROUTE", b"reply")


def test_reply_via_other_exchange_is_not_delivered(connection, rpc):
    req, replies, resp, srv = rpc
    returned = []
    resp.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    req.basic_publish("", srv, b"r", P(reply_to=RT))
    reply_to = get(resp, srv, auto_ack=True).properties.reply_to
    resp.basic_publish("amq.direct", reply_to, b"reply", mandatory=True)
    assert wait_for(connection, lambda: len(returned) == 1)
    settle(connection, 0.2)
    assert replies.bodies == []
    assert returned[0].exchange == "amq.direct"


def test_reply_after_requester_cancelled_is_dropped(connection, rpc):
    req, replies, resp, srv = rpc
    req.basic_publish("", srv, b"r", P(reply_to=RT))
    reply_to = get(resp, srv, auto_ack=True).properties.reply_to
    (tag,) = req.consumer_tags
    req.basic_cancel(tag)
    returned = []
    resp.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    resp.basic_publish("", reply_to, b"late")
    resp.basic_publish("", reply_to, b"late", mandatory=True)
    assert wait_for(connection, lambda: len(returned) == 1)
    settle(connection, 0.2)
    assert replies.bodies == []
    assert resp.is_open
