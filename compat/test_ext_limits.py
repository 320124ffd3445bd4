"""RabbitMQ extensions: queue length limits (x-max-length, x-max-length-bytes, x-overflow).

RabbitMQ 3.10 (classic queues):
* only *ready* messages count; unacked deliveries do not;
* x-max-length-bytes counts body bytes only (not properties/headers);
* drop-head (default): the new message is enqueued, then messages are dropped
  (dead-lettered with reason maxlen when a DLX is set) from the head until
  the queue is within its limits, so an oversized message drops itself;
* reject-publish: a message that would take the queue over a limit
  (count + 1 > max, or bytes + size > max) is refused: basic.nack in confirm
  mode (the nack carries requeue=1, multiple=0), silently dropped otherwise;
  never dead-lettered, never basic.return'ed;
* reject-publish-dlx: like reject-publish but the refused message is also
  dead-lettered with reason maxlen.
"""

import socket

import pika
import pytest

import amqp_raw
from ext_wire import death, raw_get, split_time, x_death
from helpers import (Collector, expect_channel_error, get, get_all, message_count,
                     open_connection, raw_connection, settle, wait_for, wait_message_count)

P = pika.BasicProperties


@pytest.fixture
def declare(channel, name, cleanup):
    def _declare(arguments=None, **kw):
        q = cleanup.queue(name("q"))
        channel.queue_declare(q, arguments=arguments, **kw)
        return q
    return _declare


@pytest.fixture
def confirm_ch(connection):
    ch = connection.channel()
    ch.confirm_delivery()
    return ch


def publish(ch, q, body, **kw):
    """Publish on a confirm channel: 'ack' or 'nack'."""
    try:
        ch.basic_publish("", q, body, **kw)
        return "ack"
    except pika.exceptions.NackError:
        return "nack"


def bodies(ch, q):
    return [d.body for d in get_all(ch, q)]


def settled_count(ch, q, expected):
    """Wait for `expected` messages, then check the count stays there."""
    assert wait_message_count(ch, q, expected) == expected
    ch.connection.sleep(0.2)
    return message_count(ch, q)


# --------------------------------------------------------------------------
# drop-head
# --------------------------------------------------------------------------

def test_max_length_drops_oldest(channel, declare):
    q = declare({"x-max-length": 2})
    for i in range(5):
        channel.basic_publish("", q, b"m%d" % i)
    assert settled_count(channel, q, 2) == 2
    assert bodies(channel, q) == [b"m3", b"m4"]


def test_explicit_drop_head_is_the_default(channel, declare, confirm_ch):
    q = declare({"x-max-length": 1, "x-overflow": "drop-head"})
    assert publish(confirm_ch, q, b"a") == "ack"
    assert publish(confirm_ch, q, b"b") == "ack"  # accepted; 'a' is dropped
    assert bodies(channel, q) == [b"b"]


def test_max_length_drop_head_dead_letters_in_order(channel, declare):
    dq = declare()
    q = declare({"x-max-length": 1, "x-dead-letter-exchange": "",
                 "x-dead-letter-routing-key": dq})
    for i in range(4):
        channel.basic_publish("", q, b"m%d" % i)
    assert wait_message_count(channel, dq, 3) == 3
    m = raw_get(dq)
    assert m.body == b"m0"
    assert split_time(x_death(m)[0])[0] == death(1, "maxlen", q, "", [q])
    assert bodies(channel, dq) == [b"m1", b"m2"]
    assert bodies(channel, q) == [b"m3"]


def test_unacked_messages_do_not_count(channel, declare):
    q = declare({"x-max-length": 2})
    channel.basic_publish("", q, b"m0")
    channel.basic_publish("", q, b"m1")
    held = [get(channel, q), get(channel, q)]
    assert [d.body for d in held] == [b"m0", b"m1"]
    for i in range(2, 5):
        channel.basic_publish("", q, b"m%d" % i)
    assert settled_count(channel, q, 2) == 2
    assert bodies(channel, q) == [b"m3", b"m4"]
    # The held deliveries are still valid.
    channel.basic_ack(held[1].method.delivery_tag, multiple=True)


def test_max_length_zero_drops_every_message(channel, declare):
    q = declare({"x-max-length": 0})
    channel.basic_publish("", q, b"a")
    channel.basic_publish("", q, b"b")
    channel.connection.sleep(0.2)
    assert bodies(channel, q) == []


def test_max_length_zero_drop_head_still_feeds_waiting_consumer(connection, channel, declare):
    # SURPRISE: with drop-head a message handed straight to a consumer with
    # spare capacity never sits in the queue, so max-length 0 does not stop it
    # (compare test_reject_publish_refuses_even_with_waiting_consumer).
    q = declare({"x-max-length": 0})
    col = Collector()
    channel.basic_consume(q, col, auto_ack=True)
    channel.basic_publish("", q, b"direct")
    assert wait_for(connection, lambda: len(col) == 1)
    assert col.bodies == [b"direct"]


