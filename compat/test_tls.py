"""AMQP over TLS (RabbitMQ's amqps listener and ssl_options) and the management API over HTTPS,
through pika (issue 14).

Unlike the other compat files these tests start their own brokers: each TLS configuration
(verify_none, verify_peer with and without fail_if_no_peer_cert, HTTPS management) is a
command-line setting of its own. WARREN_BIN names the warren binary (compat/run.sh sets it);
without it the file is skipped. Every broker gets free loopback ports and a data folder in a
temporary folder, and is stopped with SIGTERM (SIGKILL if it does not stop) at the end of the
module. The certificates are made with the openssl command: a CA, a server certificate for
localhost and 127.0.0.1, client certificates it signs (CN "tls-user" and CN "nobody-here"),
and a rogue CA with a client certificate of its own.

The behaviour asserted is RabbitMQ 3.10's with the same ssl_options (and, for EXTERNAL, the
rabbitmq_auth_mechanism_ssl plugin with ssl_cert_login_from = common_name).
"""

import atexit
import base64
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pika
import pytest

import amqp_raw
from amqp_raw import CONNECTION_CLOSE, CONNECTION_START_OK, method_of
from helpers import consume, unique

WARREN_BIN = os.environ.get("WARREN_BIN")

pytestmark = [
    pytest.mark.skipif(not WARREN_BIN, reason="WARREN_BIN (a warren binary) is not set"),
    # Setting up a module's brokers (certificates, processes) counts against its first test.
    pytest.mark.timeout(60),
]

OPENSSL = shutil.which("openssl")
START_WAIT = 10.0  # seconds a broker gets to accept connections on all its ports
STOP_WAIT = 10.0  # seconds the brokers get to stop after SIGTERM (then SIGKILL)
GUEST = ("guest", "guest")
EXTERNAL_REFUSED = ("ACCESS_REFUSED - Login was refused using authentication mechanism "
                    "EXTERNAL. For details see the broker logfile.")


# --------------------------------------------------------------------------
# certificates
# --------------------------------------------------------------------------

