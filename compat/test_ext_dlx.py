"""RabbitMQ extension: dead-letter exchanges (x-dead-letter-exchange / -routing-key).

The x-death header is checked on the wire (ext_wire.raw_get) with its exact
layout: field order, AMQP type tags and values.  What RabbitMQ 3.10 writes:

* the dead-lettered message is published to the DLX with the routing key
  x-dead-letter-routing-key if set, else with *all* the original routing keys
  (publish key + CC + BCC); the delivered exchange is the DLX;
* headers gain x-death (array 'A' of tables 'F') and, only when the message
  had no x-death header at all, x-first-death-exchange/-queue/-reason
  (longstr 'S'); there are no x-last-death-* headers in 3.10;
* the whole header table is re-sorted by key (bytewise) on every death;
* a first x-death entry has the fields count('l'), reason, queue,
  time('T', seconds), exchange, routing-keys('A' of 'S') and, if the message
  had an expiration, original-expiration('S'), in that order; an entry that
  RabbitMQ writes into an existing x-death (new queue/reason, or a count
  increment of an existing one) has its fields sorted by name; the current
  death is always the first element of the array; other entries are left
  untouched;
* a count increment keeps the entry's original time, exchange and
  routing-keys;
* the expiration property is removed (kept as original-expiration); every
  other property is kept; with x-dead-letter-routing-key the CC header is
  removed.

Reasons: rejected (basic.reject/basic.nack with requeue=false), expired
(TTL), maxlen (x-max-length/-bytes, also reject-publish-dlx, see
test_ext_limits.py) and delivery_limit (quorum queues, see test_ext_consumers.py).
"""

import time
from datetime import datetime, timezone

import pika
import pytest

from ext_wire import (Field, death, header, header_names, raw_get, split_time, x_death)
from helpers import (Collector, expect_channel_error, get, get_all, message_count,
                     wait_for, wait_message_count)
from helpers import warren_deviation

P = pika.BasicProperties
FIRST_DEATH = ["x-first-death-exchange", "x-first-death-queue", "x-first-death-reason"]


@pytest.fixture
def qname(name, cleanup):
    """qname() -> a unique queue name, deleted at teardown (not declared)."""
    return lambda: cleanup.queue(name("q"))


@pytest.fixture
def declare(channel, qname):
    def _declare(arguments=None, q=None, **kw):
        q = q or qname()
        channel.queue_declare(q, arguments=arguments, **kw)
        return q
    return _declare


@pytest.fixture
def xdeclare(channel, name, cleanup):
    def _xdeclare(xtype, **kw):
        x = cleanup.exchange(name("x"))
        channel.exchange_declare(x, xtype, **kw)
        return x
    return _xdeclare


def to_queue(dq):
    """Queue arguments dead-lettering through the default exchange into dq."""
    return {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dq}


def reject(ch, q, how="reject"):
    d = get(ch, q)
    assert d is not None, "nothing to reject in %s" % q
    if how == "reject":
        ch.basic_reject(d.method.delivery_tag, requeue=False)
    else:
        ch.basic_nack(d.method.delivery_tag, requeue=False)
    return d


def fetch(ch, q, n=1):
    """Wait until q holds n messages, then take the first one on the wire."""
    assert wait_message_count(ch, q, n) == n, "expected %d message(s) in %s" % (n, q)
    m = raw_get(q)
    assert m is not None
    return m


def first_death_headers(exchange, queue, reason):
    return [Field("x-first-death-exchange", "S", exchange.encode()),
            Field("x-first-death-queue", "S", queue.encode()),
            Field("x-first-death-reason", "S", reason.encode())]


def assert_recent(t, slack=10):
    assert isinstance(t, int)
    assert abs(t - time.time()) < slack, "x-death time %r is not now (seconds)" % t


# --------------------------------------------------------------------------
# the first death: header layout
# --------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["reject", "nack"])
def test_rejected_message_x_death_layout(channel, declare, xdeclare, how):
    dlx = xdeclare("fanout")
    dq = declare()
    channel.queue_bind(dq, dlx)
    src = declare({"x-dead-letter-exchange": dlx})
    channel.basic_publish("", src, b"body")
    reject(channel, src, how)
    m = fetch(channel, dq)
    # Without x-dead-letter-routing-key the original routing key is kept; the
    # exchange is the DLX.
    assert (m.exchange, m.routing_key, m.redelivered, m.body) == (dlx, src, False, b"body")
    assert header_names(m) == ["x-death"] + FIRST_DEATH  # no x-last-death-* in 3.10
    assert m.properties["headers"][1:] == first_death_headers("", src, "rejected")
    deaths = x_death(m)
    assert len(deaths) == 1
    entry, t = split_time(deaths[0])
    assert entry == death(1, "rejected", src, "", [src])
    assert_recent(t)


