"""RabbitMQ extensions: message TTL (x-message-ttl, expiration) and queue TTL (x-expires).

Timing notes: RabbitMQ removes expired messages at the head of a queue with a
timer, even without consumers or basic.get, so message counts reach 0 on their
own.  Queue expiry (x-expires) is a per-queue timer that is restarted by
queue.declare (active or passive), basic.get and consumers, but not by
publishing.  A passive declare to *check* an x-expires queue therefore resets
its timer: the tests look only once, after the deadline.

basic.publish and a following passive declare are not ordered in RabbitMQ
(the publish reaches the queue through another process), so counts are always
read with bounded polling (helpers.wait_message_count).
"""

import time

import pika
import pytest

from helpers import (Collector, expect_channel_error, get, get_all, message_count,
                     settle, wait_for, wait_message_count)

P = pika.BasicProperties
MAX_TTL = 315360000000  # 10 years in ms: the largest TTL / expiry RabbitMQ accepts


@pytest.fixture
def declare(channel, name, cleanup):
    """declare(arguments) -> a fresh queue with those arguments (deleted afterwards)."""
    def _declare(arguments=None, **kw):
        q = cleanup.queue(name("q"))
        channel.queue_declare(q, arguments=arguments, **kw)
        return q
    return _declare


def exists(connection, q):
    """True if q exists, else the passive-declare error code (404).

    Careful: on an x-expires queue this *resets* the expiry timer.
    """
    ch = connection.channel()
    try:
        ch.queue_declare(q, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        return e.reply_code
    ch.close()
    return True


# --------------------------------------------------------------------------
# x-message-ttl / expiration
# --------------------------------------------------------------------------

def test_queue_ttl_removes_messages_without_consumers(channel, declare):
    # Nobody consumes or gets: the head timer still removes expired messages.
    q = declare({"x-message-ttl": 100})
    for i in range(3):
        channel.basic_publish("", q, b"m%d" % i)
    channel.connection.sleep(0.4)
    assert wait_message_count(channel, q, 0, timeout=3) == 0
    assert channel.basic_get(q) == (None, None, None)


def test_queue_ttl_keeps_messages_until_it_passes(channel, declare):
    q = declare({"x-message-ttl": 60000})
    for i in range(3):
        channel.basic_publish("", q, b"m%d" % i)
    assert wait_message_count(channel, q, 3) == 3
    channel.connection.sleep(0.3)
    assert message_count(channel, q) == 3
    got = get_all(channel, q)
    assert [d.body for d in got] == [b"m0", b"m1", b"m2"]
    # The queue TTL is not written into the message's expiration property.
    assert [d.properties.expiration for d in got] == [None, None, None]


@pytest.mark.parametrize("queue_ttl,expiration", [(100, "60000"), (60000, "100")])
def test_lower_of_queue_ttl_and_expiration_wins(channel, declare, queue_ttl, expiration):
    q = declare({"x-message-ttl": queue_ttl})
    channel.basic_publish("", q, b"m", P(expiration=expiration))
    channel.connection.sleep(0.4)
    assert wait_message_count(channel, q, 0, timeout=3) == 0
    assert channel.basic_get(q) == (None, None, None)


def test_per_message_ttl_expires_only_at_the_head(channel, declare):
    # SURPRISE (documented RabbitMQ behaviour): a short-lived message behind a
    # long-lived one is not removed (nor counted out) until it reaches the head.
    q = declare()
    channel.basic_publish("", q, b"long", P(expiration="60000"))
    channel.basic_publish("", q, b"short", P(expiration="50"))
    assert wait_message_count(channel, q, 2) == 2
    channel.connection.sleep(0.3)
    assert message_count(channel, q) == 2
    d = get(channel, q)
    assert d.body == b"long"
    channel.basic_ack(d.method.delivery_tag)
    # Now 'short' is at the head and long expired: gone, never delivered.
    assert channel.basic_get(q) == (None, None, None)
    assert wait_message_count(channel, q, 0) == 0


def test_expired_message_not_delivered_to_later_consumer(connection, channel, declare):
    q = declare()
    channel.basic_publish("", q, b"gone", P(expiration="50"))
    channel.basic_publish("", q, b"kept", P(expiration="60000"))
    channel.connection.sleep(0.3)
    col = Collector()
    channel.basic_consume(q, col, auto_ack=True)
    assert wait_for(connection, lambda: len(col) >= 1)
    settle(connection, 0.2)
    assert col.bodies == [b"kept"]
    assert col.deliveries[0].properties.expiration == "60000"


def test_messages_expire_while_consumer_is_blocked_by_prefetch(connection, channel, declare):
    q = declare({"x-message-ttl": 200})
    cons = connection.channel()
    cons.basic_qos(prefetch_count=1)
    col = Collector()
    cons.basic_consume(q, col)
    for i in range(3):
        channel.basic_publish("", q, b"m%d" % i)
    assert wait_for(connection, lambda: len(col) >= 1)
    # m1 and m2 wait behind the full prefetch window and expire there.
    settle(connection, 0.4)
    assert wait_message_count(channel, q, 0, timeout=3) == 0
    # The delivered (unacked) message is not affected by the TTL.
    cons.basic_ack(col.deliveries[0].method.delivery_tag)
    settle(connection, 0.3)
    assert col.bodies == [b"m0"]


def test_queue_ttl_zero_delivers_to_waiting_consumer(connection, channel, declare):
    q = declare({"x-message-ttl": 0})
    col = Collector()
    channel.basic_consume(q, col, auto_ack=True)
    channel.basic_publish("", q, b"now")
    assert wait_for(connection, lambda: len(col) >= 1)
    assert col.bodies == [b"now"]


def test_queue_ttl_zero_without_consumer_drops(channel, declare):
    q = declare({"x-message-ttl": 0})
    channel.basic_publish("", q, b"dropped")
    channel.basic_publish("", q, b"dropped too")
    channel.connection.sleep(0.2)
    assert get_all(channel, q) == []
    assert message_count(channel, q) == 0


def test_requeued_message_keeps_original_ttl_clock(channel, declare):
    # The TTL runs from publication: a message held unacked past its TTL
    # expires as soon as it is requeued instead of being delivered again.
    q = declare({"x-message-ttl": 300})
    channel.basic_publish("", q, b"m")
    d = get(channel, q)
    assert d is not None
    channel.connection.sleep(0.5)
    channel.basic_nack(d.method.delivery_tag, requeue=True)
    channel.connection.sleep(0.1)
    assert channel.basic_get(q) == (None, None, None)
    assert wait_message_count(channel, q, 0) == 0


def test_requeued_message_within_ttl_is_delivered_again(channel, declare):
    q = declare({"x-message-ttl": 60000})
    channel.basic_publish("", q, b"m")
    d = get(channel, q)
    channel.basic_nack(d.method.delivery_tag, requeue=True)
    d = get(channel, q, auto_ack=True)
    assert d.body == b"m" and d.method.redelivered is True


@pytest.mark.parametrize("ttl", [0, 1, 4294967296, MAX_TTL])
def test_valid_message_ttl_values(channel, declare, ttl):
    q = declare({"x-message-ttl": ttl})
    assert channel.queue_declare(q, passive=True).method.queue == q


@pytest.mark.parametrize("arg,value,reason", [
    ("x-message-ttl", "abc", '"expected integer, got longstr"'),
    ("x-message-ttl", -1, "{value_negative,-1}"),
    ("x-message-ttl", True, '"expected integer, got bool"'),
    ("x-message-ttl", MAX_TTL + 1, "{value_too_large,%d}" % (MAX_TTL + 1)),
    ("x-expires", 0, "{value_zero,0}"),
    ("x-expires", -1, "{value_negative,-1}"),
    ("x-expires", "a", '"expected integer, got longstr"'),
    ("x-expires", True, '"expected integer, got bool"'),
    ("x-expires", MAX_TTL + 1, "{value_too_large,%d}" % (MAX_TTL + 1)),
])
def test_invalid_ttl_arguments_are_406(channel, name, arg, value, reason):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, arguments={arg: value})
    assert text == "PRECONDITION_FAILED - invalid arg '%s' for queue '%s' in vhost '/': %s" % (
        arg, q, reason)


