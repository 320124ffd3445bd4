'use strict';
// RabbitMQ extensions exposed through amqplib's option names: assertQueue
// {messageTtl, expires, deadLetterExchange, deadLetterRoutingKey, maxLength,
// maxPriority, overflow}, publish {expiration, priority}, consume {priority},
// and direct reply-to (amq.rabbitmq.reply-to).
const assert = require('node:assert');
const h = require('./helpers');

describe('queue arguments via amqplib options', function () {
  it('messageTtl expires messages', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true, messageTtl: 100 });
      ch.sendToQueue(queue, Buffer.from('short-lived'));
      await h.delay(400);
      assert.strictEqual(await ch.get(queue, { noAck: true }), false);
    });
  });

  it('per-message expiration expires the message', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      ch.sendToQueue(queue, Buffer.from('short-lived'), { expiration: 100 });
      ch.sendToQueue(queue, Buffer.from('stays'));
      await h.delay(400);
      const m = await ch.get(queue, { noAck: true });
      assert.strictEqual(m.content.toString(), 'stays');
      assert.strictEqual(await ch.get(queue, { noAck: true }), false);
    });
  });

  it('expires deletes an unused queue', async function () {
    const q = h.uniq('expires');
    await h.withChannel(async (ch) => {
      await ch.assertQueue(q, { durable: false, expires: 200 });
      await h.delay(700);
      const err = await h.rejected(ch.checkQueue(q));
      h.assertClose(err, 404, 50, 10);
    });
  });

  it('deadLetterExchange + deadLetterRoutingKey: rejected message is dead-lettered with x-death', async function () {
    const dlx = h.uniq('dlx');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(dlx, 'direct', { durable: false, autoDelete: true });
      const { queue: dead } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(dead, dlx, 'dead-rk');
      const { queue: src } = await ch.assertQueue('', { exclusive: true, deadLetterExchange: dlx, deadLetterRoutingKey: 'dead-rk' });
      ch.sendToQueue(src, Buffer.from('doomed'), { headers: { keep: 'me' } });
      await h.waitForMessagesOn(ch, src, 1);
      ch.reject(await ch.get(src), false);
      await h.waitForMessagesOn(ch, dead, 1);
      const m = await ch.get(dead, { noAck: true });
      assert.strictEqual(m.content.toString(), 'doomed');
      assert.strictEqual(m.fields.exchange, dlx);
      assert.strictEqual(m.fields.routingKey, 'dead-rk');
      const hd = m.properties.headers;
      assert.strictEqual(hd.keep, 'me');
      assert.ok(Array.isArray(hd['x-death']), 'x-death array');
      const d = hd['x-death'][0];
      assert.strictEqual(d.reason, 'rejected');
      assert.strictEqual(d.queue, src);
      assert.strictEqual(d.exchange, '');
      assert.deepStrictEqual(d['routing-keys'], [src]);
      assert.strictEqual(d.count, 1);
      assert.ok(d.time, 'x-death time');
      assert.strictEqual(hd['x-first-death-reason'], 'rejected');
      assert.strictEqual(hd['x-first-death-queue'], src);
      assert.strictEqual(hd['x-first-death-exchange'], '');
    });
  });

  it('expired message is dead-lettered with reason expired', async function () {
    const dlx = h.uniq('dlx-exp');
    await h.withChannel(async (ch) => {
      await ch.assertExchange(dlx, 'fanout', { durable: false, autoDelete: true });
      const { queue: dead } = await ch.assertQueue('', { exclusive: true });
      await ch.bindQueue(dead, dlx, '');
      const { queue: src } = await ch.assertQueue('', { exclusive: true, deadLetterExchange: dlx, messageTtl: 50 });
      ch.sendToQueue(src, Buffer.from('old'));
      await h.waitForMessagesOn(ch, dead, 1);
      const m = await ch.get(dead, { noAck: true });
      const d = m.properties.headers['x-death'][0];
      assert.strictEqual(d.reason, 'expired');
      assert.strictEqual(d.queue, src);
      assert.strictEqual(m.fields.routingKey, src, 'original routing key kept when no DLRK');
    });
  });

  it('maxLength drops from the head by default', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true, maxLength: 2 });
      for (const s of ['1', '2', '3']) ch.sendToQueue(queue, Buffer.from(s));
      await h.delay(100);
      assert.strictEqual((await ch.checkQueue(queue)).messageCount, 2);
      assert.strictEqual((await ch.get(queue, { noAck: true })).content.toString(), '2');
      assert.strictEqual((await ch.get(queue, { noAck: true })).content.toString(), '3');
    });
  });

  it('overflow reject-publish keeps the oldest messages', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true, maxLength: 2, overflow: 'reject-publish' });
      for (const s of ['1', '2', '3']) ch.sendToQueue(queue, Buffer.from(s));
      await h.delay(100);
      assert.strictEqual((await ch.get(queue, { noAck: true })).content.toString(), '1');
      assert.strictEqual((await ch.get(queue, { noAck: true })).content.toString(), '2');
      assert.strictEqual(await ch.get(queue, { noAck: true }), false);
    });
  });

  it('maxPriority: higher priority messages are delivered first', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true, maxPriority: 10 });
      ch.sendToQueue(queue, Buffer.from('low'), { priority: 1 });
      ch.sendToQueue(queue, Buffer.from('none'));
      ch.sendToQueue(queue, Buffer.from('high'), { priority: 9 });
      ch.sendToQueue(queue, Buffer.from('over'), { priority: 200 });
      await h.waitForMessagesOn(ch, queue, 4);
      const got = [];
      for (let i = 0; i < 4; i++) got.push((await ch.get(queue, { noAck: true })).content.toString());
      // priorities above x-max-priority count as the maximum (10 > 9)
      assert.deepStrictEqual(got, ['over', 'high', 'low', 'none']);
    });
  });

  it('consumer priority: the higher-priority consumer gets the messages', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const low = [];
      const high = [];
      await ch.consume(queue, (m) => low.push(m), { noAck: true, priority: 1 });
      await ch.consume(queue, (m) => high.push(m), { noAck: true, priority: 10 });
      for (let i = 0; i < 5; i++) ch.sendToQueue(queue, Buffer.from(String(i)));
      await h.delay(200);
      assert.strictEqual(high.length, 5);
      assert.strictEqual(low.length, 0);
    });
  });

  it('queue arguments are reported back through checkQueue/assertQueue equivalence', async function () {
    const q = h.uniq('args');
    await h.withChannel(async (ch) => {
      const opts = { durable: false, messageTtl: 60000, maxLength: 10, deadLetterExchange: 'amq.fanout', maxPriority: 5 };
      await ch.assertQueue(q, opts);
      // identical redeclare is fine
      await ch.assertQueue(q, opts);
      await ch.deleteQueue(q);
    });
  });
});