class Pki:
    """The certificate files: pki.pem(name), pki.key(name)."""

    def __init__(self, folder):
        self.folder = folder

    def pem(self, name):
        return os.path.join(self.folder, name + ".pem")

    def key(self, name):
        return os.path.join(self.folder, name + ".key")

    def _openssl(self, *args):
        r = subprocess.run([OPENSSL, *args], cwd=self.folder, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, "openssl %s failed:\n%s" % (" ".join(args), r.stderr)

    def _new_key_args(self, name):
        return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", self.key(name)]

    def make_ca(self, name):
        self._openssl("req", "-x509", *self._new_key_args(name), "-out", self.pem(name),
                      "-days", "30", "-subj", "/CN=" + name,
                      "-addext", "basicConstraints=critical,CA:TRUE",
                      "-addext", "keyUsage=critical,keyCertSign,cRLSign")

    def make_cert(self, name, cn, ca, extensions):
        csr = os.path.join(self.folder, name + ".csr")
        ext = os.path.join(self.folder, name + ".ext")
        with open(ext, "w") as f:
            f.write("\n".join(["basicConstraints=CA:FALSE"] + extensions) + "\n")
        self._openssl("req", "-new", *self._new_key_args(name), "-out", csr, "-subj", "/CN=" + cn)
        self._openssl("x509", "-req", "-in", csr, "-CA", self.pem(ca), "-CAkey", self.key(ca),
                      "-CAcreateserial", "-out", self.pem(name), "-days", "30",
                      "-extfile", ext)

    def client_context(self, cert=None):
        """An ssl.SSLContext trusting our CA (hostname checked), presenting client `cert`."""
        ctx = ssl.create_default_context(cafile=self.pem("ca"))
        if cert is not None:
            ctx.load_cert_chain(self.pem(cert), self.key(cert))
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if OPENSSL is None:
        pytest.skip("the openssl command is not installed")
    p = Pki(str(tmp_path_factory.mktemp("tls-pki")))
    client = ["keyUsage=critical,digitalSignature", "extendedKeyUsage=clientAuth"]
    p.make_ca("ca")
    p.make_cert("server", "localhost", "ca", [
        "keyUsage=critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage=serverAuth",
        "subjectAltName=DNS:localhost,IP:127.0.0.1",
    ])
    p.make_cert("tls-user", "tls-user", "ca", client)
    p.make_cert("nobody-here", "nobody-here", "ca", client)
    p.make_ca("rogue-ca")
    p.make_cert("rogue-user", "tls-user", "rogue-ca", client)
    return p


# --------------------------------------------------------------------------
# brokers
# --------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port, timeout=0.2):
    try:
        socket.create_connection(("127.0.0.1", port), timeout).close()
        return True
    except OSError:
        return False


_running = []  # every broker process started here, so that nothing outlives the test run


def _kill_leftovers():
    for proc in _running:
        if proc.poll() is None:
            proc.kill()


atexit.register(_kill_leftovers)


def _die_with_us():
    """In the child before exec: SIGTERM when this test process dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere the atexit hook and the fixture are all there is)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


class Warren:
    """A warren process of our own: amqp_port, amqps_port (or None), mgmt_port, mgmt_url."""

    def __init__(self, folder, args, amqps, management_tls):
        self.folder = folder
        self.log_path = os.path.join(folder, "warren.log")
        self.data_root = os.path.join(folder, "data")
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARREN_")}
        env["WARREN_LOG"] = os.environ.get("WARREN_LOG", "info")
        # A port taken between free_port() and the broker's bind is a failed start: try anew.
        for _attempt in range(3):
            self.amqp_port, self.mgmt_port = free_port(), free_port()
            self.amqps_port = free_port() if amqps else None
            cmd = [WARREN_BIN, "server",
                   "--amqp-listen", "127.0.0.1:%d" % self.amqp_port,
                   "--management-listen", "127.0.0.1:%d" % self.mgmt_port,
                   "--data-dir", os.path.join(self.data_root, str(_attempt))]
            # (With a certificate configured amqps is served on 5671 unless told otherwise.)
            cmd += ["--amqps-listen",
                    "127.0.0.1:%d" % self.amqps_port if amqps else "none"]
            cmd += args
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=env,
                                             preexec_fn=_die_with_us)
            _running.append(self.proc)
            if self._wait_listening():
                break
            self.stop()
            if "in use" not in self.log_tail():
                raise RuntimeError("warren did not start (%s):\n%s"
                                   % (" ".join(cmd), self.log_tail()))
        else:
            raise RuntimeError("warren did not start:\n" + self.log_tail())
        self.mgmt_url = "%s://127.0.0.1:%d" % ("https" if management_tls else "http",
                                               self.mgmt_port)

    def _wait_listening(self):
        ports = [p for p in (self.amqp_port, self.mgmt_port, self.amqps_port) if p]
        deadline = time.monotonic() + START_WAIT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            ports = [p for p in ports if not port_open(p)]
            if not ports:
                return True
            time.sleep(0.05)
        return False

    def log_tail(self, lines=30):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def terminate(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline):
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self):
        self.terminate()
        self.wait_stopped(time.monotonic() + STOP_WAIT)


@pytest.fixture(scope="module")
def brokers(pki, tmp_path_factory):
    """start(*args, amqps=True, management_tls=False) -> a started Warren; all are stopped
    (SIGTERM at once, SIGKILL after STOP_WAIT) at the end of the module."""
    started = []

    def start(*args, amqps=True, management_tls=False):
        folder = str(tmp_path_factory.mktemp("tls-warren"))
        args = ["--tls-cert", pki.pem("server"), "--tls-key", pki.key("server")] + list(args)
        if management_tls:
            args.append("--management-tls")
        w = Warren(folder, args, amqps, management_tls)
        started.append(w)
        return w

    yield start
    for w in started:
        w.terminate()
    deadline = time.monotonic() + STOP_WAIT
    for w in started:
        w.wait_stopped(deadline)
        shutil.rmtree(w.data_root, ignore_errors=True)  # the log stays, with pytest's tmp


@pytest.fixture(scope="module")
def tls_broker(brokers):
    """amqps with no client certificate asked for (RabbitMQ's verify_none)."""
    return brokers()


@pytest.fixture(scope="module")
def strict_broker(brokers, pki):
    """verify_peer + fail_if_no_peer_cert."""
    return brokers("--tls-ca", pki.pem("ca"), "--tls-verify-peer", "--tls-fail-if-no-peer-cert")


@pytest.fixture(scope="module")
def verify_broker(brokers, pki):
    """verify_peer only: a client may come without a certificate."""
    return brokers("--tls-ca", pki.pem("ca"), "--tls-verify-peer")


@pytest.fixture(scope="module")
def https_broker(brokers):
    """The management API over HTTPS (no amqps listener)."""
    return brokers(amqps=False, management_tls=True)


# --------------------------------------------------------------------------
# clients
# --------------------------------------------------------------------------

def params(port, ssl_context=None, credentials=None, name=None):
    kw = dict(
        host="127.0.0.1",
        port=port,
        credentials=credentials or pika.PlainCredentials(*GUEST),
        connection_attempts=1,
        socket_timeout=5,
        stack_timeout=10,
        blocked_connection_timeout=10,
    )
    if ssl_context is not None:
        kw["ssl_options"] = pika.SSLOptions(ssl_context, server_hostname="localhost")
    if name is not None:
        kw["client_properties"] = {"connection_name": name}
    return pika.ConnectionParameters(**kw)


def tls_params(broker, pki, cert=None, credentials=None, name=None):
    return params(broker.amqps_port, pki.client_context(cert), credentials, name)


def connect(p):
    return pika.BlockingConnection(p)


def close_quietly(conn):
    try:
        if conn.is_open:
            conn.close()
    except Exception:  # noqa: BLE001
        pass


def roundtrip(conn):
    """Declare a queue, publish to it with confirms, consume the message back."""
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("tls-q")
    ch.queue_declare(q)
    body = ("over %s" % q).encode()
    # With confirms on, basic_publish raises if the broker nacks or returns the message.
    ch.basic_publish("", q, body, mandatory=True)
    col, tag = consume(conn, ch, q, 1, auto_ack=True)
    assert col.bodies == [body]
    ch.basic_cancel(tag)
    ch.queue_delete(q)
    ch.close()


def raw_tls(broker, pki, cert=None):
    """An amqp_raw.RawConnection to the amqps listener (TLS handshake done)."""
    c = amqp_raw.RawConnection("127.0.0.1", broker.amqps_port)
    try:
        c.sock = pki.client_context(cert).wrap_socket(c.sock, server_hostname="localhost")
    except BaseException:
        c.close()
        raise
    return c


def api(broker, method, path, body=None, auth=GUEST, ctx=None):
    """(status, parsed JSON or None) from the broker's management API."""
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(
            ("%s:%s" % auth).encode()).decode()
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(broker.mgmt_url + path, method=method, headers=headers,
                                 data=data)
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, (json.loads(raw) if raw else None)


def find_connection(broker, name, timeout=5.0):
    """The management API's entry for the connection named `name` (None if none shows)."""
    deadline = time.monotonic() + timeout
    while True:
        status, conns = api(broker, "GET", "/api/connections")
        assert status == 200, conns
        for c in conns:
            if c.get("client_properties", {}).get("connection_name") == name:
                return c
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def connection_names(broker):
    status, conns = api(broker, "GET", "/api/connections")
    assert status == 200, conns
    return [c.get("client_properties", {}).get("connection_name") for c in conns]


def assert_refused_by_tls(broker, pki, cert):
    """A pika client presenting `cert` (None: no certificate) gets no connection, and a raw
    client never sees connection.start."""
    name = unique("tls-refused")
    # pika raises the ssl.SSLError itself when the TLS handshake fails, an AMQPConnectionError
    # when the connection ends after it.
    with pytest.raises((pika.exceptions.AMQPConnectionError, ssl.SSLError)):
        conn = connect(tls_params(broker, pki, cert, name=name))
        close_quietly(conn)  # only reached on failure: don't leak the connection
    # TLS 1.3 finishes the client's side of the handshake before the server has looked at
    # the client's certificate, so the refusal may show on the first read instead.
    try:
        c = raw_tls(broker, pki, cert)
        try:
            c.start()
        finally:
            c.close()
    except socket.timeout:
        pytest.fail("the broker neither refused the certificate nor answered")
    except (OSError, EOFError):
        pass  # ssl.SSLError (the broker's alert), a reset, or the socket's end
    else:
        pytest.fail("connection.start came: the certificate was not refused")
    assert name not in connection_names(broker)
    assert broker.proc.poll() is None, broker.log_tail()


# --------------------------------------------------------------------------
# 1. amqps without peer verification
# --------------------------------------------------------------------------

def test_pika_over_tls_declare_publish_confirm_consume(tls_broker, pki):
    conn = connect(tls_params(tls_broker, pki))
    try:
        roundtrip(conn)
    finally:
        close_quietly(conn)


def test_plain_listener_works_beside_amqps(tls_broker, pki):
    tls = connect(tls_params(tls_broker, pki))
    try:
        plain = connect(params(tls_broker.amqp_port))
        try:
            roundtrip(plain)
            roundtrip(tls)
        finally:
            close_quietly(plain)
    finally:
        close_quietly(tls)


def test_tls_server_certificate_is_checked_by_the_client(tls_broker, pki):
    # The server's certificate is the one made for localhost/127.0.0.1 (else pika's default
    # context would refuse it); a client trusting only the rogue CA refuses the server.
    ctx = ssl.create_default_context(cafile=pki.pem("rogue-ca"))
    with pytest.raises(ssl.SSLCertVerificationError):
        close_quietly(connect(params(tls_broker.amqps_port, ctx)))
    ctx = pki.client_context()
    with socket.create_connection(("127.0.0.1", tls_broker.amqps_port), 5) as s:
        with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
            assert t.version() in ("TLSv1.2", "TLSv1.3")


def test_plain_amqp_to_the_amqps_port_gets_no_connection_start(tls_broker):
    # An unencrypted AMQP header on the TLS port is no TLS ClientHello: the broker closes
    # the socket (RabbitMQ: a TLS alert and close); whatever it sends is no AMQP frame.
    with amqp_raw.RawConnection("127.0.0.1", tls_broker.amqps_port) as c:
        c.send(amqp_raw.PROTOCOL_HEADER)
        data = c.read_raw_until_eof(limit=5)
        assert not data.startswith(b"\x01\x00\x00"), data  # not a method frame on channel 0


# --------------------------------------------------------------------------
# 2. verify_peer + fail_if_no_peer_cert
# --------------------------------------------------------------------------

def test_fail_if_no_peer_cert_refuses_client_without_certificate(strict_broker, pki):
    assert_refused_by_tls(strict_broker, pki, None)


def test_verify_peer_refuses_certificate_from_unknown_ca(strict_broker, pki):
    assert_refused_by_tls(strict_broker, pki, "rogue-user")


def test_verify_peer_accepts_ca_signed_certificate_with_plain_login(strict_broker, pki):
    name = unique("tls-cert-plain")
    conn = connect(tls_params(strict_broker, pki, "tls-user", name=name))
    try:
        roundtrip(conn)
        c = find_connection(strict_broker, name)
        assert c is not None
        assert c["user"] == "guest"
        assert c["auth_mechanism"] == "PLAIN"
    finally:
        close_quietly(conn)


# --------------------------------------------------------------------------
# 3. verify_peer without fail_if_no_peer_cert
# --------------------------------------------------------------------------

def test_verify_peer_alone_accepts_client_without_certificate(verify_broker, pki):
    conn = connect(tls_params(verify_broker, pki))
    try:
        roundtrip(conn)
    finally:
        close_quietly(conn)


def test_verify_peer_alone_accepts_ca_signed_certificate(verify_broker, pki):
    conn = connect(tls_params(verify_broker, pki, "tls-user"))
    try:
        roundtrip(conn)
    finally:
        close_quietly(conn)


def test_verify_peer_alone_still_refuses_certificate_from_unknown_ca(verify_broker, pki):
    # A certificate that is given is checked, whether or not one is required.
    assert_refused_by_tls(verify_broker, pki, "rogue-user")


# --------------------------------------------------------------------------
# 4. EXTERNAL: login by the client certificate's common name
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_user(verify_broker):
    """The user "tls-user" (all permissions on /), made through the management API."""
    status, body = api(verify_broker, "PUT", "/api/users/tls-user",
                       {"password": "x", "tags": ""})
    assert status in (201, 204), (status, body)
    status, body = api(verify_broker, "PUT", "/api/permissions/%2F/tls-user",
                       {"configure": ".*", "write": ".*", "read": ".*"})
    assert status in (201, 204), (status, body)
    return "tls-user"


def test_external_offered_with_verified_client_certificate(verify_broker, pki):
    c = raw_tls(verify_broker, pki, "tls-user")
    with c:
        _, _, mechanisms, _ = c.start()
    assert "EXTERNAL" in mechanisms, mechanisms
    assert "PLAIN" in mechanisms and "AMQPLAIN" in mechanisms, mechanisms


def test_external_login_by_certificate_common_name(verify_broker, pki, tls_user):
    name = unique("tls-external")
    conn = connect(tls_params(verify_broker, pki, "tls-user",
                              credentials=pika.credentials.ExternalCredentials(), name=name))
    try:
        c = find_connection(verify_broker, name)
        assert c is not None
        assert c["user"] == tls_user
        assert c["auth_mechanism"] == "EXTERNAL"
        assert c["vhost"] == "/"
        roundtrip(conn)
    finally:
        close_quietly(conn)


def test_external_login_of_unknown_user_is_refused(verify_broker, pki, tls_user):
    # The CA signed the certificate, but no user is called "nobody-here". pika announces
    # authentication_failure_close, so the refusal is a connection.close 403 (which pika,
    # closed while authenticating, reports as ProbableAuthenticationError). A client-side
    # AuthenticationError ("could not negotiate") would mean EXTERNAL was not offered.
    name = unique("tls-external-refused")
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as ei:
        close_quietly(connect(tls_params(
            verify_broker, pki, "nobody-here",
            credentials=pika.credentials.ExternalCredentials(), name=name)))
    assert "403" in str(ei.value) and EXTERNAL_REFUSED in str(ei.value), ei.value
    assert name not in connection_names(verify_broker)


def assert_external_refused_raw(broker, pki, cert):
    """EXTERNAL is offered over TLS with the client certificate `cert` (None: none) and the
    login is refused with 403, as RabbitMQ refuses it (authentication_failure_close)."""
    c = raw_tls(broker, pki, cert)
    with c:
        _, _, mechanisms, _ = c.start()
        assert "EXTERNAL" in mechanisms, mechanisms
        client_props = {"product": "warren-compat-raw",
                        "capabilities": {"authentication_failure_close": True}}
        c.send_method(0, CONNECTION_START_OK,
                      amqp_raw.table(client_props) + amqp_raw.shortstr("EXTERNAL")
                      + amqp_raw.longstr(b"") + amqp_raw.shortstr("en_US"))
        fr = c.read_method()
        assert method_of(fr) == CONNECTION_CLOSE, fr
        code, text, _class_id, _method_id = amqp_raw.decode_close(fr)
        assert (code, text) == (403, EXTERNAL_REFUSED)


def test_external_login_of_unknown_user_closes_with_403_raw(verify_broker, pki, tls_user):
    assert_external_refused_raw(verify_broker, pki, "nobody-here")


def test_external_without_a_client_certificate_is_offered_and_refused_with_403(
        verify_broker, pki, tls_user):
    # As RabbitMQ's rabbitmq_auth_mechanism_ssl: EXTERNAL is offered on every TLS connection
    # (to help clients debug their setup) and refused when no certificate was given.
    assert_external_refused_raw(verify_broker, pki, None)


def test_external_not_offered_on_plain_listener(verify_broker, tls_user):
    # Not TLS, no certificate: EXTERNAL is not offered, and pika gives up by itself before
    # sending connection.start-ok (AuthenticationError, not a refusal by the broker).
    with amqp_raw.RawConnection("127.0.0.1", verify_broker.amqp_port) as c:
        _, _, mechanisms, _ = c.start()
    assert "EXTERNAL" not in mechanisms, mechanisms
    with pytest.raises(pika.exceptions.AuthenticationError) as ei:
        close_quietly(connect(params(verify_broker.amqp_port,
                                     credentials=pika.credentials.ExternalCredentials())))
    assert "EXTERNAL" in str(ei.value)


def test_management_shows_tls_connection_details(verify_broker, pki):
    # RabbitMQ's connection object: ssl true and the TLS version for an amqps connection,
    # the client certificate's subject; ssl false on the plain listener.
    tls_name, plain_name = unique("tls-details"), unique("plain-details")
    tls = connect(tls_params(verify_broker, pki, "tls-user", name=tls_name))
    try:
        plain = connect(params(verify_broker.amqp_port, name=plain_name))
        try:
            c = find_connection(verify_broker, tls_name)
            assert c is not None
            assert c["ssl"] is True, c
            assert c.get("ssl_protocol") in ("tlsv1.2", "tlsv1.3"), c
            assert c.get("peer_cert_subject") == "CN=tls-user", c
            c = find_connection(verify_broker, plain_name)
            assert c is not None
            assert c["ssl"] is False, c
        finally:
            close_quietly(plain)
    finally:
        close_quietly(tls)


# --------------------------------------------------------------------------
# 5. the management API over HTTPS
# --------------------------------------------------------------------------

def test_management_over_https(https_broker, pki):
    status, body = api(https_broker, "GET", "/api/overview", ctx=pki.client_context())
    assert status == 200
    assert isinstance(body, dict) and "object_totals" in body, body
    status, _ = api(https_broker, "GET", "/api/overview", auth=None, ctx=pki.client_context())
    assert status == 401


def test_management_https_port_does_not_speak_plain_http(https_broker):
    url = "http://127.0.0.1:%d/api/overview" % https_broker.mgmt_port
    req = urllib.request.Request(url, headers={
        "Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            answer = "HTTP %d: %r" % (r.status, r.read()[:200])
    except urllib.error.HTTPError as e:  # an HTTP answer, if an error one
        answer = "HTTP %d" % e.code
    except (OSError, http.client.HTTPException):
        answer = None  # no HTTP answer: what a TLS-only port does
    assert answer is None, answer
    assert https_broker.proc.poll() is None, https_broker.log_tail()


def test_amqp_works_beside_https_management(https_broker):
    conn = connect(params(https_broker.amqp_port))
    try:
        roundtrip(conn)
    finally:
        close_quietly(conn)
