"""RabbitMQ extension: queue types (x-queue-type), x-queue-mode, x-queue-version.

RabbitMQ 3.10 has three queue types built in: classic (the default), quorum
and stream.  Streams need no plugin for AMQP 0-9-1 use (the rabbitmq_stream
plugin only adds the stream protocol).  Quorum and stream queues must be
durable, non-exclusive and non-auto-delete.  Each type refuses the
arguments of the others with "... of queue type rabbit_<type>_queue".
Errors that a stream cannot do (basic.get, no-ack consume, purge) are
connection errors 540 NOT_IMPLEMENTED.
"""

import pika
import pytest

from ext_wire import field, raw_get
from helpers import (Collector, expect_channel_error, expect_connection_error, get,
                     open_connection, wait_for, wait_message_count)
from helpers import warren_deviation

P = pika.BasicProperties


@pytest.fixture
def declare(channel, name, cleanup):
    def _declare(arguments=None, **kw):
        q = cleanup.queue(name("q"))
        channel.queue_declare(q, arguments=arguments, **kw)
        return q
    return _declare


def invalid_property(q, prop):
    return "PRECONDITION_FAILED - invalid property '%s' for queue '%s' in vhost '/'" % (prop, q)


def invalid_for_type(arg, q, qtype):
    return ("PRECONDITION_FAILED - invalid arg '%s' for queue '%s' in vhost '/' of queue "
            "type rabbit_%s_queue" % (arg, q, qtype))


# --------------------------------------------------------------------------
# classic
# --------------------------------------------------------------------------

def test_classic_type_is_accepted(channel, declare):
    q = declare({"x-queue-type": "classic"})
    channel.basic_publish("", q, b"m")
    assert get(channel, q, auto_ack=True).body == b"m"


def test_classic_type_is_equivalent_to_no_type(channel, declare):
    # Redeclaring in either direction is fine: 'classic' == absent.
    q1 = declare({"x-queue-type": "classic"})
    assert channel.queue_declare(q1).method.queue == q1
    q2 = declare(durable=True)
    assert channel.queue_declare(q2, durable=True,
                                 arguments={"x-queue-type": "classic"}).method.queue == q2


@pytest.mark.parametrize("value,reason", [
    ("bogus", '"unsupported queue type \'bogus\'"'),
    ("", '"unsupported queue type \'\'"'),
    (1, "{unacceptable_type,signedint}"),
])
def test_invalid_queue_type_is_406(channel, name, value, reason):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, durable=True,
                                arguments={"x-queue-type": value})
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-queue-type' for queue '%s' in "
                    "vhost '/': %s" % (q, reason))


@pytest.mark.parametrize("arg,value", [
    ("x-delivery-limit", 5), ("x-dead-letter-strategy", "at-least-once"),
    ("x-max-in-memory-length", 5), ("x-quorum-initial-group-size", 3),
    ("x-max-age", "1D"), ("x-stream-max-segment-size-bytes", 5),
])
def test_classic_refuses_quorum_and_stream_arguments(channel, name, arg, value):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, arguments={arg: value})
    assert text == invalid_for_type(arg, q, "classic")


@pytest.mark.parametrize("mode", ["lazy", "default"])
def test_queue_mode_accepted(channel, declare, mode):
    q = declare({"x-queue-mode": mode})
    channel.basic_publish("", q, b"m")
    assert get(channel, q, auto_ack=True).body == b"m"


def test_invalid_queue_mode_is_406(channel, name):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-queue-mode": "bogus"})
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-queue-mode' for queue '%s' in "
                    "vhost '/': \"unsupported queue mode 'bogus'\"" % q)


@pytest.mark.parametrize("version", [1, 2])
def test_queue_version_accepted(channel, declare, version):
    q = declare({"x-queue-version": version})
    assert channel.queue_declare(q, passive=True).method.queue == q


def test_invalid_queue_version_is_406(channel, name):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-queue-version": 3})
    assert text == ("PRECONDITION_FAILED - invalid arg 'x-queue-version' for queue '%s' in "
                    "vhost '/': \"unsupported queue version '3'\"" % q)


# --------------------------------------------------------------------------
# quorum
# --------------------------------------------------------------------------

QUORUM = {"x-queue-type": "quorum"}


@pytest.mark.parametrize("flags,prop", [
    (dict(durable=False), "non-durable"),
    (dict(durable=True, exclusive=True), "exclusive-owner"),
    (dict(durable=True, auto_delete=True), "auto-delete"),
    (dict(durable=True, auto_delete=True, exclusive=True), "auto-delete"),
    # Precedence when several are wrong: auto-delete, then exclusive-owner,
    # then non-durable.
    (dict(durable=False, exclusive=True), "exclusive-owner"),
    (dict(durable=False, auto_delete=True), "auto-delete"),
])
def test_quorum_requires_durable_non_exclusive_non_auto_delete(channel, name, flags, prop):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, arguments=QUORUM,
                                **flags)
    assert text == invalid_property(q, prop)


def test_quorum_declare_passive_and_redeclare(channel, declare):
    q = declare(QUORUM, durable=True)
    ok = channel.queue_declare(q, passive=True).method
    assert (ok.queue, ok.message_count, ok.consumer_count) == (q, 0, 0)
    assert channel.queue_declare(q, durable=True, arguments=QUORUM).method.queue == q