def test_max_length_bytes_counts_body_bytes_only(channel, declare):
    q = declare({"x-max-length-bytes": 10})
    big = P(headers={"big": "x" * 1000}, content_type="y" * 200)
    channel.basic_publish("", q, b"12345", big)
    channel.basic_publish("", q, b"67890", big)
    assert settled_count(channel, q, 2) == 2
    channel.basic_publish("", q, b"A")  # 11 bytes: the oldest goes
    assert wait_message_count(channel, q, 2) == 2
    assert bodies(channel, q) == [b"67890", b"A"]


def test_max_length_bytes_oversized_message_drops_itself(channel, declare):
    q = declare({"x-max-length-bytes": 10})
    channel.basic_publish("", q, b"12345678901")  # 11 bytes
    channel.basic_publish("", q, b"1234567890")   # exactly 10 bytes fits
    assert settled_count(channel, q, 1) == 1
    assert bodies(channel, q) == [b"1234567890"]


def test_max_length_bytes_zero_keeps_empty_bodies(channel, declare):
    q = declare({"x-max-length-bytes": 0})
    channel.basic_publish("", q, b"")
    channel.basic_publish("", q, b"")
    assert settled_count(channel, q, 2) == 2
    # A 1-byte message: drop-head drops both empty ones first, then itself.
    channel.basic_publish("", q, b"x")
    assert settled_count(channel, q, 0) == 0


def test_both_limits_apply(channel, declare):
    q = declare({"x-max-length": 2, "x-max-length-bytes": 100})
    channel.basic_publish("", q, b"a")
    channel.basic_publish("", q, b"b")
    channel.basic_publish("", q, b"c")          # count limit drops 'a'
    channel.basic_publish("", q, b"x" * 100)    # count drops b, bytes (101) drop c
    assert settled_count(channel, q, 1) == 1
    assert bodies(channel, q) == [b"x" * 100]


# --------------------------------------------------------------------------
# reject-publish
# --------------------------------------------------------------------------

def test_reject_publish_without_confirms_drops_new_messages(channel, declare):
    q = declare({"x-max-length": 1, "x-overflow": "reject-publish"})
    channel.basic_publish("", q, b"a")
    channel.basic_publish("", q, b"b")
    channel.basic_publish("", q, b"c")
    assert settled_count(channel, q, 1) == 1
    assert channel.is_open
    assert bodies(channel, q) == [b"a"]


def test_reject_publish_nacks_in_confirm_mode(channel, declare, confirm_ch):
    q = declare({"x-max-length": 2, "x-overflow": "reject-publish"})
    assert [publish(confirm_ch, q, b) for b in (b"a", b"b", b"c")] == ["ack", "ack", "nack"]
    assert bodies(channel, q) == [b"a", b"b"]
    # Room again: accepted again.
    assert publish(confirm_ch, q, b"d") == "ack"
    assert bodies(channel, q) == [b"d"]


def test_reject_publish_nack_frame_and_no_return(name, cleanup):
    # On the wire: basic.nack with the requeue bit set (RabbitMQ never clears
    # it) and no basic.return even for a mandatory publish (the queue was
    # routed to).  RabbitMQ may coalesce consecutive nacks into one with
    # multiple=1, so outcomes are collected per delivery tag.
    q = cleanup.queue(name("q"))
    conn = open_connection()
    conn.channel().queue_declare(q, arguments={"x-max-length": 1,
                                               "x-overflow": "reject-publish"})
    conn.close()
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CONFIRM_SELECT, amqp_raw.bits(False))
        c.read_method(amqp_raw.CONFIRM_SELECT_OK, channel=1)
        for mandatory in (False, False, True):
            c.send_method(1, amqp_raw.BASIC_PUBLISH,
                          amqp_raw.basic_publish_args("", q, mandatory))
            c.send(amqp_raw.content_header_frame(1, 1))
            c.send(amqp_raw.body_frame(1, b"x"))
        outcome = {}
        while len(outcome) < 3:
            fr = c.read_method(channel=1)
            m = amqp_raw.method_of(fr)
            assert m in (amqp_raw.BASIC_ACK, amqp_raw.BASIC_NACK), m
            r = amqp_raw.args_of(fr)
            tag, flags = r.longlong(), r.octet()
            kind = "ack" if m == amqp_raw.BASIC_ACK else "nack"
            if kind == "nack":
                assert flags & 2, "requeue bit not set"
            for t in (range(1, tag + 1) if flags & 1 else [tag]):
                outcome.setdefault(t, kind)
        assert outcome == {1: "ack", 2: "nack", 3: "nack"}
        c.sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            c.read_frame()


def test_reject_publish_unacked_do_not_count(channel, declare, confirm_ch):
    q = declare({"x-max-length": 1, "x-overflow": "reject-publish"})
    assert publish(confirm_ch, q, b"a") == "ack"
    assert get(channel, q).body == b"a"  # held unacked
    assert publish(confirm_ch, q, b"b") == "ack"
    assert publish(confirm_ch, q, b"c") == "nack"


