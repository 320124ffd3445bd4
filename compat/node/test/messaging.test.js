'use strict';
// Message-level behaviour reachable through amqplib's API: properties,
// mandatory returns, ack/nack variants, recover, prefetch, requeue on close,
// routing by exchange type, queue lifetimes.
const assert = require('node:assert');
const h = require('./helpers');

function consumeN(ch, queue, n, opts = { noAck: true }) {
  return new Promise((resolve, reject) => {
    const got = [];
    ch.consume(queue, (m) => {
      got.push(m);
      if (got.length === n) resolve(got);
    }, opts).catch(reject);
  });
}

describe('messages: properties and content', function () {
  it('all basic properties round-trip', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const ts = 1700000000;
      ch.sendToQueue(queue, Buffer.from('props'), {
        contentType: 'text/plain', contentEncoding: 'gzip', persistent: true, priority: 3,
        correlationId: 'corr-1', replyTo: 'reply-q', expiration: '60000', messageId: 'mid-1',
        timestamp: ts, type: 'kind', userId: 'guest', appId: 'nodecompat',
        headers: {
          str: 'hello', int: 42, neg: -7, float: 1.5, bool: true, falsy: false,
          nested: { a: 1, b: 'two' }, list: [1, 'two', true],
          big: 2 ** 40, buf: Buffer.from([1, 2, 3]), nul: null,
        },
      });
      const [m] = await consumeN(ch, queue, 1);
      const p = m.properties;
      assert.strictEqual(p.contentType, 'text/plain');
      assert.strictEqual(p.contentEncoding, 'gzip');
      assert.strictEqual(p.deliveryMode, 2);
      assert.strictEqual(p.priority, 3);
      assert.strictEqual(p.correlationId, 'corr-1');
      assert.strictEqual(p.replyTo, 'reply-q');
      assert.strictEqual(p.expiration, '60000');
      assert.strictEqual(p.messageId, 'mid-1');
      assert.strictEqual(p.timestamp, ts);
      assert.strictEqual(p.type, 'kind');
      assert.strictEqual(p.userId, 'guest');
      assert.strictEqual(p.appId, 'nodecompat');
      const hd = p.headers;
      assert.strictEqual(hd.str, 'hello');
      assert.strictEqual(hd.int, 42);
      assert.strictEqual(hd.neg, -7);
      assert.strictEqual(hd.float, 1.5);
      assert.strictEqual(hd.bool, true);
      assert.strictEqual(hd.falsy, false);
      assert.deepStrictEqual(hd.nested, { a: 1, b: 'two' });
      assert.deepStrictEqual(hd.list, [1, 'two', true]);
      assert.strictEqual(hd.big, 2 ** 40);
      assert.deepStrictEqual(hd.buf, Buffer.from([1, 2, 3]));
      assert.strictEqual(hd.nul, null);
    });
  });

  it('no properties: all undefined (amqplib always sends an empty headers table)', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('bare'));
      const [m] = await consumeN(ch, queue, 1);
      for (const k of ['contentType', 'deliveryMode', 'priority', 'correlationId', 'replyTo', 'expiration', 'messageId', 'timestamp', 'type', 'userId', 'appId']) {
        assert.strictEqual(m.properties[k], undefined, k);
      }
      assert.deepStrictEqual(m.properties.headers, {});
    });
  });

  it('deliver fields: consumerTag, deliveryTag increments, exchange, routingKey, redelivered', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const p = consumeN(ch, queue, 3, { noAck: false });
      const { consumerTag } = await ch.consume(queue, h.ignore, { noAck: true }).then(async (ok) => { await ch.cancel(ok.consumerTag); return ok; });
      assert.match(consumerTag, /^amq\.ctag-/);
      for (let i = 0; i < 3; i++) ch.publish('', queue, Buffer.from(String(i)));
      const ms = await p;
      assert.deepStrictEqual(ms.map((m) => m.fields.deliveryTag), [1, 2, 3]);
      for (const m of ms) {
        assert.match(m.fields.consumerTag, /^amq\.ctag-/);
        assert.strictEqual(m.fields.exchange, '');
        assert.strictEqual(m.fields.routingKey, queue);
        assert.strictEqual(m.fields.redelivered, false);
      }
      ch.ackAll();
    });
  });

  it('consume with an explicit consumerTag', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const ok = await ch.consume(queue, h.ignore, { consumerTag: 'my-tag-1' });
      assert.deepStrictEqual(ok, { consumerTag: 'my-tag-1' });
      assert.strictEqual((await ch.checkQueue(queue)).consumerCount, 1);
      await ch.cancel('my-tag-1');
      assert.strictEqual((await ch.checkQueue(queue)).consumerCount, 0);
    });
  });

  it('CC and BCC headers route copies; BCC is stripped, CC kept', async function () {
    await h.withChannel(async (ch) => {
      const qs = [];
      for (let i = 0; i < 3; i++) qs.push((await ch.assertQueue('', { exclusive: true })).queue);
      ch.publish('', qs[0], Buffer.from('cc'), { CC: [qs[1]], BCC: [qs[2]] });
      await h.waitForMessagesOn(ch, qs[2], 1);
      for (const q of qs) {
        const m = await ch.get(q, { noAck: true });
        assert.ok(m, `copy in ${q}`);
        assert.strictEqual(m.properties.headers.BCC, undefined);
        assert.deepStrictEqual(m.properties.headers.CC, [qs[1]]);
        assert.strictEqual(m.fields.routingKey, qs[0]);
      }
    });
  });
});

