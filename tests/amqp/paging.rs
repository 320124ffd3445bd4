//! Issue 3 point 4: a deep queue keeps a bounded window in memory and reads the rest back from
//! the store, in order; transient messages spill past the window too. The window is
//! `WINDOW_MESSAGES` (1024) ready messages per queue, so these tests go a few times past it.

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
use warren::broker::queue::{WINDOW_BYTES, WINDOW_MESSAGES};

const DEEP: usize = 4 * WINDOW_MESSAGES;

fn durable_q() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// Publish bodies "0".."n-1" (offset by `first`) to `exchange` with `key`, with confirms, and
/// wait for every confirm.
async fn publish_n(
    ch: &lapin::Channel,
    exchange: &str,
    key: &str,
    first: usize,
    n: usize,
    props: impl Fn(usize) -> BasicProperties,
) {
    let mut confirms = Vec::with_capacity(n);
    for i in first..first + n {
        confirms.push(
            ch.basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                i.to_string().as_bytes(),
                props(i),
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
}

/// Consume `n` messages from `queue` (acking each) and return (body as number, redelivered).
async fn drain(ch: &lapin::Channel, queue: &str, n: usize) -> Vec<(usize, bool)> {
    ch.basic_qos(300, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            unique("drain").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let d = next_delivery(&mut consumer).await;
        let body: usize = std::str::from_utf8(&d.data).unwrap().parse().unwrap();
        out.push((body, d.redelivered));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    no_delivery(&mut consumer).await;
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
    out
}

/// Take `n` messages with basic.get (acking each), leaving the rest where they are.
async fn get_n(ch: &lapin::Channel, queue: &str, n: usize) -> Vec<(usize, bool)> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let m = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("queue ran dry");
        let body: usize = std::str::from_utf8(&m.delivery.data)
            .unwrap()
            .parse()
            .unwrap();
        out.push((body, m.delivery.redelivered));
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    out
}

async fn count(ch: &lapin::Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

fn in_memory(server: &TestServer) -> usize {
    server.shared.broker.lock().messages_in_memory()
}

/// Wait (within `WAIT`) until at most `bound` ready messages are in memory: messages past the
/// window leave memory once their store write is done.
async fn settles_within(server: &TestServer, bound: usize) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let held = in_memory(server);
        if held <= bound {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{held} messages in memory, more than {bound}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

async fn confirming_channel(conn: &lapin::Connection) -> lapin::Channel {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch
}

#[tokio::test]
async fn a_deep_durable_queue_keeps_a_window_in_memory_and_survives_a_restart_in_order() {
    let server = TestServer::start().await;
    {
        let conn = server.connect().await;
        let ch = confirming_channel(&conn).await;
        ch.queue_declare("deep".into(), durable_q(), FieldTable::default())
            .await
            .unwrap();
        publish_n(&ch, "", "deep", 0, DEEP, |_| persistent()).await;
        assert_eq!(count(&ch, "deep").await, DEEP as u32);
        settles_within(&server, WINDOW_MESSAGES).await;
        // Half of it drained live, in order, read back from the store.
        let got = get_n(&ch, "deep", DEEP / 2).await;
        assert_eq!(
            got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            (0..DEEP / 2).collect::<Vec<_>>()
        );
        assert!(got.iter().all(|(_, r)| !r));
        conn.close(200, "bye".into()).await.unwrap();
    }
    let server = server.restart().await;
    // Nothing is loaded at start-up, nor by the expiry timer a few ticks later (no message
    // here can expire); the rest comes back in order, flagged redelivered.
    assert_eq!(in_memory(&server), 0);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(in_memory(&server), 0);
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(count(&ch, "deep").await, (DEEP / 2) as u32);
    let got = drain(&ch, "deep", DEEP / 2).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (DEEP / 2..DEEP).collect::<Vec<_>>()
    );
    assert!(got.iter().all(|(_, r)| *r));
    assert_eq!(count(&ch, "deep").await, 0);
}

#[tokio::test]
async fn transient_messages_spill_past_the_window_and_drain_in_order() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    // A non-durable queue, and a durable one holding both kinds.
    ch.queue_declare("t".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_declare("mixed".into(), durable_q(), FieldTable::default())
        .await
        .unwrap();
    publish_n(&ch, "", "t", 0, DEEP, |_| BasicProperties::default()).await;
    publish_n(&ch, "", "mixed", 0, DEEP, |i| {
        if i % 2 == 0 {
            persistent()
        } else {
            BasicProperties::default()
        }
    })
    .await;
    settles_within(&server, 2 * WINDOW_MESSAGES).await;
    let got = drain(&ch, "t", DEEP).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (0..DEEP).collect::<Vec<_>>()
    );
    // Only half of "mixed" drained; after a restart only its persistent messages are back.
    let got = get_n(&ch, "mixed", DEEP / 2).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (0..DEEP / 2).collect::<Vec<_>>()
    );
    conn.close(200, "bye".into()).await.unwrap();
    let server = server.restart().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let left = count(&ch, "mixed").await as usize;
    assert_eq!(left, DEEP / 4);
    let got = drain(&ch, "mixed", left).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (DEEP / 2..DEEP).step_by(2).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_deep_priority_queue_delivers_high_priority_first() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    let mut args = FieldTable::default();
    args.insert("x-max-priority".into(), AMQPValue::ShortShortUInt(5));
    ch.queue_declare("prio".into(), durable_q(), args)
        .await
        .unwrap();
    // A deep backlog of priority 0, then a few of priority 5 (beyond the window, so on disk).
    publish_n(&ch, "", "prio", 0, DEEP, |_| persistent()).await;
    publish_n(&ch, "", "prio", DEEP, 10, |_| persistent().with_priority(5)).await;
    let got = drain(&ch, "prio", DEEP + 10).await;
    let order: Vec<usize> = got.iter().map(|(b, _)| *b).collect();
    let expected: Vec<usize> = (DEEP..DEEP + 10).chain(0..DEEP).collect();
    assert_eq!(order, expected);
}

#[tokio::test]
async fn purging_a_deep_queue_keeps_the_unacked_message() {
    let server = TestServer::start().await;
    {
        let conn = server.connect().await;
        let ch = confirming_channel(&conn).await;
        ch.queue_declare("p".into(), durable_q(), FieldTable::default())
            .await
            .unwrap();
        publish_n(&ch, "", "p", 0, DEEP, |_| persistent()).await;
        // One delivered and never acked, then the rest purged.
        let held = ch
            .basic_get("p".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&held.delivery.data[..], b"0");
        let purged = ch
            .queue_purge("p".into(), QueuePurgeOptions::default())
            .await
            .unwrap();
        assert_eq!(purged, (DEEP - 1) as u32);
        assert_eq!(count(&ch, "p").await, 0);
        // New messages after the purge are kept.
        publish_n(&ch, "", "p", DEEP, 3, |_| persistent()).await;
        conn.close(200, "bye".into()).await.unwrap();
    }
    let server = server.restart().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let got = drain(&ch, "p", 4).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        vec![0, DEEP, DEEP + 1, DEEP + 2]
    );
}

