"""A tiny raw AMQP 0-9-1 client for the tests pika cannot express.

Only what the compat tests need: the protocol header, frame encoding and
decoding, field tables, the connection handshake (PLAIN or AMQPLAIN) and a
handful of method encoders.  Everything is blocking with a socket timeout, so
a misbehaving broker makes a test fail instead of hanging.

Wire format reminders (AMQP 0-9-1, section 4.2):
  frame   = type:u8 channel:u16 size:u32 payload[size] 0xCE
  method  = class_id:u16 method_id:u16 arguments...
  header  = class_id:u16 weight:u16 body_size:u64 property_flags:u16 props...
  bits    = consecutive bit arguments are packed LSB-first into one octet
"""

import socket
import struct
import time
from collections import namedtuple
from decimal import Decimal

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE

# (class_id, method_id) pairs used by the tests.
CONNECTION_START = (10, 10)
CONNECTION_START_OK = (10, 11)
CONNECTION_TUNE = (10, 30)
CONNECTION_TUNE_OK = (10, 31)
CONNECTION_OPEN = (10, 40)
CONNECTION_OPEN_OK = (10, 41)
CONNECTION_CLOSE = (10, 50)
CONNECTION_CLOSE_OK = (10, 51)
CHANNEL_OPEN = (20, 10)
CHANNEL_OPEN_OK = (20, 11)
CHANNEL_FLOW = (20, 20)
CHANNEL_FLOW_OK = (20, 21)
CHANNEL_CLOSE = (20, 40)
CHANNEL_CLOSE_OK = (20, 41)
EXCHANGE_DECLARE = (40, 10)
QUEUE_DECLARE = (50, 10)
QUEUE_DECLARE_OK = (50, 11)
BASIC_CONSUME = (60, 20)
BASIC_CONSUME_OK = (60, 21)
BASIC_PUBLISH = (60, 40)
BASIC_RETURN = (60, 50)
BASIC_DELIVER = (60, 60)
BASIC_GET = (60, 70)
BASIC_GET_OK = (60, 71)
BASIC_GET_EMPTY = (60, 72)
BASIC_ACK = (60, 80)
BASIC_NACK = (60, 120)
CONFIRM_SELECT = (85, 10)
CONFIRM_SELECT_OK = (85, 11)


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------

def shortstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">B", len(b)) + b


def longstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(">I", len(b)) + b


def bits(*flags):
    """Pack consecutive bit arguments into one octet, first flag = bit 0."""
    v = 0
    for i, f in enumerate(flags):
        if f:
            v |= 1 << i
    return struct.pack(">B", v)


def _field_value(v):
    if isinstance(v, bool):
        return b"t" + struct.pack(">B", v)
    if isinstance(v, int):
        return b"l" + struct.pack(">q", v)
    if isinstance(v, str):
        return b"S" + longstr(v)
    if isinstance(v, bytes):
        return b"x" + longstr(v)
    if isinstance(v, dict):
        return b"F" + table(v)
    if isinstance(v, list):
        inner = b"".join(_field_value(x) for x in v)
        return b"A" + struct.pack(">I", len(inner)) + inner
    if v is None:
        return b"V"
    raise TypeError("unsupported field value %r" % (v,))


def table_fields(d):
    """Field-value pairs without the length prefix (AMQPLAIN uses this)."""
    return b"".join(shortstr(k) + _field_value(v) for k, v in d.items())


def table(d):
    body = table_fields(d)
    return struct.pack(">I", len(body)) + body


def method_payload(class_id, method_id, args=b""):
    return struct.pack(">HH", class_id, method_id) + args


def frame(ftype, channel, payload, end=FRAME_END):
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + bytes([end])


def method_frame(channel, method, args=b""):
    return frame(FRAME_METHOD, channel, method_payload(method[0], method[1], args))


def content_header_frame(channel, body_size, class_id=60, flags=0, props=b""):
    payload = struct.pack(">HHQH", class_id, 0, body_size, flags) + props
    return frame(FRAME_HEADER, channel, payload)


def body_frame(channel, data):
    return frame(FRAME_BODY, channel, data)


# A few method argument encoders -------------------------------------------

def queue_declare_args(name="", passive=False, durable=False, exclusive=False,
                       auto_delete=False, nowait=False, arguments=None):
    return (struct.pack(">H", 0) + shortstr(name)
            + bits(passive, durable, exclusive, auto_delete, nowait)
            + table(arguments or {}))


def basic_publish_args(exchange="", routing_key="", mandatory=False, immediate=False):
    return (struct.pack(">H", 0) + shortstr(exchange) + shortstr(routing_key)
            + bits(mandatory, immediate))


