'use strict';
// Connection-level behaviour that amqplib's connect/connection tests rely on
// against a live broker (test/connect.test.js, test/channel_api.test.js
// 'connect', 'updateSecret'), plus tuning and heartbeats.
const assert = require('node:assert');
const net = require('node:net');
const h = require('./helpers');
const { amqp, cbapi } = h;

describe('connect', function () {
  it('connects at all and closes cleanly', async function () {
    const c = await amqp.connect(h.URL);
    const closed = h.nextEvent(c, 'close');
    await c.close();
    const err = await closed;
    assert.strictEqual(err, undefined, 'client-initiated close has no error');
  });

  it('callback API connects and closes', function (done) {
    cbapi.connect(h.URL, (err, c) => {
      if (err) return done(err);
      c.close(done);
    });
  });

  it('connects with an options object (hostname/port/vhost) instead of a URL', async function () {
    const c = await amqp.connect({ protocol: 'amqp', hostname: h.HOST, port: h.PORT, username: 'guest', password: 'guest', vhost: '/' });
    await c.close();
  });

  it("serverProperties.product is 'RabbitMQ' (amqplib connect test 'serverProperties')", async function () {
    await h.withConnection(async (c) => {
      assert.strictEqual(c.connection.serverProperties.product, 'RabbitMQ');
    });
  });

  it('serverProperties: version/platform strings and the RabbitMQ capabilities table', async function () {
    await h.withConnection(async (c) => {
      const sp = c.connection.serverProperties;
      assert.strictEqual(typeof sp.version, 'string');
      assert.strictEqual(typeof sp.platform, 'string');
      const caps = sp.capabilities;
      assert.ok(caps, 'capabilities table present');
      for (const cap of ['publisher_confirms', 'exchange_exchange_bindings', 'basic.nack',
        'consumer_cancel_notify', 'connection.blocked', 'authentication_failure_close',
        'per_consumer_qos', 'direct_reply_to', 'consumer_priorities']) {
        assert.strictEqual(caps[cap], true, `capability ${cap}`);
      }
    });
  });

  it('tune: channelMax 2047, frameMax 131072, heartbeat 60 by default', async function () {
    await h.withConnection(async (c) => {
      assert.strictEqual(c.connection.channelMax, 2047);
      assert.strictEqual(c.connection.frameMax, 131072);
      assert.strictEqual(c.connection.heartbeat, 60);
    });
  });

  it('custom heartbeat option (20) is negotiated down from the server offer', async function () {
    await h.withConnection(async (c) => {
      assert.strictEqual(c.connection.heartbeat, 20);
    }, h.urlWith({ heartbeat: 20 }));
  });

  it('heartbeat=0 disables heartbeats and the connection works', async function () {
    await h.withConnection(async (c) => {
      assert.strictEqual(c.connection.heartbeat, 0);
      const ch = await c.createChannel();
      await ch.close();
    }, h.urlWith({ heartbeat: 0 }));
  });

  it('heartbeat=1: server sends heartbeats so an idle connection survives 3.5 s', async function () {
    const c = await h.connect(h.urlWith({ heartbeat: 1 }));
    try {
      assert.strictEqual(c.connection.heartbeat, 1);
      let recvFrames = 0;
      const sock = c.connection.stream;
      sock.on('data', () => recvFrames++);
      let failure = null;
      c.on('error', (e) => { failure = e; });
      c.on('close', (e) => { failure = failure || e || new Error('closed'); });
      await h.delay(3500);
      assert.strictEqual(failure, null, `connection failed while idle: ${failure}`);
      assert.ok(recvFrames >= 2, `expected >= 2 heartbeats from the server in 3.5 s, saw ${recvFrames} reads`);
      const ch = await c.createChannel();
      await ch.close();
    } finally {
      try { await c.close(); } catch (_) { /* */ }
    }
  });

  it('heartbeat=1: server drops a client that stops sending heartbeats', async function () {
    const c = await h.connect(h.urlWith({ heartbeat: 1 }));
    // Silence the client: stop its heartbeater (both the sender and the
    // receive-timeout check) so only the server's detection can fire.
    c.connection.heartbeater.clear();
    const closed = await h.nextEvent(c, 'close', 8000);
    assert.ok(closed instanceof Error, 'server-side drop surfaces as an error close');
  });

  it('frameMax=4096: large message is split into frames no larger than 4096 both ways', async function () {
    await h.recordingFrames(async (frames) => {
      await h.withConnection(async (c) => {
        assert.strictEqual(c.connection.frameMax, 4096);
        const ch = await c.createChannel();
        const { queue } = await ch.assertQueue('', { exclusive: true });
        const body = Buffer.alloc(100000);
        for (let i = 0; i < body.length; i++) body[i] = i % 251;
        ch.sendToQueue(queue, body, { headers: { big: 'x'.repeat(3000) } });
        await h.waitForMessagesOn(ch, queue, 1);
        const m = await ch.get(queue, { noAck: true });
        assert.ok(m);
        assert.ok(body.equals(m.content), 'content intact');
        assert.strictEqual(m.properties.headers.big.length, 3000);
      }, h.urlWith({ frameMax: 4096 }));
      const bodies = frames.filter((f) => f.content && f.id === undefined);
      assert.ok(bodies.length >= 25, `expected the body split into >= 25 frames, got ${bodies.length}`);
      const biggest = Math.max(...bodies.map((f) => f.content.length));
      assert.ok(biggest <= 4088, `body frame payload ${biggest} exceeds frame_max 4096 - 8`);
    });
  });

  it('frameMax below the 4096 minimum is refused by the server during the handshake', async function () {
    // RabbitMQ 3.10 fails the negotiation ("negotiated frame_max = 1024 is
    // lower than the minimum allowed value (4096)" in its log) and, being in
    // the tuning state, closes the socket after a 3 s delay without a
    // connection.close frame; amqplib sees ECONNRESET. Only the failure is
    // asserted here.
    this.timeout(10000);
    await h.rejected(amqp.connect(h.urlWith({ frameMax: 1024 })), 8000);
  });

  it('unknown vhost: connection.close 530 NOT_ALLOWED instead of open-ok', async function () {
    const vhost = 'no-such-vhost-' + Date.now();
    await h.recordingFrames(async (frames) => {
      const err = await h.rejected(amqp.connect(h.urlFor({ vhost })));
      assert.match(err.message, /Expected ConnectionOpenOk; got <ConnectionClose channel:0>/);
      const close = frames.find((f) => f.fields && f.fields.replyCode !== undefined);
      assert.strictEqual(close.fields.replyCode, 530);
      assert.strictEqual(close.fields.replyText, `NOT_ALLOWED - vhost ${vhost} not found`);
      assert.strictEqual(close.fields.classId, 10);
      assert.strictEqual(close.fields.methodId, 40);
    });
  });

  it('a 1 MiB message round-trips on the default frameMax (multiple body frames)', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const body = Buffer.alloc(1 << 20, 7);
      body[12345] = 1;
      ch.sendToQueue(queue, body);
      const got = new Promise((resolve) => ch.consume(queue, resolve, { noAck: true }));
      const m = await got;
      assert.ok(body.equals(m.content));
    });
  });

  it('plain credentials', async function () {
    const c = await amqp.connect(h.URL, { credentials: amqp.credentials.plain('guest', 'guest') });
    await c.close();
  });

  it('amqplain credentials', async function () {
    const c = await amqp.connect(h.URL, { credentials: amqp.credentials.amqplain('guest', 'guest') });
    await c.close();
  });

  it('unsupported SASL mechanism is not offered by the server', async function () {
    const credentials = { mechanism: 'UNSUPPORTED', response: () => Buffer.from('') };
    const err = await h.rejected(amqp.connect(h.URL, { credentials }));
    assert.match(err.message, /SASL mechanism UNSUPPORTED is not provided by the server/);
  });

  it('EXTERNAL mechanism is not offered without TLS client certs', async function () {
    const err = await h.rejected(amqp.connect(h.URL, { credentials: amqp.credentials.external() }));
    assert.match(err.message, /SASL mechanism EXTERNAL is not provided by the server/);
  });

  it('wrong password: connection.close 403 ACCESS_REFUSED during the handshake', async function () {
    const err = await h.rejected(amqp.connect(h.urlFor({ pass: 'wrong-password' })));
    assert.match(err.message, /Handshake terminated by server: 403 \(ACCESS-REFUSED\)/);
    assert.match(err.message, /ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN/);
  });

  it('wrong password with AMQPLAIN: 403 ACCESS_REFUSED naming AMQPLAIN', async function () {
    const err = await h.rejected(amqp.connect(h.URL, { credentials: amqp.credentials.amqplain('guest', 'nope') }));
    assert.match(err.message, /Handshake terminated by server: 403 \(ACCESS-REFUSED\)/);
    assert.match(err.message, /ACCESS_REFUSED - Login was refused using authentication mechanism AMQPLAIN/);
  });

  // amqplib's own test connects to amqp://[::1] (port 5672); RabbitMQ listens
  // on [::] (dual-stack) by default, and so does Warren. A test must listen on
  // loopback only, so run.sh gives a broker on [::1] as AMQP_IPV6_URL; without
  // it, the port of AMQP_URL is tried on [::1] (a broker listening on [::]).
  it('ipv6: broker accepts connections on [::1]', async function () {
    const url = process.env.AMQP_IPV6_URL || `amqp://guest:guest@[::1]:${h.PORT}/%2F`;
    const c = await amqp.connect(url);
    await c.close();
  });

  it('connection refused on a closed port (client-side)', async function () {
    const srv = net.createServer().listen(0, '127.0.0.1');
    await h.nextEvent(srv, 'listening');
    const port = srv.address().port;
    srv.close();
    await h.nextEvent(srv, 'close');
    const err = await h.rejected(amqp.connect(`amqp://127.0.0.1:${port}`));
    assert.strictEqual(err.code, 'ECONNREFUSED');
  });

  it('updateSecret gets update-secret-ok (promise API)', async function () {
    await h.withConnection(async (c) => {
      await c.updateSecret(Buffer.from('new secret'), 'no reason');
      // connection still usable afterwards
      const ch = await c.createChannel();
      await ch.close();
    });
  });

  it('updateSecret gets update-secret-ok (callback API)', function (done) {
    cbapi.connect(h.URL, (err, c) => {
      if (err) return done(err);
      c.updateSecret(Buffer.from('new secret'), 'no reason', (e) => {
        if (e) return done(e);
        c.close(done);
      });
    });
  });

  it('client close with open channels: channels close, connection close-ok', async function () {
    const c = await h.connect();
    const chs = [];
    for (let i = 0; i < 10; i++) chs.push(await c.createChannel());
    const closes = chs.map((ch) => h.nextEvent(ch, 'close'));
    await c.close();
    await Promise.all(closes);
  });

  it('many channels on one connection (200)', async function () {
    await h.withConnection(async (c) => {
      const chs = await Promise.all(Array.from({ length: 200 }, () => c.createChannel()));
      await Promise.all(chs.map((ch) => ch.checkExchange('amq.direct')));
      await Promise.all(chs.map((ch) => ch.close()));
    });
  });

  it('connection recovery: reconnects after a server-initiated connection close', async function () {
    const c = await amqp.connect(h.URL, { recovery: { initialDelay: 50, maxDelay: 200, jitter: 0, maxRetries: 20 } });
    c.on('error', h.ignore);
    try {
      const ch = await c.createChannel();
      ch.on('error', h.ignore);
      const reconnected = h.nextEvent(c, 'connect', 6000);
      // unknown exchange type is a connection-level (hard) error: 503
      ch.assertExchange(h.uniq('bad-type'), 'no-such-type').catch(h.ignore);
      await reconnected;
      const ch2 = await c.createChannel();
      await ch2.checkExchange('amq.fanout');
    } finally {
      await c.close();
    }
  });
});
