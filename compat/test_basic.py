"""basic.*: publish, consume, get, ack/nack/reject, recover, qos, returns."""

import re
import struct
from datetime import datetime, timezone
from decimal import Decimal

import pika
import pytest

import amqp_raw
from helpers import (Collector, consume, expect_channel_error,
                     expect_connection_error, get, get_all, raw_connection,
                     settle, sync, wait_for, wait_message_count)

CTAG = re.compile(r"^amq\.ctag-[A-Za-z0-9_-]{22}$")


def publish_n(ch, q, n, prefix=b"m"):
    bodies = [prefix + b"%d" % i for i in range(n)]
    for b in bodies:
        ch.basic_publish("", q, b)
    return bodies


# --------------------------------------------------------------------------
# properties and bodies
# --------------------------------------------------------------------------

FULL_HEADERS = {
    "str": "hello",
    "unicode": "h\u00e9llo \u2603",
    "int": 42,
    "neg": -7,
    "big": 2 ** 40,
    "true": True,
    "false": False,
    "dec": Decimal("3.14"),
    "ts": datetime(2020, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
    "bytes": b"\x00\x01\xfe\xff",
    "void": None,
    "array": [1, "two", True, [3, 4], {"in": "array"}],
    "nested": {"a": {"b": {"c": [1, {"d": "deep"}]}}},
    "empty_table": {},
    "empty_array": [],
}


def full_properties():
    return pika.BasicProperties(
        content_type="application/json",
        content_encoding="gzip",
        headers=FULL_HEADERS,
        delivery_mode=2,
        priority=7,
        correlation_id="corr-\u00e9-1",
        reply_to="reply.queue",
        expiration="86400000",
        message_id="msg-123",
        timestamp=1700000000,
        type="compat.type",
        user_id="guest",  # must equal the authenticated user (RabbitMQ checks)
        app_id="compat-app",
    )


def assert_full_properties(p):
    assert p.content_type == "application/json"
    assert p.content_encoding == "gzip"
    assert p.headers == FULL_HEADERS
    assert p.delivery_mode == 2
    assert p.priority == 7
    assert p.correlation_id == "corr-\u00e9-1"
    assert p.reply_to == "reply.queue"
    assert p.expiration == "86400000"
    assert p.message_id == "msg-123"
    assert p.timestamp == 1700000000
    assert p.type == "compat.type"
    assert p.user_id == "guest"
    assert p.app_id == "compat-app"
    assert p.cluster_id is None


def test_properties_round_trip_get(channel, queue):
    channel.basic_publish("", queue, b"payload", full_properties())
    d = get(channel, queue, auto_ack=True)
    assert d.body == b"payload"
    assert_full_properties(d.properties)


def test_properties_round_trip_consume(connection, channel, queue):
    channel.basic_publish("", queue, b"payload", full_properties())
    col, _ = consume(connection, channel, queue, 1, auto_ack=True)
    assert col.deliveries[0].body == b"payload"
    assert_full_properties(col.deliveries[0].properties)


def test_no_properties_round_trip(channel, queue):
    channel.basic_publish("", queue, b"x")
    d = get(channel, queue, auto_ack=True)
    p = d.properties
    for attr in ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                 "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                 "type", "user_id", "app_id", "cluster_id"):
        assert getattr(p, attr) is None, attr


def test_content_header_delivered_byte_for_byte(name):
    # Every field-table type RabbitMQ knows (including f/d/L/B/u/i that pika
    # cannot produce) is delivered back unchanged, bit for bit.
    def v(t, fmt, x):
        return t + struct.pack(fmt, x)
    fields = b"".join([
        amqp_raw.shortstr("b") + v(b"b", ">b", -5),
        amqp_raw.shortstr("B") + v(b"B", ">B", 250),
        amqp_raw.shortstr("s") + v(b"s", ">h", -300),
        amqp_raw.shortstr("u") + v(b"u", ">H", 60000),
        amqp_raw.shortstr("I") + v(b"I", ">i", -70000),
        amqp_raw.shortstr("i") + v(b"i", ">I", 4000000000),
        amqp_raw.shortstr("l") + v(b"l", ">q", -2 ** 40),
        amqp_raw.shortstr("L") + v(b"L", ">Q", 2 ** 40),
        amqp_raw.shortstr("f") + v(b"f", ">f", 1.5),
        amqp_raw.shortstr("d") + v(b"d", ">d", 2.25),
        amqp_raw.shortstr("D") + b"D\x02" + struct.pack(">i", 314),
        amqp_raw.shortstr("T") + v(b"T", ">Q", 1700000000),
        amqp_raw.shortstr("V") + b"V",
        amqp_raw.shortstr("t") + b"t\x01",
        amqp_raw.shortstr("S") + b"S" + amqp_raw.longstr("hi"),
        amqp_raw.shortstr("x") + b"x" + amqp_raw.longstr(b"\x00\xff"),
        amqp_raw.shortstr("A") + b"A" + struct.pack(">I", 8) + b"I" + struct.pack(">i", 1)
        + b"t\x00" + b"V",
        amqp_raw.shortstr("F") + b"F" + amqp_raw.table({"k": "v"}),
    ])
    # content-type (bit 15), headers (bit 13), delivery-mode (bit 12)
    flags = (1 << 15) | (1 << 13) | (1 << 12)
    props = amqp_raw.shortstr("text/plain") + struct.pack(">I", len(fields)) + fields + b"\x02"
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, 3, flags=flags, props=props))
        c.send(amqp_raw.body_frame(1, b"abc"))
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        c.read_method(amqp_raw.BASIC_GET_OK, channel=1)
        header, body, _ = c.read_content(1)
        assert header == struct.pack(">HHQH", 60, 0, 3, flags) + props
        assert body == b"abc"


