"""exchange.declare / exchange.delete and their error cases."""

import pika
import pytest

import amqp_raw
from helpers import (expect_channel_error, expect_connection_error, get,
                     raw_connection, sync)

EXCHANGE_TYPES = ["direct", "fanout", "topic", "headers"]


@pytest.mark.parametrize("xtype", EXCHANGE_TYPES)
def test_declare_each_type(channel, name, cleanup, xtype):
    x = cleanup.exchange(name("x-" + xtype))
    r = channel.exchange_declare(x, xtype)
    assert isinstance(r.method, pika.spec.Exchange.DeclareOk)
    # Passive declare finds it.
    channel.exchange_declare(x, passive=True)
    # Redeclare with identical parameters is fine.
    channel.exchange_declare(x, xtype)


def test_declare_durable_and_redeclare_equivalent(channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "topic", durable=True)
    channel.exchange_declare(x, "topic", durable=True)
    text = expect_channel_error(channel, 406, channel.exchange_declare, x, "topic", durable=False)
    assert text == ("PRECONDITION_FAILED - inequivalent arg 'durable' for exchange '%s' "
                    "in vhost '/': received 'false' but current is 'true'" % x)


def test_passive_declare_ignores_type_and_flags(channel, name, cleanup):
    # RabbitMQ: a passive declare only checks existence; type/flags are ignored.
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct")
    channel.exchange_declare(x, "fanout", passive=True, durable=True, auto_delete=True)


def test_passive_declare_missing_is_404(channel):
    x = "compat-missing-exchange-xyz"
    text = expect_channel_error(channel, 404, channel.exchange_declare, x, passive=True)
    assert text == "NOT_FOUND - no exchange '%s' in vhost '/'" % x


@pytest.mark.parametrize("field,kwargs", [
    ("type", dict(exchange_type="fanout")),
    ("durable", dict(durable=True)),
    ("auto_delete", dict(auto_delete=True)),
    ("internal", dict(internal=True)),
])
def test_redeclare_different_is_406(connection, name, cleanup, field, kwargs):
    x = cleanup.exchange(name("x"))
    ch = connection.channel()
    ch.exchange_declare(x, "direct")
    args = dict(exchange_type="direct")
    args.update(kwargs)
    text = expect_channel_error(ch, 406, ch.exchange_declare, x, **args)
    assert text.startswith("PRECONDITION_FAILED - inequivalent arg '%s' for exchange '%s'" % (field, x))
    if field == "type":
        assert text.endswith("received 'fanout' but current is 'direct'")
    # The exchange itself is unchanged and still there.
    connection.channel().exchange_declare(x, "direct", passive=True)


def test_redeclare_different_arguments_is_406(channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct")
    text = expect_channel_error(channel, 406, channel.exchange_declare, x, "direct",
                                arguments={"alternate-exchange": "foo"})
    assert text.startswith("PRECONDITION_FAILED - inequivalent arg 'alternate-exchange'")


def test_unknown_exchange_type_is_connection_error_503(connection, name):
    # SURPRISE: an unknown type is a *connection* exception:
    # 503 "COMMAND_INVALID - unknown exchange type 'x-nope'".
    ch = connection.channel()
    text = expect_connection_error(connection, 503, ch.exchange_declare, name("x"), "x-nope")
    assert text == "COMMAND_INVALID - unknown exchange type 'x-nope'"


def test_unknown_exchange_type_close_names_method():
    with raw_connection() as c:
        c.open_channel(1)
        args = (b"\x00\x00" + amqp_raw.shortstr("compat-x-badtype") + amqp_raw.shortstr("x-nope")
                + amqp_raw.bits(False, False, False, False, False) + amqp_raw.table({}))
        c.send_method(1, amqp_raw.EXCHANGE_DECLARE, args)
        close = c.expect_connection_close()
        assert close.reply_code == 503
        assert (close.class_id, close.method_id) == (40, 10)


def test_delete_exchange(channel, name):
    x = name("x")
    channel.exchange_declare(x, "fanout")
    r = channel.exchange_delete(x)
    assert isinstance(r.method, pika.spec.Exchange.DeleteOk)
    expect_channel_error(channel, 404, channel.exchange_declare, x, passive=True)


def test_delete_missing_exchange_is_ok(channel):
    # RabbitMQ 3.x: exchange.delete is idempotent -> delete-ok, even with if_unused.
    r = channel.exchange_delete("compat-missing-exchange-xyz")
    assert isinstance(r.method, pika.spec.Exchange.DeleteOk)
    r = channel.exchange_delete("compat-missing-exchange-xyz", if_unused=True)
    assert isinstance(r.method, pika.spec.Exchange.DeleteOk)
    assert channel.is_open


def test_delete_if_unused_with_queue_binding_is_406(connection, name, cleanup):
    x = cleanup.exchange(name("x"))
    ch = connection.channel()
    ch.exchange_declare(x, "direct")
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, x, "rk")
    text = expect_channel_error(ch, 406, ch.exchange_delete, x, if_unused=True)
    assert text == "PRECONDITION_FAILED - exchange '%s' in vhost '/' in use" % x
    # Still exists.
    connection.channel().exchange_declare(x, passive=True)