def test_reject_publish_bytes_refuses_what_would_exceed(channel, declare, confirm_ch):
    q = declare({"x-max-length-bytes": 10, "x-overflow": "reject-publish"})
    assert publish(confirm_ch, q, b"123456") == "ack"
    assert publish(confirm_ch, q, b"12345") == "nack"    # 6 + 5 > 10
    assert publish(confirm_ch, q, b"1234") == "ack"      # 6 + 4 = 10
    assert publish(confirm_ch, q, b"") == "ack"          # 10 + 0 = 10
    assert publish(confirm_ch, q, b"1") == "nack"
    assert bodies(channel, q) == [b"123456", b"1234", b""]


def test_reject_publish_oversized_message_is_refused(channel, declare, confirm_ch):
    q = declare({"x-max-length-bytes": 10, "x-overflow": "reject-publish"})
    assert publish(confirm_ch, q, b"12345678901") == "nack"
    assert publish(confirm_ch, q, b"1") == "ack"


def test_reject_publish_max_length_zero(channel, declare, confirm_ch):
    q = declare({"x-max-length": 0, "x-overflow": "reject-publish"})
    assert publish(confirm_ch, q, b"a") == "nack"


def test_reject_publish_refuses_even_with_waiting_consumer(connection, declare, confirm_ch):
    q = declare({"x-max-length": 0, "x-overflow": "reject-publish"})
    col = Collector()
    connection.channel().basic_consume(q, col, auto_ack=True)
    assert publish(confirm_ch, q, b"a") == "nack"
    settle(connection, 0.2)
    assert col.bodies == []


def test_reject_publish_nack_when_any_queue_refuses(connection, channel, declare, confirm_ch,
                                                    name, cleanup):
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "fanout")
    full = declare({"x-max-length": 0, "x-overflow": "reject-publish"})
    ok = declare()
    channel.queue_bind(full, x)
    channel.queue_bind(ok, x)
    with pytest.raises(pika.exceptions.NackError):
        confirm_ch.basic_publish(x, "", b"f")
    # The other queue still got its copy.
    assert settled_count(channel, ok, 1) == 1
    assert message_count(channel, full) == 0


def test_reject_publish_does_not_dead_letter(channel, declare):
    dq = declare()
    q = declare({"x-max-length": 1, "x-overflow": "reject-publish",
                 "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dq})
    channel.basic_publish("", q, b"a")
    channel.basic_publish("", q, b"b")
    assert settled_count(channel, q, 1) == 1
    assert message_count(channel, dq) == 0


def test_reject_publish_dlx_nacks_and_dead_letters(channel, declare, confirm_ch):
    dq = declare()
    q = declare({"x-max-length": 1, "x-overflow": "reject-publish-dlx",
                 "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dq})
    assert publish(confirm_ch, q, b"a") == "ack"
    assert publish(confirm_ch, q, b"b", properties=P(expiration="5000")) == "nack"
    assert wait_message_count(channel, dq, 1) == 1
    m = raw_get(dq)
    assert (m.exchange, m.routing_key, m.body) == ("", dq, b"b")
    assert split_time(x_death(m)[0])[0] == death(1, "maxlen", q, "", [q],
                                                 original_expiration="5000")
    assert bodies(channel, q) == [b"a"]


def test_reject_publish_dlx_without_dlx_just_nacks(channel, declare, confirm_ch):
    q = declare({"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
    assert publish(confirm_ch, q, b"a") == "ack"
    assert publish(confirm_ch, q, b"b") == "nack"
    assert bodies(channel, q) == [b"a"]


# --------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    {"x-max-length": 0}, {"x-max-length": 2 ** 62}, {"x-max-length-bytes": 0},
    {"x-max-length-bytes": 2 ** 62}, {"x-overflow": "drop-head"},
    {"x-overflow": "reject-publish"}, {"x-overflow": "reject-publish-dlx"},
])
def test_valid_limit_arguments(channel, declare, args):
    q = declare(args)
    assert channel.queue_declare(q, arguments=args).method.queue == q


@pytest.mark.parametrize("arg,value,reason", [
    ("x-max-length", -1, "{value_negative,-1}"),
    ("x-max-length", "a", '"expected integer, got longstr"'),
    ("x-max-length", True, '"expected integer, got bool"'),
    ("x-max-length-bytes", -1, "{value_negative,-1}"),
    ("x-max-length-bytes", "a", '"expected integer, got longstr"'),
    ("x-overflow", "bogus", "invalid_overflow"),
    ("x-overflow", "", "invalid_overflow"),
    ("x-overflow", 1, "{unacceptable_type,signedint}"),
])
def test_invalid_limit_arguments_are_406(channel, name, arg, value, reason):
    q = name("q")
    text = expect_channel_error(channel, 406, channel.queue_declare, q, arguments={arg: value})
    assert text == "PRECONDITION_FAILED - invalid arg '%s' for queue '%s' in vhost '/': %s" % (
        arg, q, reason)


def test_redeclare_with_other_overflow_is_406(channel, declare):
    q = declare({"x-overflow": "drop-head"})
    text = expect_channel_error(channel, 406, channel.queue_declare, q,
                                arguments={"x-overflow": "reject-publish"})
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'x-overflow' for queue '%s' in "
                    "vhost '/': received 'reject-publish' but current is 'drop-head'" % q)
