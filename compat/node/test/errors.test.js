'use strict';
// Channel- and connection-level errors an amqplib application meets, with
// RabbitMQ 3.x's reply codes, class/method ids and reply texts; and which
// scope (channel or whole connection) each one closes.
const assert = require('node:assert');
const h = require('./helpers');

// Run `op(ch)` on a fresh channel; expect the channel (only) to be closed
// with the given details; check the connection survives.
async function expectChannelError(op, code, classId, methodId, text) {
  await h.withConnection(async (c) => {
    let connErr = null;
    c.on('error', (e) => { connErr = e; });
    const ch = await c.createChannel();
    ch.on('error', h.ignore);
    const errEvent = h.nextEvent(ch, 'error');
    const closeEvent = h.nextEvent(ch, 'close');
    await op(ch, c).catch(h.ignore);
    const err = await errEvent;
    await closeEvent;
    h.assertClose(err, code, classId, methodId);
    if (text !== undefined) {
      const m = /with message "(.*)"$/s.exec(err.message);
      assert.ok(m, err.message);
      if (text instanceof RegExp) assert.match(m[1], text);
      else assert.strictEqual(m[1], text);
    }
    // the connection is still fine: another channel works
    const ch2 = await c.createChannel();
    await ch2.checkExchange('amq.direct');
    await ch2.close();
    assert.strictEqual(connErr, null, `connection should survive a channel error, got ${connErr}`);
  });
}

// Run `op(ch)`; expect the whole connection to be closed with a
// connection.close carrying these details (amqplib only exposes the code on
// the error, so class/method ids are read from the recorded close frame).
async function expectConnectionError(op, code, classId, methodId, text) {
  await h.recordingFrames(async (frames) => {
    const c = await h.connect();
    const connErr = h.nextEvent(c, 'error');
    const connClose = h.nextEvent(c, 'close');
    const ch = await c.createChannel();
    ch.on('error', h.ignore);
    await op(ch, c).catch(h.ignore);
    const err = await connErr;
    await connClose;
    h.assertClose(err, code);
    assert.match(err.message, /^Connection closed: /);
    const close = frames.find((f) => f.channel === 0 && f.fields && f.fields.replyCode === code);
    assert.ok(close, 'connection.close frame on channel 0');
    assert.strictEqual(close.fields.classId, classId, 'class id');
    assert.strictEqual(close.fields.methodId, methodId, 'method id');
    if (text instanceof RegExp) assert.match(close.fields.replyText, text);
    else if (text !== undefined) assert.strictEqual(close.fields.replyText, text);
  });
}

