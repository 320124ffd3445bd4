"""Typed wire-level views of messages, for the test_ext_* suites.

pika decodes field tables into plain Python values and loses the AMQP type
tags (a 'T' timestamp, an 'l' long-long and an 'I' long all come back as
something else or as int), and dicts hide nothing about order.  The header
layouts RabbitMQ writes (x-death and friends) are part of its observable
behaviour, so these helpers fetch a message with a raw basic.get and decode
its content header into (name, type_tag, value) triples that keep the order
and the type of every field exactly as they were on the wire.
"""

from collections import namedtuple

import amqp_raw
from helpers import WARREN, raw_connection

# Basic class property flags, highest bit first (AMQP 0-9-1, 4.2.6.1).
PROPERTY_ORDER = [
    ("content_type", "shortstr"), ("content_encoding", "shortstr"),
    ("headers", "table"), ("delivery_mode", "octet"), ("priority", "octet"),
    ("correlation_id", "shortstr"), ("reply_to", "shortstr"),
    ("expiration", "shortstr"), ("message_id", "shortstr"),
    ("timestamp", "timestamp"), ("type", "shortstr"), ("user_id", "shortstr"),
    ("app_id", "shortstr"), ("cluster_id", "shortstr"),
]

Field = namedtuple("Field", "name type value")
RawMessage = namedtuple("RawMessage", "exchange routing_key redelivered properties body")


class TypedReader(amqp_raw.Reader):
    """amqp_raw.Reader whose tables/arrays keep type tags and order."""

    def typed_table(self):
        end = self.pos + 4 + self.long()
        out = []
        while self.pos < end:
            key = self.shortstr()
            t, v = self.typed_value()
            out.append(Field(key, t, v))
        return out

    def typed_value(self):
        t = self.data[self.pos:self.pos + 1].decode()
        if t == "F":
            self.pos += 1
            return t, self.typed_table()
        if t == "A":
            self.pos += 1
            end = self.pos + 4 + self.long()
            items = []
            while self.pos < end:
                items.append(self.typed_value())
            return t, items
        return t, self.value()


def decode_properties(header_payload):
    """Content-header payload -> dict of the properties present.

    'headers' is a list of Field triples (typed, in wire order).
    """
    r = TypedReader(header_payload)
    r.unpack(">HHQ")  # class id, weight, body size
    flags = r.short()
    props = {}
    for i, (attr, kind) in enumerate(PROPERTY_ORDER):
        if not flags & (1 << (15 - i)):
            continue
        if kind == "shortstr":
            props[attr] = r.shortstr()
        elif kind == "table":
            props[attr] = r.typed_table()
        elif kind == "octet":
            props[attr] = r.octet()
        else:
            props[attr] = r.longlong()
    return props


def raw_get(queue):
    """basic.get (no-ack) on a fresh raw connection: RawMessage or None."""
    with raw_connection() as c:
        c.open_channel(1)
        c.send_method(1, amqp_raw.BASIC_GET, amqp_raw.basic_get_args(queue, no_ack=True))
        fr = c.read_method(channel=1)
        m = amqp_raw.method_of(fr)
        if m == amqp_raw.BASIC_GET_EMPTY:
            return None
        assert m == amqp_raw.BASIC_GET_OK, m
        r = amqp_raw.args_of(fr)
        r.longlong()  # delivery tag
        redelivered = bool(r.octet())
        exchange, routing_key = r.shortstr(), r.shortstr()
        r.long()  # message count
        header, body, _ = c.read_content(1)
        props = decode_properties(header)
        if WARREN and props.get("headers") is not None:
            props["headers"] = _check_last_death(props["headers"])
        return RawMessage(exchange, routing_key, redelivered, props, body)


def _check_last_death(fields):
    """Warren also writes RabbitMQ 3.13's x-last-death-* headers (3.10, the reference these
    tests were written against, has none): check they name the newest death, then drop them so
    the 3.10 assertions apply unchanged."""
    last = {f.name: f for f in fields if f.name.startswith("x-last-death-")}
    rest = [f for f in fields if not f.name.startswith("x-last-death-")]
    deaths = [f for f in rest if f.name == "x-death"]
    if deaths and deaths[0].type == "A" and deaths[0].value:
        newest = {f.name: f.value for f in deaths[0].value[0][1]}
        for key in ("queue", "reason"):
            got = last.get("x-last-death-" + key)
            assert got is not None and got.type == "S", last
            assert got.value == newest[key], (got, newest)
        assert "x-last-death-exchange" in last, last
    return rest


def field(fields, name):
    """The Field called `name` in a typed table (AssertionError if absent)."""
    for f in fields:
        if f.name == name:
            return f
    raise AssertionError("no field %r in %r" % (name, [f.name for f in fields]))


def names(fields):
    return [f.name for f in fields]


def header_names(msg):
    return names(msg.properties.get("headers", []))


def header(msg, name):
    return field(msg.properties.get("headers", []), name)


def x_death(msg):
    """The x-death entries of a RawMessage, each a list of Fields (wire order)."""
    f = header(msg, "x-death")
    assert f.type == "A", f
    for tag, _ in f.value:
        assert tag == "F", f
    return [entry for _, entry in f.value]


def split_time(entry):
    """(entry with the 'time' value replaced by None, the time value).

    x-death 'time' is the dead-lettering wall-clock time in seconds; tests
    check it against their own clock separately.
    """
    out, t = [], None
    for f in entry:
        if f.name == "time":
            assert f.type == "T", f
            t = f.value
            f = Field("time", "T", None)
        out.append(f)
    return out, t


def death(count, reason, queue, exchange, routing_keys, original_expiration=None,
          sort=False):
    """An x-death entry as RabbitMQ 3.10 writes it (time value None).

    First-death layout (sort=False): count, reason, queue, time, exchange,
    routing-keys[, original-expiration].  Entries RabbitMQ rewrote on a later
    death (a new entry added to an existing x-death, or a count increment)
    are sorted by field name (sort=True).
    """
    b = lambda s: s.encode() if isinstance(s, str) else s  # noqa: E731
    entry = [Field("count", "l", count), Field("reason", "S", b(reason)),
             Field("queue", "S", b(queue)), Field("time", "T", None),
             Field("exchange", "S", b(exchange)),
             Field("routing-keys", "A", [("S", b(k)) for k in routing_keys])]
    if original_expiration is not None:
        entry.append(Field("original-expiration", "S", b(original_expiration)))
    if sort:
        entry.sort(key=lambda f: f.name.encode())
    return entry
