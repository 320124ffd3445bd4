//! `warren perf`: a load generator in the spirit of RabbitMQ's PerfTest, speaking raw frames
//! (the `protocol` crate's codec) so that it is not the bottleneck: publishes are written in
//! batches, bodies are shared, and each producer and consumer has its own connection.
//!
//! Every body starts with the send time (ns since the run started), so consumers measure
//! publish-to-delivery latency.
//!
//! Two-phase runs (fill a queue, then drain it): `--consumers 0 --count N` publishes N messages
//! per producer and exits once they are confirmed; `--producers 0 --count N` consumes N messages
//! from what is already queued (no purge) and exits. `messages_left` in the summary is what the
//! queues hold (ready) at the end, read with a passive queue.declare.

use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, queue, AMQPClass};
use amq_protocol::types::FieldTable;
use anyhow::{bail, Context};
use bytes::Bytes;
use futures::StreamExt;
use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;
use warren_protocol::{Body, Frame, FrameCodec, OutBuffer, PROTOCOL_HEADER};

#[derive(clap::Args, Debug, Clone)]
pub struct PerfArgs {
    /// Broker to load.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub uri: String,
    /// Publishing connections. 0: drain only (the queues are not purged; consume what is
    /// there until --count messages arrived, or for --duration seconds).
    #[arg(long, default_value_t = 1)]
    pub producers: usize,
    /// Consuming connections. 0: publish only.
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Queues (`<prefix>-<n>`); producers and consumers are spread over them: with more queues
    /// than producers, producer i publishes round-robin to queues i, i+P, i+2P...; with more
    /// queues than consumers, consumer i subscribes to queues i, i+C, i+2C...
    #[arg(long, default_value_t = 1)]
    pub queues: usize,
    /// direct: publish to each queue through the default exchange; fanout: publish to one
    /// fanout exchange bound to every queue.
    #[arg(long, default_value = "direct")]
    pub exchange_type: String,
    /// Body size in bytes (at least 8: the send time).
    #[arg(long, default_value_t = 16)]
    pub size: usize,
    /// Persistent messages in durable queues.
    #[arg(long)]
    pub persistent: bool,
    /// Fill every body with fresh pseudo-random bytes (after the send time) instead of zeros,
    /// so that a broker that compresses what it stores cannot shrink it.
    #[arg(long)]
    pub random_body: bool,
    /// Publisher confirms with this many unconfirmed messages in flight (0: no confirms).
    #[arg(long, default_value_t = 0)]
    pub confirm: u64,
    /// Consumer prefetch (0: unlimited).
    #[arg(long, default_value_t = 0)]
    pub prefetch: u16,
    /// Consume with no-ack.
    #[arg(long)]
    pub auto_ack: bool,
    /// With manual acks, ack every N deliveries with multiple=true.
    #[arg(long, default_value_t = 1)]
    pub multi_ack_every: u64,
    /// Messages per second per producer (0: as fast as possible).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Seconds to publish for.
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Stop each producer after this many messages (after they are confirmed, with --confirm)
    /// instead. With --producers 0: stop once this many messages were consumed in all.
    #[arg(long)]
    pub count: Option<u64>,
    /// Queue name prefix.
    #[arg(long, default_value = "perf")]
    pub queue_prefix: String,
    /// The queues' `x-queue-type` (classic, quorum); none: the broker's default.
    #[arg(long)]
    pub queue_type: Option<String>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Consumers that have subscribed (producers start after all of them).
#[derive(Default)]
struct Ready {
    count: AtomicUsize,
    notify: tokio::sync::Notify,
}

#[derive(Default)]
struct Stats {
    published: AtomicU64,
    confirmed: AtomicU64,
    nacked: AtomicU64,
    returned: AtomicU64,
    consumed: AtomicU64,
}

#[derive(Serialize, Debug)]
pub struct Summary {
    pub seconds: f64,
    pub published: u64,
    pub consumed: u64,
    pub confirmed: u64,
    pub nacked: u64,
    pub returned: u64,
    pub published_per_sec: f64,
    pub consumed_per_sec: f64,
    /// Publish-to-delivery latency; all zero in a drain-only run (the send times in the bodies
    /// are from another run's clock).
    pub latency_us: Latency,
    /// Ready messages left in the queues at the end (passive queue.declare); None if that
    /// failed.
    pub messages_left: Option<u64>,
}

#[derive(Serialize, Debug, Default)]
pub struct Latency {
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

struct Target {
    host: String,
    port: u16,
    user: String,
    password: String,
    vhost: String,
}

fn target(uri: &str) -> anyhow::Result<Target> {
    let u = amq_protocol::uri::AMQPUri::from_str(uri)
        .map_err(|e| anyhow::anyhow!("bad uri {uri}: {e}"))?;
    Ok(Target {
        host: u.authority.host,
        port: u.authority.port,
        user: u.authority.userinfo.username,
        password: u.authority.userinfo.password,
        vhost: u.vhost,
    })
}

/// One AMQP connection with channel 1 open.
struct Client {
    rd: FramedRead<OwnedReadHalf, FrameCodec>,
    wr: OwnedWriteHalf,
    out: OutBuffer,
    frame_max: u32,
}

impl Client {
    async fn connect(t: &Target) -> anyhow::Result<Client> {
        let stream = TcpStream::connect((t.host.as_str(), t.port))
            .await
            .with_context(|| format!("connecting to {}:{}", t.host, t.port))?;
        stream.set_nodelay(true)?;
        let (rd, mut wr) = stream.into_split();
        wr.write_all(&PROTOCOL_HEADER).await?;
        let mut c = Client {
            rd: FramedRead::new(rd, FrameCodec::new(0)),
            wr,
            out: OutBuffer::new(),
            frame_max: 131072,
        };
        match c.next_method().await? {
            (0, AMQPClass::Connection(connection::AMQPMethod::Start(_))) => {}
            other => bail!("expected connection.start, got {other:?}"),
        }
        c.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: format!("\0{}\0{}", t.user, t.password).into(),
                locale: "en_US".into(),
            })),
        )
        .await?;
        let tune = match c.next_method().await? {
            (0, AMQPClass::Connection(connection::AMQPMethod::Tune(t))) => t,
            other => bail!("login failed: {other:?}"),
        };
        c.frame_max = if tune.frame_max == 0 {
            131072
        } else {
            tune.frame_max
        };
        c.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max: c.frame_max,
                heartbeat: 0,
            })),
        )
        .await?;
        c.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: t.vhost.as_str().into(),
            })),
        )
        .await?;
        c.expect_ok().await?;
        c.send(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await?;
        c.expect_ok().await?;
        Ok(c)
    }

    async fn send(&mut self, ch: u16, m: AMQPClass) -> anyhow::Result<()> {
        self.out.method(ch, &m);
        self.flush().await
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        self.wr.write_all_buf(&mut self.out).await?;
        self.out.clear();
        Ok(())
    }

    async fn next_method(&mut self) -> anyhow::Result<(u16, AMQPClass)> {
        loop {
            match self.rd.next().await {
                Some(Ok(Frame::Method(ch, m))) => return Ok((ch, m)),
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("frame error: {e}"),
                None => bail!("connection closed"),
            }
        }
    }

    /// The reply of a synchronous method; a close is an error.
    async fn expect_ok(&mut self) -> anyhow::Result<AMQPClass> {
        match self.next_method().await? {
            (_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                bail!("connection closed: {}", c.reply_text)
            }
            (_, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
                bail!("channel closed: {}", c.reply_text)
            }
            (_, m) => Ok(m),
        }
    }
}

