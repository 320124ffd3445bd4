'use strict';
// The live-broker behaviours of amqplib's test/channel_api.test.js, with
// the exact reply codes / class ids / method ids RabbitMQ 3.x sends.
const assert = require('node:assert');
const h = require('./helpers');

const Q_OPTS = { durable: false };
const X_OPTS = { durable: false };

describe('channel API: assert, check, delete', function () {
  it('create channel and close it', async function () {
    await h.withConnection(async (c) => {
      const ch = await c.createChannel();
      const closed = h.nextEvent(ch, 'close');
      await ch.close();
      await closed;
    });
  });

  it('assert and check queue', async function () {
    const q = h.uniq('check-queue');
    await h.withChannel(async (ch) => {
      const ok = await ch.assertQueue(q, Q_OPTS);
      assert.deepStrictEqual(ok, { queue: q, messageCount: 0, consumerCount: 0 });
      const ok2 = await ch.checkQueue(q);
      assert.deepStrictEqual(ok2, { queue: q, messageCount: 0, consumerCount: 0 });
      await ch.deleteQueue(q);
    });
  });

  it('assert and check exchange', async function () {
    const x = h.uniq('check-exchange');
    await h.withChannel(async (ch) => {
      const ok = await ch.assertExchange(x, 'direct', X_OPTS);
      assert.strictEqual(ok.exchange, x);
      assert.ok(await ch.checkExchange(x));
      await ch.deleteExchange(x);
    });
  });

  it('fail on reasserting queue with different options: 406, class 50 method 10', async function () {
    const q = h.uniq('reassert-queue');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, { durable: false, autoDelete: true });
      const errEvent = h.nextEvent(ch, 'error');
      const err = await h.rejected(ch.assertQueue(q, { durable: false, autoDelete: false }));
      h.assertClose(err, 406, 50, 10, /^Operation failed: QueueDeclare; 406 \(PRECONDITION-FAILED\) with message "PRECONDITION_FAILED - /);
      const ev = await errEvent;
      h.assertClose(ev, 406, 50, 10, /^Channel closed by server: 406 \(PRECONDITION-FAILED\)/);
    });
    await h.withChannel((ch) => ch.deleteQueue(q));
  });

  it("fail on checking a queue that's not there: 404, class 50 method 10", async function () {
    await h.withChannel(async (ch) => {
      const err = await h.rejected(ch.checkQueue(h.uniq('nothere')));
      h.assertClose(err, 404, 50, 10, /NOT_FOUND/);
    });
  });

  it("fail on checking an exchange that's not there: 404, class 40 method 10", async function () {
    await h.withChannel(async (ch) => {
      const err = await h.rejected(ch.checkExchange(h.uniq('nothere')));
      h.assertClose(err, 404, 40, 10, /NOT_FOUND/);
    });
  });

  it('fail on reasserting exchange with different type: 406, class 40 method 10', async function () {
    const x = h.uniq('reassert-ex');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'fanout', X_OPTS);
      const err = await h.rejected(ch.assertExchange(x, 'direct', X_OPTS));
      h.assertClose(err, 406, 40, 10, /PRECONDITION_FAILED/);
    });
    await h.withChannel((ch) => ch.deleteExchange(x));
  });

  it('channel break on publishing to non-exchange: 404, class 60 method 40', async function () {
    await h.withChannel(async (ch) => {
      const errEvent = h.nextEvent(ch, 'error');
      const closeEvent = h.nextEvent(ch, 'close');
      ch.publish(h.uniq('no-such-ex'), '', Buffer.from('foobar'));
      const err = await errEvent;
      h.assertClose(err, 404, 60, 40, /^Channel closed by server: 404 \(NOT-FOUND\) with message "NOT_FOUND - no exchange/);
      await closeEvent;
    });
  });

  it('delete queue, then checkQueue fails with 404', async function () {
    const q = h.uniq('delete-queue');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      const ok = await ch.deleteQueue(q);
      assert.deepStrictEqual(ok, { messageCount: 0 });
      const err = await h.rejected(ch.checkQueue(q));
      h.assertClose(err, 404, 50, 10, /NOT_FOUND/);
    });
  });

  it('delete exchange, then checkExchange fails with 404', async function () {
    const x = h.uniq('delete-exchange');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'fanout', X_OPTS);
      await ch.deleteExchange(x);
      const err = await h.rejected(ch.checkExchange(x));
      h.assertClose(err, 404, 40, 10, /NOT_FOUND/);
    });
  });
});