def test_delete_if_unused_with_exchange_binding_as_source_is_406(connection, name, cleanup):
    src = cleanup.exchange(name("src"))
    dst = cleanup.exchange(name("dst"))
    ch = connection.channel()
    ch.exchange_declare(src, "fanout")
    ch.exchange_declare(dst, "fanout")
    ch.exchange_bind(dst, src)
    expect_channel_error(ch, 406, ch.exchange_delete, src, if_unused=True)


def test_delete_if_unused_when_only_destination_is_ok(channel, name, cleanup):
    # if_unused only looks at bindings where the exchange is the *source*.
    src = cleanup.exchange(name("src"))
    dst = name("dst")
    channel.exchange_declare(src, "fanout")
    channel.exchange_declare(dst, "fanout")
    channel.exchange_bind(dst, src)
    channel.exchange_delete(dst, if_unused=True)
    expect_channel_error(channel, 404, channel.exchange_declare, dst, passive=True)


def test_delete_if_unused_without_bindings_is_ok(channel, name):
    x = name("x")
    channel.exchange_declare(x, "direct")
    channel.exchange_delete(x, if_unused=True)
    expect_channel_error(channel, 404, channel.exchange_declare, x, passive=True)


def test_delete_exchange_removes_its_bindings(connection, name):
    ch = connection.channel()
    x = name("x")
    ch.exchange_declare(x, "fanout")
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, x)
    ch.exchange_delete(x)
    ch.exchange_declare(x, "fanout")  # recreated: no bindings survive
    try:
        ch.basic_publish(x, "", b"m")
        assert get(ch, q, timeout=0.3) is None
    finally:
        ch.exchange_delete(x)


@pytest.mark.parametrize("x,xtype", [
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
])
def test_predeclared_exchanges_exist(channel, x, xtype):
    channel.exchange_declare(x, passive=True)
    # Redeclaring with the exact same (durable) parameters is allowed...
    channel.exchange_declare(x, xtype, durable=True)
    # ...and proves the type: a different type fails.
    other = "fanout" if xtype != "fanout" else "direct"
    text = expect_channel_error(channel, 406, channel.exchange_declare, x, other, durable=True)
    assert "inequivalent arg 'type'" in text


def test_predeclared_exchanges_are_durable(channel):
    text = expect_channel_error(channel, 406, channel.exchange_declare, "amq.direct", "direct",
                                durable=False)
    assert "inequivalent arg 'durable'" in text


def test_declare_amq_prefix_is_403(channel):
    text = expect_channel_error(channel, 403, channel.exchange_declare, "amq.compat-foo", "direct")
    assert text == "ACCESS_REFUSED - exchange name 'amq.compat-foo' contains reserved prefix 'amq.*'"


def test_amq_prefix_is_case_sensitive(channel, name):
    x = "AMQ." + name("x")
    channel.exchange_declare(x, "direct", auto_delete=True)
    channel.exchange_delete(x)


@pytest.mark.parametrize("x", ["amq.direct", "amq.compat-missing"])
def test_delete_amq_prefix_is_403(channel, x):
    # Also for a *missing* amq.* exchange: the prefix check comes first.
    text = expect_channel_error(channel, 403, channel.exchange_delete, x)
    assert text == "ACCESS_REFUSED - deletion of system exchange '%s' in vhost '/' not allowed" % x