describe('errors: channel-level', function () {
  it('passive queue declare of a missing queue: 404 text', async function () {
    const q = h.uniq('missing');
    await expectChannelError((ch) => ch.checkQueue(q), 404, 50, 10, `NOT_FOUND - no queue '${q}' in vhost '/'`);
  });

  it('passive exchange declare of a missing exchange: 404 text', async function () {
    const x = h.uniq('missing');
    await expectChannelError((ch) => ch.checkExchange(x), 404, 40, 10, `NOT_FOUND - no exchange '${x}' in vhost '/'`);
  });

  it('publish to a missing exchange: 404 text, class 60 method 40', async function () {
    const x = h.uniq('missing');
    await expectChannelError(async (ch) => { ch.publish(x, 'rk', Buffer.from('x')); }, 404, 60, 40, `NOT_FOUND - no exchange '${x}' in vhost '/'`);
  });

  it('queue redeclare with different auto_delete: 406 inequivalent arg text', async function () {
    const q = h.uniq('ineq');
    await expectChannelError(async (ch) => {
      await ch.assertQueue(q, { durable: false, autoDelete: true });
      await ch.assertQueue(q, { durable: false, autoDelete: false });
    }, 406, 50, 10, `PRECONDITION_FAILED - inequivalent arg 'auto_delete' for queue '${q}' in vhost '/': received 'false' but current is 'true'`);
  });

  it('queue redeclare with different durable: 406 inequivalent arg text', async function () {
    const q = h.uniq('ineq');
    await expectChannelError(async (ch) => {
      await ch.assertQueue(q, { durable: false });
      await ch.assertQueue(q, { durable: true });
    }, 406, 50, 10, `PRECONDITION_FAILED - inequivalent arg 'durable' for queue '${q}' in vhost '/': received 'true' but current is 'false'`);
    await h.withChannel((ch) => ch.deleteQueue(q));
  });

  it('queue redeclare with different x-message-ttl: 406 inequivalent arg text', async function () {
    const q = h.uniq('ineq');
    await expectChannelError(async (ch) => {
      await ch.assertQueue(q, { durable: false, messageTtl: 1000 });
      await ch.assertQueue(q, { durable: false, messageTtl: 2000 });
    }, 406, 50, 10, `PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue '${q}' in vhost '/': received '2000' but current is '1000'`);
    await h.withChannel((ch) => ch.deleteQueue(q));
  });

  it('exchange redeclare with different type: 406 inequivalent arg text', async function () {
    const x = h.uniq('ineq');
    await expectChannelError(async (ch) => {
      await ch.assertExchange(x, 'fanout', { durable: false });
      await ch.assertExchange(x, 'direct', { durable: false });
    }, 406, 40, 10, `PRECONDITION_FAILED - inequivalent arg 'type' for exchange '${x}' in vhost '/': received 'direct' but current is 'fanout'`);
    await h.withChannel((ch) => ch.deleteExchange(x));
  });

  it("queue name with reserved 'amq.' prefix: 403", async function () {
    await expectChannelError((ch) => ch.assertQueue('amq.nodecompat-reserved'), 403, 50, 10,
      "ACCESS_REFUSED - queue name 'amq.nodecompat-reserved' contains reserved prefix 'amq.*'");
  });

  it("exchange name with reserved 'amq.' prefix: 403", async function () {
    await expectChannelError((ch) => ch.assertExchange('amq.nodecompat-reserved', 'direct'), 403, 40, 10,
      "ACCESS_REFUSED - exchange name 'amq.nodecompat-reserved' contains reserved prefix 'amq.*'");
  });

  it('bind a queue to the default exchange: 403', async function () {
    await expectChannelError(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(queue, '', 'rk');
    }, 403, 50, 20, /^ACCESS_REFUSED - operation not permitted on the default exchange$/);
  });

  it('bind a missing queue: 404', async function () {
    const q = h.uniq('missing');
    await expectChannelError((ch) => ch.bindQueue(q, 'amq.direct', 'rk'), 404, 50, 20, `NOT_FOUND - no queue '${q}' in vhost '/'`);
  });

  it('bind to a missing exchange: 404', async function () {
    const x = h.uniq('missing');
    await expectChannelError(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(queue, x, 'rk');
    }, 404, 50, 20, `NOT_FOUND - no exchange '${x}' in vhost '/'`);
  });

  it('exchange-to-exchange bind with a missing source: 404', async function () {
    const x = h.uniq('missing');
    await expectChannelError((ch) => ch.bindExchange('amq.fanout', x, ''), 404, 40, 30, `NOT_FOUND - no exchange '${x}' in vhost '/'`);
  });

  it('publish to an internal exchange: 403', async function () {
    const x = h.uniq('internal');
    await expectChannelError(async (ch) => {
      await ch.assertExchange(x, 'fanout', { durable: false, internal: true, autoDelete: false });
      ch.publish(x, '', Buffer.from('x'));
    }, 403, 60, 40, `ACCESS_REFUSED - cannot publish to internal exchange '${x}' in vhost '/'`);
    await h.withChannel((ch) => ch.deleteExchange(x));
  });

  it('ack of an unknown delivery tag: 406, class 60 method 80', async function () {
    await expectChannelError(async (ch) => {
      ch.ack({ fields: { deliveryTag: 7 } });
    }, 406, 60, 80, 'PRECONDITION_FAILED - unknown delivery tag 7');
  });

  it('double ack of the same message: 406 unknown delivery tag', async function () {
    await expectChannelError(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('x'));
      await h.waitForMessagesOn(ch, queue, 1);
      const m = await ch.get(queue);
      ch.ack(m);
      ch.ack(m);
    }, 406, 60, 80, 'PRECONDITION_FAILED - unknown delivery tag 1');
  });

  it('nack of an unknown delivery tag: 406, class 60 method 120', async function () {
    await expectChannelError(async (ch) => {
      ch.nack({ fields: { deliveryTag: 3 } });
    }, 406, 60, 120, 'PRECONDITION_FAILED - unknown delivery tag 3');
  });

  it('reject of an unknown delivery tag: 406, class 60 method 90', async function () {
    await expectChannelError(async (ch) => {
      ch.reject({ fields: { deliveryTag: 5 } });
    }, 406, 60, 90, 'PRECONDITION_FAILED - unknown delivery tag 5');
  });

  it('user_id that is not the authenticated user: 406', async function () {
    await expectChannelError(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('x'), { userId: 'bob' });
    }, 406, 60, 40, "PRECONDITION_FAILED - user_id property set to 'bob' but authenticated user was 'guest'");
  });

  it('declaring a queue exclusive to another connection: 405 RESOURCE_LOCKED', async function () {
    await h.withChannel(async (owner) => {
      const { queue } = await owner.assertQueue('', { exclusive: true });
      await expectChannelError((ch) => ch.checkQueue(queue), 405, 50, 10,
        `RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '${queue}' in vhost '/'. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.`);
    });
  });

  it('consuming from a queue exclusive to another connection: 405 RESOURCE_LOCKED', async function () {
    await h.withChannel(async (owner) => {
      const { queue } = await owner.assertQueue('', { exclusive: true });
      await expectChannelError((ch) => ch.consume(queue, h.ignore), 405, 60, 20, /^RESOURCE_LOCKED - cannot obtain exclusive access to locked queue/);
    });
  });

  it('second consumer on a queue with an exclusive consumer: 403', async function () {
    const q = h.uniq('exclusive-consumer');
    await h.withChannel(async (owner) => {
      await owner.assertQueue(q, { durable: false, autoDelete: false });
      await owner.consume(q, h.ignore, { exclusive: true });
      await expectChannelError((ch) => ch.consume(q, h.ignore), 403, 60, 20, `ACCESS_REFUSED - queue '${q}' in vhost '/' in exclusive use`);
      await owner.deleteQueue(q);
    });
  });

  it('exclusive consume on a queue that has a consumer: 403', async function () {
    const q = h.uniq('exclusive-consumer2');
    await h.withChannel(async (owner) => {
      await owner.assertQueue(q, { durable: false, autoDelete: false });
      await owner.consume(q, h.ignore);
      await expectChannelError((ch) => ch.consume(q, h.ignore, { exclusive: true }), 403, 60, 20, `ACCESS_REFUSED - queue '${q}' in vhost '/' in exclusive use`);
      await owner.deleteQueue(q);
    });
  });

  it('delete queue ifEmpty on a non-empty queue: 406', async function () {
    const q = h.uniq('ifempty');
    await expectChannelError(async (ch) => {
      await ch.assertQueue(q, { durable: false });
      ch.sendToQueue(q, Buffer.from('x'));
      await h.waitForMessagesOn(ch, q, 1);
      await ch.deleteQueue(q, { ifEmpty: true });
    }, 406, 50, 40, `PRECONDITION_FAILED - queue '${q}' in vhost '/' not empty`);
    await h.withChannel((ch) => ch.deleteQueue(q));
  });

  it('delete queue ifUnused on a queue with a consumer: 406', async function () {
    const q = h.uniq('ifunused');
    await h.withChannel(async (owner) => {
      await owner.assertQueue(q, { durable: false });
      await owner.consume(q, h.ignore);
      await expectChannelError((ch) => ch.deleteQueue(q, { ifUnused: true }), 406, 50, 40, `PRECONDITION_FAILED - queue '${q}' in vhost '/' in use`);
      await owner.deleteQueue(q);
    });
  });

  it('delete exchange ifUnused on an exchange with bindings: 406', async function () {
    const x = h.uniq('ifunused-x');
    await expectChannelError(async (ch) => {
      await ch.assertExchange(x, 'fanout', { durable: false });
      await ch.bindExchange('amq.fanout', x, '');
      await ch.deleteExchange(x, { ifUnused: true });
    }, 406, 40, 20, `PRECONDITION_FAILED - exchange '${x}' in vhost '/' in use`);
    await h.withChannel((ch) => ch.deleteExchange(x));
  });

  it('delete of a built-in amq.* exchange: 403', async function () {
    await expectChannelError((ch) => ch.deleteExchange('amq.direct'), 403, 40, 20,
      "ACCESS_REFUSED - deletion of system exchange 'amq.direct' in vhost '/' not allowed");
  });

  it('the channel is unusable after a channel error; a new channel works', async function () {
    await h.withConnection(async (c) => {
      const ch = await c.createChannel();
      ch.on('error', h.ignore);
      await h.rejected(ch.checkQueue(h.uniq('missing')));
      await assert.rejects(() => ch.checkExchange('amq.direct'));
      const ch2 = await c.createChannel();
      await ch2.checkExchange('amq.direct');
    });
  });
});