describe('messages: mandatory returns', function () {
  it('mandatory unroutable publish comes back as basic.return 312 NO_ROUTE', async function () {
    await h.withChannel(async (ch) => {
      const rk = h.uniq('nowhere');
      const ret = h.nextEvent(ch, 'return');
      ch.publish('amq.direct', rk, Buffer.from('bounce'), { mandatory: true, messageId: 'r1', headers: { h: 1 } });
      const m = await ret;
      assert.strictEqual(m.fields.replyCode, 312);
      assert.strictEqual(m.fields.replyText, 'NO_ROUTE');
      assert.strictEqual(m.fields.exchange, 'amq.direct');
      assert.strictEqual(m.fields.routingKey, rk);
      assert.strictEqual(m.content.toString(), 'bounce');
      assert.strictEqual(m.properties.messageId, 'r1');
      assert.deepStrictEqual(m.properties.headers, { h: 1 });
    });
  });

  it('non-mandatory unroutable publish is silently dropped', async function () {
    await h.withChannel(async (ch) => {
      let returned = false;
      ch.on('return', () => { returned = true; });
      ch.publish('amq.direct', h.uniq('nowhere'), Buffer.from('drop'));
      await ch.checkExchange('amq.direct');
      await h.delay(100);
      assert.strictEqual(returned, false);
    });
  });

  it('confirm channel: mandatory unroutable gets basic.return then basic.ack', async function () {
    await h.withConfirmChannel(async (ch) => {
      const order = [];
      ch.on('return', () => order.push('return'));
      await new Promise((resolve, reject) => ch.publish('amq.direct', h.uniq('nowhere'), Buffer.from('x'), { mandatory: true },
        (err) => { if (err) reject(err); else { order.push('ack'); resolve(); } }));
      assert.deepStrictEqual(order, ['return', 'ack']);
    });
  });

  it('confirm channel: publish to a full reject-publish queue is nacked', async function () {
    await h.withConfirmChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true, maxLength: 1, arguments: { 'x-overflow': 'reject-publish' } });
      const res = [];
      for (let i = 0; i < 2; i++) {
        res.push(await new Promise((resolve) => ch.sendToQueue(queue, Buffer.from(String(i)), {}, (err) => resolve(err ? 'nack' : 'ack'))));
      }
      assert.deepStrictEqual(res, ['ack', 'nack']);
    });
  });
});