#[tokio::test]
async fn a_deep_fanout_backlog_drains_from_every_queue_across_a_restart() {
    let server = TestServer::start().await;
    {
        let conn = server.connect().await;
        let ch = confirming_channel(&conn).await;
        ch.exchange_declare(
            "fan".into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        for q in ["f1", "f2"] {
            ch.queue_declare(q.into(), durable_q(), FieldTable::default())
                .await
                .unwrap();
            ch.queue_bind(
                q.into(),
                "fan".into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        publish_n(&ch, "fan", "", 0, DEEP, |_| persistent()).await;
        let got = drain(&ch, "f1", DEEP).await;
        assert_eq!(got.len(), DEEP);
        conn.close(200, "bye".into()).await.unwrap();
    }
    let server = server.restart().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(count(&ch, "f1").await, 0);
    let got = drain(&ch, "f2", DEEP).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (0..DEEP).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn limits_and_ttl_reach_into_the_part_on_disk() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(2000));
    ch.queue_declare("capped".into(), durable_q(), args)
        .await
        .unwrap();
    publish_n(&ch, "", "capped", 0, DEEP, |_| persistent()).await;
    assert_eq!(count(&ch, "capped").await, 2000);
    let got = drain(&ch, "capped", 2000).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (DEEP - 2000..DEEP).collect::<Vec<_>>()
    );
    // A queue TTL expires the whole backlog, the part on disk included.
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(300));
    ch.queue_declare("ttl".into(), durable_q(), args)
        .await
        .unwrap();
    publish_n(&ch, "", "ttl", 0, DEEP, |_| persistent()).await;
    let deadline = std::time::Instant::now() + WAIT;
    while count(&ch, "ttl").await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} messages still there",
            count(&ch, "ttl").await
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_consumer_draining_while_a_deep_queue_fills_gets_everything_once_in_order() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    ch.queue_declare("busy".into(), durable_q(), FieldTable::default())
        .await
        .unwrap();
    // A consumer that is slower than the publisher (small prefetch, acks one by one), so the
    // queue goes past its window and pages while it is being consumed.
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut consumer = cch
        .basic_consume(
            "busy".into(),
            "slow".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let n = 3 * WINDOW_MESSAGES;
    let reader = tokio::spawn(async move {
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            let d = next_delivery(&mut consumer).await;
            got.push(
                std::str::from_utf8(&d.data)
                    .unwrap()
                    .parse::<usize>()
                    .unwrap(),
            );
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
        no_delivery(&mut consumer).await;
        got
    });
    // Persistent and transient interleaved, so both the stored and the spilled path run.
    publish_n(&ch, "", "busy", 0, n, |i| {
        if i % 3 == 0 {
            BasicProperties::default()
        } else {
            persistent()
        }
    })
    .await;
    let got = reader.await.unwrap();
    assert_eq!(got, (0..n).collect::<Vec<_>>());
    assert_eq!(count(&ch, "busy").await, 0);
}