@pytest.mark.parametrize("kw,detail", [
    (dict(durable=True),
     "inequivalent arg 'x-queue-type' for queue '{q}' in vhost '/': received none but "
     "current is the value 'quorum' of type 'longstr'"),
    (dict(durable=True, arguments={"x-queue-type": "classic"}),
     "inequivalent arg 'x-queue-type' for queue '{q}' in vhost '/': received 'classic' but "
     "current is 'quorum'"),
    (dict(durable=False, arguments=QUORUM),
     "inequivalent arg 'durable' for queue '{q}' in vhost '/': received 'false' but "
     "current is 'true'"),
])
def test_quorum_redeclare_mismatch_is_406(channel, declare, kw, detail):
    q = declare(QUORUM, durable=True)
    text = expect_channel_error(channel, 406, channel.queue_declare, q, **kw)
    assert text == "PRECONDITION_FAILED - " + detail.replace("{q}", q)


def test_classic_redeclared_as_quorum_is_406(channel, declare):
    q = declare(durable=True)
    text = expect_channel_error(channel, 406, channel.queue_declare, q, durable=True,
                                arguments=QUORUM)
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue '%s' in "
                    "vhost '/': received the value 'quorum' of type 'longstr' but current "
                    "is none" % q)


def test_quorum_publish_get_and_delivery_count(channel, declare):
    q = declare(QUORUM, durable=True)
    channel.basic_publish("", q, b"hello", P(headers={"h": "v"}))
    assert wait_message_count(channel, q, 1) == 1
    d = get(channel, q)
    # x-delivery-count (a long-long) is there from the first delivery on.
    assert d.properties.headers == {"h": "v", "x-delivery-count": 0}
    assert d.method.redelivered is False
    channel.basic_nack(d.method.delivery_tag, requeue=True)
    assert wait_message_count(channel, q, 1) == 1
    m = raw_get(q)
    assert field(m.properties["headers"], "x-delivery-count") == ("x-delivery-count", "l", 1)
    assert m.redelivered is True
    assert m.body == b"hello"


def test_quorum_consume(connection, channel, declare):
    q = declare(QUORUM, durable=True)
    col = Collector()
    channel.basic_consume(q, col, auto_ack=True)
    for i in range(3):
        channel.basic_publish("", q, b"%d" % i)
    assert wait_for(connection, lambda: len(col) == 3)
    assert col.bodies == [b"0", b"1", b"2"]


@pytest.mark.parametrize("args", [
    {"x-message-ttl": 1000}, {"x-expires": 100000}, {"x-max-length": 3},
    {"x-max-length-bytes": 100}, {"x-overflow": "reject-publish"},
    {"x-overflow": "reject-publish-dlx"}, {"x-single-active-consumer": True},
    {"x-dead-letter-exchange": "some-x"}, {"x-delivery-limit": 5},
])
def test_quorum_accepts_its_arguments(channel, declare, args):
    q = declare(dict(QUORUM, **args), durable=True)
    assert channel.queue_declare(q, passive=True).method.queue == q


@pytest.mark.parametrize("arg,value", [
    ("x-max-priority", 5), ("x-queue-mode", "lazy"), ("x-queue-version", 2),
])
def test_quorum_refuses_classic_arguments(channel, name, arg, value):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, durable=True,
                                arguments=dict(QUORUM, **{arg: value}))
    assert text == invalid_for_type(arg, q, "quorum")


# --------------------------------------------------------------------------
# stream
# --------------------------------------------------------------------------

STREAM = {"x-queue-type": "stream"}


@pytest.mark.parametrize("flags,prop", [
    (dict(durable=False), "non-durable"),
    (dict(durable=True, exclusive=True), "exclusive-owner"),
    (dict(durable=True, auto_delete=True), "auto-delete"),
])
@warren_deviation("stream queues are refused with 406 until Warren has them")
def test_stream_requires_durable_non_exclusive_non_auto_delete(channel, name, flags, prop):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, arguments=STREAM,
                                **flags)
    assert text == invalid_property(q, prop)


@warren_deviation("stream queues are refused with 406 until Warren has them")
def test_stream_publish_and_consume_from_first(connection, channel, declare):
    q = declare(STREAM, durable=True)
    for i in range(3):
        channel.basic_publish("", q, b"s%d" % i)
    # SURPRISE: a stream reports 0 messages in declare-ok.
    channel.connection.sleep(0.2)
    assert channel.queue_declare(q, passive=True).method.message_count == 0
    cons = connection.channel()
    cons.basic_qos(prefetch_count=10)
    col = Collector()
    cons.basic_consume(q, col, arguments={"x-stream-offset": "first"})
    assert wait_for(connection, lambda: len(col) == 3)
    assert col.bodies == [b"s0", b"s1", b"s2"]
    assert [d.properties.headers["x-stream-offset"] for d in col.deliveries] == [0, 1, 2]


@warren_deviation("stream queues are refused with 406 until Warren has them")
def test_stream_consume_needs_prefetch(channel, declare):
    q = declare(STREAM, durable=True)
    text = expect_channel_error(channel, 406, channel.basic_consume, q, lambda *a: None)
    assert text == ("PRECONDITION_FAILED - consumer prefetch count is not set for "
                    "'queue '%s' in vhost '/''" % q)


@pytest.mark.parametrize("op,what", [
    ("get", "basic.get not supported by stream queues"),
    ("no-ack consume", "automatic acknowledgement not supported by stream queues"),
    ("purge", "queue.purge not supported by stream queues"),
])
@warren_deviation("stream queues are refused with 406 until Warren has them")
def test_stream_unsupported_operations_close_connection_540(declare, op, what):
    q = declare(STREAM, durable=True)
    conn = open_connection()
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        fn = {"get": lambda: ch.basic_get(q),
              "no-ack consume": lambda: ch.basic_consume(q, lambda *a: None, auto_ack=True),
              "purge": lambda: ch.queue_purge(q)}[op]
        text = expect_connection_error(conn, 540, fn)
        assert text == "NOT_IMPLEMENTED - %s queue '%s' in vhost '/'" % (what, q)
    finally:
        if conn.is_open:
            conn.close()