def test_unknown_field_type_in_headers_closes_connection():
    # 'U' is the spec's signed 16-bit integer, which RabbitMQ does not know: RabbitMQ 3.10
    # accepts the publish and fails while delivering it, closing the connection with 541
    # INTERNAL_ERROR (class/method 0/0). Warren decodes properties on arrival and reads 'U' as
    # the spec says, so it delivers the message byte for byte (a documented deviation, see the
    # README).
    fields = amqp_raw.shortstr("bad") + b"U" + struct.pack(">h", -3)
    props = struct.pack(">I", len(fields)) + fields
    with raw_connection() as c:
        warren = c.server_properties.get("platform", b"").startswith(b"Warren")
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, 3, flags=1 << 13, props=props))
        c.send(amqp_raw.body_frame(1, b"abc"))
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        if warren:
            c.read_method(amqp_raw.BASIC_GET_OK, channel=1)
            header, body, _ = c.read_content(1)
            assert header[12:] == struct.pack(">H", 1 << 13) + props
            assert body == b"abc"
        else:
            close = c.expect_connection_close()
            assert close.reply_code in (541, 501, 502)


def test_user_id_mismatch_is_406(channel):
    text = expect_channel_error(channel, 406, channel.basic_publish, "", "nowhere", b"x",
                                pika.BasicProperties(user_id="bob"))
    assert text == "PRECONDITION_FAILED - user_id property set to 'bob' but authenticated user was 'guest'"


@pytest.mark.parametrize("expiration,text", [
    ("abc", "PRECONDITION_FAILED - invalid expiration 'abc': no_integer"),
    ("", "PRECONDITION_FAILED - invalid expiration '': no_integer"),
    ("-5", "PRECONDITION_FAILED - invalid expiration '-5': {value_negative,-5}"),
    ("99999999999999",
     "PRECONDITION_FAILED - invalid expiration '99999999999999': {value_too_large,99999999999999}"),
])
def test_invalid_expiration_is_406(channel, expiration, text):
    got = expect_channel_error(channel, 406, channel.basic_publish, "", "nowhere", b"x",
                               pika.BasicProperties(expiration=expiration))
    assert got == text


def test_large_expiration_is_accepted(channel, queue):
    channel.basic_publish("", queue, b"x", pika.BasicProperties(expiration="4294967296"))
    assert get(channel, queue, auto_ack=True).properties.expiration == "4294967296"


def test_expired_message_is_dropped(channel, queue):
    channel.basic_publish("", queue, b"short", pika.BasicProperties(expiration="50"))
    channel.basic_publish("", queue, b"long", pika.BasicProperties(expiration="60000"))
    channel.connection.sleep(0.4)
    assert [d.body for d in get_all(channel, queue)] == [b"long"]


def test_expiration_zero_without_consumer_is_dropped(channel, queue):
    # TTL 0: expires on arrival unless it can be delivered immediately.
    channel.basic_publish("", queue, b"zero", pika.BasicProperties(expiration="0"))
    channel.basic_publish("", queue, b"kept")
    assert [d.body for d in get_all(channel, queue)] == [b"kept"]


@pytest.mark.parametrize("size", [0, 1, 131072 - 8, 131072 - 7, 131072, 1024 * 1024])
def test_body_sizes_round_trip(channel, queue, size):
    body = bytes((i * 7 + 3) % 256 for i in range(size))
    channel.basic_publish("", queue, body)
    d = get(channel, queue, auto_ack=True)
    assert d is not None and d.body == body


