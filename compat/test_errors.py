"""Protocol errors (raw socket) and the scope of channel vs connection errors."""

import struct

import pika
import pytest

import amqp_raw
from amqp_raw import CONNECTION_CLOSE, method_of
from helpers import (expect_channel_error, get, open_connection,
                     raw_connection, sync)


def _open(c, ch=1):
    c.open_channel(ch)
    return ch


# --------------------------------------------------------------------------
# frame-level errors -> connection.close, class/method 0/0
# --------------------------------------------------------------------------

def test_frame_larger_than_frame_max_is_501():
    # The check happens on the frame header, before the payload is read.
    with raw_connection() as c:
        _open(c)
        payload = amqp_raw.method_payload(60, 40, amqp_raw.basic_publish_args("", "x")) + b"\0" * 200000
        c.send(amqp_raw.frame(amqp_raw.FRAME_METHOD, 1, payload))
        close = c.expect_connection_close()
        assert close.reply_code == 501
        assert close.reply_text.startswith("FRAME_ERROR")
        assert "frame_too_large" in close.reply_text
        assert (close.class_id, close.method_id) == (0, 0)


def test_frame_payload_one_over_frame_max_is_501():
    with raw_connection(frame_max=4096) as c:
        _open(c)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "nowhere"))
        c.send(amqp_raw.content_header_frame(1, 4097))
        c.send(amqp_raw.body_frame(1, b"x" * 4097))
        close = c.expect_connection_close()
        assert close.reply_code == 501
        # Text reports the limit as frame_max - 8:
        assert close.reply_text == "FRAME_ERROR - type 3, all octets = <<>>: {frame_too_large,4097,4088}"


def test_frame_payload_equal_to_frame_max_is_tolerated():
    # SURPRISE: RabbitMQ allows a payload of up to frame_max bytes (a total
    # frame size of frame_max + 8) as a "fudge" for buggy clients, although
    # the spec limits the *whole* frame to frame_max.
    with raw_connection(frame_max=4096) as c:
        _open(c)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, 4096))
        c.send(amqp_raw.body_frame(1, b"y" * 4096))
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        c.read_method(amqp_raw.BASIC_GET_OK, channel=1)
        _, body, _ = c.read_content(1)
        assert body == b"y" * 4096


def test_bad_frame_end_is_501():
    with raw_connection() as c:
        _open(c)
        fr = amqp_raw.method_frame(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        c.send(fr[:-1] + b"\x00")
        close = c.expect_connection_close()
        assert close.reply_code == 501
        assert close.reply_text.startswith("FRAME_ERROR")
        assert "invalid_frame_end_marker" in close.reply_text
        assert (close.class_id, close.method_id) == (0, 0)


def test_unknown_frame_type_is_501():
    with raw_connection() as c:
        _open(c)
        c.send(amqp_raw.frame(9, 1, b"abc"))
        close = c.expect_connection_close()
        assert close.reply_code == 501
        assert close.reply_text == 'FRAME_ERROR - type 9, all octets = <<"abc">>: unknown_frame'
        assert (close.class_id, close.method_id) == (0, 0)


def test_heartbeat_on_nonzero_channel_is_505():
    with raw_connection() as c:
        _open(c)
        c.send(amqp_raw.frame(amqp_raw.FRAME_HEARTBEAT, 1, b""))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert close.reply_text == "UNEXPECTED_FRAME - type 8, all octets = <<>>"


def test_truncated_method_arguments_is_501():
    # queue.declare with arguments cut short: 501 "FRAME_ERROR - cannot
    # decode <<...>>", naming the method (50/10).
    with raw_connection() as c:
        _open(c)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, b"\x00\x00\x05ab")
        close = c.expect_connection_close()
        assert close.reply_code == 501
        assert close.reply_text.startswith("FRAME_ERROR - cannot decode")
        assert (close.class_id, close.method_id) == (50, 10)


# --------------------------------------------------------------------------
# unknown methods
# --------------------------------------------------------------------------

@pytest.mark.parametrize("channel,cls,meth", [(1, 50, 99), (1, 99, 10), (0, 10, 99)])
def test_unknown_class_or_method_terminates_connection(channel, cls, meth):
    # SURPRISE: RabbitMQ 3.10 has no connection.close for this: the reader
    # process crashes on {unknown_method_id,{C,M}} and the TCP connection is
    # reset.  The spec would say 503 COMMAND_INVALID / 540 NOT_IMPLEMENTED;
    # a compatible broker may send either (with the class/method ids) before
    # closing, but it must end the connection.
    with raw_connection() as c:
        if channel:
            _open(c, channel)
        c.send_method(channel, (cls, meth))
        frames = c.read_all_until_eof(limit=5)
        closes = [f for f in frames if f.type == amqp_raw.FRAME_METHOD and method_of(f) == CONNECTION_CLOSE]
        for f in closes:
            close = amqp_raw.decode_close(f)
            assert close.reply_code in (503, 540)
            assert (close.class_id, close.method_id) == (cls, meth)