fn queue_name(args: &PerfArgs, i: usize) -> String {
    format!("{}-{i}", args.queue_prefix)
}

/// The queues worker `n` of `workers` (producers or consumers) uses: queue `n % queues` when
/// there are no more queues than workers, else every `workers`-th queue from `n`, so that
/// every queue is used.
fn assigned_queues(n: usize, workers: usize, queues: usize) -> Vec<usize> {
    if queues <= workers {
        vec![n % queues]
    } else {
        (n..queues).step_by(workers).collect()
    }
}

fn queue_arguments(args: &PerfArgs) -> FieldTable {
    let mut t = FieldTable::default();
    if let Some(kind) = &args.queue_type {
        t.insert(
            "x-queue-type".into(),
            amq_protocol::types::AMQPValue::LongString(kind.as_str().into()),
        );
    }
    t
}

fn fanout_name(args: &PerfArgs) -> String {
    format!("{}-fanout", args.queue_prefix)
}

/// Declare the queues (purged, unless this is a drain-only run), and the fanout exchange if
/// asked.
async fn setup(t: &Target, args: &PerfArgs) -> anyhow::Result<()> {
    let mut c = Client::connect(t).await?;
    if args.exchange_type == "fanout" {
        c.send(
            1,
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
                exchange: fanout_name(args).into(),
                kind: "fanout".into(),
                durable: args.persistent,
                ..Default::default()
            })),
        )
        .await?;
        c.expect_ok().await?;
    }
    for i in 0..args.queues {
        let name = queue_name(args, i);
        c.send(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.as_str().into(),
                durable: args.persistent,
                arguments: queue_arguments(args),
                ..Default::default()
            })),
        )
        .await?;
        c.expect_ok().await?;
        if args.producers > 0 {
            c.send(
                1,
                AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
                    queue: name.as_str().into(),
                    nowait: false,
                })),
            )
            .await?;
            c.expect_ok().await?;
        }
        if args.exchange_type == "fanout" {
            c.send(
                1,
                AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
                    queue: name.as_str().into(),
                    exchange: fanout_name(args).into(),
                    ..Default::default()
                })),
            )
            .await?;
            c.expect_ok().await?;
        }
    }
    Ok(())
}

