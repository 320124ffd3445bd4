"""Small helpers shared by the compat tests (names, waits, error checks)."""

import os
import time
import uuid
from collections import namedtuple

import pika
import pytest

import amqp_raw

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
_P = pika.URLParameters(AMQP_URL)
HOST, PORT = _P.host, _P.port
USER, PASSWORD = _P.credentials.username, _P.credentials.password
VHOST = _P.virtual_host


def make_params(**overrides):
    """pika.ConnectionParameters for AMQP_URL with tight timeouts + overrides."""
    kw = dict(
        host=HOST,
        port=PORT,
        virtual_host=VHOST,
        credentials=pika.PlainCredentials(USER, PASSWORD),
        connection_attempts=1,
        socket_timeout=5,
        stack_timeout=10,
        blocked_connection_timeout=10,
    )
    kw.update(overrides)
    return pika.ConnectionParameters(**kw)


def open_connection(**overrides):
    return pika.BlockingConnection(make_params(**overrides))


def unique(prefix="x"):
    """A name no other test (or test run) will use."""
    return "compat-%s-%s" % (prefix, uuid.uuid4().hex[:16])


def raw_connection(handshake=True, timeout=5.0, **tune):
    """A RawConnection to the broker, optionally with the handshake done.

    tune: channel_max / frame_max / heartbeat / mechanism overrides.
    """
    c = amqp_raw.RawConnection(HOST, PORT, timeout=timeout)
    if handshake:
        c.handshake(USER, PASSWORD, VHOST, **tune)
    return c


def sync(ch):
    """A harmless synchronous round trip on `ch`.

    Asynchronous errors (e.g. after basic.publish / basic.ack) arrive as a
    channel.close; pika raises ChannelClosedByBroker from the next blocking
    call, so we make one.
    """
    ch.exchange_declare("amq.direct", passive=True)


def expect_channel_error(ch, code, fn, *args, **kwargs):
    """Run fn (+ a sync round trip); assert the broker closes `ch` with `code`."""
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as ei:
        fn(*args, **kwargs)
        sync(ch)
    assert ei.value.reply_code == code, ei.value
    assert ch.is_closed
    return ei.value.reply_text


def expect_connection_error(conn, code, fn, *args, **kwargs):
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as ei:
        fn(*args, **kwargs)
    assert ei.value.reply_code == code, ei.value
    assert conn.is_closed
    return ei.value.reply_text


def wait_for(conn, predicate, timeout=5.0):
    """Pump `conn` until predicate() is true or timeout; returns predicate()."""
    deadline = time.monotonic() + timeout
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn.process_data_events(time_limit=min(0.05, left))
    return predicate()


def settle(conn, seconds=0.3):
    """Pump `conn` for a fixed time (to show nothing more arrives)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        conn.process_data_events(time_limit=left)


Delivery = namedtuple("Delivery", "channel method properties body")


class Collector:
    """on_message_callback that records deliveries."""

    def __init__(self):
        self.deliveries = []

    def __call__(self, ch, method, properties, body):
        self.deliveries.append(Delivery(ch, method, properties, body))

    def __len__(self):
        return len(self.deliveries)

    @property
    def bodies(self):
        return [d.body for d in self.deliveries]


def consume(conn, ch, queue, n, timeout=5.0, **kwargs):
    """Start a consumer, wait for n deliveries; returns (collector, ctag)."""
    col = Collector()
    tag = ch.basic_consume(queue, col, **kwargs)
    assert wait_for(conn, lambda: len(col) >= n, timeout), (
        "expected %d deliveries, got %d" % (n, len(col)))
    return col, tag


def get(ch, queue, timeout=3.0, auto_ack=False):
    """basic.get, retried until a message arrives or timeout (then None).

    Retrying matters when the message was published on another channel or
    connection: routing is asynchronous with respect to this channel.
    """
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is not None:
            return Delivery(ch, method, props, body)
        if time.monotonic() >= deadline:
            return None
        ch.connection.sleep(0.02)


def get_all(ch, queue, auto_ack=True):
    """basic.get until get-empty; returns the deliveries."""
    out = []
    for _ in range(100000):
        method, props, body = ch.basic_get(queue, auto_ack=auto_ack)
        if method is None:
            return out
        out.append(Delivery(ch, method, props, body))
    raise AssertionError("queue never emptied")


def message_count(ch, queue):
    return ch.queue_declare(queue, passive=True).method.message_count


def wait_message_count(ch, queue, expected, timeout=3.0):
    """Poll passive declare until the queue holds `expected` messages."""
    deadline = time.monotonic() + timeout
    while True:
        n = message_count(ch, queue)
        if n == expected or time.monotonic() >= deadline:
            return n
        ch.connection.sleep(0.02)


def _server_platform():
    """The broker's `platform` server property (from connection.start), or None if none
    answers. Warren reports product "RabbitMQ" (clients gate RabbitMQ features on it) and
    names itself in `platform`."""
    try:
        conn = pika.BlockingConnection(make_params())
    except Exception:  # noqa: BLE001 - no broker: tests will fail on their own
        return None
    try:
        platform = conn._impl.server_properties.get("platform")
        return platform.decode() if isinstance(platform, bytes) else platform
    finally:
        conn.close()


WARREN = (_server_platform() or "").startswith("Warren")


def warren_deviation(reason):
    """Skip a RabbitMQ-reference test on Warren for a deviation documented in the README."""
    return pytest.mark.skipif(WARREN, reason="documented Warren deviation: " + reason)