describe('messages: acknowledgements', function () {
  it('ackAll acks every outstanding delivery', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      for (let i = 0; i < 3; i++) ch.sendToQueue(queue, Buffer.from(String(i)));
      await consumeN(ch, queue, 3, { noAck: false });
      ch.ackAll();
      // after ackAll nothing is left unacked: recover redelivers nothing
      await ch.recover();
      await h.delay(100);
      const ok = await ch.checkQueue(queue);
      assert.strictEqual(ok.messageCount, 0);
    });
  });

  it('nackAll(requeue=false) drops every outstanding delivery', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      for (let i = 0; i < 3; i++) ch.sendToQueue(queue, Buffer.from(String(i)));
      await h.waitForMessagesOn(ch, queue, 3);
      const ms = [];
      for (let i = 0; i < 3; i++) ms.push(await ch.get(queue));
      ch.nackAll(false);
      const ok = await ch.checkQueue(queue);
      assert.strictEqual(ok.messageCount, 0);
    });
  });

  it('nackAll() requeues every outstanding delivery in order', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      for (let i = 0; i < 3; i++) ch.sendToQueue(queue, Buffer.from(String(i)));
      await h.waitForMessagesOn(ch, queue, 3);
      for (let i = 0; i < 3; i++) await ch.get(queue);
      ch.nackAll();
      await h.waitForMessagesOn(ch, queue, 3);
      const got = [];
      for (let i = 0; i < 3; i++) {
        const m = await ch.get(queue, { noAck: true });
        assert.strictEqual(m.fields.redelivered, true);
        got.push(m.content.toString());
      }
      assert.deepStrictEqual(got, ['0', '1', '2']);
    });
  });

  it('ack with allUpTo=true acks deliveries up to the tag (multiple)', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      for (let i = 0; i < 4; i++) ch.sendToQueue(queue, Buffer.from(String(i)));
      await h.waitForMessagesOn(ch, queue, 4);
      const ms = [];
      for (let i = 0; i < 4; i++) ms.push(await ch.get(queue));
      ch.ack(ms[2], true);
      ch.nack(ms[3], false, true);
      await h.waitForMessagesOn(ch, queue, 1);
      const left = await ch.get(queue, { noAck: true });
      assert.strictEqual(left.content.toString(), '3');
      assert.strictEqual(await ch.get(queue, { noAck: true }), false);
    });
  });

  it('reject(requeue=false) drops the message', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('x'));
      await h.waitForMessagesOn(ch, queue, 1);
      ch.reject(await ch.get(queue), false);
      assert.strictEqual((await ch.checkQueue(queue)).messageCount, 0);
    });
  });

  it('recover redelivers unacked messages with redelivered=true', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const seen = [];
      let resolve2;
      const second = new Promise((r) => { resolve2 = r; });
      await ch.consume(queue, (m) => {
        seen.push([m.content.toString(), m.fields.redelivered]);
        if (seen.length === 2) resolve2();
      }, { noAck: false });
      ch.sendToQueue(queue, Buffer.from('once'));
      while (seen.length < 1) await h.delay(5);
      await ch.recover();
      await second;
      assert.deepStrictEqual(seen, [['once', false], ['once', true]]);
    });
  });

  it('closing a channel requeues its unacked messages (redelivered on next get)', async function () {
    await h.withConnection(async (c) => {
      const ch = await c.createChannel();
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('a'));
      await h.waitForMessagesOn(ch, queue, 1);
      const m = await ch.get(queue);
      assert.strictEqual(m.fields.redelivered, false);
      await ch.close();
      const ch2 = await c.createChannel();
      await h.waitForMessagesOn(ch2, queue, 1);
      const again = await ch2.get(queue, { noAck: true });
      assert.strictEqual(again.content.toString(), 'a');
      assert.strictEqual(again.fields.redelivered, true);
    });
  });

  it('prefetch(1): a second message is not delivered until the first is acked', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.prefetch(1);
      for (let i = 0; i < 3; i++) ch.sendToQueue(queue, Buffer.from(String(i)));
      await h.waitForMessagesOn(ch, queue, 3);
      const got = [];
      await ch.consume(queue, (m) => got.push(m), { noAck: false });
      await h.delay(200);
      assert.strictEqual(got.length, 1);
      ch.ack(got[0]);
      await h.delay(200);
      assert.strictEqual(got.length, 2);
      ch.ack(got[1]);
    });
  });

  it('prefetch(2, global=true) limits the whole channel across consumers', async function () {
    await h.withChannel(async (ch) => {
      const { queue: q1 } = await ch.assertQueue('', { exclusive: true });
      const { queue: q2 } = await ch.assertQueue('', { exclusive: true });
      await ch.prefetch(2, true);
      for (let i = 0; i < 3; i++) { ch.sendToQueue(q1, Buffer.from('a')); ch.sendToQueue(q2, Buffer.from('b')); }
      await h.waitForMessagesOn(ch, q1, 3);
      await h.waitForMessagesOn(ch, q2, 3);
      const got = [];
      await ch.consume(q1, (m) => got.push(m), { noAck: false });
      await ch.consume(q2, (m) => got.push(m), { noAck: false });
      await h.delay(250);
      assert.strictEqual(got.length, 2);
    });
  });

  it('prefetch(2) per consumer: each consumer gets 2', async function () {
    await h.withChannel(async (ch) => {
      const { queue: q1 } = await ch.assertQueue('', { exclusive: true });
      const { queue: q2 } = await ch.assertQueue('', { exclusive: true });
      await ch.prefetch(2);
      for (let i = 0; i < 3; i++) { ch.sendToQueue(q1, Buffer.from('a')); ch.sendToQueue(q2, Buffer.from('b')); }
      await h.waitForMessagesOn(ch, q1, 3);
      await h.waitForMessagesOn(ch, q2, 3);
      const got = [];
      await ch.consume(q1, (m) => got.push(m), { noAck: false });
      await ch.consume(q2, (m) => got.push(m), { noAck: false });
      await h.delay(250);
      assert.strictEqual(got.length, 4);
    });
  });
});

