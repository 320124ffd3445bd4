//! Issue 13 point 2, replay equals live: a real mixed workload over TCP, then the replicated
//! ops the broker recorded applied to a fresh broker. Definitions, every stored queue's
//! messages in order with their properties, and their counts must be equal. This is what a
//! replica will do with the leader's op stream.

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use std::time::Duration;

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn durable_x() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in entries {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

async fn publish(
    ch: &lapin::Channel,
    exchange: &str,
    key: &str,
    body: &str,
    props: BasicProperties,
) {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            props,
        )
        .await
        .unwrap();
    // Confirms on a confirm channel; a tx channel's publish is settled at commit.
    let _ = confirm.await;
}

async fn get(ch: &lapin::Channel, queue: &str) -> lapin::message::BasicGetMessage {
    ch.basic_get(queue.into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{queue} is empty"))
}

/// The workload: declares (with arguments), exchange-to-exchange bindings, fanned-out
/// publishes, priorities, acks, rejects with requeue, nacks, TTL expiry and dead-lettering
/// with x-death, drop-head and reject-publish length limits, purge with a delivery
/// outstanding, queue and exchange deletion with an auto-delete chain, tx commit and
/// rollback, and deliveries left unacknowledged when the connection closes.
async fn workload(server: &TestServer) {
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for (name, kind) in [
        ("rx.fan", ExchangeKind::Fanout),
        ("rx.topic", ExchangeKind::Topic),
        ("rx.direct", ExchangeKind::Direct),
        ("rx.dlx", ExchangeKind::Fanout),
    ] {
        ch.exchange_declare(name.into(), kind, durable_x(), FieldTable::default())
            .await
            .unwrap();
    }
    let auto = ExchangeDeclareOptions {
        durable: true,
        auto_delete: true,
        ..Default::default()
    };
    for name in ["rx.ad1", "rx.ad2"] {
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Fanout,
            auto,
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    let dlx = || ("x-dead-letter-exchange", text("rx.dlx"));
    let queues: Vec<(&str, FieldTable)> = vec![
        ("rq.a", FieldTable::default()),
        (
            "rq.prio",
            table(&[("x-max-priority", AMQPValue::ShortShortUInt(5))]),
        ),
        (
            "rq.ttl",
            table(&[("x-message-ttl", AMQPValue::LongInt(100)), dlx()]),
        ),
        ("rq.dead", FieldTable::default()),
        (
            "rq.len",
            table(&[("x-max-length", AMQPValue::LongInt(3)), dlx()]),
        ),
        (
            "rq.rej",
            table(&[
                ("x-max-length", AMQPValue::LongInt(2)),
                ("x-overflow", text("reject-publish")),
            ]),
        ),
        ("rq.purge", FieldTable::default()),
        ("rq.tmp", FieldTable::default()),
    ];
    for (name, args) in queues {
        ch.queue_declare(name.into(), durable(), args)
            .await
            .unwrap();
    }
    // A transient queue and a transient message: local, not replicated.
    ch.queue_declare(
        "rq.transient".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let bind = |q: &'static str, x: &'static str, k: &'static str| {
        let ch = ch.clone();
        async move {
            ch.queue_bind(
                q.into(),
                x.into(),
                k.into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .unwrap()
        }
    };
    bind("rq.a", "rx.fan", "").await;
    bind("rq.prio", "rx.fan", "").await;
    bind("rq.transient", "rx.fan", "").await;
    bind("rq.a", "rx.topic", "k.#").await;
    for q in ["rq.ttl", "rq.len", "rq.rej", "rq.purge"] {
        bind(q, "rx.direct", "d").await;
    }
    bind("rq.dead", "rx.dlx", "").await;
    bind("rq.tmp", "rx.ad1", "").await;
    ch.exchange_bind(
        "rx.ad1".into(),
        "rx.ad2".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_bind(
        "rx.fan".into(),
        "rx.topic".into(),
        "fan.#".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // Fanned out, with priorities; one transient.
    for i in 0..12u8 {
        publish(
            &ch,
            "rx.fan",
            "",
            &format!("f{i}"),
            persistent().with_priority(i % 6),
        )
        .await;
    }
    publish(&ch, "rx.fan", "", "transient", BasicProperties::default()).await;
    for i in 0..4 {
        publish(
            &ch,
            "rx.topic",
            &format!("k.{i}"),
            &format!("t{i}"),
            persistent(),
        )
        .await;
        publish(&ch, "rx.topic", "fan.x", &format!("e2e{i}"), persistent()).await;
    }
    for i in 0..6 {
        publish(&ch, "rx.direct", "d", &format!("d{i}"), persistent()).await;
    }
    // Consume part of rq.a: ack, reject with requeue, nack without (no DLX: dropped).
    for i in 0..6 {
        let m = get(&ch, "rq.a").await;
        match i % 3 {
            0 => {
                m.delivery.ack(BasicAckOptions::default()).await.unwrap();
            }
            1 => {
                m.delivery
                    .reject(BasicRejectOptions { requeue: true })
                    .await
                    .unwrap();
            }
            _ => {
                m.delivery
                    .nack(BasicNackOptions {
                        requeue: false,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
            }
        }
    }
    // Priorities: the highest first; ack two.
    for _ in 0..2 {
        get(&ch, "rq.prio")
            .await
            .delivery
            .ack(BasicAckOptions::default())
            .await
            .unwrap();
    }
    // rq.len dead-lettered the heads that went over its length (drop-head); rq.ttl's
    // messages expire into rq.dead with x-death.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let q = ch
            .queue_declare(
                "rq.ttl".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        if q.message_count() == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "rq.ttl never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // One dead-lettered message rejected from rq.dead again (requeued), one acked.
    let m = get(&ch, "rq.dead").await;
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    // Purge with a delivery outstanding: that one stays.
    let held = get(&ch, "rq.purge").await;
    ch.queue_purge("rq.purge".into(), Default::default())
        .await
        .unwrap();
    publish(&ch, "rx.direct", "d", "after-purge", persistent()).await;
    // A transaction committed, one rolled back.
    let tx = conn.create_channel().await.unwrap();
    tx.tx_select().await.unwrap();
    publish(&tx, "", "rq.a", "tx-committed", persistent()).await;
    let m = get(&tx, "rq.prio").await;
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    tx.tx_commit().await.unwrap();
    publish(&tx, "", "rq.a", "tx-rolled-back", persistent()).await;
    let m = get(&tx, "rq.prio").await;
    m.delivery.ack(BasicAckOptions::default()).await.unwrap();
    tx.tx_rollback().await.unwrap();
    // Deletion: rq.tmp takes rx.ad1 with it (its last binding), and rx.ad1 rx.ad2 (its only
    // binding pointed at rx.ad1).
    ch.queue_delete("rq.tmp".into(), Default::default())
        .await
        .unwrap();
    ch.exchange_delete("rx.topic".into(), Default::default())
        .await
        .unwrap();
    // Deliveries still unacknowledged go back when the connection closes.
    let _ = get(&ch, "rq.a").await;
    drop(held);
    conn.close(200, "bye".into()).await.unwrap();
}

#[tokio::test]
async fn applying_the_recorded_ops_to_a_fresh_broker_gives_the_same_state() {
    let server = TestServer::start().await;
    server.shared.broker.lock().record_ops();
    workload(&server).await;
    // The connection's teardown (requeues) has run once a new connection sees its effects.
    let deadline = std::time::Instant::now() + WAIT;
    while !server.shared.registry.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the connection never went"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (live, ops) = {
        let mut b = server.shared.broker.lock();
        (b.replicated_view().unwrap(), b.take_ops())
    };
    // The workload reached every corner it means to.
    let queue = |name: &str| live.queues.iter().find(|q| q.name == name);
    assert!(queue("rq.tmp").is_none());
    assert!(
        queue("rq.transient").is_none(),
        "a transient queue is replicated"
    );
    assert!(!live
        .exchanges
        .iter()
        .any(|x| x.1.starts_with("rx.ad") || x.1 == "rx.topic"));
    let dead = queue("rq.dead").unwrap();
    assert!(dead.message_count >= 3, "{dead:?}");
    assert!(dead
        .messages
        .iter()
        .all(|m| m.properties.windows(7).any(|w| w == b"x-death")));
    assert_eq!(queue("rq.rej").unwrap().message_count, 2);
    assert_eq!(queue("rq.len").unwrap().message_count, 3);
    assert_eq!(
        queue("rq.purge").unwrap().message_count,
        2,
        "the held one and one after"
    );
    let a: Vec<&str> = queue("rq.a")
        .unwrap()
        .messages
        .iter()
        .map(|m| std::str::from_utf8(&m.body).unwrap())
        .collect();
    assert!(
        a.contains(&"tx-committed") && !a.contains(&"tx-rolled-back"),
        "{a:?}"
    );
    assert!(!ops
        .iter()
        .any(|op| matches!(op, warren_storage::Op::Spill { .. })));
    // Each cascade was derived, never recorded: rx.ad1 and rx.ad2 went with rq.tmp.
    assert!(!ops.iter().any(
        |op| matches!(op, warren_storage::Op::DeleteExchange { name, .. } if name.starts_with("rx.ad"))
    ));

    // As a replica gets them: encoded (the versioned op encoding) and decoded again.
    let shipped = warren_storage::op_codec::encode_ops(&ops).unwrap();
    let ops = warren_storage::op_codec::decode_ops(shipped).unwrap();
    // A fresh node starts with the default vhost, user and permissions (made before the
    // recording began), then applies what was recorded.
    let mut fresh = warren::broker::Broker::new();
    let mut fx = Vec::new();
    for op in warren::node::default_definitions(&fresh, &server.shared.config) {
        fresh.apply(&op, &mut fx).unwrap();
    }
    for op in &ops {
        fresh.apply(op, &mut fx).unwrap();
    }
    let replayed = fresh.replicated_view().unwrap();
    assert_eq!(replayed.exchanges, live.exchanges);
    assert_eq!(replayed.bindings, live.bindings);
    for (l, r) in live.queues.iter().zip(&replayed.queues) {
        assert_eq!(l, r, "queue {} differs", l.name);
    }
    assert_eq!(replayed, live);
}
