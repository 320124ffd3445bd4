'use strict';
// The live-broker behaviours of amqplib's test/callback_api.test.js: error
// message formats built from the broker's close frames, exclusive
// server-named queues, confirms, and errors from get/consume on no queue.
const assert = require('node:assert');
const h = require('./helpers');
const { cbapi } = h;

function withCbChannel(method, fn, done) {
  cbapi.connect(h.URL, (err, c) => {
    if (err) return done(err);
    c.on('error', h.ignore);
    const finish = (e) => { try { c.close(() => done(e)); } catch (_) { done(e); } };
    c[method]((err2, ch) => {
      if (err2) return finish(err2);
      try { fn(ch, finish, c); } catch (e) { finish(e); }
    });
  });
}
const chTest = (fn) => (done) => withCbChannel('createChannel', fn, done);
const confirmTest = (fn) => (done) => withCbChannel('createConfirmChannel', fn, done);

function latch(n, done) {
  let left = n;
  let dead = false;
  return (err) => {
    if (dead) return;
    if (err) { dead = true; return done(err); }
    if (--left === 0) { dead = true; done(); }
  };
}

function guard(done, fn) {
  return (...args) => { try { fn(...args); } catch (e) { done(e); } };
}

describe('callback API', function () {
  it('channel open and close', chTest((ch, done) => ch.close(done)));

  it('assert, check, delete queue (durable by default)', chTest((ch, done) => {
    const q = h.uniq('cb.queue');
    ch.assertQueue(q, {}, guard(done, (err, ok) => {
      assert.ifError(err);
      assert.strictEqual(ok.queue, q);
      ch.checkQueue(q, guard(done, (err2, ok2) => {
        assert.ifError(err2);
        assert.strictEqual(ok2.queue, q);
        ch.deleteQueue(q, {}, done);
      }));
    }));
  }));

  it('assert, check, delete topic exchange', chTest((ch, done) => {
    const x = h.uniq('cb.exchange');
    ch.assertExchange(x, 'topic', {}, guard(done, (err, ok) => {
      assert.ifError(err);
      assert.strictEqual(ok.exchange, x);
      ch.checkExchange(x, guard(done, (err2) => {
        assert.ifError(err2);
        ch.deleteExchange(x, {}, done);
      }));
    }));
  }));

  it('fail on check non-queue: RPC error text and channel error text', chTest((ch, done) => {
    const q = h.uniq('cb.nothere');
    const l = latch(2, done);
    ch.on('error', guard(l, (err) => {
      assert.match(err.message, /^Channel closed by server: 404 \(NOT-FOUND\) with message "NOT_FOUND - no queue '.*' in vhost '\/'"$/);
      l();
    }));
    ch.checkQueue(q, guard(l, (err) => {
      assert.strictEqual(err.message, `Operation failed: QueueDeclare; 404 (NOT-FOUND) with message "NOT_FOUND - no queue '${q}' in vhost '/'"`);
      l();
    }));
  }));

  it('fail on check non-exchange: RPC error text and channel error text', chTest((ch, done) => {
    const x = h.uniq('cb.nothere');
    const l = latch(2, done);
    ch.on('error', guard(l, (err) => {
      assert.match(err.message, /^Channel closed by server: 404 \(NOT-FOUND\)/);
      l();
    }));
    ch.checkExchange(x, guard(l, (err) => {
      assert.strictEqual(err.message, `Operation failed: ExchangeDeclare; 404 (NOT-FOUND) with message "NOT_FOUND - no exchange '${x}' in vhost '/'"`);
      l();
    }));
  }));

  it('bind queue', chTest((ch, done) => {
    const q = h.uniq('cb.bindq');
    const x = h.uniq('cb.bindex');
    ch.assertQueue(q, { durable: false }, guard(done, (err) => {
      assert.ifError(err);
      ch.assertExchange(x, 'fanout', { durable: false }, guard(done, (err2) => {
        assert.ifError(err2);
        ch.bindQueue(q, x, '', {}, guard(done, (err3) => {
          assert.ifError(err3);
          ch.deleteQueue(q, {}, () => ch.deleteExchange(x, {}, done));
        }));
      }));
    }));
  }));

  it('bind exchange', chTest((ch, done) => {
    const x1 = h.uniq('cb.bindex1');
    const x2 = h.uniq('cb.bindex2');
    ch.assertExchange(x1, 'fanout', { durable: false }, guard(done, (err) => {
      assert.ifError(err);
      ch.assertExchange(x2, 'fanout', { durable: false }, guard(done, (err2) => {
        assert.ifError(err2);
        ch.bindExchange(x1, x2, '', {}, guard(done, (err3) => {
          assert.ifError(err3);
          ch.deleteExchange(x1, {}, () => ch.deleteExchange(x2, {}, done));
        }));
      }));
    }));
  }));

  it('send to exclusive server-named queue and consume noAck (exclusive consumer)', chTest((ch, done) => {
    const msg = h.uniq('m');
    ch.assertQueue('', { exclusive: true }, guard(done, (err, ok) => {
      assert.ifError(err);
      assert.match(ok.queue, /^amq\.gen-/);
      ch.consume(ok.queue, guard(done, (m) => {
        assert.strictEqual(m.content.toString(), msg);
        done();
      }), { noAck: true, exclusive: true });
      ch.sendToQueue(ok.queue, Buffer.from(msg));
    }));
  }));

  it('send to queue and consume with ack', chTest((ch, done) => {
    const msg = h.uniq('m');
    ch.assertQueue('', { exclusive: true }, guard(done, (err, ok) => {
      assert.ifError(err);
      ch.consume(ok.queue, guard(done, (m) => {
        assert.strictEqual(m.content.toString(), msg);
        ch.ack(m);
        done();
      }), { noAck: false, exclusive: true });
      ch.sendToQueue(ok.queue, Buffer.from(msg));
    }));
  }));

  it('send to and get from queue', chTest((ch, done) => {
    ch.assertQueue('', { exclusive: true }, guard(done, (err, ok) => {
      assert.ifError(err);
      const msg = h.uniq('m');
      ch.sendToQueue(ok.queue, Buffer.from(msg));
      const poll = () => ch.checkQueue(ok.queue, guard(done, (e, qok) => {
        assert.ifError(e);
        if (qok.messageCount === 0) return setImmediate(poll);
        ch.get(ok.queue, { noAck: true }, guard(done, (e2, m) => {
          assert.ifError(e2);
          assert.ok(m);
          assert.strictEqual(m.content.toString(), msg);
          done();
        }));
      }));
      poll();
    }));
  }));

  it('prefetch(0, false) gets qos-ok', chTest((ch, done) => {
    ch.prefetch(0, false, done);
  }));

  it('ConfirmChannel: receive confirmation for an unroutable message', confirmTest((ch, done) => {
    ch.publish('', '', Buffer.from('foo'), {}, done);
  }));

  it('ConfirmChannel: wait for 1000 confirms', confirmTest((ch, done) => {
    for (let i = 0; i < 1000; i++) ch.publish('', '', Buffer.from('foo'), {});
    ch.waitForConfirms(done);
  }));

  it('get from non-queue invokes the callback and channel error with 404', chTest((ch, done) => {
    const l = latch(2, done);
    ch.on('error', guard(l, (err) => {
      assert.match(err.message, /404 \(NOT-FOUND\)/);
      l();
    }));
    ch.get('', {}, guard(l, (err) => {
      assert.ok(err);
      assert.match(err.message, /^Operation failed: BasicGet; 404 \(NOT-FOUND\)/);
      l();
    }));
  }));

  it('consume from non-queue invokes the callback and channel error with 404', chTest((ch, done) => {
    const l = latch(2, done);
    ch.on('error', guard(l, (err) => {
      assert.match(err.message, /404 \(NOT-FOUND\)/);
      assert.strictEqual(err.classId, 60);
      assert.strictEqual(err.methodId, 20);
      l();
    }));
    ch.consume('', () => {}, {}, guard(l, (err) => {
      assert.ok(err);
      assert.match(err.message, /^Operation failed: BasicConsume; 404 \(NOT-FOUND\)/);
      l();
    }));
  }));
});
