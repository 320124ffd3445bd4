"""Connection-level behaviour: handshake, properties, auth, tuning, heartbeats."""

import socket
import time

import pika
import pytest

import amqp_raw
from amqp_raw import CONNECTION_CLOSE, CONNECTION_CLOSE_OK, method_of
from helpers import PASSWORD, USER, VHOST, get, make_params, raw_connection

CAPABILITIES = [
    "publisher_confirms",
    "exchange_exchange_bindings",
    "basic.nack",
    "consumer_cancel_notify",
    "connection.blocked",
    "consumer_priorities",
    "authentication_failure_close",
    "per_consumer_qos",
    "direct_reply_to",
]


# --------------------------------------------------------------------------
# connection.start
# --------------------------------------------------------------------------

def test_server_properties_via_pika(connection):
    props = connection._impl.server_properties
    for key in ("product", "version", "platform", "copyright", "information"):
        assert key in props, key
        assert props[key], key
    caps = connection._impl.server_capabilities
    for cap in CAPABILITIES:
        assert caps.get(cap) is True, cap


def test_connection_start_raw():
    with raw_connection(handshake=False) as c:
        major, minor, mechanisms, locales = c.start()
        assert (major, minor) == (0, 9)
        assert "PLAIN" in mechanisms and "AMQPLAIN" in mechanisms
        assert locales == ["en_US"]
        props = c.server_properties
        # RabbitMQ sends these as longstr ('S') values.
        for key in ("product", "version", "platform", "copyright", "information"):
            assert isinstance(props[key], bytes) and props[key], key
        caps = props["capabilities"]
        assert isinstance(caps, dict)
        for cap in CAPABILITIES:
            assert caps[cap] is True, cap


# --------------------------------------------------------------------------
# protocol header
# --------------------------------------------------------------------------

@pytest.mark.parametrize("header", [
    b"AMQP\x00\x00\x09\x00",   # wrong revision
    b"AMQP\x00\x00\x08\x00",   # 0-8 as some clients spell it in 0-9-1 style
    b"HTTP/1.1",               # not AMQP at all (8 bytes)
    b"GET / HTTP/1.1\r\n\r\n",  # longer garbage: only the first 8 bytes matter
])
def test_bad_protocol_header_gets_supported_header_and_close(header):
    with raw_connection(handshake=False) as c:
        c.send(header)
        assert c.read_raw_until_eof(limit=5) == amqp_raw.PROTOCOL_HEADER


def test_good_protocol_header_gets_connection_start():
    with raw_connection(handshake=False) as c:
        c.send(amqp_raw.PROTOCOL_HEADER)
        fr = c.read_frame()
        assert fr.type == amqp_raw.FRAME_METHOD and fr.channel == 0
        assert method_of(fr) == amqp_raw.CONNECTION_START


# --------------------------------------------------------------------------
# authentication
# --------------------------------------------------------------------------

def test_bad_password_pika():
    with pytest.raises((pika.exceptions.ProbableAuthenticationError,
                        pika.exceptions.AuthenticationError)):
        pika.BlockingConnection(make_params(
            credentials=pika.PlainCredentials(USER, "definitely-wrong")))


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_bad_credentials_raw_get_403_close(mechanism):
    # The client advertises authentication_failure_close, so RabbitMQ sends
    # connection.close 403 instead of silently dropping the socket.
    with raw_connection(handshake=False) as c:
        c.start()
        c.start_ok(USER, "definitely-wrong", mechanism)
        close = c.expect_connection_close()
        assert close.reply_code == 403
        assert close.reply_text.startswith("ACCESS_REFUSED")
        assert mechanism in close.reply_text
        assert (close.class_id, close.method_id) == (0, 0)


def test_unknown_user_refused():
    with raw_connection(handshake=False) as c:
        c.start()
        c.start_ok("no-such-user-compat", "x")
        assert c.expect_connection_close().reply_code == 403


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_login_mechanisms_succeed(mechanism):
    with raw_connection(handshake=False) as c:
        tune = c.handshake(USER, PASSWORD, VHOST, mechanism=mechanism)
        assert tune.frame_max > 0
        c.open_channel(1)


def test_unknown_mechanism_drops_connection():
    # SURPRISE: unknown mechanism during 'starting' is a handshake error; it
    # waits ~3 s (anti brute-force delay) and closes the socket without any
    # connection.close frame.
    with raw_connection(handshake=False) as c:
        c.start()
        c.send_method(0, amqp_raw.CONNECTION_START_OK,
                      amqp_raw.table({}) + amqp_raw.shortstr("FOO")
                      + amqp_raw.longstr(b"x") + amqp_raw.shortstr("en_US"))
        frames = c.read_all_until_eof(limit=6)
        assert not any(f.type == amqp_raw.FRAME_METHOD and method_of(f) == amqp_raw.CONNECTION_TUNE
                       for f in frames)


# --------------------------------------------------------------------------
# tuning
# --------------------------------------------------------------------------

def test_tune_defaults():
    with raw_connection(handshake=False) as c:
        c.start()
        c.start_ok(USER, PASSWORD)
        t = c.read_tune()
        assert t == amqp_raw.Tune(channel_max=2047, frame_max=131072, heartbeat=60)


def test_pika_negotiated_values(connection):
    params = connection._impl.params
    assert params.frame_max == 131072
    assert params.channel_max == 2047