def test_rejected_from_consumer_is_dead_lettered(connection, channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m")
    col = Collector()
    channel.basic_consume(src, col)
    assert wait_for(connection, lambda: len(col) == 1)
    channel.basic_reject(col.deliveries[0].method.delivery_tag, requeue=False)
    m = fetch(channel, dq)
    # With x-dead-letter-routing-key the message is routed (and delivered) with it.
    assert (m.exchange, m.routing_key) == ("", dq)
    entry, _ = split_time(x_death(m)[0])
    assert entry == death(1, "rejected", src, "", [src])


def test_expired_by_queue_ttl_x_death(channel, declare):
    dq = declare()
    src = declare(dict(to_queue(dq), **{"x-message-ttl": 50}))
    channel.basic_publish("", src, b"m", P(headers={"h": "v"}))
    m = fetch(channel, dq)
    assert header_names(m) == ["h", "x-death"] + FIRST_DEATH
    assert m.properties["headers"][2:] == first_death_headers("", src, "expired")
    entry, t = split_time(x_death(m)[0])
    assert entry == death(1, "expired", src, "", [src])  # no original-expiration
    assert_recent(t)
    assert "expiration" not in m.properties


def test_expired_by_message_ttl_records_original_expiration(channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m", P(expiration="20"))
    m = fetch(channel, dq)
    entry, _ = split_time(x_death(m)[0])
    assert entry == death(1, "expired", src, "", [src], original_expiration="20")
    # The expiration property itself is removed from the dead-lettered copy.
    assert "expiration" not in m.properties


def test_maxlen_x_death(channel, declare, xdeclare):
    x = xdeclare("direct")
    dq = declare()
    src = declare(dict(to_queue(dq), **{"x-max-length": 1}))
    channel.queue_bind(src, x, "rk")
    channel.basic_publish(x, "rk", b"old")
    channel.basic_publish(x, "rk", b"new")
    m = fetch(channel, dq)
    assert m.body == b"old"
    entry, _ = split_time(x_death(m)[0])
    assert entry == death(1, "maxlen", src, x, ["rk"])
    assert m.properties["headers"][1:] == first_death_headers(x, src, "maxlen")
    assert [d.body for d in get_all(channel, src)] == [b"new"]


def test_properties_kept_except_expiration(channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m", P(
        content_type="ct", content_encoding="ce", delivery_mode=2, priority=4,
        correlation_id="cid", reply_to="rt", expiration="60000", message_id="mid",
        timestamp=123, type="ty", user_id="guest", app_id="ai", cluster_id="cl"))
    reject(channel, src)
    m = fetch(channel, dq)
    props = dict(m.properties)
    del props["headers"]
    assert props == {"content_type": "ct", "content_encoding": "ce", "delivery_mode": 2,
                     "priority": 4, "correlation_id": "cid", "reply_to": "rt",
                     "message_id": "mid", "timestamp": 123, "type": "ty",
                     "user_id": "guest", "app_id": "ai", "cluster_id": "cl"}
    entry, _ = split_time(x_death(m)[0])
    assert entry == death(1, "rejected", src, "", [src], original_expiration="60000")


def test_headers_are_sorted_by_key_when_dead_lettered(channel, declare):
    # SURPRISE: RabbitMQ rewrites the header table sorted (bytewise) by key.
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m", P(headers={"zzz": 1, "aaa": 2, "x-zz": "q", "A": 3}))
    reject(channel, src)
    m = fetch(channel, dq)
    assert header_names(m) == ["A", "aaa", "x-death"] + FIRST_DEATH + ["x-zz", "zzz"]
    assert header(m, "zzz") == Field("zzz", "I", 1)  # values and types untouched


def test_dead_lettered_with_routing_key_drops_cc_header(channel, declare, xdeclare):
    x = xdeclare("direct")
    dq = declare()
    src = declare(to_queue(dq))
    channel.queue_bind(src, x, "k1")
    channel.queue_bind(src, x, "k2")
    channel.basic_publish(x, "k1", b"m", P(headers={"CC": ["k2", "zz"], "BCC": ["k3"]}))
    reject(channel, src)
    m = fetch(channel, dq)
    # routing-keys: publish key + CC keys (the BCC header was stripped at
    # publish time, so BCC keys never appear); the CC header is removed.
    assert header_names(m) == ["x-death"] + FIRST_DEATH
    entry, _ = split_time(x_death(m)[0])
    assert entry == death(1, "rejected", src, x, ["k1", "k2", "zz"])
    assert m.routing_key == dq


@warren_deviation("BCC keys are not kept for dead-letter routing")
def test_dead_lettered_without_routing_key_uses_cc_and_bcc_keys(channel, declare, xdeclare):
    x = xdeclare("direct")
    dlx = xdeclare("direct")
    qa, qb, qc, qd = declare(), declare(), declare(), declare()
    for q, k in [(qa, "a"), (qb, "b"), (qc, "c"), (qd, "d")]:
        channel.queue_bind(q, dlx, k)
    src = declare({"x-dead-letter-exchange": dlx})
    channel.queue_bind(src, x, "a")
    channel.basic_publish(x, "a", b"m", P(headers={"CC": ["b"], "BCC": ["c"]}))
    reject(channel, src)
    # SURPRISE: the BCC key still routes at the DLX although the BCC header is gone.
    for q in (qa, qb, qc):
        assert wait_message_count(channel, q, 1) == 1
    m = raw_get(qc)
    assert (m.exchange, m.routing_key) == (dlx, "a")
    assert header_names(m) == ["CC", "x-death"] + FIRST_DEATH
    assert header(m, "CC") == Field("CC", "A", [("S", b"b")])
    entry, _ = split_time(x_death(m)[0])
    assert entry == death(1, "rejected", src, x, ["a", "b"])
    assert message_count(channel, qd) == 0


# --------------------------------------------------------------------------
# later deaths
# --------------------------------------------------------------------------

@warren_deviation("older x-death entries are re-encoded with sorted fields")
def test_second_death_on_another_queue(channel, declare, xdeclare):
    fx = xdeclare("fanout")
    final = declare()
    q2 = declare(to_queue(final))
    channel.queue_bind(q2, fx)
    q1 = declare({"x-dead-letter-exchange": fx, "x-message-ttl": 10})
    channel.basic_publish("", q1, b"m", P(expiration="100000", headers={"b": 1, "a": 2}))
    assert wait_message_count(channel, q2, 1) == 1
    d = reject(channel, q2)
    assert (d.method.exchange, d.method.routing_key) == (fx, q1)
    m = fetch(channel, final)
    assert header_names(m) == ["a", "b", "x-death"] + FIRST_DEATH
    # x-first-death-* keep describing the first death.
    assert m.properties["headers"][3:] == first_death_headers("", q1, "expired")
    d_new, d_old = x_death(m)
    # Newest first; the new entry is sorted by field name, the old one untouched.
    # The new entry's exchange/routing-keys are those the message had at q2:
    # the DLX it came through and its original routing key.
    assert split_time(d_new)[0] == death(1, "rejected", q2, fx, [q1], sort=True)
    assert [f.name for f in d_new] == ["count", "exchange", "queue", "reason",
                                       "routing-keys", "time"]
    assert split_time(d_old)[0] == death(1, "expired", q1, "", [q1],
                                         original_expiration="100000")


def test_repeated_deaths_increment_count_and_move_entry_first(channel, declare, qname):
    # a and b dead-letter into each other; every rejection is a death.
    a, b = qname(), qname()
    declare(to_queue(b), q=a)
    declare(to_queue(a), q=b)
    channel.basic_publish("", a, b"m")
    for q in [a, b, a, b, a]:
        reject(channel, q)
    m = fetch(channel, b)
    assert header_names(m) == ["x-death"] + FIRST_DEATH
    assert m.properties["headers"][1:] == first_death_headers("", a, "rejected")
    d1, d2 = x_death(m)
    assert split_time(d1)[0] == death(3, "rejected", a, "", [a], sort=True)
    assert split_time(d2)[0] == death(2, "rejected", b, "", [b], sort=True)


def test_count_increment_keeps_first_time(channel, declare):
    # A queue dead-lettering into itself (default exchange, no routing key):
    # rejection cycles are allowed.  The count goes up; 'time' stays the time
    # of the first death for that queue and reason.
    q = declare({"x-dead-letter-exchange": ""})
    channel.basic_publish("", q, b"m")
    reject(channel, q)
    d = get(channel, q)
    first = d.properties.headers["x-death"][0]
    assert first["count"] == 1
    t1 = first["time"]
    assert isinstance(t1, datetime)
    channel.connection.sleep(1.2)
    channel.basic_reject(d.method.delivery_tag, requeue=False)
    m = fetch(channel, q)
    (entry,) = x_death(m)
    entry, t2 = split_time(entry)
    assert entry == death(2, "rejected", q, "", [q], sort=True)
    assert t2 == int(t1.replace(tzinfo=timezone.utc).timestamp())
    assert m.routing_key == q


def test_x_death_of_wrong_type_is_replaced(channel, declare):
    # A non-array x-death is replaced by a fresh one; since the message had an
    # x-death header, no x-first-death-* headers are added.
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m", P(headers={"x-death": "bogus"}))
    reject(channel, src)
    m = fetch(channel, dq)
    assert header_names(m) == ["x-death"]
    (entry,) = x_death(m)
    assert split_time(entry)[0] == death(1, "rejected", src, "", [src])


def test_client_supplied_x_death_entry_is_incremented(channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m", P(headers={
        "x-death": [{"queue": src, "reason": "rejected", "count": 5}],
        "x-first-death-queue": "fake"}))
    reject(channel, src)
    m = fetch(channel, dq)
    assert header_names(m) == ["x-death", "x-first-death-queue"]
    assert header(m, "x-first-death-queue").value == b"fake"
    # Matched on queue + reason: only count changes (and becomes a long-long).
    assert x_death(m) == [[Field("count", "l", 6), Field("queue", "S", src.encode()),
                           Field("reason", "S", b"rejected")]]