describe('channel API: sendMessage and get', function () {
  it('send to queue and get from queue', async function () {
    const q = h.uniq('send-to-q');
    const msg = h.uniq('msg');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      await ch.purgeQueue(q);
      ch.sendToQueue(q, Buffer.from(msg));
      await h.waitForMessages(q);
      const m = await ch.get(q, { noAck: true });
      assert.ok(m);
      assert.strictEqual(m.content.toString(), msg);
      assert.strictEqual(m.fields.exchange, '');
      assert.strictEqual(m.fields.routingKey, q);
      assert.strictEqual(m.fields.redelivered, false);
      assert.strictEqual(m.fields.messageCount, 0);
      await ch.deleteQueue(q);
    });
  });

  it('send (and get) zero content to queue', async function () {
    const q = h.uniq('send-zero');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      ch.sendToQueue(q, Buffer.alloc(0));
      await h.waitForMessages(q);
      const m = await ch.get(q, { noAck: true });
      assert.ok(m);
      assert.deepStrictEqual(m.content, Buffer.alloc(0));
      await ch.deleteQueue(q);
    });
  });

  it('get returns false when queue is empty', async function () {
    const q = h.uniq('get-empty');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      assert.strictEqual(await ch.get(q, { noAck: true }), false);
      await ch.deleteQueue(q);
    });
  });

  it('get-ok messageCount counts the messages left behind', async function () {
    const q = h.uniq('get-count');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      for (let i = 0; i < 3; i++) ch.sendToQueue(q, Buffer.from(String(i)));
      await h.waitForMessages(q, 3);
      const counts = [];
      for (let i = 0; i < 3; i++) {
        const m = await ch.get(q, { noAck: true });
        assert.strictEqual(m.content.toString(), String(i));
        counts.push(m.fields.messageCount);
      }
      assert.deepStrictEqual(counts, [2, 1, 0]);
      await ch.deleteQueue(q);
    });
  });

  it('get with no queue name and no previously declared queue: 404, class 60 method 70', async function () {
    await h.withChannel(async (ch) => {
      const err = await h.rejected(ch.get('', {}));
      h.assertClose(err, 404, 60, 70, /^Operation failed: BasicGet; 404 \(NOT-FOUND\)/);
    });
  });

  it("get with empty queue name uses the channel's last declared queue", async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('last'));
      await h.waitForMessagesOn(ch, queue, 1);
      const m = await ch.get('', { noAck: true });
      assert.ok(m);
      assert.strictEqual(m.content.toString(), 'last');
    });
  });
});