describe('routing by exchange type', function () {
  it('direct: exact routing key match', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(queue, 'amq.direct', queue);
      ch.publish('amq.direct', queue, Buffer.from('yes'));
      ch.publish('amq.direct', queue + '.no', Buffer.from('no'));
      const [m] = await consumeN(ch, queue, 1);
      assert.strictEqual(m.content.toString(), 'yes');
      await h.delay(50);
      assert.strictEqual((await ch.checkQueue(queue)).messageCount, 0);
    });
  });

  it('topic: * matches one word, # matches zero or more', async function () {
    const x = h.uniq('topic');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'topic', { durable: false, autoDelete: true });
      const { queue: star } = await ch.assertQueue('', { exclusive: true });
      const { queue: hash } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(star, x, 'a.*.c');
      await ch.bindQueue(hash, x, 'a.#');
      for (const rk of ['a.b.c', 'a.c', 'a', 'a.b.b.c', 'b.a.c']) ch.publish(x, rk, Buffer.from(rk));
      await ch.checkQueue(star);
      await h.delay(100);
      const drain = async (q) => { const out = []; for (;;) { const m = await ch.get(q, { noAck: true }); if (!m) return out; out.push(m.content.toString()); } };
      assert.deepStrictEqual(await drain(star), ['a.b.c']);
      assert.deepStrictEqual(await drain(hash), ['a.b.c', 'a.c', 'a', 'a.b.b.c']);
    });
  });

  it('headers: x-match all / any', async function () {
    const x = h.uniq('headers');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'headers', { durable: false, autoDelete: true });
      const { queue: all } = await ch.assertQueue('', { exclusive: true });
      const { queue: any } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(all, x, '', { 'x-match': 'all', a: 1, b: 'two' });
      await ch.bindQueue(any, x, '', { 'x-match': 'any', a: 1, b: 'two' });
      ch.publish(x, '', Buffer.from('both'), { headers: { a: 1, b: 'two' } });
      ch.publish(x, '', Buffer.from('one'), { headers: { a: 1 } });
      ch.publish(x, '', Buffer.from('none'), { headers: { c: 3 } });
      await h.delay(150);
      const drain = async (q) => { const out = []; for (;;) { const m = await ch.get(q, { noAck: true }); if (!m) return out; out.push(m.content.toString()); } };
      assert.deepStrictEqual(await drain(all), ['both']);
      assert.deepStrictEqual(await drain(any), ['both', 'one']);
    });
  });

  it('alternate exchange receives unroutable messages', async function () {
    const x = h.uniq('with-ae');
    const ae = h.uniq('ae');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(ae, 'fanout', { durable: false, autoDelete: true });
      await ch.assertExchange(x, 'direct', { durable: false, autoDelete: true, alternateExchange: ae });
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(queue, ae, '');
      let returned = false;
      ch.on('return', () => { returned = true; });
      ch.publish(x, 'unbound', Buffer.from('to-ae'), { mandatory: true });
      const [m] = await consumeN(ch, queue, 1);
      assert.strictEqual(m.content.toString(), 'to-ae');
      assert.strictEqual(m.fields.exchange, x);
      assert.strictEqual(returned, false);
      await ch.deleteExchange(x);
    });
  });

  it('all built-in exchanges exist', async function () {
    await h.withChannel(async (ch) => {
      for (const x of ['amq.direct', 'amq.fanout', 'amq.topic', 'amq.headers', 'amq.match']) await ch.checkExchange(x);
    });
  });
});