def test_empty_x_death_array_counts_as_present(channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"m", P(headers={"x-death": []}))
    reject(channel, src)
    m = fetch(channel, dq)
    assert header_names(m) == ["x-death"]
    (entry,) = x_death(m)
    assert split_time(entry)[0] == death(1, "rejected", src, "", [src], sort=True)


# --------------------------------------------------------------------------
# cycles
# --------------------------------------------------------------------------

def test_expiry_self_cycle_is_dropped(channel, declare):
    # Dead-lettered back into the same queue by expiry: a cycle without a
    # rejection, which RabbitMQ drops (with a log warning).
    q = declare({"x-dead-letter-exchange": "", "x-message-ttl": 50})
    channel.basic_publish("", q, b"m")
    channel.connection.sleep(0.4)
    assert wait_message_count(channel, q, 0) == 0
    channel.connection.sleep(0.2)
    assert message_count(channel, q) == 0


def test_expiry_cycle_between_two_queues_is_dropped(channel, declare, qname):
    a, b = qname(), qname()
    declare(dict(to_queue(b), **{"x-message-ttl": 50}), q=a)
    declare(dict(to_queue(a), **{"x-message-ttl": 50}), q=b)
    channel.basic_publish("", a, b"m")
    # a -> b (expired at a), then b -> a would close a cycle: dropped.
    channel.connection.sleep(0.5)
    assert (message_count(channel, a), message_count(channel, b)) == (0, 0)
    channel.connection.sleep(0.2)
    assert (message_count(channel, a), message_count(channel, b)) == (0, 0)


