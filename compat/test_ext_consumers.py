"""RabbitMQ extensions for consumers: consumer priorities (x-priority),
single active consumer (x-single-active-consumer), consumer cancel
notifications, x-delivery-limit.

Not tested: the consumer acknowledgement timeout (consumer_timeout) is a
server configuration setting, not something a client can negotiate.
"""

import socket

import pika
import pytest

import amqp_raw
from ext_wire import death, raw_get, split_time, x_death
from helpers import (HOST, PASSWORD, PORT, USER, VHOST, Collector, expect_channel_error,
                     get, settle, sync, wait_for, wait_message_count)

P = pika.BasicProperties


@pytest.fixture
def declare(channel, name, cleanup):
    def _declare(arguments=None, **kw):
        q = cleanup.queue(name("q"))
        channel.queue_declare(q, arguments=arguments, **kw)
        return q
    return _declare


def publish_n(ch, q, n, start=0):
    for i in range(start, start + n):
        ch.basic_publish("", q, b"%d" % i)


# --------------------------------------------------------------------------
# consumer priorities
# --------------------------------------------------------------------------

def test_higher_priority_consumer_served_while_it_has_capacity(connection, channel, declare):
    q = declare()
    high = connection.channel()
    high.basic_qos(prefetch_count=2)
    normal = connection.channel()
    col_h, col_n, col_l = Collector(), Collector(), Collector()
    high.basic_consume(q, col_h, arguments={"x-priority": 10})
    normal.basic_consume(q, col_n)                                  # priority 0
    normal.basic_consume(q, col_l, arguments={"x-priority": -1})
    publish_n(channel, q, 6)
    assert wait_for(connection, lambda: len(col_h) + len(col_n) + len(col_l) == 6)
    assert col_h.bodies == [b"0", b"1"]
    assert col_n.bodies == [b"2", b"3", b"4", b"5"]
    assert col_l.bodies == []   # never reached: priority 0 has unlimited capacity
    # Capacity again: the high-priority consumer is first in line.
    high.basic_ack(col_h.deliveries[0].method.delivery_tag)
    settle(connection, 0.1)
    publish_n(channel, q, 2, start=6)
    assert wait_for(connection, lambda: len(col_h) + len(col_n) == 8)
    assert col_h.bodies == [b"0", b"1", b"6"]
    assert col_n.bodies[-1] == b"7"


def test_lower_priority_consumer_used_when_higher_are_blocked(connection, channel, declare):
    q = declare()
    a = connection.channel()
    a.basic_qos(prefetch_count=1)
    b = connection.channel()
    b.basic_qos(prefetch_count=1)
    col_a, col_b = Collector(), Collector()
    a.basic_consume(q, col_a, arguments={"x-priority": 5})
    b.basic_consume(q, col_b, arguments={"x-priority": 1})
    publish_n(channel, q, 3)
    assert wait_for(connection, lambda: len(col_a) + len(col_b) == 2)
    settle(connection, 0.2)
    assert (col_a.bodies, col_b.bodies) == ([b"0"], [b"1"])
    assert wait_message_count(channel, q, 1) == 1


def test_equal_priority_consumers_round_robin(connection, channel, declare):
    q = declare()
    col_a, col_b = Collector(), Collector()
    channel.basic_consume(q, col_a, auto_ack=True, arguments={"x-priority": 5})
    channel.basic_consume(q, col_b, auto_ack=True, arguments={"x-priority": 5})
    publish_n(channel, q, 6)
    assert wait_for(connection, lambda: len(col_a) + len(col_b) == 6)
    assert sorted([col_a.bodies, col_b.bodies]) == [[b"0", b"2", b"4"], [b"1", b"3", b"5"]]


@pytest.mark.parametrize("value", [-5, 0, 2 ** 40])
def test_valid_consumer_priorities(channel, queue, value):
    tag = channel.basic_consume(queue, lambda *a: None, arguments={"x-priority": value})
    sync(channel)
    channel.basic_cancel(tag)


@pytest.mark.parametrize("value,reason", [
    ("abc", '"expected integer, got longstr"'),
    (True, '"expected integer, got bool"'),
])
def test_invalid_consumer_priority_is_406(channel, queue, value, reason):
    text = expect_channel_error(channel, 406, channel.basic_consume, queue, lambda *a: None,
                                arguments={"x-priority": value})
    # (sic: "for queue")
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-priority' for queue '%s' in vhost "
                    "'/': %s" % (queue, reason))


# --------------------------------------------------------------------------
# single active consumer
# --------------------------------------------------------------------------