/// Start a consumer on `ch` (prefetch `prefetch`) that, once `go` has a permit, takes `n`
/// messages of `queue` and acks each, spending `pace` on each; returns their numbers (the
/// bodies' first word) in arrival order.
fn spawn_reader(
    ch: lapin::Channel,
    queue: &'static str,
    prefetch: u16,
    n: usize,
    go: std::sync::Arc<tokio::sync::Semaphore>,
    pace: std::time::Duration,
) -> tokio::task::JoinHandle<Vec<usize>> {
    tokio::spawn(async move {
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .unwrap();
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "reader".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _go = go.acquire().await.unwrap();
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            let d = next_delivery(&mut consumer).await;
            let body = std::str::from_utf8(&d.data).unwrap();
            got.push(body.split(' ').next().unwrap().parse().unwrap());
            tokio::time::sleep(pace).await;
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
        no_delivery(&mut consumer).await;
        got
    })
}

fn flow_hold(hold: std::time::Duration) -> warren::Config {
    warren::Config {
        flow_hold: hold,
        ..Default::default()
    }
}

/// Publish three windows' worth of 64 KiB messages to `queue` while a slower reader on
/// `consumer_conn` (prefetch 20, 1 ms per message) takes them; returns how many messages the
/// queue paged out.
async fn publish_to_a_reader(
    server: &TestServer,
    publisher: &lapin::Connection,
    consumer_conn: &lapin::Connection,
    queue: &'static str,
) -> u64 {
    let ch = confirming_channel(publisher).await;
    ch.queue_declare(queue.into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    const SIZE: usize = 64 * 1024;
    let n = 3 * (WINDOW_BYTES as usize / SIZE);
    let go = std::sync::Arc::new(tokio::sync::Semaphore::new(1));
    let reader = spawn_reader(
        consumer_conn.create_channel().await.unwrap(),
        queue,
        20,
        n,
        go,
        std::time::Duration::from_millis(1),
    );
    // The consumer is in place before the first publish.
    while server
        .shared
        .broker
        .lock()
        .consumer_count("/", queue)
        .unwrap_or(0)
        == 0
    {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let all = async {
        let mut confirms = Vec::with_capacity(n);
        for i in 0..n {
            let mut body = format!("{i} ").into_bytes();
            body.resize(SIZE, b'.');
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default(),
                )
                .await
                .unwrap(),
            );
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
        reader.await.unwrap()
    };
    let got = tokio::time::timeout(std::time::Duration::from_secs(20), all)
        .await
        .expect("publisher or consumer stalled");
    assert_eq!(got, (0..n).collect::<Vec<_>>());
    server.shared.broker.lock().paged_out("/", queue).unwrap()
}

/// Flow control: consumers that are only behind slow their publisher down (it stops being
/// read until they bring the queue back under its window) rather than make the queue page
/// messages they are about to take. The same load with holding switched off pages, so the
/// load does go past the window.
#[tokio::test]
async fn a_publisher_waits_for_consumers_that_are_behind_instead_of_paging() {
    let server = TestServer::start_with(flow_hold(std::time::Duration::from_secs(30))).await;
    let (p, c) = (server.connect().await, server.connect().await);
    assert_eq!(publish_to_a_reader(&server, &p, &c, "behind").await, 0);

    let server = TestServer::start_with(flow_hold(std::time::Duration::ZERO)).await;
    let (p, c) = (server.connect().await, server.connect().await);
    assert!(publish_to_a_reader(&server, &p, &c, "behind").await > 0);
}

/// A publisher consuming (with acks) from the same queue on its own connection is not held:
/// its acks come in on the connection that would stop being read. With a 30 s hold, waiting
/// for itself would stall past the test's 20 s bound.
#[tokio::test]
async fn a_publisher_consuming_on_its_own_connection_is_not_held_for_itself() {
    let server = TestServer::start_with(flow_hold(std::time::Duration::from_secs(30))).await;
    let conn = server.connect().await;
    publish_to_a_reader(&server, &conn, &conn, "own").await;
}

/// A consumer that takes nothing (prefetch 1, never acks) holds its queue's publisher no
/// longer than `flow_hold` (100 ms by default): the queue then pages, every publish is
/// confirmed, and once the consumer acks it gets everything in order.
#[tokio::test]
async fn a_stuck_consumer_holds_a_publisher_only_briefly_then_the_queue_pages() {
    let server = TestServer::start().await;
    let (p, c) = (server.connect().await, server.connect().await);
    let ch = confirming_channel(&p).await;
    ch.queue_declare("stuck".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let n = 3 * WINDOW_MESSAGES;
    let go = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let reader = spawn_reader(
        c.create_channel().await.unwrap(),
        "stuck",
        1,
        n,
        go.clone(),
        std::time::Duration::ZERO,
    );
    while server
        .shared
        .broker
        .lock()
        .consumer_count("/", "stuck")
        .unwrap_or(0)
        == 0
    {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        publish_n(&ch, "", "stuck", 0, n, |_| BasicProperties::default()),
    )
    .await
    .expect("publisher held for good by a stuck consumer");
    assert!(server.shared.broker.lock().paged_out("/", "stuck").unwrap() > 0);
    go.add_permits(1);
    let got = tokio::time::timeout(std::time::Duration::from_secs(20), reader)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, (0..n).collect::<Vec<_>>());
}

/// Messages with an `expiration` still expire after a restart, from the part on disk, while a
/// queue without any is not read back by the expiry timer (see the test above).
#[tokio::test]
async fn messages_with_an_expiration_expire_after_a_restart() {
    let server = TestServer::start().await;
    {
        let conn = server.connect().await;
        let ch = confirming_channel(&conn).await;
        ch.queue_declare("ttl-restart".into(), durable_q(), FieldTable::default())
            .await
            .unwrap();
        publish_n(&ch, "", "ttl-restart", 0, 5, |_| {
            persistent().with_expiration("600".into())
        })
        .await;
        publish_n(&ch, "", "ttl-restart", 5, 5, |_| persistent()).await;
        conn.close(200, "bye".into()).await.unwrap();
    }
    let server = server.restart().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while count(&ch, "ttl-restart").await != 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "expired messages still there"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let got = drain(&ch, "ttl-restart", 5).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (5..10).collect::<Vec<_>>()
    );
}