describe('channel API: binding, consuming', function () {
  it('route message through a fanout exchange', async function () {
    const x = h.uniq('route-message');
    const q = h.uniq('route-message-q');
    const msg = h.uniq('m');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'fanout', X_OPTS);
      await ch.assertQueue(q, Q_OPTS);
      await ch.bindQueue(q, x, '', {});
      ch.publish(x, '', Buffer.from(msg));
      await h.waitForMessages(q);
      const m = await ch.get(q, { noAck: true });
      assert.strictEqual(m.content.toString(), msg);
      assert.strictEqual(m.fields.exchange, x);
      await ch.deleteQueue(q);
      await ch.deleteExchange(x);
    });
  });

  it('purge queue returns the purged count and leaves the queue empty', async function () {
    const q = h.uniq('purge-queue');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      ch.sendToQueue(q, Buffer.from('foobar'));
      ch.sendToQueue(q, Buffer.from('foobar'));
      await h.waitForMessages(q, 2);
      const ok = await ch.purgeQueue(q);
      assert.deepStrictEqual(ok, { messageCount: 2 });
      assert.strictEqual(await ch.get(q, { noAck: true }), false);
      await ch.deleteQueue(q);
    });
  });

  it('unbind queue: messages via the old binding are no longer routed', async function () {
    const x = h.uniq('unbind-queue-ex');
    const q = h.uniq('unbind-queue');
    const viabinding = h.uniq('via');
    const direct = h.uniq('direct');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'fanout', X_OPTS);
      await ch.assertQueue(q, Q_OPTS);
      await ch.bindQueue(q, x, '', {});
      ch.publish(x, '', Buffer.from('foobar'));
      await h.waitForMessages(q);
      assert.ok(await ch.get(q, { noAck: true }));
      await ch.unbindQueue(q, x, '', {});
      ch.publish(x, '', Buffer.from(viabinding));
      ch.sendToQueue(q, Buffer.from(direct));
      await h.waitForMessages(q);
      const m = await ch.get(q);
      assert.strictEqual(m.content.toString(), direct);
      await ch.deleteQueue(q);
      await ch.deleteExchange(x);
    });
  });

  it('consume via exchange-exchange binding into an internal exchange', async function () {
    const x1 = h.uniq('exex1');
    const x2 = h.uniq('exex2');
    const q = h.uniq('exex-q');
    const msg = h.uniq('m');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x1, 'direct', X_OPTS);
      await ch.assertExchange(x2, 'fanout', { durable: false, internal: true });
      await ch.assertQueue(q, Q_OPTS);
      await ch.bindExchange(x2, x1, 'test.routing.key', {});
      await ch.bindQueue(q, x2, '', {});
      const got = new Promise((resolve) => ch.consume(q, resolve, { noAck: true }));
      ch.publish(x1, 'test.routing.key', Buffer.from(msg));
      const m = await got;
      assert.strictEqual(m.content.toString(), msg);
      assert.strictEqual(m.fields.exchange, x1, 'delivery names the exchange published to');
      assert.strictEqual(m.fields.routingKey, 'test.routing.key');
      await ch.deleteQueue(q);
      await ch.deleteExchange(x2);
      await ch.deleteExchange(x1);
    });
  });

  it('unbind exchange', async function () {
    const src = h.uniq('unbind-ex-src');
    const dst = h.uniq('unbind-ex-dst');
    const q = h.uniq('unbind-ex-q');
    const viabinding = h.uniq('via');
    const direct = h.uniq('direct');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(src, 'fanout', X_OPTS);
      await ch.assertExchange(dst, 'fanout', X_OPTS);
      await ch.assertQueue(q, Q_OPTS);
      await ch.bindExchange(dst, src, '', {});
      await ch.bindQueue(q, dst, '', {});
      ch.publish(src, '', Buffer.from('foobar'));
      await h.waitForMessages(q);
      assert.ok(await ch.get(q, { noAck: true }));
      await ch.unbindExchange(dst, src, '', {});
      ch.publish(src, '', Buffer.from(viabinding));
      ch.sendToQueue(q, Buffer.from(direct));
      await h.waitForMessages(q);
      const m = await ch.get(q);
      assert.strictEqual(m.content.toString(), direct);
      await ch.deleteQueue(q);
      await ch.deleteExchange(src);
      await ch.deleteExchange(dst);
    });
  });

  it('cancel consumer: later messages stay in the queue', async function () {
    const q = h.uniq('consumer-cancel');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      let ctag;
      await new Promise((resolve, reject) => {
        ch.consume(q, resolve, { noAck: true }).then((ok) => {
          ctag = ok.consumerTag;
          ch.sendToQueue(q, Buffer.from('foo'));
        }, reject);
      });
      const cok = await ch.cancel(ctag);
      assert.deepStrictEqual(cok, { consumerTag: ctag });
      ch.sendToQueue(q, Buffer.from('bar'));
      await h.waitForMessages(q);
      const m = await ch.get(q, { noAck: true });
      assert.strictEqual(m.content.toString(), 'bar');
      await ch.deleteQueue(q);
    });
  });

  it('cancelled consumer: deleting the queue sends basic.cancel (consumer gets null)', async function () {
    const q = h.uniq('cancelled-consumer');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q);
      const cancelEvent = h.nextEvent(ch, 'cancel');
      let ctag;
      const gotNull = new Promise((resolve, reject) => {
        ch.consume(q, (msg) => {
          if (msg === null) resolve();
          else reject(new Error('Message not expected'));
        }).then((ok) => { ctag = ok.consumerTag; return ch.deleteQueue(q); }).catch(reject);
      });
      await gotNull;
      const f = await cancelEvent;
      assert.strictEqual(f.consumerTag, ctag);
    });
  });

  it('ack removes a single message from the queue', async function () {
    const q = h.uniq('ack');
    const m1 = h.uniq('m1');
    const m2 = h.uniq('m2');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      ch.sendToQueue(q, Buffer.from(m1));
      ch.sendToQueue(q, Buffer.from(m2));
      await h.waitForMessages(q, 2);
      const a = await ch.get(q, { noAck: false });
      assert.strictEqual(a.content.toString(), m1);
      ch.ack(a);
      const b = await ch.get(q);
      assert.strictEqual(b.content.toString(), m2);
      ch.ack(b);
      await ch.deleteQueue(q);
    });
  });

  it('nack requeues by default (redelivered)', async function () {
    const q = h.uniq('nack');
    const msg = h.uniq('m');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      ch.sendToQueue(q, Buffer.from(msg));
      await h.waitForMessages(q);
      const a = await ch.get(q, { noAck: false });
      ch.nack(a);
      await h.waitForMessages(q);
      const b = await ch.get(q, { noAck: true });
      assert.strictEqual(b.content.toString(), msg);
      assert.strictEqual(b.fields.redelivered, true);
      await ch.deleteQueue(q);
    });
  });

  it('reject requeues by default (redelivered)', async function () {
    const q = h.uniq('reject');
    const msg = h.uniq('m');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      ch.sendToQueue(q, Buffer.from(msg));
      await h.waitForMessages(q);
      const a = await ch.get(q, { noAck: false });
      ch.reject(a);
      await h.waitForMessages(q);
      const b = await ch.get(q, { noAck: true });
      assert.strictEqual(b.content.toString(), msg);
      assert.strictEqual(b.fields.redelivered, true);
      await ch.deleteQueue(q);
    });
  });

  it('prefetch(1) with ack delivers both messages in turn', async function () {
    const q = h.uniq('prefetch');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      await ch.prefetch(1);
      ch.sendToQueue(q, Buffer.from('foobar'));
      ch.sendToQueue(q, Buffer.from('foobar'));
      await h.waitForMessages(q, 2);
      const n = await new Promise((resolve) => {
        let count = 0;
        ch.consume(q, (m) => {
          ch.ack(m);
          if (++count > 1) resolve(count);
        }, { noAck: false });
      });
      assert.strictEqual(n, 2);
      await ch.deleteQueue(q);
    });
  });
});