# --------------------------------------------------------------------------
# x-expires
# --------------------------------------------------------------------------

@pytest.mark.parametrize("expires", [1, MAX_TTL])
def test_valid_expires_values(connection, declare, expires):
    q = declare({"x-expires": expires})
    if expires == 1:
        connection.sleep(0.3)
        assert exists(connection, q) == 404
    else:
        assert exists(connection, q) is True


def test_unused_queue_expires(connection, declare):
    q = declare({"x-expires": 300})
    connection.sleep(0.7)
    assert exists(connection, q) == 404


def test_messages_do_not_keep_queue_alive(connection, channel, declare):
    # Publishing is not "use": the queue (and its messages) go anyway, and the
    # messages are not dead-lettered by queue expiry (see test_ext_dlx.py).
    q = declare({"x-expires": 300})
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        channel.basic_publish("", q, b"m")
        connection.sleep(0.1)
    connection.sleep(0.2)
    assert exists(connection, q) == 404


def test_queue_with_consumer_does_not_expire(connection, channel, declare):
    q = declare({"x-expires": 200})
    tag = channel.basic_consume(q, lambda *a: None)
    settle(connection, 0.5)
    assert exists(connection, q) is True
    # The timer starts again when the last consumer goes away.
    channel.basic_cancel(tag)
    connection.sleep(0.5)
    assert exists(connection, q) == 404


def test_queue_expires_after_consumer_channel_closes(connection, declare):
    q = declare({"x-expires": 200})
    ch = connection.channel()
    ch.basic_consume(q, lambda *a: None)
    settle(connection, 0.3)
    ch.close()
    connection.sleep(0.5)
    assert exists(connection, q) == 404


@pytest.mark.parametrize("how", ["declare", "passive", "get"])
def test_declare_and_get_reset_the_expiry_timer(connection, channel, declare, how):
    q = declare({"x-expires": 300})
    # 4 x 0.15 s = 0.6 s, twice the expiry, with a renewal every 0.15 s.
    for _ in range(4):
        connection.sleep(0.15)
        if how == "declare":
            channel.queue_declare(q, arguments={"x-expires": 300})
        elif how == "passive":
            channel.queue_declare(q, passive=True)
        else:
            channel.basic_get(q)
    assert exists(connection, q) is True  # (this renews once more)
    connection.sleep(0.6)
    assert exists(connection, q) == 404