/// Take every one of `n` ready messages of `queue` on `ch` without acknowledging them (no
/// prefetch limit): the deliveries, in order.
async fn take_unacked(ch: &lapin::Channel, queue: &str, n: usize) -> Vec<lapin::message::Delivery> {
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            unique("taker").as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(next_delivery(&mut consumer).await);
    }
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await
        .unwrap();
    out
}

/// Issue 12 point 5: requeued messages past the window go back to the store like any other
/// (200,000 requeued messages stayed in memory). Half of a deep durable queue's messages are
/// nacked back first and page out; the other half, nacked after, land among them. The queue
/// settles within its window while another client carries on, delivers everything in order,
/// flagged redelivered, and a purge of the paged-out part is durable.
#[tokio::test]
async fn requeued_messages_past_the_window_page_out_and_come_back_in_order() {
    let server = TestServer::start().await;
    {
        let conn = server.connect().await;
        let ch = confirming_channel(&conn).await;
        ch.queue_declare("rq".into(), durable_q(), FieldTable::default())
            .await
            .unwrap();
        publish_n(&ch, "", "rq", 0, DEEP, |_| persistent()).await;
        let taker = conn.create_channel().await.unwrap();
        let held = take_unacked(&taker, "rq", DEEP).await;
        assert_eq!(in_memory(&server), 0, "every message is delivered");
        let (even, odd): (Vec<_>, Vec<_>) = held.into_iter().partition(|d| {
            std::str::from_utf8(&d.data)
                .unwrap()
                .parse::<usize>()
                .unwrap()
                % 2
                == 0
        });
        for d in even.iter().rev() {
            d.nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        assert_eq!(count(&ch, "rq").await, (DEEP / 2) as u32);
        settles_within(&server, WINDOW_MESSAGES).await;
        for d in odd.iter().rev() {
            d.nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        assert_eq!(count(&ch, "rq").await, DEEP as u32);
        settles_within(&server, WINDOW_MESSAGES).await;
        // Another client carries on meanwhile.
        let other = server.connect().await;
        let och = confirming_channel(&other).await;
        och.queue_declare("bystander".into(), durable_q(), FieldTable::default())
            .await
            .unwrap();
        publish_n(&och, "", "bystander", 7, 1, |_| persistent()).await;
        assert_eq!(get_n(&och, "bystander", 1).await, vec![(7, false)]);
        // The first half comes back in order, redelivered; the rest is purged.
        let got = get_n(&ch, "rq", DEEP / 2).await;
        assert_eq!(
            got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
            (0..DEEP / 2).collect::<Vec<_>>()
        );
        assert!(got.iter().all(|(_, r)| *r));
        let purged = ch
            .queue_purge("rq".into(), QueuePurgeOptions::default())
            .await
            .unwrap();
        assert_eq!(purged, (DEEP / 2) as u32);
        publish_n(&ch, "", "rq", DEEP, 2, |_| persistent()).await;
        conn.close(200, "bye".into()).await.unwrap();
    }
    let server = server.restart().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    // (Redelivered: after a restart Warren cannot tell whether they were delivered.)
    assert_eq!(count(&ch, "rq").await, 2);
    assert_eq!(
        get_n(&ch, "rq", 2).await,
        vec![(DEEP, true), (DEEP + 1, true)]
    );
}

/// The same for transient messages of a non-durable queue (paged out as spills) when a channel
/// holding all of them closes, and for a quorum queue, whose messages keep their delivery
/// count across the page-out.
#[tokio::test]
async fn requeued_transient_and_quorum_messages_page_out_and_drain_in_order() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    ch.queue_declare("rt".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let mut quorum = FieldTable::default();
    quorum.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    ch.queue_declare("rquorum".into(), durable_q(), quorum)
        .await
        .unwrap();
    publish_n(&ch, "", "rt", 0, DEEP, |_| BasicProperties::default()).await;
    publish_n(&ch, "", "rquorum", 0, DEEP, |_| persistent()).await;
    for q in ["rt", "rquorum"] {
        let taker = conn.create_channel().await.unwrap();
        let held = take_unacked(&taker, q, DEEP).await;
        assert_eq!(held.len(), DEEP);
        // Closing the channel requeues every one of them.
        taker.close(200, "bye".into()).await.unwrap();
        assert_eq!(count(&ch, q).await, DEEP as u32);
        // A window for each of the two queues.
        settles_within(&server, 2 * WINDOW_MESSAGES).await;
    }
    let got = drain(&ch, "rt", DEEP).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (0..DEEP).collect::<Vec<_>>()
    );
    assert!(got.iter().all(|(_, r)| *r));
    let mut delivery_counts = Vec::with_capacity(DEEP);
    for i in 0..DEEP {
        let m = ch
            .basic_get("rquorum".into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("queue ran dry");
        assert_eq!(m.delivery.data, i.to_string().as_bytes());
        assert!(m.delivery.redelivered);
        let headers = m.delivery.properties.headers().clone().unwrap_or_default();
        delivery_counts.push(headers.inner().get("x-delivery-count").cloned());
        m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert!(
        delivery_counts
            .iter()
            .all(|c| *c == Some(AMQPValue::LongLongInt(1))),
        "{:?}",
        &delivery_counts[..4]
    );
}

/// A requeue that pushes never-delivered messages past the window pages them out with the rest,
/// and they must come back as they were: only the requeued ones are redelivered (the review of
/// the paging found every paged-out message marked redelivered).
#[tokio::test]
async fn messages_paged_out_by_a_requeue_keep_their_redelivered_flag() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    ch.queue_declare("rflag".into(), durable_q(), FieldTable::default())
        .await
        .unwrap();
    const N: usize = 2 * WINDOW_MESSAGES;
    // More than the window: the head refills from disk while they are taken, so their return
    // puts it past the window and its newest, never-delivered part pages out.
    const TAKEN: usize = WINDOW_MESSAGES + WINDOW_MESSAGES / 8;
    publish_n(&ch, "", "rflag", 0, N, |_| persistent()).await;
    let taker = conn.create_channel().await.unwrap();
    taker
        .basic_qos(TAKEN as u16, BasicQosOptions::default())
        .await
        .unwrap();
    let held = take_unacked(&taker, "rflag", TAKEN).await;
    assert_eq!(held.len(), TAKEN);
    taker.close(200, "bye".into()).await.unwrap();
    settles_within(&server, WINDOW_MESSAGES).await;
    let got = get_n(&ch, "rflag", N).await;
    assert_eq!(
        got.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        (0..N).collect::<Vec<_>>()
    );
    let redelivered: Vec<usize> = got.iter().filter(|(_, r)| *r).map(|(b, _)| *b).collect();
    assert_eq!(redelivered, (0..TAKEN).collect::<Vec<_>>());
}

/// Issue 13 point 5: a queue's backlog is read back from the store outside the broker lock
/// (the core asks, the node reads, the core takes the result). With every backlog read
/// taking 1.5 s (a slow disk), a consumer draining a deep queue waits for its reads, while
/// another client's publishes and gets on another queue go through all along; the consumer
/// still gets every message once, in order. (With the reads under the lock, as before, each
/// of the bystander's round trips waited out a read.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_backlog_read_holds_up_no_other_client() {
    slow_reads_beside_a_bystander(Work::Consume).await;
}

/// The same with basic.get draining the deep queue: the head it needs is read with the lock
/// released before the get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_backlog_read_for_basic_get_holds_up_no_other_client() {
    slow_reads_beside_a_bystander(Work::Get).await;
}