describe('channel API: confirms', function () {
  it('message is confirmed', async function () {
    const q = h.uniq('confirm-message');
    await h.withConfirmChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      await new Promise((resolve, reject) => ch.sendToQueue(q, Buffer.from('bleep'), {}, (err) => (err ? reject(err) : resolve())));
      await ch.deleteQueue(q);
    });
  });

  it('multiple confirms: the broker acks with multiple=true for a burst of publishes', async function () {
    const q = h.uniq('multiple-confirms');
    await h.withConfirmChannel(async (ch) => {
      await ch.assertQueue(q, Q_OPTS);
      let multiple = false;
      ch.on('ack', (a) => { if (a.multiple) multiple = true; });
      async function prod(num) {
        const cs = [];
        for (let i = 0; i < num; i++) {
          cs.push(new Promise((resolve, reject) => ch.sendToQueue(q, Buffer.from('bleep'), {}, (e) => (e ? reject(e) : resolve()))));
        }
        await Promise.all(cs);
        if (multiple) return true;
        if (num > 500) throw new Error(`Couldn't provoke the server into multi-acking with ${num} messages; giving up`);
        return prod(num * 2);
      }
      await prod(5);
      await ch.deleteQueue(q);
    });
  });

  it('wait for confirms of 1000 unroutable publishes', async function () {
    await h.withConfirmChannel(async (ch) => {
      for (let i = 0; i < 1000; i++) ch.publish('', '', Buffer.from('foobar'), {});
      await ch.waitForConfirms();
    });
  });

  it('waitForConfirms fails after the channel is closed with unconfirmed messages', async function () {
    await h.withConfirmChannel(async (ch) => {
      for (let i = 0; i < 1000; i++) ch.publish('', '', Buffer.from('foobar'), {});
      await ch.close();
      const err = await h.rejected(ch.waitForConfirms());
      assert.strictEqual(err.message, 'channel closed');
    });
  });
});