def test_cycle_with_a_rejection_is_not_dropped(channel, declare, qname):
    a, b = qname(), qname()
    declare(dict(to_queue(b), **{"x-message-ttl": 50}), q=a)
    declare(to_queue(a), q=b)
    channel.basic_publish("", a, b"m")
    assert wait_message_count(channel, b, 1) == 1   # expired at a
    reject(channel, b)                               # rejected at b -> a
    m = fetch(channel, b)                            # expired at a again -> b
    d1, d2 = x_death(m)
    assert split_time(d1)[0] == death(2, "expired", a, "", [a], sort=True)
    assert split_time(d2)[0] == death(1, "rejected", b, "", [b], sort=True)
    assert m.properties["headers"][1:] == first_death_headers("", a, "expired")


def test_maxlen_self_cycle_is_dropped(channel, declare):
    q = declare({"x-dead-letter-exchange": "", "x-max-length": 1})
    channel.basic_publish("", q, b"1")
    channel.basic_publish("", q, b"2")
    channel.connection.sleep(0.3)
    assert [d.body for d in get_all(channel, q)] == [b"2"]


# --------------------------------------------------------------------------
# where it goes (or doesn't)
# --------------------------------------------------------------------------

def test_missing_dead_letter_exchange_drops_silently(channel, declare, name):
    q = declare({"x-dead-letter-exchange": name("missing-x")})
    channel.basic_publish("", q, b"m")
    reject(channel, q)
    channel.connection.sleep(0.1)
    assert channel.is_open
    assert message_count(channel, q) == 0