def test_large_body_with_small_frame_max(connect, name, cleanup):
    conn = connect(frame_max=4096)
    ch = conn.channel()
    q = cleanup.queue(name("q"))
    ch.queue_declare(q)
    body = bytes(i % 251 for i in range(1024 * 1024))
    ch.basic_publish("", q, body)
    col, _ = consume(conn, ch, q, 1, timeout=10, auto_ack=True)
    assert col.deliveries[0].body == body


def test_body_split_into_frame_max_sized_frames():
    # With frame_max=4096 a 10000-byte body arrives as 4088 + 4088 + 1824.
    with raw_connection(frame_max=4096) as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        body = bytes(i % 256 for i in range(10000))
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, len(body)))
        for off in range(0, len(body), 1000):  # client may use smaller frames
            c.send(amqp_raw.body_frame(1, body[off:off + 1000]))
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        c.read_method(amqp_raw.BASIC_GET_OK, channel=1)
        sizes = []
        hdr = c.read_frame()
        assert hdr.type == amqp_raw.FRAME_HEADER
        got = b""
        while len(got) < len(body):
            fr = c.read_frame()
            assert fr.type == amqp_raw.FRAME_BODY
            sizes.append(len(fr.payload))
            got += fr.payload
        assert got == body
        assert sizes == [4088, 4088, 1824]


def test_empty_body_has_no_body_frame():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, 0))
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        c.read_method(amqp_raw.BASIC_GET_OK, channel=1)
        hdr = c.read_frame()
        assert hdr.type == amqp_raw.FRAME_HEADER
        assert struct.unpack_from(">Q", hdr.payload, 4)[0] == 0
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        fr = c.read_frame()  # next frame is get-empty, not a body frame
        assert fr.type == amqp_raw.FRAME_METHOD
        assert amqp_raw.method_of(fr) == amqp_raw.BASIC_GET_EMPTY


# --------------------------------------------------------------------------
# mandatory / returns
# --------------------------------------------------------------------------

def test_mandatory_unroutable_is_returned(connection, channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct")
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append((m, p, b)))
    props = pika.BasicProperties(message_id="ret-1", headers={"h": "v"})
    channel.basic_publish(x, "no-such-key", b"bounce", props, mandatory=True)
    assert wait_for(connection, lambda: len(returned) == 1)
    settle(connection, 0.2)
    assert len(returned) == 1
    m, p, b = returned[0]
    assert (m.reply_code, m.reply_text) == (312, "NO_ROUTE")
    assert (m.exchange, m.routing_key) == (x, "no-such-key")
    assert b == b"bounce"
    assert p.message_id == "ret-1" and p.headers == {"h": "v"}


def test_mandatory_default_exchange_missing_queue_is_returned(connection, channel):
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    channel.basic_publish("", "compat-missing-queue-xyz", b"x", mandatory=True)
    assert wait_for(connection, lambda: len(returned) == 1)
    assert (returned[0].reply_code, returned[0].reply_text, returned[0].exchange) == (312, "NO_ROUTE", "")


def test_non_mandatory_unroutable_is_dropped_silently(connection, channel):
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    channel.basic_publish("amq.direct", "compat-no-binding-xyz", b"x")
    sync(channel)
    settle(connection, 0.3)
    assert returned == [] and channel.is_open


def test_mandatory_routable_not_returned(connection, channel, queue):
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append(m))
    channel.basic_publish("", queue, b"x", mandatory=True)
    assert get(channel, queue, auto_ack=True).body == b"x"
    settle(connection, 0.2)
    assert returned == []


def test_mandatory_unroutable_in_confirm_mode_raises(channel):
    channel.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError) as ei:
        channel.basic_publish("amq.direct", "compat-no-binding-xyz", b"x", mandatory=True)
    msgs = ei.value.messages
    assert len(msgs) == 1 and msgs[0].body == b"x"
    assert msgs[0].method.reply_code == 312
    assert channel.is_open


def test_immediate_flag_not_implemented():
    # RabbitMQ 3.x removed 'immediate': connection.close 540
    # "NOT_IMPLEMENTED - immediate=true", class 60 method 40.
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "x", immediate=True))
        c.send(amqp_raw.content_header_frame(1, 0))
        close = c.expect_connection_close()
        assert close.reply_code == 540
        assert close.reply_text == "NOT_IMPLEMENTED - immediate=true"
        assert (close.class_id, close.method_id) == (60, 40)


# --------------------------------------------------------------------------
# consume / cancel
# --------------------------------------------------------------------------

