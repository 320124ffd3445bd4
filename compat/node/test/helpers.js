'use strict';
// Shared helpers for the amqplib compatibility suite. Every test talks to a
// live broker given by AMQP_URL and asserts what RabbitMQ 3.x does.
const assert = require('node:assert');
const crypto = require('node:crypto');
const amqp = require('amqplib');
const cbapi = require('amqplib/callback_api');

const URL = process.env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672/%2F';
const parsed = new globalThis.URL(URL);
const HOST = parsed.hostname.replace(/^\[|\]$/g, '');
const PORT = Number(parsed.port || 5672);

// URL with extra query parameters (frameMax, heartbeat, channelMax ...)
function urlWith(params) {
  const u = new globalThis.URL(URL);
  for (const [k, v] of Object.entries(params || {})) u.searchParams.set(k, String(v));
  return u.toString();
}

// URL with other credentials and/or vhost
function urlFor({ user, pass, vhost } = {}) {
  const u = new globalThis.URL(URL);
  if (user !== undefined) u.username = encodeURIComponent(user);
  if (pass !== undefined) u.password = encodeURIComponent(pass);
  if (vhost !== undefined) u.pathname = '/' + encodeURIComponent(vhost);
  return u.toString();
}

function uniq(kind) {
  return `nodecompat.${kind}.${crypto.randomBytes(6).toString('hex')}`;
}

function ignore() {}

function connect(url, opts) {
  return amqp.connect(url || URL, opts).then((c) => {
    c.on('error', ignore);
    return c;
  });
}

async function withConnection(fn, url, opts) {
  const c = await connect(url, opts);
  try {
    return await fn(c);
  } finally {
    try { await c.close(); } catch (_) { /* already closed */ }
  }
}

function withChannel(fn) {
  return withConnection(async (c) => {
    const ch = await c.createChannel();
    ch.on('error', ignore);
    return fn(ch, c);
  });
}

function withConfirmChannel(fn) {
  return withConnection(async (c) => {
    const ch = await c.createConfirmChannel();
    ch.on('error', ignore);
    return fn(ch, c);
  });
}

// Resolve with the first emission of `event`, reject after `ms`.
function nextEvent(emitter, event, ms = 4000) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => {
      emitter.removeListener(event, on);
      reject(new Error(`timed out after ${ms} ms waiting for '${event}'`));
    }, ms);
    function on(arg) {
      clearTimeout(t);
      resolve(arg);
    }
    emitter.once(event, on);
  });
}

function delay(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

// Expect `promise` to be rejected; return the error.
async function rejected(promise, ms = 4000) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`operation neither failed nor succeeded within ${ms} ms`)), ms);
  });
  try {
    await Promise.race([promise.then(
      (v) => { throw new assert.AssertionError({ message: `expected failure, got success: ${JSON.stringify(v)}` }); },
      () => {}), timeout]);
  } finally {
    clearTimeout(timer);
  }
  return promise.catch((e) => e);
}

// Assert an amqplib error carries the given AMQP close details.
function assertClose(err, code, classId, methodId, textRe) {
  assert.ok(err instanceof Error, `expected an Error, got ${err}`);
  assert.strictEqual(err.code, code, `reply code: ${err.message}`);
  if (classId !== undefined) assert.strictEqual(err.classId, classId, `class id: ${err.message}`);
  if (methodId !== undefined) assert.strictEqual(err.methodId, methodId, `method id: ${err.message}`);
  if (textRe) assert.match(err.message, textRe);
}

// Poll checkQueue (on its own connection, as amqplib's suite does) until
// messageCount >= n.
async function waitForMessages(q, n = 1, ms = 4000) {
  return withChannel(async (ch) => {
    const end = Date.now() + ms;
    for (;;) {
      const ok = await ch.checkQueue(q);
      if (ok.messageCount >= n) return ok;
      if (Date.now() > end) throw new Error(`queue ${q} has ${ok.messageCount} < ${n} messages`);
      await delay(5);
    }
  });
}

// Same, polling on a given channel (needed for exclusive queues).
async function waitForMessagesOn(ch, q, n = 1, ms = 4000) {
  const end = Date.now() + ms;
  for (;;) {
    const ok = await ch.checkQueue(q);
    if (ok.messageCount >= n) return ok;
    if (Date.now() > end) throw new Error(`queue ${q} has ${ok.messageCount} < ${n} messages`);
    await delay(5);
  }
}

// amqplib's internal Connection class (same module instance amqplib uses),
// reached by file path because the package's "exports" hides lib/.
const path = require('node:path');
const amqplibDir = path.dirname(require.resolve('amqplib'));
const { Connection: RawConnection } = require(path.join(amqplibDir, 'lib', 'connection.js'));

// Record every frame amqplib decodes while `fn` runs (all connections).
// Content frames appear as {channel, content}; methods as {id, channel, fields}.
async function recordingFrames(fn) {
  const frames = [];
  const orig = RawConnection.prototype.recvFrame;
  let depth = 0; // recvFrame recurses; record each frame once
  RawConnection.prototype.recvFrame = function () {
    depth++;
    let f;
    try { f = orig.call(this); } finally { depth--; }
    if (f && depth === 0) frames.push(f);
    return f;
  };
  try {
    return await fn(frames);
  } finally {
    RawConnection.prototype.recvFrame = orig;
  }
}

module.exports = {
  recordingFrames, RawConnection,
  waitForMessagesOn,
  amqp, cbapi, URL, HOST, PORT, urlWith, urlFor, uniq, ignore, connect,
  withConnection, withChannel, withConfirmChannel, nextEvent, delay, rejected,
  assertClose, waitForMessages,
};