# --------------------------------------------------------------------------
# content framing errors
# --------------------------------------------------------------------------

def test_content_header_without_publish_is_505():
    with raw_connection() as c:
        _open(c)
        c.send(amqp_raw.content_header_frame(1, 5))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert close.reply_text == "UNEXPECTED_FRAME - expected method frame, got non method frame instead"
        assert (close.class_id, close.method_id) == (0, 0)


def test_body_without_pending_content_is_505():
    with raw_connection() as c:
        _open(c)
        c.send(amqp_raw.body_frame(1, b"hello"))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert close.reply_text == "UNEXPECTED_FRAME - expected method frame, got non method frame instead"
        assert (close.class_id, close.method_id) == (0, 0)


def test_body_after_complete_message_is_505():
    with raw_connection() as c:
        _open(c)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("amq.direct", "nowhere"))
        c.send(amqp_raw.content_header_frame(1, 2))
        c.send(amqp_raw.body_frame(1, b"ab"))
        c.send(amqp_raw.body_frame(1, b"extra"))
        close = c.expect_connection_close()
        assert close.reply_code == 505


def test_method_instead_of_content_header_is_505():
    # The close names the interrupted basic.publish (60/40).
    with raw_connection() as c:
        _open(c)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "x"))
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert close.reply_text == ("UNEXPECTED_FRAME - expected content header for class 60, "
                                    "got non content header frame instead")
        assert (close.class_id, close.method_id) == (60, 40)


def test_body_instead_of_content_header_is_505():
    with raw_connection() as c:
        _open(c)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "x"))
        c.send(amqp_raw.body_frame(1, b"hello"))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert (close.class_id, close.method_id) == (60, 40)


def test_content_header_wrong_class_is_505():
    with raw_connection() as c:
        _open(c)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "x"))
        c.send(amqp_raw.content_header_frame(1, 3, class_id=50))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert close.reply_text == ("UNEXPECTED_FRAME - expected content header for class 60, "
                                    "got one for class 50 instead")
        assert (close.class_id, close.method_id) == (60, 40)


def test_method_instead_of_body_is_505():
    with raw_connection() as c:
        _open(c)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "x"))
        c.send(amqp_raw.content_header_frame(1, 3))
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        close = c.expect_connection_close()
        assert close.reply_code == 505
        assert close.reply_text == ("UNEXPECTED_FRAME - expected content body, "
                                    "got non content body frame instead")
        assert (close.class_id, close.method_id) == (60, 40)


def test_content_interleaved_across_channels_is_fine():
    # Content frames of a message on channel 1 may be interleaved with frames
    # on channel 2.
    with raw_connection() as c:
        _open(c, 1)
        _open(c, 2)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, 4))
        c.send_method(2, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(2, 2))
        c.send(amqp_raw.body_frame(1, b"on"))
        c.send(amqp_raw.body_frame(2, b"c2"))
        c.send(amqp_raw.body_frame(1, b"e1"))
        bodies = []
        for ch in (1, 2):  # by the time channel 2's get runs, both are queued
            c.send_method(ch, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
            c.read_method(amqp_raw.BASIC_GET_OK, channel=ch)
            bodies.append(c.read_content(ch)[1])
        assert sorted(bodies) == [b"c2", b"one1"]


# --------------------------------------------------------------------------
# close frames name the offending method
# --------------------------------------------------------------------------

def _exclusive_queue(c, ch):
    c.send_method(ch, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
    return amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()


@pytest.mark.parametrize("case", [
    # (description, request builder, expected code, expected class/method)
    "passive_queue_404", "passive_exchange_404", "bind_missing_exchange_404",
    "declare_amq_exchange_403", "redeclare_exchange_type_406", "publish_missing_exchange_404",
    "ack_unknown_tag_406", "queue_amq_prefix_403", "get_missing_queue_404",
])
def test_channel_close_names_class_and_method(case):
    with raw_connection() as c:
        _open(c)
        if case == "passive_queue_404":
            c.send_method(1, amqp_raw.QUEUE_DECLARE,
                          amqp_raw.queue_declare_args("compat-missing-queue-xyz", passive=True))
            expected = (404, 50, 10)
        elif case == "passive_exchange_404":
            c.send_method(1, amqp_raw.EXCHANGE_DECLARE,
                          b"\0\0" + amqp_raw.shortstr("compat-missing-exchange-xyz")
                          + amqp_raw.shortstr("direct") + amqp_raw.bits(True, False, False, False, False)
                          + amqp_raw.table({}))
            expected = (404, 40, 10)
        elif case == "bind_missing_exchange_404":
            q = _exclusive_queue(c, 1)
            c.send_method(1, (50, 20), b"\0\0" + amqp_raw.shortstr(q)
                          + amqp_raw.shortstr("compat-missing-exchange-xyz") + amqp_raw.shortstr("rk")
                          + amqp_raw.bits(False) + amqp_raw.table({}))
            expected = (404, 50, 20)
        elif case == "declare_amq_exchange_403":
            c.send_method(1, amqp_raw.EXCHANGE_DECLARE,
                          b"\0\0" + amqp_raw.shortstr("amq.compat-x") + amqp_raw.shortstr("direct")
                          + amqp_raw.bits(False, False, False, False, False) + amqp_raw.table({}))
            expected = (403, 40, 10)
        elif case == "redeclare_exchange_type_406":
            c.send_method(1, amqp_raw.EXCHANGE_DECLARE,
                          b"\0\0" + amqp_raw.shortstr("amq.direct") + amqp_raw.shortstr("fanout")
                          + amqp_raw.bits(False, True, False, False, False) + amqp_raw.table({}))
            expected = (406, 40, 10)
        elif case == "publish_missing_exchange_404":
            c.send_method(1, amqp_raw.BASIC_PUBLISH,
                          amqp_raw.basic_publish_args("compat-missing-exchange-xyz", "rk"))
            c.send(amqp_raw.content_header_frame(1, 1))
            c.send(amqp_raw.body_frame(1, b"x"))
            expected = (404, 60, 40)
        elif case == "ack_unknown_tag_406":
            c.send_method(1, amqp_raw.BASIC_ACK, struct.pack(">Q", 42) + amqp_raw.bits(False))
            expected = (406, 60, 80)
        elif case == "queue_amq_prefix_403":
            c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("amq.compat-q"))
            expected = (403, 50, 10)
        elif case == "get_missing_queue_404":
            c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args("compat-missing-queue-xyz"))
            expected = (404, 60, 70)
        close = c.expect_channel_close(1)
        assert (close.reply_code, close.class_id, close.method_id) == expected, close
        # The connection survives: the channel number can be reused.
        c.open_channel(1)
        _exclusive_queue(c, 1)