def test_consume_server_generated_tag():
    # pika always picks its own tag, so use the raw client with an empty tag.
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        tags = []
        for _ in range(2):
            c.send_method(1, amqp_raw.BASIC_CONSUME, amqp_raw.basic_consume_args(q, ""))
            fr = c.read_method(amqp_raw.BASIC_CONSUME_OK, channel=1)
            tags.append(amqp_raw.args_of(fr).shortstr())
        assert all(CTAG.match(t) for t in tags), tags
        assert tags[0] != tags[1]
        # Deliveries carry the generated tag.
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", q))
        c.send(amqp_raw.content_header_frame(1, 2))
        c.send(amqp_raw.body_frame(1, b"hi"))
        fr = c.read_method(amqp_raw.BASIC_DELIVER, channel=1)
        assert amqp_raw.args_of(fr).shortstr() in tags
        _, body, _ = c.read_content(1)
        assert body == b"hi"


def test_consume_client_tag_and_deliver_fields(connection, channel, queue):
    channel.basic_publish("", queue, b"a")
    channel.basic_publish("", queue, b"b")
    col, tag = consume(connection, channel, queue, 2, consumer_tag="my-tag")
    assert tag == "my-tag"
    d0, d1 = col.deliveries
    assert [d0.body, d1.body] == [b"a", b"b"]
    assert d0.method.consumer_tag == "my-tag"
    assert (d0.method.delivery_tag, d1.method.delivery_tag) == (1, 2)
    assert d0.method.redelivered is False
    assert (d0.method.exchange, d0.method.routing_key) == ("", queue)


def test_delivery_tags_are_per_channel(connection, name, cleanup):
    q = cleanup.queue(name("q"))
    ch1, ch2 = connection.channel(), connection.channel()
    ch1.queue_declare(q)
    publish_n(ch1, q, 2)
    a = get(ch1, q)
    b = get(ch2, q)
    assert a.method.delivery_tag == 1 and b.method.delivery_tag == 1


def test_no_ack_consumer(connection, channel, queue):
    publish_n(channel, queue, 3)
    col, tag = consume(connection, channel, queue, 3, auto_ack=True)
    assert col.bodies == [b"m0", b"m1", b"m2"]
    channel.basic_cancel(tag)
    assert wait_message_count(channel, queue, 0) == 0
    channel.close()  # nothing unacked: nothing comes back
    ch = connection.channel()
    assert get(ch, queue, timeout=0.3) is None


def test_cancel_stops_deliveries(connection, channel, queue):
    col, tag = consume(connection, channel, queue, 0, auto_ack=True)
    r = channel.basic_cancel(tag)
    assert r == []  # no pending (already-delivered) messages for auto_ack
    channel.basic_publish("", queue, b"after-cancel")
    settle(connection, 0.3)
    assert len(col) == 0
    assert get(channel, queue, auto_ack=True).body == b"after-cancel"


def test_cancel_keeps_unacked_deliveries_unacked(connection, channel, queue):
    publish_n(channel, queue, 3)
    col, tag = consume(connection, channel, queue, 3)
    channel.basic_cancel(tag)
    assert wait_message_count(channel, queue, 0) == 0
    # Delivery tags stay valid after cancel.
    channel.basic_ack(col.deliveries[0].method.delivery_tag)
    channel.basic_reject(col.deliveries[1].method.delivery_tag, requeue=True)
    sync(channel)
    assert channel.is_open
    d = get(channel, queue, auto_ack=True)
    assert d.body == b"m1" and d.method.redelivered is True


def test_cancel_unknown_tag_is_ok():
    # RabbitMQ answers cancel-ok for an unknown consumer tag (raw, since pika
    # refuses unknown tags client-side).
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, (60, 30), amqp_raw.shortstr("no-such-tag") + amqp_raw.bits(False))
        fr = c.read_method((60, 31), channel=1)
        assert amqp_raw.args_of(fr).shortstr() == "no-such-tag"


def test_duplicate_consumer_tag_is_530():
    # SURPRISE: reusing a consumer tag on the same channel is a *connection* error:
    # 530 "NOT_ALLOWED - attempt to reuse consumer tag 't1'", class 60 method 20.
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_CONSUME, amqp_raw.basic_consume_args(q, "t1"))
        c.read_method(amqp_raw.BASIC_CONSUME_OK)
        c.send_method(1, amqp_raw.BASIC_CONSUME, amqp_raw.basic_consume_args(q, "t1"))
        close = c.expect_connection_close()
        assert close.reply_code == 530
        assert close.reply_text == "NOT_ALLOWED - attempt to reuse consumer tag 't1'"
        assert (close.class_id, close.method_id) == (60, 20)


def test_same_consumer_tag_on_different_channels_is_ok(connection, queue):
    connection.channel().basic_consume(queue, lambda *a: None, consumer_tag="shared")
    connection.channel().basic_consume(queue, lambda *a: None, consumer_tag="shared")


