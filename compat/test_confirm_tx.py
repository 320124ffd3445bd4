"""Publisher confirms (confirm.select) and transactions (tx.*)."""

import struct

import pika
import pytest

import amqp_raw
from helpers import (expect_channel_error, get, get_all, raw_connection, settle,
                     sync, wait_message_count)


# --------------------------------------------------------------------------
# confirms
# --------------------------------------------------------------------------

def test_confirm_delivery_every_publish_acked(channel, queue):
    channel.confirm_delivery()
    for i in range(50):
        # BlockingChannel waits for the ack; raises NackError/UnroutableError otherwise.
        channel.basic_publish("", queue, b"%d" % i)
    assert wait_message_count(channel, queue, 50) == 50


def test_confirm_unroutable_non_mandatory_is_acked(channel):
    channel.confirm_delivery()
    channel.basic_publish("amq.direct", "compat-no-binding-xyz", b"x")  # no exception
    assert channel.is_open


def test_confirm_select_twice_is_ok():
    with raw_connection() as c:
        c.open_channel(1)
        for _ in range(2):
            c.send_method(1, amqp_raw.CONFIRM_SELECT, amqp_raw.bits(False))
            c.read_method(amqp_raw.CONFIRM_SELECT_OK, channel=1)


def _raw_confirm_channel(c, ch=1):
    c.open_channel(ch)
    c.send_method(ch, amqp_raw.CONFIRM_SELECT, amqp_raw.bits(False))
    c.read_method(amqp_raw.CONFIRM_SELECT_OK, channel=ch)


def _raw_publish(c, ch, exchange, rk, body=b"x", mandatory=False):
    c.send_method(ch, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args(exchange, rk, mandatory))
    c.send(amqp_raw.content_header_frame(ch, len(body)))
    if body:
        c.send(amqp_raw.body_frame(ch, body))


def _decode_ack(fr):
    r = amqp_raw.args_of(fr)
    return r.longlong(), bool(r.octet() & 1)


def test_confirm_delivery_tags_match_publish_sequence():
    n = 20
    with raw_connection() as c:
        _raw_confirm_channel(c)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        for i in range(n):
            _raw_publish(c, 1, "", q, b"%d" % i)
        confirmed, last = set(), 0
        while len(confirmed) < n:
            fr = c.read_method(channel=1)
            assert amqp_raw.method_of(fr) == amqp_raw.BASIC_ACK, fr  # never a nack
            tag, multiple = _decode_ack(fr)
            assert tag > last, "acks must be in increasing order"
            new = set(range(last + 1, tag + 1)) if multiple else {tag}
            assert not (new & confirmed)
            confirmed |= new
            last = tag
        assert confirmed == set(range(1, n + 1))


def test_confirm_tags_are_per_channel_and_start_at_one():
    with raw_connection() as c:
        _raw_confirm_channel(c, 1)
        _raw_confirm_channel(c, 2)
        _raw_publish(c, 1, "amq.direct", "compat-no-binding-xyz")
        assert _decode_ack(c.read_method(amqp_raw.BASIC_ACK, channel=1)) == (1, False)
        _raw_publish(c, 2, "amq.direct", "compat-no-binding-xyz")
        assert _decode_ack(c.read_method(amqp_raw.BASIC_ACK, channel=2)) == (1, False)
        _raw_publish(c, 1, "amq.direct", "compat-no-binding-xyz")
        assert _decode_ack(c.read_method(amqp_raw.BASIC_ACK, channel=1)) == (2, False)


def test_confirm_mandatory_unroutable_return_before_ack():
    with raw_connection() as c:
        _raw_confirm_channel(c)
        _raw_publish(c, 1, "amq.direct", "compat-no-binding-xyz", b"bounce", mandatory=True)
        fr = c.read_method(amqp_raw.BASIC_RETURN, channel=1)
        r = amqp_raw.args_of(fr)
        assert (r.short(), r.shortstr(), r.shortstr(), r.shortstr()) == (
            312, "NO_ROUTE", "amq.direct", "compat-no-binding-xyz")
        _, body, _ = c.read_content(1)
        assert body == b"bounce"
        assert _decode_ack(c.read_method(amqp_raw.BASIC_ACK, channel=1)) == (1, False)


def test_confirm_select_nowait_has_no_reply():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.CONFIRM_SELECT, amqp_raw.bits(True))
        _raw_publish(c, 1, "amq.direct", "compat-no-binding-xyz")
        fr = c.read_method(channel=1)
        assert amqp_raw.method_of(fr) == amqp_raw.BASIC_ACK  # no select-ok first
        assert _decode_ack(fr) == (1, False)


def test_confirm_publish_to_missing_exchange_closes_channel(channel):
    channel.confirm_delivery()
    text = expect_channel_error(channel, 404, channel.basic_publish,
                                "compat-missing-exchange-xyz", "rk", b"x")
    assert text == "NOT_FOUND - no exchange 'compat-missing-exchange-xyz' in vhost '/'"


def test_confirm_select_on_tx_channel_is_406(channel):
    channel.tx_select()
    text = expect_channel_error(channel, 406, channel.confirm_delivery)
    assert text == "PRECONDITION_FAILED - cannot switch from tx to confirm mode"


def test_tx_select_on_confirm_channel_is_406(channel):
    channel.confirm_delivery()
    text = expect_channel_error(channel, 406, channel.tx_select)
    assert text == "PRECONDITION_FAILED - cannot switch from confirm to tx mode"


# --------------------------------------------------------------------------
# transactions
# --------------------------------------------------------------------------

def test_tx_select_ok(channel):
    r = channel.tx_select()
    assert isinstance(r.method, pika.spec.Tx.SelectOk)
    r = channel.tx_select()  # idempotent
    assert isinstance(r.method, pika.spec.Tx.SelectOk)


