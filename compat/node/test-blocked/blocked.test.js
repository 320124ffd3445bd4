'use strict';
// connection.blocked, against a broker that is already in a resource alarm
// (AMQP_BLOCKED_URL): Warren started with a --disk-free-limit above the free
// space, or RabbitMQ after `rabbitmqctl set_disk_free_limit 1000GB`.
// amqplib advertises the 'connection.blocked' capability and emits
// 'blocked' (reason) / 'unblocked' on the connection.
const assert = require('node:assert');
const amqp = require('amqplib');

const URL = process.env.AMQP_BLOCKED_URL;

function nextEvent(emitter, event, ms) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`no '${event}' within ${ms} ms`)), ms);
    emitter.once(event, (arg) => { clearTimeout(t); resolve(arg); });
  });
}

(URL ? describe : describe.skip)('connection.blocked during a resource alarm', function () {
  it('a publishing connection gets connection.blocked with a reason', async function () {
    const c = await amqp.connect(URL);
    c.on('error', () => {});
    try {
      const blocked = nextEvent(c, 'blocked', 5000);
      const ch = await c.createChannel();
      ch.publish('amq.direct', 'nowhere', Buffer.from('x'));
      const reason = await blocked;
      assert.strictEqual(reason, 'low on disk');
    } finally {
      // close while blocked: amqplib sends connection.close and ends its side
      // without waiting; a blocked connection is not read by the broker
      // (RabbitMQ and Warren alike leave it in CLOSE-WAIT), so drop the socket.
      await c.close().catch(() => {});
      c.connection.stream.destroy();
    }
  });

  it('a connection that does not publish can still declare, get and consume', async function () {
    const c = await amqp.connect(URL);
    c.on('error', () => {});
    try {
      const ch = await c.createChannel();
      const { queue } = await ch.assertQueue('', { exclusive: true });
      assert.strictEqual(await ch.get(queue, { noAck: true }), false);
      await ch.consume(queue, () => {}, { noAck: true });
    } finally {
      await c.close();
    }
  });
});