def test_exclusive_consumer_blocks_second_consumer(connection, queue):
    connection.channel().basic_consume(queue, lambda *a: None, exclusive=True)
    ch = connection.channel()
    text = expect_channel_error(ch, 403, ch.basic_consume, queue, lambda *a: None)
    assert text == "ACCESS_REFUSED - queue '%s' in vhost '/' in exclusive use" % queue


def test_exclusive_consume_refused_when_queue_has_consumers(connection, queue):
    connection.channel().basic_consume(queue, lambda *a: None)
    ch = connection.channel()
    text = expect_channel_error(ch, 403, ch.basic_consume, queue, lambda *a: None, exclusive=True)
    assert text == "ACCESS_REFUSED - queue '%s' in vhost '/' in exclusive use" % queue


def test_exclusive_consumer_released_on_cancel(connection, queue):
    ch = connection.channel()
    tag = ch.basic_consume(queue, lambda *a: None, exclusive=True)
    ch.basic_cancel(tag)
    connection.channel().basic_consume(queue, lambda *a: None)


def test_consume_missing_queue_is_404(channel):
    text = expect_channel_error(channel, 404, channel.basic_consume, "compat-missing-queue-xyz",
                                lambda *a: None)
    assert text == "NOT_FOUND - no queue 'compat-missing-queue-xyz' in vhost '/'"


def test_round_robin_between_consumers(connection, queue):
    ch_pub = connection.channel()
    ch_a, ch_b = connection.channel(), connection.channel()
    col_a, col_b = Collector(), Collector()
    ch_a.basic_consume(queue, col_a, auto_ack=True)
    ch_b.basic_consume(queue, col_b, auto_ack=True)
    bodies = publish_n(ch_pub, queue, 10)
    assert wait_for(connection, lambda: len(col_a) + len(col_b) == 10)
    assert len(col_a) == 5 and len(col_b) == 5
    # Strict alternation.
    assert col_a.bodies in (bodies[0::2], bodies[1::2])
    assert sorted(col_a.bodies + col_b.bodies) == sorted(bodies)


def test_round_robin_same_channel(connection, channel, queue):
    col_a, col_b = Collector(), Collector()
    channel.basic_consume(queue, col_a, auto_ack=True)
    channel.basic_consume(queue, col_b, auto_ack=True)
    bodies = publish_n(channel, queue, 6)
    assert wait_for(connection, lambda: len(col_a) + len(col_b) == 6)
    assert col_a.bodies in (bodies[0::2], bodies[1::2])
    assert col_b.bodies in (bodies[0::2], bodies[1::2])


# --------------------------------------------------------------------------
# basic.get
# --------------------------------------------------------------------------

def test_get_ok_fields_and_get_empty(channel, queue):
    publish_n(channel, queue, 3)
    d = get(channel, queue)
    assert isinstance(d.method, pika.spec.Basic.GetOk)
    assert d.body == b"m0"
    assert d.method.message_count == 2  # messages *remaining*
    assert d.method.delivery_tag == 1
    assert d.method.redelivered is False
    assert (d.method.exchange, d.method.routing_key) == ("", queue)
    d = get(channel, queue, auto_ack=True)
    assert (d.body, d.method.message_count, d.method.delivery_tag) == (b"m1", 1, 2)
    d = get(channel, queue, auto_ack=True)
    assert (d.body, d.method.message_count) == (b"m2", 0)
    assert channel.basic_get(queue) == (None, None, None)  # get-empty


def test_get_empty_raw():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.QUEUE_DECLARE, amqp_raw.queue_declare_args("", exclusive=True))
        q = amqp_raw.args_of(c.read_method(amqp_raw.QUEUE_DECLARE_OK)).shortstr()
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(q))
        fr = c.read_method(amqp_raw.BASIC_GET_EMPTY, channel=1)
        # get-empty carries the deprecated cluster-id shortstr (empty).
        assert amqp_raw.args_of(fr).shortstr() == ""


def test_get_missing_queue_is_404(channel):
    expect_channel_error(channel, 404, channel.basic_get, "compat-missing-queue-xyz")


def test_get_bypasses_prefetch(channel, queue):
    channel.basic_qos(prefetch_count=1)
    publish_n(channel, queue, 3)
    got = [get(channel, queue) for _ in range(3)]
    assert [d.body for d in got] == [b"m0", b"m1", b"m2"]


# --------------------------------------------------------------------------
# ack / nack / reject
# --------------------------------------------------------------------------

def test_ack_removes_message(connection, channel, queue):
    publish_n(channel, queue, 2)
    d = get(channel, queue)
    channel.basic_ack(d.method.delivery_tag)
    channel.close()  # only the unacked-and-not-fetched m1 remains
    ch = connection.channel()
    assert [x.body for x in get_all(ch, queue)] == [b"m1"]