/// Ready messages in all the queues (passive queue.declare).
async fn messages_left(t: &Target, args: &PerfArgs) -> anyhow::Result<u64> {
    let mut c = Client::connect(t).await?;
    let mut total = 0u64;
    for i in 0..args.queues {
        c.send(
            1,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: queue_name(args, i).into(),
                passive: true,
                ..Default::default()
            })),
        )
        .await?;
        match c.expect_ok().await? {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => {
                total += u64::from(ok.message_count)
            }
            other => bail!("expected queue.declare-ok, got {other:?}"),
        }
    }
    Ok(total)
}

async fn produce(
    t: Arc<Target>,
    args: Arc<PerfArgs>,
    n: usize,
    stats: Arc<Stats>,
    start: Instant,
    stop: Arc<AtomicBool>,
    ready: Arc<Ready>,
) -> anyhow::Result<()> {
    let mut c = Client::connect(&t).await?;
    let confirming = args.confirm > 0;
    if confirming {
        c.send(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
                nowait: false,
            })),
        )
        .await?;
        c.expect_ok().await?;
    }
    let routes: Vec<(String, String)> = if args.exchange_type == "fanout" {
        vec![(fanout_name(&args), String::new())]
    } else {
        assigned_queues(n, args.producers, args.queues)
            .into_iter()
            .map(|q| (String::new(), queue_name(&args, q)))
            .collect()
    };
    // The publish method frame is the same for every message to a queue: encode it once.
    let publish_frames: Vec<Vec<u8>> = routes
        .iter()
        .map(|(exchange, routing_key)| {
            let mut template = OutBuffer::new();
            template.method(
                1,
                &AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                    exchange: exchange.as_str().into(),
                    routing_key: routing_key.as_str().into(),
                    ..Default::default()
                })),
            );
            template.to_vec()
        })
        .collect();
    let props =
        basic::AMQPProperties::default().with_delivery_mode(if args.persistent { 2 } else { 1 });
    let raw_props = warren_protocol::codec::encode_properties(&props);
    let mut body = vec![0u8; args.size.max(8)];
    let shared_rest = Bytes::copy_from_slice(&body[8..]);
    let mut rng = XorShift::new(n as u64);
    let frame_max = c.frame_max;
    let Client {
        mut rd,
        mut wr,
        mut out,
        ..
    } = c;
    // Confirms are read by a second task; `acked` is the highest confirmed sequence number.
    let acked = Arc::new(AtomicU64::new(0));
    let wake = Arc::new(tokio::sync::Notify::new());
    let reader = {
        let (acked, wake, stats, stop) = (acked.clone(), wake.clone(), stats.clone(), stop.clone());
        tokio::spawn(async move {
            while let Some(Ok(frame)) = rd.next().await {
                match frame {
                    Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                        let prev = acked.fetch_max(a.delivery_tag, Ordering::AcqRel);
                        if a.delivery_tag > prev {
                            let n = if a.multiple { a.delivery_tag - prev } else { 1 };
                            stats.confirmed.fetch_add(n, Ordering::Relaxed);
                        }
                        wake.notify_one();
                    }
                    Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(a))) => {
                        let prev = acked.fetch_max(a.delivery_tag, Ordering::AcqRel);
                        if a.delivery_tag > prev {
                            let n = if a.multiple { a.delivery_tag - prev } else { 1 };
                            stats.nacked.fetch_add(n, Ordering::Relaxed);
                        }
                        wake.notify_one();
                    }
                    Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Return(_))) => {
                        stats.returned.fetch_add(1, Ordering::Relaxed);
                    }
                    Frame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                        eprintln!("producer connection closed: {}", c.reply_text);
                        stop.store(true, Ordering::Relaxed);
                        wake.notify_one();
                        break;
                    }
                    _ => {}
                }
            }
        })
    };
    // Publish once every consumer has subscribed (as PerfTest does), so that the first
    // messages' latency is not the time the consumers took to connect.
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready.count.load(Ordering::Acquire) < args.consumers && Instant::now() < deadline {
        let notified = ready.notify.notified();
        if ready.count.load(Ordering::Acquire) >= args.consumers {
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
    }
    // The rate schedule starts now.
    let begun = Instant::now();
    let mut sent = 0u64;
    let limit = args.count.unwrap_or(u64::MAX);
    let batch = 64u64;
    while !stop.load(Ordering::Relaxed) && sent < limit {
        let mut room = batch.min(limit - sent);
        if confirming {
            let in_flight = sent - acked.load(Ordering::Acquire);
            if in_flight >= args.confirm {
                let notified = wake.notified();
                if sent - acked.load(Ordering::Acquire) >= args.confirm {
                    let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
                }
                continue;
            }
            room = room.min(args.confirm - in_flight);
        }
        if args.rate > 0 {
            // Stay on schedule: message k goes out at k / rate seconds, producer n shifted by
            // n / producers of an interval, so that rate-limited producers do not all fire at
            // the same instant (as independent clients would not; PerfTest's producers are not
            // aligned either).
            let phase = n as f64 / args.producers.max(1) as f64;
            let due = Duration::from_secs_f64((sent as f64 + phase) / args.rate as f64);
            let elapsed = begun.elapsed();
            if due > elapsed {
                tokio::time::sleep(due - elapsed).await;
            }
            room = 1;
        }
        for k in sent..sent + room {
            let now = start.elapsed().as_nanos() as u64;
            body[..8].copy_from_slice(&now.to_be_bytes());
            if args.random_body {
                rng.fill(&mut body[8..]);
            }
            out.raw(&publish_frames[(k % publish_frames.len() as u64) as usize]);
            if body.len() >= warren_protocol::codec::SHARE_MIN {
                // Large bodies: the stamp in a part of its own, the rest shared, not copied.
                let rest = if args.random_body {
                    Bytes::copy_from_slice(&body[8..])
                } else {
                    shared_rest.clone()
                };
                let parts = vec![Bytes::copy_from_slice(&body[..8]), rest];
                out.content(1, &raw_props, &Body::from_parts(parts), frame_max);
            } else {
                out.content_slice(1, &raw_props, &body, frame_max);
            }
        }
        wr.write_all_buf(&mut out).await?;
        out.clear();
        sent += room;
        stats.published.fetch_add(room, Ordering::Relaxed);
    }
    if confirming {
        // Wait for the outstanding confirms; give up after 10 s without progress.
        let mut last = acked.load(Ordering::Acquire);
        let mut since = Instant::now();
        while last < sent && since.elapsed() < Duration::from_secs(10) {
            let _ = tokio::time::timeout(Duration::from_millis(50), wake.notified()).await;
            let now = acked.load(Ordering::Acquire);
            if now != last {
                (last, since) = (now, Instant::now());
            }
        }
        if last < sent {
            eprintln!("producer {n}: {} publishes never confirmed", sent - last);
        }
    }
    reader.abort();
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn consume(
    t: Arc<Target>,
    args: Arc<PerfArgs>,
    n: usize,
    stats: Arc<Stats>,
    start: Instant,
    hist: Arc<Mutex<Histogram<u64>>>,
    done: Arc<AtomicBool>,
    ready: Arc<Ready>,
) -> anyhow::Result<()> {
    let mut c = Client::connect(&t).await?;
    if args.prefetch > 0 {
        c.send(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: args.prefetch,
                global: false,
            })),
        )
        .await?;
        c.expect_ok().await?;
    }
    // The consumes are pipelined: once the first is in place deliveries may arrive before the
    // next consume-ok, so the oks (and a refusal) are read by the delivery loop below.
    for q in assigned_queues(n, args.consumers, args.queues) {
        c.out.method(
            1,
            &AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: queue_name(&args, q).into(),
                no_ack: args.auto_ack,
                ..Default::default()
            })),
        );
    }
    c.flush().await?;
    ready.count.fetch_add(1, Ordering::AcqRel);
    ready.notify.notify_waiters();
    // In a drain-only run the bodies carry another run's send times: no latency.
    let measure_latency = args.producers > 0;
    let mut local = Histogram::<u64>::new(3)?;
    let mut last_tag = 0u64;
    // The tag of the last message received in full (counted, and what acks cover).
    let mut counted_tag = 0u64;
    let mut unacked = 0u64;
    let mut remaining = 0u64;
    let mut first_body = false;
    // Between a basic.deliver and the end of its content.
    let mut in_message = false;
    loop {
        let frame = tokio::select! {
            f = c.rd.next() => f,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if done.load(Ordering::Relaxed) { break; }
                continue;
            }
        };
        let mut complete = false;
        match frame {
            Some(Ok(Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))))) => {
                last_tag = d.delivery_tag;
                first_body = true;
                in_message = true;
            }
            Some(Ok(Frame::Header { body_size, .. })) => {
                remaining = body_size;
                complete = body_size == 0;
            }
            Some(Ok(Frame::Body(_, data))) => {
                if first_body && measure_latency && data.len() >= 8 {
                    let sent = u64::from_be_bytes(data[..8].try_into().unwrap_or([0; 8]));
                    let now = start.elapsed().as_nanos() as u64;
                    let _ = local.record(now.saturating_sub(sent) / 1000);
                }
                first_body = false;
                remaining = remaining.saturating_sub(data.len() as u64);
                complete = remaining == 0;
            }
            Some(Ok(Frame::Method(
                _,
                AMQPClass::Connection(connection::AMQPMethod::Close(cl)),
            ))) => {
                bail!("consumer connection closed: {}", cl.reply_text);
            }
            Some(Ok(Frame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(cl))))) => {
                bail!("consumer channel closed: {}", cl.reply_text);
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => bail!("frame error: {e}"),
            None => break,
        }
        if complete {
            in_message = false;
            counted_tag = last_tag;
            stats.consumed.fetch_add(1, Ordering::Relaxed);
            if !args.auto_ack {
                unacked += 1;
                if unacked >= args.multi_ack_every {
                    c.out.method(
                        1,
                        &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                            delivery_tag: counted_tag,
                            multiple: true,
                        })),
                    );
                    c.flush().await?;
                    unacked = 0;
                }
            }
        }
        if done.load(Ordering::Relaxed) && !in_message && c.rd.read_buffer().is_empty() {
            break;
        }
    }
    if unacked > 0 {
        // Ack the last partial batch, so that what was counted as consumed leaves the queue.
        c.out.method(
            1,
            &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: counted_tag,
                multiple: true,
            })),
        );
        let _ = c.flush().await;
    }
    hist.lock().add(&local)?;
    Ok(())
}