def test_amq_direct_survives_delete_attempt(connection):
    ch = connection.channel()
    expect_channel_error(ch, 403, ch.exchange_delete, "amq.direct")
    connection.channel().exchange_declare("amq.direct", passive=True)


@pytest.mark.parametrize("op", ["declare", "passive", "delete"])
def test_default_exchange_operations_are_403(channel, op):
    # SURPRISE: even a passive declare of "" is refused.
    if op == "declare":
        fn = lambda: channel.exchange_declare("", "direct")  # noqa: E731
    elif op == "passive":
        fn = lambda: channel.exchange_declare("", passive=True)  # noqa: E731
    else:
        fn = lambda: channel.exchange_delete("")  # noqa: E731
    text = expect_channel_error(channel, 403, fn)
    assert text == "ACCESS_REFUSED - operation not permitted on the default exchange"


def test_publish_to_missing_exchange_is_404(channel):
    x = "compat-missing-exchange-xyz"
    text = expect_channel_error(channel, 404, channel.basic_publish, x, "rk", b"m")
    assert text == "NOT_FOUND - no exchange '%s' in vhost '/'" % x


def test_publish_to_internal_exchange_is_403(connection, name, cleanup):
    x = cleanup.exchange(name("x"))
    ch = connection.channel()
    ch.exchange_declare(x, "fanout", internal=True)
    text = expect_channel_error(ch, 403, ch.basic_publish, x, "", b"m")
    assert text == "ACCESS_REFUSED - cannot publish to internal exchange '%s' in vhost '/'" % x


def test_internal_exchange_receives_via_exchange_binding(channel, name, cleanup):
    src = cleanup.exchange(name("src"))
    internal = cleanup.exchange(name("int"))
    channel.exchange_declare(src, "fanout")
    channel.exchange_declare(internal, "fanout", internal=True)
    channel.exchange_bind(internal, src)
    q = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(q, internal)
    channel.basic_publish(src, "", b"via-internal")
    d = get(channel, q, auto_ack=True)
    assert d is not None and d.body == b"via-internal"


def test_auto_delete_exchange_deleted_when_last_binding_removed(channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct", auto_delete=True)
    q = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(q, x, "a")
    channel.queue_bind(q, x, "b")
    channel.queue_unbind(q, x, "a")
    channel.exchange_declare(x, passive=True)  # one binding left
    channel.queue_unbind(q, x, "b")
    expect_channel_error(channel, 404, channel.exchange_declare, x, passive=True)


def test_auto_delete_exchange_without_bindings_survives(channel, name, cleanup):
    # Never having had a binding, an auto-delete exchange stays.
    x = cleanup.exchange(name("x"))
    channel.exchange_declare(x, "direct", auto_delete=True)
    channel.connection.sleep(0.2)
    channel.exchange_declare(x, passive=True)


def test_auto_delete_exchange_deleted_when_bound_queue_deleted(channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    q = name("q")
    channel.exchange_declare(x, "fanout", auto_delete=True)
    channel.queue_declare(q)
    channel.queue_bind(q, x)
    channel.queue_delete(q)
    expect_channel_error(channel, 404, channel.exchange_declare, x, passive=True)


def test_exchange_declare_nowait(channel, name, cleanup):
    x = cleanup.exchange(name("x"))
    # pika has no nowait for exchange_declare in BlockingChannel; use the raw
    # client: declare with nowait=1 must produce no reply at all.
    with raw_connection(timeout=1.0) as c:
        c.open_channel(1)
        args = (b"\x00\x00" + amqp_raw.shortstr(x) + amqp_raw.shortstr("fanout")
                + amqp_raw.bits(False, False, False, False, True) + amqp_raw.table({}))
        c.send_method(1, amqp_raw.EXCHANGE_DECLARE, args)
        c.send_method(1, amqp_raw.CHANNEL_CLOSE, amqp_raw.close_args())
        fr = c.read_method()
        assert amqp_raw.method_of(fr) == amqp_raw.CHANNEL_CLOSE_OK
    sync(channel)
    channel.exchange_declare(x, passive=True)