def basic_get_args(queue, no_ack=True):
    return struct.pack(">H", 0) + shortstr(queue) + bits(no_ack)


def basic_consume_args(queue, tag="", no_local=False, no_ack=False,
                       exclusive=False, nowait=False, arguments=None):
    return (struct.pack(">H", 0) + shortstr(queue) + shortstr(tag)
            + bits(no_local, no_ack, exclusive, nowait) + table(arguments or {}))


def close_args(code=200, text="", class_id=0, method_id=0):
    return struct.pack(">H", code) + shortstr(text) + struct.pack(">HH", class_id, method_id)


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------

class Reader:
    """Sequential decoder over a bytes payload."""

    def __init__(self, data, pos=0):
        self.data = data
        self.pos = pos

    def take(self, n):
        b = self.data[self.pos:self.pos + n]
        if len(b) != n:
            raise ValueError("truncated payload")
        self.pos += n
        return b

    def unpack(self, fmt):
        vals = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return vals if len(vals) > 1 else vals[0]

    def octet(self):
        return self.unpack(">B")

    def short(self):
        return self.unpack(">H")

    def long(self):
        return self.unpack(">I")

    def longlong(self):
        return self.unpack(">Q")

    def shortstr(self):
        return self.take(self.octet()).decode("utf-8", "replace")

    def longstr(self):
        return self.take(self.long())

    def table(self):
        end = self.pos + 4 + self.long()
        out = {}
        while self.pos < end:
            key = self.shortstr()
            out[key] = self.value()
        return out

    def value(self):
        t = self.take(1)
        simple = {b"t": ">B", b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H",
                  b"I": ">i", b"i": ">I", b"l": ">q", b"L": ">Q", b"f": ">f",
                  b"d": ">d", b"T": ">Q"}
        if t in simple:
            v = self.unpack(simple[t])
            return bool(v) if t == b"t" else v
        if t == b"D":
            scale = self.octet()
            return Decimal(self.unpack(">i")).scaleb(-scale)
        if t in (b"S", b"x"):
            return self.longstr()
        if t == b"F":
            return self.table()
        if t == b"A":
            end = self.pos + 4 + self.long()
            items = []
            while self.pos < end:
                items.append(self.value())
            return items
        if t == b"V":
            return None
        raise ValueError("unknown field type %r" % t)


Frame = namedtuple("Frame", "type channel payload")
Close = namedtuple("Close", "reply_code reply_text class_id method_id")
Tune = namedtuple("Tune", "channel_max frame_max heartbeat")


def method_of(fr):
    """(class_id, method_id) of a method frame."""
    assert fr.type == FRAME_METHOD, "expected a method frame, got %r" % (fr,)
    return struct.unpack_from(">HH", fr.payload, 0)


def args_of(fr):
    """A Reader positioned on the method arguments."""
    return Reader(fr.payload, 4)


def decode_close(fr):
    r = args_of(fr)
    return Close(r.short(), r.shortstr(), r.short(), r.short())


# --------------------------------------------------------------------------
# Connection
# --------------------------------------------------------------------------