def test_lower_frame_max_large_message_round_trip(connect, name, cleanup):
    conn = connect(frame_max=4096)
    assert conn._impl.params.frame_max == 4096
    ch = conn.channel()
    q = cleanup.queue(name("q"))
    ch.queue_declare(q)
    body = bytes(range(256)) * 400  # 102400 bytes -> 26 body frames
    ch.basic_publish("", q, body)
    d = get(ch, q, auto_ack=True)
    assert d is not None and d.body == body


def test_frame_max_is_enforced_after_tune():
    # Client lowers frame_max to 4096; a 5000-byte body frame is too big.
    with raw_connection(frame_max=4096) as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.BASIC_PUBLISH, amqp_raw.basic_publish_args("", "nowhere"))
        c.send(amqp_raw.content_header_frame(1, 5000))
        c.send(amqp_raw.body_frame(1, b"x" * 5000))
        close = c.expect_connection_close()
        assert close.reply_code == 501
        assert close.reply_text.startswith("FRAME_ERROR")


def test_channel_max_limits_number_of_open_channels():
    # SURPRISE: RabbitMQ enforces channel_max as a *count* of open channels: with
    # channel_max=3, the 4th simultaneous channel.open gets connection.close
    # 530 NOT_ALLOWED ("number of channels opened (3) has reached the
    # negotiated channel_max (3)"), class/method 0/0.
    with raw_connection(channel_max=3) as c:
        for ch in (1, 2, 3):
            c.open_channel(ch)
        c.send_method(4, amqp_raw.CHANNEL_OPEN, amqp_raw.shortstr(""))
        close = c.expect_connection_close()
        assert close.reply_code == 530
        assert close.reply_text.startswith("NOT_ALLOWED")
        assert "channel_max" in close.reply_text


def test_channel_max_count_frees_on_close():
    with raw_connection(channel_max=2) as c:
        c.open_channel(1)
        c.open_channel(2)
        c.send_method(2, amqp_raw.CHANNEL_CLOSE, amqp_raw.close_args())
        c.read_method(amqp_raw.CHANNEL_CLOSE_OK, channel=2)
        c.open_channel(3)  # back to 2 open channels: allowed


def test_channel_number_above_channel_max_is_accepted():
    # SURPRISE: RabbitMQ 3.10 does not validate the channel *number* against
    # channel_max (only the count of open channels), so channel 11 opens fine
    # with channel_max=10, and so does 3000 with the default 2047.
    with raw_connection(channel_max=10) as c:
        c.open_channel(11)
    with raw_connection() as c:
        c.open_channel(3000)


def test_pika_channel_max(connect):
    conn = connect(channel_max=5)
    assert conn._impl.params.channel_max == 5
    chans = [conn.channel() for _ in range(5)]
    assert all(ch.is_open for ch in chans)


# --------------------------------------------------------------------------
# heartbeats
# --------------------------------------------------------------------------

def test_heartbeat_timeout_disconnects_silent_client():
    # SURPRISE (no close frame): negotiate heartbeat=1, stay silent.  RabbitMQ sends its own
    # heartbeat frames and, after ~2 missed client heartbeats, closes the
    # socket WITHOUT a connection.close frame (observed: ~3 s).
    c = raw_connection(handshake=False)
    try:
        c.start()
        c.start_ok(USER, PASSWORD)
        c.read_tune()
        c.tune_ok(2047, 131072, 1)
        c.open(VHOST)
        t0 = time.monotonic()
        frames = c.read_all_until_eof(limit=6)
        elapsed = time.monotonic() - t0
        assert 1.0 <= elapsed <= 6.0
        assert any(f.type == amqp_raw.FRAME_HEARTBEAT and f.channel == 0 for f in frames)
        for f in frames:
            # Nothing but heartbeats or (optionally) a connection.close.
            assert f.type == amqp_raw.FRAME_HEARTBEAT or method_of(f) == CONNECTION_CLOSE
    finally:
        c.close()


def test_heartbeating_client_stays_connected():
    c = raw_connection(handshake=False)
    try:
        c.start()
        c.start_ok(USER, PASSWORD)
        c.read_tune()
        c.tune_ok(2047, 131072, 1)
        c.open(VHOST)
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            c.send(amqp_raw.frame(amqp_raw.FRAME_HEARTBEAT, 0, b""))
            time.sleep(0.4)
        c.open_channel(1)  # still alive
    finally:
        c.close()


def test_heartbeat_zero_means_no_server_heartbeats():
    with raw_connection(heartbeat=0, timeout=1.5) as c:
        with pytest.raises(socket.timeout):
            c.read_frame()


def test_pika_heartbeat_negotiation(connect):
    conn = connect(heartbeat=5)
    assert conn._impl.params.heartbeat == 5


# --------------------------------------------------------------------------
# closing
# --------------------------------------------------------------------------

def test_client_close_gets_close_ok():
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(0, CONNECTION_CLOSE, amqp_raw.close_args(200, "bye"))
        fr = c.read_method()
        assert fr.channel == 0
        assert method_of(fr) == CONNECTION_CLOSE_OK
        # SURPRISE: RabbitMQ does not close the socket right after close-ok; the
        # client (who initiated the close) is expected to do it.


def test_pika_close(connect):
    conn = connect()
    conn.channel()
    conn.close()
    assert conn.is_closed


def test_many_connections_in_parallel(connect):
    conns = [connect() for _ in range(10)]
    for conn in conns:
        ch = conn.channel()
        assert ch.queue_declare("", exclusive=True).method.queue.startswith("amq.gen-")