def test_single_active_consumer_only_first_gets_messages(connection, channel, declare):
    q = declare({"x-single-active-consumer": True})
    chans = [connection.channel() for _ in range(3)]
    cols = [Collector() for _ in range(3)]
    for ch, col in zip(chans, cols):
        ch.basic_consume(q, col)
    # declare-ok counts every consumer, active or waiting.
    assert channel.queue_declare(q, passive=True).method.consumer_count == 3
    publish_n(channel, q, 4)
    assert wait_for(connection, lambda: len(cols[0]) == 4)
    settle(connection, 0.2)
    assert [c.bodies for c in cols] == [[b"0", b"1", b"2", b"3"], [], []]


def test_single_active_consumer_handover_on_cancel_and_close(connection, channel, declare):
    q = declare({"x-single-active-consumer": True})
    chans = [connection.channel() for _ in range(3)]
    cols = [Collector() for _ in range(3)]
    tags = [ch.basic_consume(q, col) for ch, col in zip(chans, cols)]
    publish_n(channel, q, 3)
    assert wait_for(connection, lambda: len(cols[0]) == 3)
    # Cancelling the active consumer: the next in subscription order takes
    # over at once; the cancelled consumer's deliveries stay unacked on its
    # channel (not requeued).
    chans[0].basic_cancel(tags[0])
    channel.basic_publish("", q, b"3")
    assert wait_for(connection, lambda: len(cols[1]) == 1)
    assert cols[1].bodies == [b"3"]
    assert channel.queue_declare(q, passive=True).method.message_count == 0
    # Closing that channel requeues them; they go to the new active consumer.
    chans[0].close()
    assert wait_for(connection, lambda: len(cols[1]) == 4)
    assert [(d.body, d.method.redelivered) for d in cols[1].deliveries] == [
        (b"3", False), (b"0", True), (b"1", True), (b"2", True)]
    # The active consumer's channel closing hands over as well.
    chans[1].close()
    assert wait_for(connection, lambda: len(cols[2]) == 4)
    channel.basic_publish("", q, b"4")
    assert wait_for(connection, lambda: len(cols[2]) == 5)
    assert cols[2].bodies[-1] == b"4"
    assert [d.method.redelivered for d in cols[2].deliveries] == [True] * 4 + [False]


def test_single_active_consumer_handover_prefers_consumer_priority(connection, channel, declare):
    # The first subscriber is active whatever its priority and is never
    # pre-empted; on hand-over the waiting consumer with the highest
    # x-priority wins (ties: subscription order).
    q = declare({"x-single-active-consumer": True})
    prios = [0, 5, 10, 10]
    chans = [connection.channel() for _ in prios]
    cols = [Collector() for _ in prios]
    tags = [ch.basic_consume(q, col, auto_ack=True, arguments={"x-priority": p})
            for ch, col, p in zip(chans, cols, prios)]

    def who_gets(body):
        channel.basic_publish("", q, body)
        assert wait_for(connection, lambda: any(body in c.bodies for c in cols))
        return [i for i, c in enumerate(cols) if body in c.bodies]

    assert who_gets(b"a") == [0]
    chans[0].basic_cancel(tags[0])
    assert who_gets(b"b") == [2]
    chans[2].basic_cancel(tags[2])
    assert who_gets(b"c") == [3]
    late = connection.channel()
    late_col = Collector()
    late.basic_consume(q, late_col, auto_ack=True, arguments={"x-priority": 20})
    assert who_gets(b"d") == [3]
    assert late_col.bodies == []


def test_single_active_consumer_does_not_affect_basic_get(connection, channel, declare):
    q = declare({"x-single-active-consumer": True})
    cons = connection.channel()
    cons.basic_qos(prefetch_count=1)
    col = Collector()
    cons.basic_consume(q, col)
    publish_n(channel, q, 3)
    assert wait_for(connection, lambda: len(col) == 1)
    assert get(channel, q, auto_ack=True).body == b"1"


def test_single_active_consumer_false_is_round_robin(connection, channel, declare):
    q = declare({"x-single-active-consumer": False})
    col_a, col_b = Collector(), Collector()
    connection.channel().basic_consume(q, col_a, auto_ack=True)
    connection.channel().basic_consume(q, col_b, auto_ack=True)
    publish_n(channel, q, 4)
    assert wait_for(connection, lambda: len(col_a) + len(col_b) == 4)
    assert (col_a.bodies, col_b.bodies) == ([b"0", b"2"], [b"1", b"3"])


def test_exclusive_consume_on_single_active_consumer_queue_with_consumer_is_403(
        connection, declare):
    q = declare({"x-single-active-consumer": True})
    connection.channel().basic_consume(q, lambda *a: None)
    ch = connection.channel()
    text = expect_channel_error(ch, 403, ch.basic_consume, q, lambda *a: None, exclusive=True)
    assert text == "ACCESS_REFUSED - queue '%s' in vhost '/' in exclusive use" % q