class RawConnection:
    def __init__(self, host, port, timeout=5.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.buf = b""
        self.server_properties = None
        self.tune = None

    # -- transport --------------------------------------------------------
    def send(self, data):
        self.sock.sendall(data)

    def send_method(self, channel, method, args=b""):
        self.send(method_frame(channel, method, args))

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("server closed the connection")
        self.buf += chunk

    def read_exact(self, n):
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self):
        ftype, channel, size = struct.unpack(">BHI", self.read_exact(7))
        payload = self.read_exact(size)
        end = self.read_exact(1)[0]
        if end != FRAME_END:
            raise ValueError("bad frame end 0x%02x" % end)
        return Frame(ftype, channel, payload)

    def read_method(self, expect=None, channel=None):
        """Next method frame, skipping heartbeats (and checking expectations)."""
        while True:
            fr = self.read_frame()
            if fr.type == FRAME_HEARTBEAT:
                continue
            m = method_of(fr)
            if expect is not None:
                assert m == expect, "expected method %r, got %r (%r)" % (
                    expect, m, decode_close(fr) if m in (CONNECTION_CLOSE, CHANNEL_CLOSE) else fr)
            if channel is not None:
                assert fr.channel == channel, fr
            return fr

    def read_all_until_eof(self, limit=5.0):
        """Read frames until the server closes the socket; returns the frames.

        Raises AssertionError if the socket is still open after `limit` s.
        """
        frames = []
        deadline = time.monotonic() + limit
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError("socket still open after %.1fs" % limit)
                self.sock.settimeout(remaining)
                frames.append(self.read_frame())
        except (EOFError, ConnectionResetError):
            return frames
        except socket.timeout:
            raise AssertionError("socket still open after %.1fs" % limit)

    def read_raw_until_eof(self, limit=5.0):
        """All bytes until EOF (for non-frame replies such as a protocol header)."""
        deadline = time.monotonic() + limit
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError("socket still open after %.1fs" % limit)
                self.sock.settimeout(remaining)
                self._fill()
        except (EOFError, ConnectionResetError):
            out, self.buf = self.buf, b""
            return out
        except socket.timeout:
            raise AssertionError("socket still open after %.1fs" % limit)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    # -- handshake ------------------------------------------------------
    def start(self):
        """Send the protocol header and decode connection.start."""
        self.send(PROTOCOL_HEADER)
        fr = self.read_method(CONNECTION_START, channel=0)
        r = args_of(fr)
        major, minor = r.octet(), r.octet()
        self.server_properties = r.table()
        mechanisms = r.longstr().decode().split()
        locales = r.longstr().decode().split()
        return major, minor, mechanisms, locales

    def start_ok(self, user, password, mechanism="PLAIN"):
        if mechanism == "PLAIN":
            response = b"\x00" + user.encode() + b"\x00" + password.encode()
        elif mechanism == "AMQPLAIN":
            response = table_fields({"LOGIN": user, "PASSWORD": password})
        else:
            raise ValueError(mechanism)
        client_props = {"product": "warren-compat-raw",
                        "capabilities": {"authentication_failure_close": True}}
        self.send_method(0, CONNECTION_START_OK,
                         table(client_props) + shortstr(mechanism)
                         + longstr(response) + shortstr("en_US"))

    def read_tune(self):
        r = args_of(self.read_method(CONNECTION_TUNE, channel=0))
        self.tune = Tune(r.short(), r.long(), r.short())
        return self.tune

    def tune_ok(self, channel_max, frame_max, heartbeat):
        self.send_method(0, CONNECTION_TUNE_OK,
                         struct.pack(">HIH", channel_max, frame_max, heartbeat))

    def open(self, vhost="/"):
        self.send_method(0, CONNECTION_OPEN, shortstr(vhost) + shortstr("") + bits(False))
        self.read_method(CONNECTION_OPEN_OK, channel=0)

    def handshake(self, user, password, vhost="/", mechanism="PLAIN",
                  channel_max=None, frame_max=None, heartbeat=0):
        """Full handshake; None for a tune value means 'accept the server's'."""
        self.start()
        self.start_ok(user, password, mechanism)
        t = self.read_tune()
        self.tune_ok(t.channel_max if channel_max is None else channel_max,
                     t.frame_max if frame_max is None else frame_max,
                     heartbeat)
        self.open(vhost)
        return t

    def read_content(self, channel):
        """After a get-ok/deliver/return: (header_payload, body_bytes, n_body_frames)."""
        hdr = self.read_frame()
        assert hdr.type == FRAME_HEADER and hdr.channel == channel, hdr
        size = struct.unpack_from(">Q", hdr.payload, 4)[0]
        body, n = b"", 0
        while len(body) < size:
            fr = self.read_frame()
            assert fr.type == FRAME_BODY and fr.channel == channel, fr
            body += fr.payload
            n += 1
        assert len(body) == size
        return hdr.payload, body, n

    # -- channels / errors ----------------------------------------------
    def open_channel(self, channel):
        self.send_method(channel, CHANNEL_OPEN, shortstr(""))
        return self.read_method(CHANNEL_OPEN_OK, channel=channel)

    def expect_connection_close(self, send_close_ok=True, expect_eof=True):
        """Read frames until connection.close; decode it, answer, expect EOF."""
        while True:
            fr = self.read_frame()
            if fr.type == FRAME_METHOD and method_of(fr) == CONNECTION_CLOSE:
                break
        assert fr.channel == 0
        close = decode_close(fr)
        if send_close_ok:
            try:
                self.send_method(0, CONNECTION_CLOSE_OK)
            except OSError:
                pass
        if expect_eof:
            self.read_all_until_eof()
        return close

    def expect_channel_close(self, channel):
        """Read until channel.close on `channel`, answer close-ok, decode it."""
        while True:
            fr = self.read_frame()
            if fr.type != FRAME_METHOD:
                continue
            m = method_of(fr)
            assert m != CONNECTION_CLOSE, "connection closed: %r" % (decode_close(fr),)
            if m == CHANNEL_CLOSE and fr.channel == channel:
                break
        self.send_method(channel, CHANNEL_CLOSE_OK)
        return decode_close(fr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
