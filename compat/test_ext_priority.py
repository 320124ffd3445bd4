"""RabbitMQ extension: priority queues (x-max-priority).

RabbitMQ 3.10 (classic queues): x-max-priority is an integer 0..255.  Higher
priority messages are delivered first, FIFO within a priority; a message
without a priority property counts as priority 0; a priority above the
maximum is treated as the maximum (but the delivered property keeps the value
the publisher set).  x-max-priority 0 behaves like a plain FIFO queue.
"""

import pika
import pytest

from helpers import (Collector, expect_channel_error, get, get_all, wait_for,
                     wait_message_count)

P = pika.BasicProperties

# (body, priority) in publish order.
MIXED = [(b"n0", None), (b"p0", 0), (b"p5a", 5), (b"p10", 10), (b"p3", 3), (b"p5b", 5),
         (b"p255", 255), (b"n1", None), (b"p1", 1)]


@pytest.fixture
def declare(channel, name, cleanup):
    def _declare(arguments=None, **kw):
        q = cleanup.queue(name("q"))
        channel.queue_declare(q, arguments=arguments, **kw)
        return q
    return _declare


def publish_all(ch, q, msgs):
    for body, prio in msgs:
        ch.basic_publish("", q, body, P(priority=prio))
    assert wait_message_count(ch, q, len(msgs)) == len(msgs)


def drain(ch, q):
    return [(d.body, d.properties.priority) for d in get_all(ch, q)]


def test_priority_order_with_max_5(channel, declare):
    q = declare({"x-max-priority": 5})
    publish_all(channel, q, MIXED)
    # 10 and 255 count as 5 (FIFO with the real 5s); no priority == 0.
    assert drain(channel, q) == [
        (b"p5a", 5), (b"p10", 10), (b"p5b", 5), (b"p255", 255),
        (b"p3", 3), (b"p1", 1),
        (b"n0", None), (b"p0", 0), (b"n1", None)]


def test_priority_order_with_max_1(channel, declare):
    q = declare({"x-max-priority": 1})
    publish_all(channel, q, MIXED)
    assert [b for b, _ in drain(channel, q)] == [
        b"p5a", b"p10", b"p3", b"p5b", b"p255", b"p1", b"n0", b"p0", b"n1"]


def test_priority_order_with_max_255(channel, declare):
    q = declare({"x-max-priority": 255})
    publish_all(channel, q, MIXED)
    assert [b for b, _ in drain(channel, q)] == [
        b"p255", b"p10", b"p5a", b"p5b", b"p3", b"p1", b"n0", b"p0", b"n1"]


def test_max_priority_zero_is_fifo(channel, declare):
    q = declare({"x-max-priority": 0})
    publish_all(channel, q, MIXED)
    assert [b for b, _ in drain(channel, q)] == [b for b, _ in MIXED]


def test_plain_queue_ignores_priority(channel, declare):
    q = declare()
    publish_all(channel, q, MIXED)
    assert drain(channel, q) == MIXED


def test_consumer_receives_in_priority_order(connection, channel, declare):
    q = declare({"x-max-priority": 9})
    publish_all(channel, q, [(b"%d" % p, p) for p in [1, 2, 3, 9, 0, 5]])
    cons = connection.channel()
    cons.basic_qos(prefetch_count=1)
    got = []

    def on_message(ch, method, props, body):
        got.append(body)
        ch.basic_ack(method.delivery_tag)

    cons.basic_consume(q, on_message)
    assert wait_for(connection, lambda: len(got) == 6)
    assert got == [b"9", b"5", b"3", b"2", b"1", b"0"]


def test_later_high_priority_overtakes_waiting_messages(connection, channel, declare):
    q = declare({"x-max-priority": 5})
    cons = connection.channel()
    cons.basic_qos(prefetch_count=1)
    col = Collector()
    cons.basic_consume(q, col)
    channel.basic_publish("", q, b"first", P(priority=1))
    assert wait_for(connection, lambda: len(col) == 1)
    channel.basic_publish("", q, b"low", P(priority=1))
    channel.basic_publish("", q, b"high", P(priority=5))
    assert wait_message_count(channel, q, 2) == 2
    for _ in range(2):
        n = len(col)
        cons.basic_ack(col.deliveries[-1].method.delivery_tag)
        assert wait_for(connection, lambda: len(col) == n + 1)
    assert col.bodies == [b"first", b"high", b"low"]


def test_requeued_message_returns_to_head_of_its_priority(channel, declare):
    q = declare({"x-max-priority": 5})
    channel.basic_publish("", q, b"low", P(priority=1))
    d = get(channel, q)
    channel.basic_publish("", q, b"high", P(priority=5))
    channel.basic_publish("", q, b"low2", P(priority=1))
    assert wait_message_count(channel, q, 2) == 2
    channel.basic_nack(d.method.delivery_tag, requeue=True)
    assert wait_message_count(channel, q, 3) == 3
    got = get_all(channel, q)
    assert [(x.body, x.method.redelivered) for x in got] == [
        (b"high", False), (b"low", True), (b"low2", False)]


@pytest.mark.parametrize("value", [0, 1, 10, 255])
def test_valid_max_priority(channel, declare, value):
    q = declare({"x-max-priority": value})
    assert channel.queue_declare(q, passive=True).method.queue == q


@pytest.mark.parametrize("value,reason", [
    (256, "{max_value_exceeded,256}"),
    (2 ** 40, "{max_value_exceeded,%d}" % 2 ** 40),
    (-1, "{value_negative,-1}"),
    ("abc", '"expected integer, got longstr"'),
    (True, '"expected integer, got bool"'),
])
def test_invalid_max_priority_is_406(channel, name, value, reason):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-max-priority": value})
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-max-priority' for queue '%s' in "
                    "vhost '/': %s" % (q, reason))


@pytest.mark.parametrize("first,second,detail", [
    ({"x-max-priority": 5}, {"x-max-priority": 6}, "received '6' but current is '5'"),
    ({"x-max-priority": 5}, {},
     "received none but current is the value '5' of type 'signedint'"),
    ({}, {"x-max-priority": 5},
     "received the value '5' of type 'signedint' but current is none"),
])
def test_redeclare_with_different_max_priority_is_406(channel, declare, first, second, detail):
    q = declare(first)
    text = expect_channel_error(channel, 406, channel.queue_declare, q, arguments=second)
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'x-max-priority' for queue '%s' "
                    "in vhost '/': %s" % (q, detail))


def test_redeclare_with_same_max_priority_is_ok(channel, declare):
    q = declare({"x-max-priority": 5})
    assert channel.queue_declare(q, arguments={"x-max-priority": 5}).method.queue == q