/// Run a load test and return its summary (also printed, as text or JSON).
pub async fn run(args: PerfArgs) -> anyhow::Result<Summary> {
    if args.producers == 0 && args.consumers == 0 {
        bail!("nothing to do: --producers 0 and --consumers 0");
    }
    if args.queues == 0 {
        bail!("--queues must be at least 1");
    }
    let t = Arc::new(target(&args.uri)?);
    setup(&t, &args).await?;
    let args = Arc::new(args);
    let stats = Arc::new(Stats::default());
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new(3)?));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let ready = Arc::new(Ready::default());
    let mut consumers = Vec::new();
    for n in 0..args.consumers {
        consumers.push(tokio::spawn(consume(
            t.clone(),
            args.clone(),
            n,
            stats.clone(),
            start,
            hist.clone(),
            done.clone(),
            ready.clone(),
        )));
    }
    let mut producers = Vec::new();
    for n in 0..args.producers {
        producers.push(tokio::spawn(produce(
            t.clone(),
            args.clone(),
            n,
            stats.clone(),
            start,
            stop.clone(),
            ready.clone(),
        )));
    }
    // Per-second report while publishing.
    let reporter = {
        let stats = stats.clone();
        let quiet = args.json;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            let (mut p0, mut c0, mut k0) = (0, 0, 0);
            let mut second = 0;
            loop {
                tick.tick().await;
                second += 1;
                let (p, c, k) = (
                    stats.published.load(Ordering::Relaxed),
                    stats.confirmed.load(Ordering::Relaxed),
                    stats.consumed.load(Ordering::Relaxed),
                );
                if !quiet {
                    eprintln!(
                        "{second:>4}s  published {:>9}/s  confirmed {:>9}/s  consumed {:>9}/s",
                        p - p0,
                        c - c0,
                        k - k0
                    );
                }
                (p0, c0, k0) = (p, c, k);
            }
        })
    };
    let publish_for = Duration::from_secs(args.duration);
    let (publish_time, consume_time) = if args.producers == 0 {
        // Drain only: until --count messages arrived (or --duration passed), giving up after
        // 10 s without a delivery.
        let mut last = 0;
        let mut since = Instant::now();
        loop {
            let k = stats.consumed.load(Ordering::Relaxed);
            match args.count {
                Some(n) if k >= n => break,
                None if start.elapsed() >= publish_for => break,
                _ => {}
            }
            if k != last {
                (last, since) = (k, Instant::now());
            } else if since.elapsed() >= Duration::from_secs(10) {
                eprintln!("nothing delivered for 10 s: stopping after {k} messages");
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let t = start.elapsed();
        (t, t)
    } else {
        if args.count.is_none() {
            tokio::time::sleep(publish_for).await;
            stop.store(true, Ordering::Relaxed);
        }
        for p in producers {
            if let Err(e) = p.await? {
                eprintln!("producer: {e:#}");
            }
        }
        let publish_time = start.elapsed();
        // Let consumers drain what was published (bounded).
        let expected = stats.published.load(Ordering::Relaxed) * fanout(&args);
        let drain_deadline = Instant::now() + Duration::from_secs(30);
        while args.consumers > 0
            && stats.consumed.load(Ordering::Relaxed) < expected
            && Instant::now() < drain_deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (publish_time, start.elapsed())
    };
    done.store(true, Ordering::Relaxed);
    for c in consumers {
        if let Err(e) = c.await? {
            eprintln!("consumer: {e:#}");
        }
    }
    reporter.abort();
    let left = match messages_left(&t, &args).await {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("counting the messages left: {e:#}");
            None
        }
    };
    let h = hist.lock();
    let summary = Summary {
        seconds: publish_time.as_secs_f64(),
        published: stats.published.load(Ordering::Relaxed),
        consumed: stats.consumed.load(Ordering::Relaxed),
        confirmed: stats.confirmed.load(Ordering::Relaxed),
        nacked: stats.nacked.load(Ordering::Relaxed),
        returned: stats.returned.load(Ordering::Relaxed),
        published_per_sec: if args.producers == 0 {
            0.0
        } else {
            stats.published.load(Ordering::Relaxed) as f64 / publish_time.as_secs_f64()
        },
        consumed_per_sec: stats.consumed.load(Ordering::Relaxed) as f64
            / consume_time.as_secs_f64(),
        latency_us: if h.is_empty() {
            Latency::default()
        } else {
            Latency {
                p50: h.value_at_quantile(0.5),
                p95: h.value_at_quantile(0.95),
                p99: h.value_at_quantile(0.99),
                p999: h.value_at_quantile(0.999),
                max: h.max(),
            }
        },
        messages_left: left,
    };
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        println!(
            "published {} ({:.0}/s), consumed {} ({:.0}/s), confirmed {}, nacked {}, returned {}",
            summary.published,
            summary.published_per_sec,
            summary.consumed,
            summary.consumed_per_sec,
            summary.confirmed,
            summary.nacked,
            summary.returned
        );
        let l = &summary.latency_us;
        println!(
            "latency (us): p50 {} p95 {} p99 {} p99.9 {} max {}",
            l.p50, l.p95, l.p99, l.p999, l.max
        );
        if let Some(n) = summary.messages_left {
            println!("messages left in the queues: {n}");
        }
    }
    Ok(summary)
}

/// How many queues each message reaches.
fn fanout(args: &PerfArgs) -> u64 {
    if args.exchange_type == "fanout" {
        args.queues as u64
    } else {
        1
    }
}

/// xorshift64*: cheap incompressible bodies (not for anything needing real randomness).
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> Self {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}