def test_ack_multiple(connection, channel, queue):
    publish_n(channel, queue, 5)
    tags = [get(channel, queue).method.delivery_tag for _ in range(5)]
    assert tags == [1, 2, 3, 4, 5]
    channel.basic_ack(3, multiple=True)
    channel.close()
    ch = connection.channel()
    got = get_all(ch, queue)
    assert [d.body for d in got] == [b"m3", b"m4"]
    assert all(d.method.redelivered for d in got)


def test_ack_zero_multiple_acks_everything(connection, channel, queue):
    publish_n(channel, queue, 3)
    for _ in range(3):
        get(channel, queue)
    channel.basic_ack(0, multiple=True)
    channel.close()
    assert get(connection.channel(), queue, timeout=0.3) is None


@pytest.mark.parametrize("method", ["ack", "reject", "nack"])
def test_unknown_delivery_tag_is_406(channel, method):
    fn = {"ack": channel.basic_ack, "reject": channel.basic_reject, "nack": channel.basic_nack}[method]
    text = expect_channel_error(channel, 406, fn, 99)
    assert text == "PRECONDITION_FAILED - unknown delivery tag 99"


def test_double_ack_is_406(channel, queue):
    publish_n(channel, queue, 1)
    d = get(channel, queue)
    channel.basic_ack(d.method.delivery_tag)
    text = expect_channel_error(channel, 406, channel.basic_ack, d.method.delivery_tag)
    assert text == "PRECONDITION_FAILED - unknown delivery tag 1"


def test_ack_of_no_ack_delivery_is_406(channel, queue):
    publish_n(channel, queue, 1)
    d = get(channel, queue, auto_ack=True)
    expect_channel_error(channel, 406, channel.basic_ack, d.method.delivery_tag)


def test_ack_zero_single_is_406(channel):
    text = expect_channel_error(channel, 406, channel.basic_ack, 0, multiple=False)
    assert text == "PRECONDITION_FAILED - unknown delivery tag 0"


def test_ack_zero_multiple_with_nothing_outstanding_is_ok(channel):
    channel.basic_ack(0, multiple=True)
    sync(channel)


def test_reject_requeue_goes_back_to_original_position(channel, queue):
    # Requeued messages go back to their original position (by publish
    # order), whatever order they are rejected in.
    publish_n(channel, queue, 5)
    tags = [get(channel, queue).method.delivery_tag for _ in range(3)]  # m0 m1 m2
    channel.basic_reject(tags[1], requeue=True)  # m1
    channel.basic_reject(tags[0], requeue=True)  # m0
    got = get_all(channel, queue)
    assert [(d.body, d.method.redelivered) for d in got] == [
        (b"m0", True), (b"m1", True), (b"m3", False), (b"m4", False)]


def test_reject_requeue_head_of_queue_before_later_publishes(channel, queue):
    publish_n(channel, queue, 2)
    d = get(channel, queue)  # m0
    channel.basic_publish("", queue, b"late")
    channel.basic_reject(d.method.delivery_tag, requeue=True)
    assert [x.body for x in get_all(channel, queue)] == [b"m0", b"m1", b"late"]


def test_reject_without_requeue_discards(channel, queue):
    publish_n(channel, queue, 2)
    d = get(channel, queue)
    channel.basic_reject(d.method.delivery_tag, requeue=False)
    assert [x.body for x in get_all(channel, queue)] == [b"m1"]


def test_nack_multiple_requeue(channel, queue):
    publish_n(channel, queue, 4)
    tags = [get(channel, queue).method.delivery_tag for _ in range(4)]
    channel.basic_nack(tags[2], multiple=True, requeue=True)  # m0..m2 back
    got = get_all(channel, queue, auto_ack=False)
    assert [(d.body, d.method.redelivered) for d in got] == [
        (b"m0", True), (b"m1", True), (b"m2", True)]
    # m3 still unacked; the refetched ones too: ack them all.
    channel.basic_ack(0, multiple=True)
    sync(channel)


def test_nack_multiple_without_requeue_discards(connection, channel, queue):
    publish_n(channel, queue, 4)
    tags = [get(channel, queue).method.delivery_tag for _ in range(4)]
    channel.basic_nack(tags[1], multiple=True, requeue=False)  # m0, m1 dropped
    channel.close()  # m2, m3 come back
    assert [d.body for d in get_all(connection.channel(), queue)] == [b"m2", b"m3"]


def test_nack_single_requeue(channel, queue):
    publish_n(channel, queue, 3)
    tags = [get(channel, queue).method.delivery_tag for _ in range(3)]
    channel.basic_nack(tags[1], multiple=False, requeue=True)
    d = get(channel, queue, auto_ack=True)
    assert (d.body, d.method.redelivered) == (b"m1", True)
    assert get(channel, queue, timeout=0.2) is None