/// The same with a publisher into a drop-head queue at its limit, past its window: each
/// publish drops the head, on disk. The trim waits for the head's read (the queue is over its
/// limit meanwhile) instead of reading under the lock; then the queue is back at its limit
/// with the newest messages, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_head_read_for_drop_head_holds_up_no_other_client() {
    slow_reads_beside_a_bystander(Work::DropHead).await;
}

/// What reaches a deep queue's backlog beside the bystander.
#[derive(Clone, Copy)]
enum Work {
    Consume,
    Get,
    DropHead,
}

async fn slow_reads_beside_a_bystander(work: Work) {
    let server = TestServer::start_with(warren::Config {
        read_delay: Some(std::time::Duration::from_millis(1500)),
        ..Default::default()
    })
    .await;
    let conn = server.connect().await;
    let ch = confirming_channel(&conn).await;
    let q = unique("slow-read");
    let n = 3 * WINDOW_MESSAGES;
    let limit = 2 * WINDOW_MESSAGES;
    let mut arguments = FieldTable::default();
    if let Work::DropHead = work {
        arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(limit as i64));
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("drop-head".into()),
        );
    }
    ch.queue_declare(q.as_str().into(), durable_q(), arguments)
        .await
        .unwrap();
    publish_n(&ch, "", &q, 0, n, |_| persistent()).await;
    settles_within(&server, WINDOW_MESSAGES).await;
    let other = unique("bystander");
    ch.queue_declare(other.as_str().into(), durable_q(), FieldTable::default())
        .await
        .unwrap();
    // The consumer drains the window in memory, then waits for the store (about 4 reads);
    // the drop-head publisher's trims wait for the head's reads likewise.
    let consumer_conn = server.connect().await;
    let cch = confirming_channel(&consumer_conn).await;
    let queue = q.clone();
    let drained = tokio::spawn(async move {
        match work {
            Work::Consume => drain(&cch, &queue, n).await,
            Work::Get => get_n(&cch, &queue, n).await,
            Work::DropHead => {
                publish_n(&cch, "", &queue, n, limit, |_| persistent()).await;
                // 4 reads of 1.5 s bring the head in for the 2,048 drops.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                loop {
                    let c = count(&cch, &queue).await as usize;
                    if c == limit {
                        break;
                    }
                    assert!(c > limit, "the drop-head queue fell to {c}");
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the drop-head queue still holds {c}"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                get_n(&cch, &queue, limit).await
            }
        }
    });
    // Meanwhile, until the consumer is done: round trips on another queue, each well within a
    // read's 1.5 s. The bystander runs on a thread and runtime of its own: the broker runs on
    // the test's, and a worker thread of it blocked (as behind a lock held over a read) would
    // also stop a bystander sharing it from measuring anything.
    let url = server.url();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let bystander = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let conn = lapin::Connection::connect(&url, Default::default())
                .await
                .unwrap();
            let bch = confirming_channel(&conn).await;
            let mut slowest = std::time::Duration::ZERO;
            let mut trips = 0;
            while stopped.try_recv().is_err() {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                let started = std::time::Instant::now();
                publish_n(&bch, "", &other, trips, 1, |_| persistent()).await;
                let got = get_n(&bch, &other, 1).await;
                assert_eq!(got, vec![(trips, false)]);
                slowest = slowest.max(started.elapsed());
                trips += 1;
            }
            (slowest, trips)
        })
    });
    let got = drained.await.unwrap();
    stop.send(()).unwrap();
    let (slowest, trips) = bystander.join().unwrap();
    assert!(
        slowest < std::time::Duration::from_millis(1000),
        "a round trip beside the slow reads took {slowest:?}"
    );
    assert!(trips >= 10, "only {trips} round trips beside the reads");
    let expected: Vec<(usize, bool)> = match work {
        Work::DropHead => (n..n + limit).map(|i| (i, false)).collect(),
        _ => (0..n).map(|i| (i, false)).collect(),
    };
    assert_eq!(got, expected);
}