describe('errors: connection-level (hard) errors', function () {
  it('unknown exchange type closes the connection: 503 COMMAND_INVALID', async function () {
    await expectConnectionError((ch) => ch.assertExchange(h.uniq('badtype'), 'no-such-type'), 503, 40, 10,
      "COMMAND_INVALID - unknown exchange type 'no-such-type'");
  });

  it('reusing a consumer tag on a channel closes the connection: 530 NOT_ALLOWED', async function () {
    await expectConnectionError(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.consume(queue, h.ignore, { consumerTag: 'dup-tag' });
      await ch.consume(queue, h.ignore, { consumerTag: 'dup-tag' });
    }, 530, 60, 20, "NOT_ALLOWED - attempt to reuse consumer tag 'dup-tag'");
  });
});

describe('idempotent deletes and unbinds', function () {
  it('deleting a missing queue succeeds with messageCount 0', async function () {
    await h.withChannel(async (ch) => {
      assert.deepStrictEqual(await ch.deleteQueue(h.uniq('never')), { messageCount: 0 });
    });
  });

  it('deleting a missing exchange succeeds', async function () {
    await h.withChannel(async (ch) => {
      await ch.deleteExchange(h.uniq('never'));
    });
  });

  it('unbinding a binding that does not exist succeeds', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.unbindQueue(queue, 'amq.direct', 'never-bound');
    });
  });
});