describe('direct reply-to (amq.rabbitmq.reply-to)', function () {
  it('RPC round trip through the pseudo-queue', async function () {
    await h.withConnection(async (c) => {
      const server = await c.createChannel();
      const client = await c.createChannel();
      const { queue } = await server.assertQueue('', { exclusive: true });
      await server.consume(queue, (m) => {
        server.sendToQueue(m.properties.replyTo, Buffer.from('re:' + m.content.toString()), { correlationId: m.properties.correlationId });
      }, { noAck: true });
      const reply = new Promise((resolve) => client.consume('amq.rabbitmq.reply-to', resolve, { noAck: true }));
      client.sendToQueue(queue, Buffer.from('ping'), { replyTo: 'amq.rabbitmq.reply-to', correlationId: 'c-1' });
      const m = await reply;
      assert.strictEqual(m.content.toString(), 're:ping');
      assert.strictEqual(m.properties.correlationId, 'c-1');
      assert.strictEqual(m.fields.exchange, '');
      assert.match(m.fields.routingKey, /^amq\.rabbitmq\.reply-to\./);
    });
  });

  it('reply-to seen by the responder is rewritten to amq.rabbitmq.reply-to.<token>', async function () {
    await h.withConnection(async (c) => {
      const server = await c.createChannel();
      const client = await c.createChannel();
      const { queue } = await server.assertQueue('', { exclusive: true });
      await client.consume('amq.rabbitmq.reply-to', h.ignore, { noAck: true });
      client.sendToQueue(queue, Buffer.from('x'), { replyTo: 'amq.rabbitmq.reply-to' });
      await h.waitForMessagesOn(server, queue, 1);
      const m = await server.get(queue, { noAck: true });
      assert.match(m.properties.replyTo, /^amq\.rabbitmq\.reply-to\.[A-Za-z0-9+/=._-]+$/);
      assert.notStrictEqual(m.properties.replyTo, 'amq.rabbitmq.reply-to');
    });
  });

  it('checkQueue(amq.rabbitmq.reply-to) succeeds', async function () {
    await h.withChannel(async (ch) => {
      const ok = await ch.checkQueue('amq.rabbitmq.reply-to');
      assert.strictEqual(ok.queue, 'amq.rabbitmq.reply-to');
    });
  });

  it('consuming amq.rabbitmq.reply-to with acks: 406 reply consumer cannot acknowledge', async function () {
    await h.withChannel(async (ch) => {
      const err = await h.rejected(ch.consume('amq.rabbitmq.reply-to', h.ignore, { noAck: false }));
      h.assertClose(err, 406, 60, 20, /PRECONDITION_FAILED - reply consumer cannot acknowledge/);
    });
  });

  it('publishing with reply-to amq.rabbitmq.reply-to without consuming it: 406', async function () {
    await h.withChannel(async (ch) => {
      const { queue } = await ch.assertQueue('', { exclusive: true });
      const errEvent = h.nextEvent(ch, 'error');
      ch.sendToQueue(queue, Buffer.from('x'), { replyTo: 'amq.rabbitmq.reply-to' });
      const err = await errEvent;
      h.assertClose(err, 406, 60, 40, /PRECONDITION_FAILED - fast reply consumer does not exist/);
    });
  });
});