def test_exclusive_queue_405_names_method(name):
    conn = open_connection()
    try:
        q = name("excl")
        conn.channel().queue_declare(q, exclusive=True)
        with raw_connection() as c:
            _open(c)
            c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args(q, passive=True))
            close = c.expect_channel_close(1)
            assert (close.reply_code, close.class_id, close.method_id) == (405, 50, 10)
    finally:
        conn.close()


def test_connection_error_close_names_method():
    with raw_connection() as c:
        _open(c)
        c.send_method(1, (60, 10), struct.pack(">IHB", 1000, 0, 0))  # qos prefetch_size=1000
        close = c.expect_connection_close()
        assert (close.reply_code, close.class_id, close.method_id) == (540, 60, 10)


# --------------------------------------------------------------------------
# isolation: a channel error closes only that channel
# --------------------------------------------------------------------------

@pytest.mark.parametrize("code", [404, 405, 406, 403])
def test_channel_error_isolated_from_other_channels_and_connections(connection, connect, name,
                                                                    cleanup, code):
    q = cleanup.queue(name("q"))
    bystander = connection.channel()
    bystander.queue_declare(q)
    other_conn_ch = connect().channel()
    victim = connection.channel()

    if code == 404:
        expect_channel_error(victim, 404, victim.queue_declare, "compat-missing-queue-xyz", passive=True)
    elif code == 405:
        owner = connect().channel()
        xq = name("excl")
        owner.queue_declare(xq, exclusive=True)
        expect_channel_error(victim, 405, victim.queue_declare, xq, passive=True)
    elif code == 406:
        expect_channel_error(victim, 406, victim.queue_declare, q, durable=True)
    else:
        expect_channel_error(victim, 403, victim.exchange_declare, "amq.compat-x", "direct")

    assert victim.is_closed
    assert connection.is_open and bystander.is_open
    # Bystander channel on the same connection still works end to end.
    bystander.basic_publish("", q, b"still-alive")
    assert get(bystander, q, auto_ack=True).body == b"still-alive"
    # So does another connection.
    other_conn_ch.basic_publish("", q, b"other-conn")
    assert get(other_conn_ch, q, auto_ack=True).body == b"other-conn"
    # And a new channel on the same connection.
    fresh = connection.channel()
    sync(fresh)


def test_channel_error_keeps_other_channels_consumers(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    consumer_ch = connection.channel()
    consumer_ch.queue_declare(q)
    got = []
    consumer_ch.basic_consume(q, lambda ch, m, p, b: got.append(b), auto_ack=True)
    victim = connection.channel()
    expect_channel_error(victim, 404, victim.basic_publish, "compat-missing-exchange-xyz", "", b"x")
    connection.channel().basic_publish("", q, b"after")
    deadline_hit = False
    for _ in range(100):
        if got:
            break
        connection.process_data_events(time_limit=0.05)
    else:
        deadline_hit = True
    assert not deadline_hit and got == [b"after"]


def test_connection_error_closes_all_channels(connect):
    conn = connect()
    channels = [conn.channel() for _ in range(3)]
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as ei:
        channels[0].basic_qos(prefetch_size=1)
    assert ei.value.reply_code == 540
    assert conn.is_closed
    assert all(ch.is_closed for ch in channels)