describe('queue and exchange lifetimes', function () {
  it('exclusive queue is deleted when its connection closes', async function () {
    let q;
    await h.withChannel(async (ch) => { q = (await ch.assertQueue('', { exclusive: true })).queue; });
    await h.withChannel(async (ch) => {
      const err = await h.rejected(ch.checkQueue(q));
      h.assertClose(err, 404, 50, 10);
    });
  });

  it('auto-delete queue is deleted when its last consumer is cancelled', async function () {
    const q = h.uniq('autodelete');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, { durable: false, autoDelete: true });
      const { consumerTag } = await ch.consume(q, h.ignore);
      await ch.cancel(consumerTag);
      await h.delay(100);
      const err = await h.rejected(ch.checkQueue(q));
      h.assertClose(err, 404, 50, 10);
    });
  });

  it('auto-delete queue that never had a consumer survives its declaring connection', async function () {
    const q = h.uniq('autodelete-unused');
    await h.withChannel((ch) => ch.assertQueue(q, { durable: false, autoDelete: true }));
    await h.delay(100);
    await h.withChannel(async (ch) => {
      const ok = await ch.checkQueue(q);
      assert.strictEqual(ok.queue, q);
      await ch.deleteQueue(q);
    });
  });

  it('auto-delete exchange is deleted when its last binding goes', async function () {
    const x = h.uniq('autodelete-x');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(x, 'fanout', { durable: false, autoDelete: true });
      const { queue } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(queue, x, '');
      await ch.unbindQueue(queue, x, '');
      await h.delay(100);
      const err = await h.rejected(ch.checkExchange(x));
      h.assertClose(err, 404, 40, 10);
    });
  });

  it('deleteQueue returns the number of messages deleted', async function () {
    const q = h.uniq('delete-count');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, { durable: false });
      for (let i = 0; i < 3; i++) ch.sendToQueue(q, Buffer.from('x'));
      await h.waitForMessagesOn(ch, q, 3);
      assert.deepStrictEqual(await ch.deleteQueue(q), { messageCount: 3 });
    });
  });

  it('assertQueue on an existing queue reports message and consumer counts', async function () {
    const q = h.uniq('counts');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, { durable: false });
      ch.sendToQueue(q, Buffer.from('x'));
      ch.sendToQueue(q, Buffer.from('y'));
      await h.waitForMessagesOn(ch, q, 2);
      await h.withChannel(async (other) => {
        await other.prefetch(1);
        await other.consume(q, h.ignore, { noAck: false });
        await h.delay(100);
        const ok = await ch.assertQueue(q, { durable: false });
        assert.deepStrictEqual(ok, { queue: q, messageCount: 1, consumerCount: 1 });
      });
      await ch.deleteQueue(q);
    });
  });

  it('durable queue with persistent message (survives as long as the broker)', async function () {
    const q = h.uniq('durable');
    await h.withChannel(async (ch) => {
      const ok = await ch.assertQueue(q, { durable: true });
      assert.strictEqual(ok.queue, q);
      ch.sendToQueue(q, Buffer.from('p'), { persistent: true });
      await h.waitForMessagesOn(ch, q, 1);
      const m = await ch.get(q, { noAck: true });
      assert.strictEqual(m.properties.deliveryMode, 2);
      await ch.deleteQueue(q);
    });
  });
});