@pytest.mark.parametrize("value,reason", [
    ("yes", "{unacceptable_type,longstr}"),
    (1, "{unacceptable_type,signedint}"),
])
def test_invalid_single_active_consumer_is_406(channel, name, value, reason):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-single-active-consumer": value})
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-single-active-consumer' for queue "
                    "'%s' in vhost '/': %s" % (q, reason))


# --------------------------------------------------------------------------
# consumer cancel notification
# --------------------------------------------------------------------------

def _raw_consumer(q, capabilities):
    """A raw connection consuming from q with tag 'tag1', announcing capabilities."""
    c = amqp_raw.RawConnection(HOST, PORT)
    c.start()
    props = {"product": "warren-compat-raw"}
    if capabilities is not None:
        props["capabilities"] = capabilities
    response = b"\x00" + USER.encode() + b"\x00" + PASSWORD.encode()
    c.send_method(0, amqp_raw.CONNECTION_START_OK,
                  amqp_raw.table(props) + amqp_raw.shortstr("PLAIN")
                  + amqp_raw.longstr(response) + amqp_raw.shortstr("en_US"))
    t = c.read_tune()
    c.tune_ok(t.channel_max, t.frame_max, 0)
    c.open(VHOST)
    c.open_channel(1)
    c.send_method(1, amqp_raw.BASIC_CONSUME, amqp_raw.basic_consume_args(q, "tag1"))
    c.read_method(amqp_raw.BASIC_CONSUME_OK, channel=1)
    return c


def test_queue_deletion_sends_basic_cancel_with_nowait(channel, name):
    q = name("q")
    channel.queue_declare(q)
    with _raw_consumer(q, {"consumer_cancel_notify": True}) as c:
        channel.queue_delete(q)
        fr = c.read_method(channel=1)
        assert amqp_raw.method_of(fr) == (60, 30)  # basic.cancel
        r = amqp_raw.args_of(fr)
        assert r.shortstr() == "tag1"
        assert r.octet() == 1  # nowait: the client must not answer cancel-ok
        # The channel stays open.
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        c.read_method(amqp_raw.QUEUE_DECLARE_OK, channel=1)


@pytest.mark.parametrize("capabilities", [None, {"consumer_cancel_notify": False}])
def test_no_basic_cancel_without_capability(channel, name, capabilities):
    q = name("q")
    channel.queue_declare(q)
    with _raw_consumer(q, capabilities) as c:
        channel.queue_delete(q)
        c.sock.settimeout(0.4)
        with pytest.raises(socket.timeout):
            c.read_frame()
        c.sock.settimeout(5)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        c.read_method(amqp_raw.QUEUE_DECLARE_OK, channel=1)


def test_pika_on_cancel_for_every_consumer_of_deleted_queue(connection, channel, declare):
    q = declare()
    a, b = connection.channel(), connection.channel()
    got = []
    a.add_on_cancel_callback(lambda frame: got.append(("a", frame.method.consumer_tag)))
    b.add_on_cancel_callback(lambda frame: got.append(("b", frame.method.consumer_tag)))
    ta = a.basic_consume(q, lambda *x: None)
    tb = b.basic_consume(q, lambda *x: None)
    channel.queue_delete(q)
    assert wait_for(connection, lambda: len(got) == 2)
    assert sorted(got) == [("a", ta), ("b", tb)]
    assert a.is_open and b.is_open


# --------------------------------------------------------------------------
# x-delivery-limit
# --------------------------------------------------------------------------

@pytest.mark.parametrize("value", [5, "a"])
def test_delivery_limit_refused_on_classic_queue(channel, name, value):
    # Quorum-only argument: a classic queue refuses it (whatever its value).
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-delivery-limit": value})
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-delivery-limit' for queue '%s' in "
                    "vhost '/' of queue type rabbit_classic_queue" % q)


def test_delivery_limit_on_quorum_queue_dead_letters(channel, declare):
    dq = declare()
    q = declare({"x-queue-type": "quorum", "x-delivery-limit": 1,
                 "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dq}, durable=True)
    channel.basic_publish("", q, b"m")
    seen = []
    for _ in range(2):
        d = get(channel, q)
        assert d is not None
        seen.append((d.properties.headers["x-delivery-count"], d.method.redelivered))
        channel.basic_nack(d.method.delivery_tag, requeue=True)
    # Delivered limit + 1 times, then the return over the limit dead-letters it.
    assert seen == [(0, False), (1, True)]
    assert wait_message_count(channel, dq, 1) == 1
    m = raw_get(dq)
    assert split_time(x_death(m)[0])[0] == death(1, "delivery_limit", q, "", [q])
    assert wait_message_count(channel, q, 0) == 0
