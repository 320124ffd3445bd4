"""Channel lifecycle: open/close, flow, protocol errors around channel state."""

import pika
import pytest

import amqp_raw
from amqp_raw import method_of
from helpers import expect_channel_error, raw_connection, sync


def test_open_and_close_many_channels(connection):
    chans = [connection.channel() for _ in range(200)]
    numbers = [ch.channel_number for ch in chans]
    assert len(set(numbers)) == 200
    for ch in chans:
        assert ch.is_open
        sync(ch)
    for ch in chans:
        ch.close()
        assert ch.is_closed
    # The connection is unaffected.
    assert connection.is_open
    sync(connection.channel())


def test_channel_number_reuse_after_close():
    with raw_connection() as c:
        for _ in range(3):
            c.open_channel(1)
            c.send_method(1, amqp_raw.CHANNEL_CLOSE, amqp_raw.close_args())
            c.read_method(amqp_raw.CHANNEL_CLOSE_OK, channel=1)


def test_channel_open_ok_payload():
    # channel.open-ok carries a single (deprecated) longstr, empty in RabbitMQ.
    with raw_connection() as c:
        fr = c.open_channel(7)
        assert fr.channel == 7
        assert amqp_raw.args_of(fr).longstr() == b""


def test_channel_close_from_client_with_reply_code(connection):
    ch = connection.channel()
    ch.close(reply_code=200, reply_text="bye")
    assert ch.is_closed
    assert connection.is_open


def test_channel_flow_active_true_pika(channel):
    assert channel.flow(True) is True


def test_channel_flow_raw():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CHANNEL_FLOW, amqp_raw.bits(True))
        fr = c.read_method(amqp_raw.CHANNEL_FLOW_OK, channel=1)
        assert amqp_raw.args_of(fr).octet() == 1


def test_channel_flow_false_not_implemented():
    # SURPRISE: RabbitMQ refuses client-side flow(active=false) with a *connection*
    # error: 540 "NOT_IMPLEMENTED - active=false", class 20 method 20.
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CHANNEL_FLOW, amqp_raw.bits(False))
        close = c.expect_connection_close()
        assert close.reply_code == 540
        assert close.reply_text == "NOT_IMPLEMENTED - active=false"
        assert (close.class_id, close.method_id) == (20, 20)


def test_method_on_unopened_channel_is_504():
    # queue.declare on channel 5 with no channel.open first:
    # connection.close 504 "CHANNEL_ERROR - expected 'channel.open'", 50/10.
    with raw_connection() as c:
        c.send_method(5, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        close = c.expect_connection_close()
        assert close.reply_code == 504
        assert close.reply_text == "CHANNEL_ERROR - expected 'channel.open'"
        assert (close.class_id, close.method_id) == (50, 10)


def test_method_on_closed_channel_is_504():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CHANNEL_CLOSE, amqp_raw.close_args())
        c.read_method(amqp_raw.CHANNEL_CLOSE_OK, channel=1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        close = c.expect_connection_close()
        assert close.reply_code == 504
        assert (close.class_id, close.method_id) == (50, 10)


def test_second_channel_open_is_504():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CHANNEL_OPEN, amqp_raw.shortstr(""))
        close = c.expect_connection_close()
        assert close.reply_code == 504
        assert close.reply_text == "CHANNEL_ERROR - second 'channel.open' seen"
        assert (close.class_id, close.method_id) == (20, 10)


def test_channel_method_on_channel_zero_is_504():
    # 504 "CHANNEL_ERROR - unexpected method in connection state running".
    with raw_connection() as c:
        c.send_method(0, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        close = c.expect_connection_close()
        assert close.reply_code == 504
        assert (close.class_id, close.method_id) == (50, 10)


def test_connection_method_on_nonzero_channel_is_503():
    # connection.open on channel 1: 503 "COMMAND_INVALID - unimplemented method".
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CONNECTION_OPEN,
                      amqp_raw.shortstr("/") + amqp_raw.shortstr("") + amqp_raw.bits(False))
        close = c.expect_connection_close()
        assert close.reply_code == 503
        assert (close.class_id, close.method_id) == (10, 40)


def test_unsolicited_channel_close_ok_is_503():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CHANNEL_CLOSE_OK)
        close = c.expect_connection_close()
        assert close.reply_code == 503
        assert (close.class_id, close.method_id) == (20, 41)


def test_frames_after_channel_close_are_ignored_until_close_ok():
    # After the server sends channel.close, everything but close/close-ok on
    # that channel is discarded; after close-ok the channel can be reopened.
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE,
                      amqp_raw.queue_declare_args("compat-missing-queue-xyz", passive=True))
        fr = c.read_method(amqp_raw.CHANNEL_CLOSE, channel=1)
        assert amqp_raw.decode_close(fr).reply_code == 404
        # This declare is dropped (no reply, no error).
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        c.send_method(1, amqp_raw.CHANNEL_CLOSE_OK)
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        fr = c.read_method()
        assert method_of(fr) == amqp_raw.QUEUE_DECLARE_OK and fr.channel == 1


def test_channel_error_leaves_connection_usable(connection):
    ch = connection.channel()
    expect_channel_error(ch, 404, ch.queue_declare, "compat-missing-queue-xyz", passive=True)
    assert connection.is_open
    ch2 = connection.channel()
    assert ch2.queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")


def test_pika_reports_channel_closed_state(connection):
    ch = connection.channel()
    expect_channel_error(ch, 404, ch.exchange_declare, "compat-missing-exchange-xyz", passive=True)
    with pytest.raises(pika.exceptions.ChannelWrongStateError):
        ch.queue_declare("", exclusive=True)