def test_requeued_message_redelivered_to_consumer(connection, channel, queue):
    publish_n(channel, queue, 1)
    col, _ = consume(connection, channel, queue, 1)
    channel.basic_reject(col.deliveries[0].method.delivery_tag, requeue=True)
    assert wait_for(connection, lambda: len(col) == 2)
    d = col.deliveries[1]
    assert d.body == b"m0" and d.method.redelivered is True
    assert d.method.delivery_tag == 2
    channel.basic_ack(2)


# --------------------------------------------------------------------------
# recover
# --------------------------------------------------------------------------

def test_recover_requeue_true_redelivers_unacked(connection, channel, queue):
    publish_n(channel, queue, 3)
    col, _ = consume(connection, channel, queue, 3)
    channel.basic_recover(requeue=True)
    assert wait_for(connection, lambda: len(col) == 6)
    again = col.deliveries[3:]
    assert [d.body for d in again] == [b"m0", b"m1", b"m2"]
    assert all(d.method.redelivered for d in again)
    assert [d.method.delivery_tag for d in again] == [4, 5, 6]
    channel.basic_ack(0, multiple=True)


def test_recover_requeue_true_with_get(channel, queue):
    publish_n(channel, queue, 3)
    get(channel, queue)
    get(channel, queue)
    channel.basic_recover(requeue=True)
    got = get_all(channel, queue)
    assert [(d.body, d.method.redelivered) for d in got] == [
        (b"m0", True), (b"m1", True), (b"m2", False)]


def test_recover_requeue_false_not_implemented(connection, channel):
    # SURPRISE: basic.recover(requeue=false) -> connection.close 540
    # "NOT_IMPLEMENTED - requeue=false".
    text = expect_connection_error(connection, 540, channel.basic_recover, requeue=False)
    assert text == "NOT_IMPLEMENTED - requeue=false"


# --------------------------------------------------------------------------
# channel close requeues
# --------------------------------------------------------------------------

def test_unacked_requeued_in_order_on_channel_close(connection, channel, queue):
    publish_n(channel, queue, 6)
    col, _ = consume(connection, channel, queue, 6)
    channel.basic_ack(col.deliveries[1].method.delivery_tag)
    channel.basic_ack(col.deliveries[4].method.delivery_tag)
    channel.close()
    got = get_all(connection.channel(), queue)
    assert [(d.body, d.method.redelivered) for d in got] == [
        (b"m0", True), (b"m2", True), (b"m3", True), (b"m5", True)]


def test_unacked_requeued_on_connection_close(connect, name, cleanup):
    q = cleanup.queue(name("q"))
    c1 = connect()
    ch1 = c1.channel()
    ch1.queue_declare(q)
    publish_n(ch1, q, 3)
    get(ch1, q)
    get(ch1, q)
    c1.close()
    ch2 = connect().channel()
    assert wait_message_count(ch2, q, 3) == 3
    got = get_all(ch2, q)
    assert [(d.body, d.method.redelivered) for d in got] == [
        (b"m0", True), (b"m1", True), (b"m2", False)]


def test_requeued_message_goes_to_other_consumer(connection, queue):
    ch1, ch2 = connection.channel(), connection.channel()
    ch1.basic_qos(prefetch_count=1)
    publish_n(ch1, queue, 1)
    col1, _ = consume(connection, ch1, queue, 1)
    col2 = Collector()
    ch2.basic_consume(queue, col2)
    ch1.close()
    assert wait_for(connection, lambda: len(col2) == 1)
    assert col2.deliveries[0].body == b"m0" and col2.deliveries[0].method.redelivered


# --------------------------------------------------------------------------
# qos
# --------------------------------------------------------------------------

def test_prefetch_count_limits_unacked(connection, channel, queue):
    channel.basic_qos(prefetch_count=2)
    publish_n(channel, queue, 5)
    col, _ = consume(connection, channel, queue, 2)
    settle(connection, 0.3)
    assert col.bodies == [b"m0", b"m1"]
    channel.basic_ack(col.deliveries[0].method.delivery_tag)
    assert wait_for(connection, lambda: len(col) == 3)
    settle(connection, 0.3)
    assert col.bodies == [b"m0", b"m1", b"m2"]
    channel.basic_ack(0, multiple=True)  # acks m1, m2 -> two more
    assert wait_for(connection, lambda: len(col) == 5)
    assert col.bodies == [b"m%d" % i for i in range(5)]


