"""queue.declare / bind / unbind / purge / delete."""

import re

import pika
import pytest

from helpers import (Collector, expect_channel_error, get, message_count,
                     open_connection, wait_for, wait_message_count)

SERVER_NAMED = re.compile(r"^amq\.gen-[A-Za-z0-9_-]{22}$")

LOCKED = ("RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '%s' in vhost '/'. "
          "It could be originally declared on another connection or the exclusive property "
          "value does not match that of the original declaration.")


def test_declare_returns_name_and_counts(channel, name, cleanup):
    q = cleanup.queue(name("q"))
    r = channel.queue_declare(q)
    assert isinstance(r.method, pika.spec.Queue.DeclareOk)
    assert (r.method.queue, r.method.message_count, r.method.consumer_count) == (q, 0, 0)


def test_server_named_queue(channel):
    r = channel.queue_declare("", exclusive=True)
    assert SERVER_NAMED.match(r.method.queue), r.method.queue
    r2 = channel.queue_declare("", exclusive=True)
    assert r2.method.queue != r.method.queue


def test_declare_ok_counts(connection, name, cleanup):
    ch = connection.channel()
    q = cleanup.queue(name("q"))
    ch.queue_declare(q)
    for i in range(3):
        ch.basic_publish("", q, b"m%d" % i)
    consumer_ch = connection.channel()
    consumer_ch.basic_qos(prefetch_count=1)
    col = Collector()
    consumer_ch.basic_consume(q, col)
    consumer_ch.basic_consume(q, col)
    assert wait_for(connection, lambda: len(col) == 2)
    assert wait_message_count(ch, q, 1) == 1
    # Two messages are unacked (prefetch 1 per consumer): they are not "ready"
    # and are not counted; consumer_count counts both consumers.
    r = ch.queue_declare(q, passive=True)
    assert (r.method.message_count, r.method.consumer_count) == (1, 2)
    r = ch.queue_declare(q)  # non-passive redeclare reports the same
    assert (r.method.message_count, r.method.consumer_count) == (1, 2)


def test_passive_declare_missing_is_404(channel):
    q = "compat-missing-queue-xyz"
    text = expect_channel_error(channel, 404, channel.queue_declare, q, passive=True)
    assert text == "NOT_FOUND - no queue '%s' in vhost '/'" % q


def test_passive_declare_ignores_flags(channel, queue):
    r = channel.queue_declare(queue, passive=True, durable=True, auto_delete=True)
    assert r.method.queue == queue


def test_durable_queue_declare(channel, name, cleanup):
    q = cleanup.queue(name("q"))
    channel.queue_declare(q, durable=True)
    channel.queue_declare(q, durable=True)
    text = expect_channel_error(channel, 406, channel.queue_declare, q, durable=False)
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'durable' for queue '%s' in vhost '/': "
                    "received 'false' but current is 'true'" % q)


def test_redeclare_different_durable_is_406(channel, queue):
    text = expect_channel_error(channel, 406, channel.queue_declare, queue, durable=True)
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'durable' for queue '%s' in vhost '/': "
                    "received 'true' but current is 'false'" % queue)


def test_redeclare_different_auto_delete_is_406(channel, queue):
    text = expect_channel_error(channel, 406, channel.queue_declare, queue, auto_delete=True)
    assert "inequivalent arg 'auto_delete'" in text


def test_redeclare_non_exclusive_as_exclusive_is_405(channel, queue):
    # SURPRISE: a mismatch of the exclusive flag is 405, not 406.
    text = expect_channel_error(channel, 405, channel.queue_declare, queue, exclusive=True)
    assert text == LOCKED % queue


def test_redeclare_with_different_arguments_is_406(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    ch = connection.channel()
    ch.queue_declare(q, arguments={"x-message-ttl": 1000})
    ch.queue_declare(q, arguments={"x-message-ttl": 1000})
    text = expect_channel_error(ch, 406, ch.queue_declare, q, arguments={"x-message-ttl": 2000})
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue '%s' in "
                    "vhost '/': received '2000' but current is '1000'" % q)
    ch = connection.channel()
    text = expect_channel_error(ch, 406, ch.queue_declare, q)
    assert text.startswith("PRECONDITION_FAILED - inequivalent arg 'x-message-ttl'")


