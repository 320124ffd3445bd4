"""Shared fixtures for the Warren <-> RabbitMQ compatibility suite.

The broker under test is given by AMQP_URL (default: a local RabbitMQ or
Warren on 127.0.0.1:5672 with guest/guest).  Every test uses unique names and
removes what it declares, so tests can run in any order and in parallel with
other users of the same broker.
"""

import sys

# Don't litter compat/ with __pycache__ for the modules imported from here on.
sys.dont_write_bytecode = True

import pika  # noqa: E402
import pytest  # noqa: E402

# AMQP_URL and its parsed pieces (HOST, PORT, ... for raw-socket tests) live in
# helpers.py so test modules can import them too.
from helpers import (  # noqa: E402,F401
    AMQP_URL, HOST, PASSWORD, PORT, USER, VHOST, make_params, open_connection, unique)


def _close_quietly(conn):
    try:
        if conn.is_open:
            conn.close()
    except Exception:
        pass


@pytest.fixture
def amqp_url():
    return AMQP_URL


@pytest.fixture
def broker_addr():
    """(host, port) of the broker, for raw-socket tests."""
    return HOST, PORT


@pytest.fixture
def credentials():
    return USER, PASSWORD, VHOST


@pytest.fixture
def connection():
    conn = open_connection()
    yield conn
    _close_quietly(conn)


@pytest.fixture
def channel(connection):
    return connection.channel()


@pytest.fixture
def connect():
    """Factory for extra connections (closed at teardown): connect(**params)."""
    opened = []

    def _connect(**overrides):
        conn = open_connection(**overrides)
        opened.append(conn)
        return conn

    yield _connect
    for conn in opened:
        _close_quietly(conn)


@pytest.fixture
def name():
    """name('q') -> a unique resource name like 'compat-q-1a2b3c...'."""
    return unique


class Cleanup:
    """Deletes registered queues/exchanges at teardown on a fresh connection.

    Using a separate connection makes cleanup independent of whatever state
    (closed channels, closed connections) the test left behind.
    """

    def __init__(self):
        self.queues = []
        self.exchanges = []

    def queue(self, q):
        self.queues.append(q)
        return q

    def exchange(self, x):
        self.exchanges.append(x)
        return x

    def run(self):
        if not (self.queues or self.exchanges):
            return
        conn = open_connection()
        try:
            for q in self.queues:
                ch = conn.channel()
                try:
                    ch.queue_delete(q)
                    ch.close()
                except pika.exceptions.AMQPChannelError:
                    pass
            for x in self.exchanges:
                ch = conn.channel()
                try:
                    ch.exchange_delete(x)
                    ch.close()
                except pika.exceptions.AMQPChannelError:
                    pass
        finally:
            _close_quietly(conn)


@pytest.fixture
def cleanup():
    c = Cleanup()
    yield c
    c.run()


@pytest.fixture
def queue(channel, name, cleanup):
    """A fresh, empty, non-exclusive queue on `channel` (deleted afterwards)."""
    q = cleanup.queue(name("q"))
    channel.queue_declare(q)
    return q