def test_prefetch_is_per_consumer_when_not_global(connection, channel, name, cleanup):
    # RabbitMQ 3.x: global=false -> each new consumer on the channel gets its
    # own limit.
    q1, q2 = cleanup.queue(name("q1")), cleanup.queue(name("q2"))
    channel.queue_declare(q1)
    channel.queue_declare(q2)
    publish_n(channel, q1, 5)
    publish_n(channel, q2, 5)
    channel.basic_qos(prefetch_count=2, global_qos=False)
    c1, c2 = Collector(), Collector()
    channel.basic_consume(q1, c1)
    channel.basic_consume(q2, c2)
    assert wait_for(connection, lambda: len(c1) == 2 and len(c2) == 2)
    settle(connection, 0.3)
    assert (len(c1), len(c2)) == (2, 2)


def test_prefetch_global_is_shared_across_channel(connection, channel, name, cleanup):
    # RabbitMQ 3.x: global=true -> one limit shared by all consumers on the channel.
    q1, q2 = cleanup.queue(name("q1")), cleanup.queue(name("q2"))
    channel.queue_declare(q1)
    channel.queue_declare(q2)
    publish_n(channel, q1, 5)
    publish_n(channel, q2, 5)
    channel.basic_qos(prefetch_count=3, global_qos=True)
    c1, c2 = Collector(), Collector()
    channel.basic_consume(q1, c1)
    channel.basic_consume(q2, c2)
    assert wait_for(connection, lambda: len(c1) + len(c2) == 3)
    settle(connection, 0.3)
    assert len(c1) + len(c2) == 3
    channel.basic_ack(0, multiple=True)
    assert wait_for(connection, lambda: len(c1) + len(c2) == 6)
    settle(connection, 0.3)
    assert len(c1) + len(c2) == 6


def test_prefetch_global_and_per_consumer_combined(connection, channel, name, cleanup):
    qs = [cleanup.queue(name("q%d" % i)) for i in range(3)]
    for q in qs:
        channel.queue_declare(q)
        publish_n(channel, q, 5)
    channel.basic_qos(prefetch_count=4, global_qos=True)
    channel.basic_qos(prefetch_count=1, global_qos=False)
    cols = [Collector() for _ in qs]
    for q, col in zip(qs, cols):
        channel.basic_consume(q, col)
    # Each consumer is capped at 1 (3 in total, under the global 4).
    assert wait_for(connection, lambda: sum(map(len, cols)) == 3)
    settle(connection, 0.3)
    assert [len(c) for c in cols] == [1, 1, 1]


def test_prefetch_change_does_not_affect_existing_consumer(connection, channel, queue):
    # SURPRISE: the per-consumer limit is captured at basic.consume time.
    publish_n(channel, queue, 5)
    channel.basic_qos(prefetch_count=1)
    col, _ = consume(connection, channel, queue, 1)
    channel.basic_qos(prefetch_count=3)
    settle(connection, 0.3)
    assert len(col) == 1


def test_prefetch_global_change_applies_immediately(connection, channel, queue):
    publish_n(channel, queue, 5)
    channel.basic_qos(prefetch_count=1, global_qos=True)
    col, _ = consume(connection, channel, queue, 1)
    settle(connection, 0.2)
    assert len(col) == 1
    channel.basic_qos(prefetch_count=3, global_qos=True)
    assert wait_for(connection, lambda: len(col) == 3)
    settle(connection, 0.3)
    assert len(col) == 3


def test_prefetch_zero_is_unlimited(connection, channel, queue):
    channel.basic_qos(prefetch_count=0)
    publish_n(channel, queue, 20)
    col, _ = consume(connection, channel, queue, 20)
    assert len(col) == 20


def test_prefetch_ignored_for_no_ack_consumers(connection, channel, queue):
    channel.basic_qos(prefetch_count=1)
    publish_n(channel, queue, 5)
    col, _ = consume(connection, channel, queue, 5, auto_ack=True)
    assert len(col) == 5


def test_prefetch_with_reject_requeue_redelivers(connection, channel, queue):
    channel.basic_qos(prefetch_count=1)
    publish_n(channel, queue, 2)
    col, _ = consume(connection, channel, queue, 1)
    channel.basic_reject(col.deliveries[0].method.delivery_tag, requeue=True)
    assert wait_for(connection, lambda: len(col) == 2)
    assert col.deliveries[1].body == b"m0" and col.deliveries[1].method.redelivered


def test_prefetch_size_not_implemented(connection, channel):
    # SURPRISE: prefetch_size != 0 -> connection.close 540
    # "NOT_IMPLEMENTED - prefetch_size!=0 (1000)".
    text = expect_connection_error(connection, 540, channel.basic_qos, prefetch_size=1000)
    assert text == "NOT_IMPLEMENTED - prefetch_size!=0 (1000)"