def test_redeclare_adding_argument_is_406(channel, queue):
    text = expect_channel_error(channel, 406, channel.queue_declare, queue,
                                arguments={"x-max-length": 10})
    assert text.startswith("PRECONDITION_FAILED - inequivalent arg 'x-max-length'")


def test_unknown_non_x_arguments_are_ignored_for_equivalence(channel, name, cleanup):
    q = cleanup.queue(name("q"))
    channel.queue_declare(q, arguments={"x-message-ttl": 1000})
    channel.queue_declare(q, arguments={"x-message-ttl": 1000, "foo": "bar"})


@pytest.mark.parametrize("value,fragment", [
    ("abc", "expected integer, got longstr"),
    (-1, "{value_negative,-1}"),
])
def test_invalid_queue_argument_is_406(channel, name, value, fragment):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-message-ttl": value})
    assert text.startswith("PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue '%s'" % q)
    assert fragment in text


def test_declare_amq_prefix_is_403(channel):
    text = expect_channel_error(channel, 403, channel.queue_declare, "amq.compat-q")
    assert text == "ACCESS_REFUSED - queue name 'amq.compat-q' contains reserved prefix 'amq.*'"


def test_passive_declare_amq_prefix_missing_is_404(channel):
    expect_channel_error(channel, 404, channel.queue_declare, "amq.compat-q", passive=True)


# --------------------------------------------------------------------------
# exclusive queues
# --------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["declare_exclusive", "declare_plain", "passive", "consume",
                                "get", "purge", "delete", "bind", "unbind"])
def test_exclusive_queue_locked_for_other_connections(connection, connect, name, op):
    owner = connection.channel()
    q = name("excl")
    owner.queue_declare(q, exclusive=True)
    owner.queue_bind(q, "amq.fanout", "compat-k")
    other = connect().channel()
    ops = {
        "declare_exclusive": lambda: other.queue_declare(q, exclusive=True),
        "declare_plain": lambda: other.queue_declare(q),
        "passive": lambda: other.queue_declare(q, passive=True),
        "consume": lambda: other.basic_consume(q, lambda *a: None),
        "get": lambda: other.basic_get(q),
        "purge": lambda: other.queue_purge(q),
        "delete": lambda: other.queue_delete(q),
        "bind": lambda: other.queue_bind(q, "amq.fanout"),
        # (an unbind of a binding that does not exist answers unbind-ok
        # before any exclusivity check; this one exists)
        "unbind": lambda: other.queue_unbind(q, "amq.fanout", "compat-k"),
    }
    text = expect_channel_error(other, 405, ops[op])
    assert text == LOCKED % q
    owner.queue_declare(q, passive=True)  # owner unaffected


def test_exclusive_queue_usable_from_other_channel_same_connection(connection, name):
    ch1 = connection.channel()
    q = name("excl")
    ch1.queue_declare(q, exclusive=True)
    ch2 = connection.channel()
    ch2.queue_declare(q, exclusive=True)
    ch2.queue_declare(q, passive=True)
    ch2.basic_publish("", q, b"m")
    assert get(ch2, q, auto_ack=True).body == b"m"


def test_exclusive_queue_redeclared_non_exclusive_by_owner_is_405(connection, name):
    ch = connection.channel()
    q = name("excl")
    ch.queue_declare(q, exclusive=True)
    text = expect_channel_error(ch, 405, ch.queue_declare, q)
    assert text == LOCKED % q


def test_redeclare_server_named_queue_is_403(connection):
    # SURPRISE: the 'amq.' prefix check runs before the existence check for a
    # non-passive declare, so even the owner cannot redeclare its own
    # amq.gen-* queue (passive declare works).
    ch = connection.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_declare(q, passive=True)
    text = expect_channel_error(ch, 403, ch.queue_declare, q, exclusive=True)
    assert text == "ACCESS_REFUSED - queue name '%s' contains reserved prefix 'amq.*'" % q