@pytest.mark.parametrize("op", ["commit", "rollback"])
def test_tx_commit_rollback_without_select_is_406(channel, op):
    fn = channel.tx_commit if op == "commit" else channel.tx_rollback
    text = expect_channel_error(channel, 406, fn)
    assert text == "PRECONDITION_FAILED - channel is not transactional"


def test_tx_publish_visible_only_after_commit(connection, queue):
    tx = connection.channel()
    tx.tx_select()
    observer = connection.channel()
    for i in range(3):
        tx.basic_publish("", queue, b"t%d" % i)
    sync(tx)
    settle(connection, 0.3)
    assert observer.queue_declare(queue, passive=True).method.message_count == 0
    assert get(observer, queue, timeout=0.1) is None
    r = tx.tx_commit()
    assert isinstance(r.method, pika.spec.Tx.CommitOk)
    assert wait_message_count(observer, queue, 3) == 3
    assert [d.body for d in get_all(observer, queue)] == [b"t0", b"t1", b"t2"]


def test_tx_rollback_discards_publishes(connection, queue):
    tx = connection.channel()
    tx.tx_select()
    tx.basic_publish("", queue, b"discard-me")
    r = tx.tx_rollback()
    assert isinstance(r.method, pika.spec.Tx.RollbackOk)
    tx.basic_publish("", queue, b"keep-me")
    tx.tx_commit()
    observer = connection.channel()
    assert wait_message_count(observer, queue, 1) == 1
    assert [d.body for d in get_all(observer, queue)] == [b"keep-me"]


def test_tx_ack_takes_effect_on_commit(connection, queue):
    setup = connection.channel()
    for i in range(2):
        setup.basic_publish("", queue, b"m%d" % i)
    tx = connection.channel()
    tx.tx_select()
    d = get(tx, queue)
    tx.basic_ack(d.method.delivery_tag)
    tx.tx_commit()
    tx.close()
    # m0 is gone for good; m1 was never fetched.
    assert [x.body for x in get_all(connection.channel(), queue)] == [b"m1"]


def test_tx_ack_rolled_back_leaves_message_unacked(connection, queue):
    setup = connection.channel()
    setup.basic_publish("", queue, b"m0")
    tx = connection.channel()
    tx.tx_select()
    d = get(tx, queue)
    tx.basic_ack(d.method.delivery_tag)
    tx.tx_rollback()
    # Still unacked (not requeued by the rollback itself)...
    assert setup.queue_declare(queue, passive=True).method.message_count == 0
    # ...and it comes back when the channel closes.
    tx.close()
    got = get_all(connection.channel(), queue)
    assert [(x.body, x.method.redelivered) for x in got] == [(b"m0", True)]


def test_tx_ack_then_reack_after_rollback(connection, queue):
    setup = connection.channel()
    setup.basic_publish("", queue, b"m0")
    tx = connection.channel()
    tx.tx_select()
    d = get(tx, queue)
    tx.basic_ack(d.method.delivery_tag)
    tx.tx_rollback()
    tx.basic_ack(d.method.delivery_tag)  # the tag is still valid
    tx.tx_commit()
    tx.close()
    assert get(connection.channel(), queue, timeout=0.3) is None


def test_tx_reject_requeue_takes_effect_on_commit(connection, queue):
    setup = connection.channel()
    setup.basic_publish("", queue, b"m0")
    tx = connection.channel()
    tx.tx_select()
    d = get(tx, queue)
    tx.basic_reject(d.method.delivery_tag, requeue=True)
    sync(tx)
    assert setup.queue_declare(queue, passive=True).method.message_count == 0
    tx.tx_commit()
    assert wait_message_count(setup, queue, 1) == 1


def test_tx_publish_uncommitted_discarded_on_channel_close(connection, queue):
    tx = connection.channel()
    tx.tx_select()
    tx.basic_publish("", queue, b"lost")
    sync(tx)
    tx.close()
    ch = connection.channel()
    assert get(ch, queue, timeout=0.3) is None


def test_tx_multiple_commits(connection, queue):
    tx = connection.channel()
    tx.tx_select()
    tx.basic_publish("", queue, b"a")
    tx.tx_commit()
    tx.basic_publish("", queue, b"b")
    tx.tx_rollback()
    tx.basic_publish("", queue, b"c")
    tx.tx_commit()
    ch = connection.channel()
    assert wait_message_count(ch, queue, 2) == 2
    assert [d.body for d in get_all(ch, queue)] == [b"a", b"c"]


def test_tx_commit_with_nothing_pending(channel):
    channel.tx_select()
    assert isinstance(channel.tx_commit().method, pika.spec.Tx.CommitOk)
    assert isinstance(channel.tx_rollback().method, pika.spec.Tx.RollbackOk)


def test_tx_mandatory_unroutable_returned_on_commit(connection, channel):
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append(m.reply_code))
    channel.tx_select()
    channel.basic_publish("amq.direct", "compat-no-binding-xyz", b"x", mandatory=True)
    sync(channel)
    settle(connection, 0.2)
    assert returned == []  # nothing routed (or returned) before commit
    channel.tx_commit()
    settle(connection, 0.3)
    assert returned == [312]


def test_raw_tx_ack_frame_layout():
    # tx.select-ok / commit-ok / rollback-ok have no arguments.
    with raw_connection() as c:
        c.open_channel(1)
        for req, ok in (((90, 10), (90, 11)), ((90, 20), (90, 21)), ((90, 30), (90, 31))):
            c.send_method(1, req)
            fr = c.read_method(ok, channel=1)
            assert fr.payload == struct.pack(">HH", *ok)