def test_unroutable_at_dlx_is_dropped_and_alternate_exchange_applies(channel, declare, xdeclare):
    ae = xdeclare("fanout")
    aeq = declare()
    channel.queue_bind(aeq, ae)
    plain = xdeclare("direct")
    with_ae = xdeclare("direct", arguments={"alternate-exchange": ae})
    q1 = declare({"x-dead-letter-exchange": plain})
    q2 = declare({"x-dead-letter-exchange": with_ae})
    channel.basic_publish("", q1, b"lost")
    channel.basic_publish("", q2, b"to-ae")
    reject(channel, q1)
    reject(channel, q2)
    m = fetch(channel, aeq)
    assert (m.exchange, m.routing_key, m.body) == (with_ae, q2, b"to-ae")
    assert message_count(channel, q1) == 0
    assert wait_message_count(channel, aeq, 0) == 0


def test_not_dead_lettered_on_requeue_purge_close_or_delete(connection, channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    channel.basic_publish("", src, b"1")
    channel.basic_publish("", src, b"2")
    assert wait_message_count(channel, src, 2) == 2
    channel.queue_purge(src)
    channel.basic_publish("", src, b"3")
    d = get(channel, src)
    channel.basic_reject(d.method.delivery_tag, requeue=True)
    d = get(channel, src)
    channel.basic_nack(d.method.delivery_tag, requeue=True)
    other = connection.channel()
    assert get(other, src) is not None
    other.close()  # unacked: requeued, not dead-lettered
    assert wait_message_count(channel, src, 1) == 1
    channel.queue_delete(src)
    channel.connection.sleep(0.2)
    assert message_count(channel, dq) == 0


def test_queue_expiry_does_not_dead_letter(connection, channel, declare):
    dq = declare()
    src = declare(dict(to_queue(dq), **{"x-expires": 200}))
    channel.basic_publish("", src, b"m")
    connection.sleep(0.6)
    ch = connection.channel()
    expect_channel_error(ch, 404, ch.queue_declare, src, passive=True)
    assert message_count(channel, dq) == 0


def test_nack_multiple_dead_letters_in_order(channel, declare):
    dq = declare()
    src = declare(to_queue(dq))
    for i in range(3):
        channel.basic_publish("", src, b"%d" % i)
    ds = [get(channel, src) for _ in range(3)]
    channel.basic_nack(ds[-1].method.delivery_tag, multiple=True, requeue=False)
    assert wait_message_count(channel, dq, 3) == 3
    assert [d.body for d in get_all(channel, dq)] == [b"0", b"1", b"2"]


def test_default_exchange_dlx_without_routing_key_goes_back_to_source(channel, declare):
    # DLX "" and no routing key: the original key (the queue name) routes the
    # message straight back to its queue, at the tail.
    q = declare({"x-dead-letter-exchange": ""})
    channel.basic_publish("", q, b"first")
    channel.basic_publish("", q, b"second")
    reject(channel, q)
    assert wait_message_count(channel, q, 2) == 2
    got = get_all(channel, q)
    assert [d.body for d in got] == [b"second", b"first"]
    assert got[1].properties.headers["x-first-death-reason"] == "rejected"


# --------------------------------------------------------------------------
# invalid arguments
# --------------------------------------------------------------------------

@pytest.mark.parametrize("args,text", [
    ({"x-dead-letter-exchange": 1},
     "PRECONDITION_FAILED - invalid type 'signedint' for arg 'x-dead-letter-exchange' in "
     "queue '{q}' in vhost '/'"),
    ({"x-dead-letter-routing-key": "k"},
     "PRECONDITION_FAILED - invalid arg 'x-dead-letter-routing-key' for queue '{q}' in "
     "vhost '/': routing_key_but_no_dlx_defined"),
    ({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": 1},
     "PRECONDITION_FAILED - invalid arg 'x-dead-letter-routing-key' for queue '{q}' in "
     "vhost '/': {unacceptable_type,signedint}"),
])
def test_invalid_dead_letter_arguments_are_406(channel, name, args, text):
    q = name("q")
    got = expect_channel_error(channel, 406, channel.queue_declare, q, arguments=args)
    assert got == text.replace("{q}", q)


def test_dead_letter_exchange_need_not_exist_at_declare(channel, declare, name):
    q = declare({"x-dead-letter-exchange": name("later-x"), "x-dead-letter-routing-key": "k"})
    assert channel.queue_declare(q, passive=True).method.queue == q