def test_other_connection_may_publish_to_exclusive_queue(connection, connect):
    # Exclusivity restricts queue operations, not routing.
    owner = connection.channel()
    q = owner.queue_declare("", exclusive=True).method.queue
    other = connect().channel()
    other.basic_publish("", q, b"from-other")
    d = get(owner, q, auto_ack=True)
    assert d is not None and d.body == b"from-other"


def test_exclusive_queue_vanishes_when_connection_closes(connect):
    c1 = connect()
    q = c1.channel().queue_declare("", exclusive=True).method.queue
    ch2 = connect().channel()
    c1.close()
    text = expect_channel_error(ch2, 404, ch2.queue_declare, q, passive=True)
    assert text == "NOT_FOUND - no queue '%s' in vhost '/'" % q


def test_exclusive_queue_survives_channel_close(connection):
    ch1 = connection.channel()
    q = ch1.queue_declare("", exclusive=True).method.queue
    ch1.close()
    connection.channel().queue_declare(q, passive=True)


# --------------------------------------------------------------------------
# auto-delete
# --------------------------------------------------------------------------

def test_auto_delete_queue_deleted_after_last_consumer_cancels(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    ch = connection.channel()
    ch.queue_declare(q, auto_delete=True)
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    assert ch.queue_declare(q, passive=True).method.consumer_count == 1
    ch.basic_cancel(t2)
    probe = connection.channel()
    text = expect_channel_error(probe, 404, probe.queue_declare, q, passive=True)
    assert "no queue '%s'" % q in text


def test_auto_delete_queue_deleted_when_consumer_channel_closes(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    ch = connection.channel()
    ch.queue_declare(q, auto_delete=True)
    ch.basic_consume(q, lambda *a: None)
    ch.close()
    probe = connection.channel()
    expect_channel_error(probe, 404, probe.queue_declare, q, passive=True)


def test_auto_delete_queue_without_consumers_survives(channel, name, cleanup):
    q = cleanup.queue(name("q"))
    channel.queue_declare(q, auto_delete=True)
    channel.basic_publish("", q, b"m")
    assert get(channel, q, auto_ack=True).body == b"m"  # basic.get is not a consumer
    channel.connection.sleep(0.2)
    channel.queue_declare(q, passive=True)


# --------------------------------------------------------------------------
# bind / unbind
# --------------------------------------------------------------------------

def test_bind_and_unbind(channel, name, cleanup, queue):
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct")
    r = channel.queue_bind(queue, x, "rk")
    assert isinstance(r.method, pika.spec.Queue.BindOk)
    channel.queue_bind(queue, x, "rk")  # duplicate bind is fine
    channel.basic_publish(x, "rk", b"one")
    assert get(channel, queue, auto_ack=True).body == b"one"
    assert get(channel, queue, timeout=0.2) is None  # delivered once
    r = channel.queue_unbind(queue, x, "rk")
    assert isinstance(r.method, pika.spec.Queue.UnbindOk)
    channel.basic_publish(x, "rk", b"two")
    assert get(channel, queue, timeout=0.3) is None


def test_unbind_nonexistent_binding_is_ok(channel, name, cleanup, queue):
    # SURPRISE: unbind is idempotent, even when the queue or the exchange
    # does not exist at all.
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct")
    channel.queue_unbind(queue, x, "never-bound")
    channel.queue_unbind("compat-missing-queue-xyz", x, "rk")
    channel.queue_unbind(queue, "compat-missing-exchange-xyz", "rk")
    assert channel.is_open


def test_bind_missing_exchange_is_404(channel, queue):
    x = "compat-missing-exchange-xyz"
    text = expect_channel_error(channel, 404, channel.queue_bind, queue, x, "rk")
    assert text == "NOT_FOUND - no exchange '%s' in vhost '/'" % x


def test_bind_missing_queue_is_404(channel):
    q = "compat-missing-queue-xyz"
    text = expect_channel_error(channel, 404, channel.queue_bind, q, "amq.direct", "rk")
    assert text == "NOT_FOUND - no queue '%s' in vhost '/'" % q


@pytest.mark.parametrize("op", ["bind", "unbind"])
def test_bind_to_default_exchange_is_403(channel, queue, op):
    fn = channel.queue_bind if op == "bind" else channel.queue_unbind
    text = expect_channel_error(channel, 403, fn, queue, "", queue)
    assert text == "ACCESS_REFUSED - operation not permitted on the default exchange"


# --------------------------------------------------------------------------
# purge / delete
# --------------------------------------------------------------------------

def test_purge_returns_count(channel, queue):
    for i in range(7):
        channel.basic_publish("", queue, b"%d" % i)
    r = channel.queue_purge(queue)
    assert isinstance(r.method, pika.spec.Queue.PurgeOk)
    assert r.method.message_count == 7
    assert channel.queue_purge(queue).method.message_count == 0
    assert message_count(channel, queue) == 0


def test_purge_does_not_touch_unacked(connection, channel, queue):
    for i in range(3):
        channel.basic_publish("", queue, b"%d" % i)
    d = get(channel, queue)  # unacked
    assert channel.queue_purge(queue).method.message_count == 2
    channel.basic_reject(d.method.delivery_tag, requeue=True)
    assert get(channel, queue, auto_ack=True).body == b"0"


def test_purge_missing_queue_is_404(channel):
    expect_channel_error(channel, 404, channel.queue_purge, "compat-missing-queue-xyz")


def test_delete_returns_message_count(channel, name):
    q = name("q")
    channel.queue_declare(q)
    for i in range(5):
        channel.basic_publish("", q, b"%d" % i)
    r = channel.queue_delete(q)
    assert isinstance(r.method, pika.spec.Queue.DeleteOk)
    assert r.method.message_count == 5
    expect_channel_error(channel, 404, channel.queue_declare, q, passive=True)


def test_delete_missing_queue_is_ok(channel):
    # RabbitMQ 3.x: queue.delete is idempotent -> delete-ok with message_count 0.
    r = channel.queue_delete("compat-missing-queue-xyz")
    assert r.method.message_count == 0
    r = channel.queue_delete("compat-missing-queue-xyz", if_unused=True, if_empty=True)
    assert r.method.message_count == 0


def test_delete_if_unused_with_consumer_is_406(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    ch = connection.channel()
    ch.queue_declare(q)
    connection.channel().basic_consume(q, lambda *a: None)
    text = expect_channel_error(ch, 406, ch.queue_delete, q, if_unused=True)
    assert text == "PRECONDITION_FAILED - queue '%s' in vhost '/' in use" % q


def test_delete_if_empty_with_messages_is_406(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    ch = connection.channel()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"m")
    text = expect_channel_error(ch, 406, ch.queue_delete, q, if_empty=True)
    assert text == "PRECONDITION_FAILED - queue '%s' in vhost '/' not empty" % q
    assert message_count(connection.channel(), q) == 1


def test_delete_if_unused_and_if_empty_ok_when_idle(channel, name):
    q = name("q")
    channel.queue_declare(q)
    assert channel.queue_delete(q, if_unused=True, if_empty=True).method.message_count == 0


def test_delete_queue_cancels_consumers(connection, name):
    # consumer_cancel_notify: the broker sends basic.cancel to the consumer.
    q = name("q")
    ch = connection.channel()
    ch.queue_declare(q)
    cancelled = []
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    tag = ch.basic_consume(q, lambda *a: None)
    other = connection.channel()
    other.queue_delete(q)
    assert wait_for(connection, lambda: cancelled == [tag])
    assert ch.is_open


def test_delete_removes_bindings(channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    q = name("q")
    channel.exchange_declare(x, "fanout")
    channel.queue_declare(q)
    channel.queue_bind(q, x)
    channel.queue_delete(q)
    channel.queue_declare(q)
    try:
        channel.basic_publish(x, "", b"m")
        assert get(channel, q, timeout=0.3) is None
    finally:
        channel.queue_delete(q)


def test_queue_declare_from_fresh_connection_sees_messages(channel, queue):
    for _ in range(4):
        channel.basic_publish("", queue, b"m")
    # NOTE: in RabbitMQ the declare-ok counts are not synchronised with
    # publishes on the same channel (the queue process answers 'stat' with a
    # higher priority than pending deliveries), so poll.
    assert wait_message_count(channel, queue, 4) == 4
    conn = open_connection()
    try:
        assert conn.channel().queue_declare(queue, passive=True).method.message_count == 4
    finally:
        conn.close()
