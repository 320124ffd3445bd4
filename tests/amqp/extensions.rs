//! Issue 4: RabbitMQ's extensions, through lapin (the pika suite in compat/ covers them too).

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use std::time::Duration;

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(v.into())
}

async fn declare(ch: &lapin::Channel, name: &str, a: FieldTable) -> ShortString {
    ch.queue_declare(name.into(), Default::default(), a)
        .await
        .unwrap()
        .name()
        .clone()
}

async fn publish(ch: &lapin::Channel, q: &str, body: &str, props: BasicProperties) {
    ch.basic_publish(
        "".into(),
        q.into(),
        Default::default(),
        body.as_bytes(),
        props,
    )
    .await
    .unwrap();
}

async fn get_body(ch: &lapin::Channel, q: &str) -> Option<String> {
    ch.basic_get(q.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .map(|m| String::from_utf8_lossy(&m.delivery.data).into_owned())
}

async fn wait_count(ch: &lapin::Channel, q: &str, want: u32) -> u32 {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let n = ch
            .queue_declare(
                q.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count();
        if n == want || tokio::time::Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn ttl_expires_messages_even_without_consumers() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("ttl");
    declare(&ch, &q, args(&[("x-message-ttl", AMQPValue::LongInt(200))])).await;
    publish(&ch, &q, "queue-ttl", BasicProperties::default()).await;
    publish(
        &ch,
        &q,
        "short",
        BasicProperties::default().with_expiration("50".into()),
    )
    .await;
    assert_eq!(
        wait_count(&ch, &q, 0).await,
        0,
        "both gone with nobody consuming"
    );
    let q2 = unique("ttl");
    declare(&ch, &q2, FieldTable::default()).await;
    publish(
        &ch,
        &q2,
        "kept",
        BasicProperties::default().with_expiration("60000".into()),
    )
    .await;
    assert_eq!(get_body(&ch, &q2).await.as_deref(), Some("kept"));
}

#[tokio::test]
async fn invalid_arguments_are_406_naming_the_argument() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    for (arg, value, reason) in [
        (
            "x-message-ttl",
            s("abc"),
            "\"expected integer, got longstr\"",
        ),
        (
            "x-max-length",
            AMQPValue::LongInt(-1),
            "{value_negative,-1}",
        ),
        ("x-expires", AMQPValue::LongInt(0), "{value_zero,0}"),
        (
            "x-max-priority",
            AMQPValue::LongInt(256),
            "{max_value_exceeded,256}",
        ),
        ("x-overflow", s("bogus"), "invalid_overflow"),
    ] {
        let ch = conn.create_channel().await.unwrap();
        let err = ch
            .queue_declare("bad-args".into(), Default::default(), args(&[(arg, value)]))
            .await
            .unwrap_err();
        assert_eq!(
            amqp_error(&err),
            (
                406,
                format!("PRECONDITION_FAILED - invalid arg '{arg}' for queue 'bad-args' in vhost '/': {reason}")
            )
        );
    }
}

/// Publish a message with `props` to a new queue that dead-letters to another through the
/// default exchange, reject it, and fetch it from there: (source queue, dead-letter queue,
/// the dead-lettered message).
async fn reject_to_dead_letter_queue(
    ch: &lapin::Channel,
    props: BasicProperties,
) -> (String, ShortString, lapin::message::BasicGetMessage) {
    reject_to_dead_letter_queue_with(ch, |_| props).await
}

/// `reject_to_dead_letter_queue` with properties made from the source queue's name.
async fn reject_to_dead_letter_queue_with(
    ch: &lapin::Channel,
    props: impl FnOnce(&str) -> BasicProperties,
) -> (String, ShortString, lapin::message::BasicGetMessage) {
    let dlq = declare(ch, &unique("dlq"), FieldTable::default()).await;
    let src = unique("src");
    declare(
        ch,
        &src,
        args(&[
            ("x-dead-letter-exchange", s("")),
            ("x-dead-letter-routing-key", s(dlq.as_str())),
        ]),
    )
    .await;
    publish(ch, &src, "rejected", props(&src)).await;
    let m = ch
        .basic_get(src.as_str().into(), Default::default())
        .await
        .unwrap()
        .unwrap();
    ch.basic_reject(
        m.delivery.delivery_tag,
        BasicRejectOptions { requeue: false },
    )
    .await
    .unwrap();
    assert_eq!(wait_count(ch, dlq.as_str(), 1).await, 1);
    let d = ch
        .basic_get(dlq.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    (src, dlq, d)
}

#[tokio::test]
async fn rejected_messages_are_dead_lettered_with_x_death() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (src, dlq, d) = reject_to_dead_letter_queue(
        &ch,
        BasicProperties::default().with_expiration("60000".into()),
    )
    .await;
    let h = d.delivery.properties.headers().clone().unwrap();
    let Some(AMQPValue::FieldArray(deaths)) = h.inner().get("x-death") else {
        panic!("no x-death: {h:?}");
    };
    let Some(AMQPValue::FieldTable(death)) = deaths.as_slice().first() else {
        panic!("empty x-death");
    };
    let field = |k: &str| death.inner().get(k).cloned();
    assert_eq!(field("count"), Some(AMQPValue::LongLongInt(1)));
    assert_eq!(field("reason"), Some(s("rejected")));
    assert_eq!(field("queue"), Some(s(&src)));
    assert_eq!(field("exchange"), Some(s("")));
    assert_eq!(
        field("routing-keys"),
        Some(AMQPValue::FieldArray(FieldArray::from(vec![s(&src)])))
    );
    assert_eq!(field("original-expiration"), Some(s("60000")));
    assert!(matches!(field("time"), Some(AMQPValue::Timestamp(_))));
    assert_eq!(h.inner().get("x-first-death-reason"), Some(&s("rejected")));
    assert_eq!(h.inner().get("x-first-death-queue"), Some(&s(&src)));
    assert_eq!(h.inner().get("x-last-death-reason"), Some(&s("rejected")));
    assert_eq!(h.inner().get("x-last-death-queue"), Some(&s(&src)));
    assert_eq!(
        d.delivery.properties.expiration(),
        &None,
        "expiration removed"
    );
    assert_eq!(d.delivery.routing_key, dlq);
}

/// A client's `x-death` whose count for this queue and reason is already at i64::MAX stays
/// there: `count + 1` wrapped to a negative count (and panicked in a debug build, the
/// message already out of its queue).
#[tokio::test]
async fn an_x_death_count_at_its_limit_stays_there() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (_, _, d) = reject_to_dead_letter_queue_with(&ch, |src| {
        let entry = AMQPValue::FieldTable(args(&[
            ("queue", s(src)),
            ("reason", s("rejected")),
            ("count", AMQPValue::LongLongInt(i64::MAX)),
        ]));
        let headers = args(&[("x-death", AMQPValue::FieldArray(vec![entry].into()))]);
        BasicProperties::default().with_headers(headers)
    })
    .await;
    let h = d.delivery.properties.headers().clone().unwrap();
    let Some(AMQPValue::FieldArray(deaths)) = h.inner().get("x-death") else {
        panic!("no x-death: {h:?}");
    };
    let Some(AMQPValue::FieldTable(death)) = deaths.as_slice().first() else {
        panic!("empty x-death");
    };
    assert_eq!(
        death.inner().get("count"),
        Some(&AMQPValue::LongLongInt(i64::MAX))
    );
}

/// Entries written by brokers before 3.8 (one per death, no `count`) are merged by queue and
/// reason with their number as the count, as RabbitMQ 3.10 does (the Java client's
/// `handlingOfXDeathHeadersFromEarlierVersions`).
#[tokio::test]
async fn old_style_x_death_entries_are_merged_by_queue_and_reason() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let old = |q: &str, reason: &str| {
        AMQPValue::FieldTable(args(&[
            ("queue", s(q)),
            ("reason", s(reason)),
            ("exchange", s("")),
        ]))
    };
    let deaths = vec![
        old("a", "expired"),
        old("b", "rejected"),
        old("a", "expired"),
        old("a", "expired"),
    ];
    let headers = args(&[("x-death", AMQPValue::FieldArray(deaths.into()))]);
    let (src, _, d) =
        reject_to_dead_letter_queue(&ch, BasicProperties::default().with_headers(headers)).await;
    let h = d.delivery.properties.headers().clone().unwrap();
    let Some(AMQPValue::FieldArray(deaths)) = h.inner().get("x-death") else {
        panic!("no x-death: {h:?}");
    };
    let summary: Vec<(String, String, i64)> = deaths
        .as_slice()
        .iter()
        .map(|d| {
            let AMQPValue::FieldTable(t) = d else {
                panic!("entry {d:?}")
            };
            let text = |k: &str| match t.inner().get(k) {
                Some(AMQPValue::LongString(v)) => v.to_string(),
                v => panic!("{k}: {v:?}"),
            };
            let count = match t.inner().get("count") {
                Some(AMQPValue::LongLongInt(n)) => *n,
                v => panic!("count: {v:?}"),
            };
            (text("queue"), text("reason"), count)
        })
        .collect();
    let entry = |q: &str, r: &str, n| (q.to_string(), r.to_string(), n);
    assert_eq!(
        summary,
        vec![
            entry(&src, "rejected", 1),
            entry("a", "expired", 3),
            entry("b", "rejected", 1),
        ]
    );
}

#[tokio::test]
async fn expired_and_overflowing_messages_are_dead_lettered() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let dlx = unique("dlx");
    ch.exchange_declare(
        dlx.clone().into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let dlq = declare(&ch, &unique("dlq"), FieldTable::default()).await;
    ch.queue_bind(
        dlq.clone(),
        dlx.clone().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = unique("lim");
    declare(
        &ch,
        &q,
        args(&[
            ("x-max-length", AMQPValue::LongInt(2)),
            ("x-dead-letter-exchange", s(&dlx)),
        ]),
    )
    .await;
    for b in ["1", "2", "3", "4"] {
        publish(&ch, &q, b, BasicProperties::default()).await;
    }
    assert_eq!(wait_count(&ch, dlq.as_str(), 2).await, 2);
    assert_eq!(
        get_body(&ch, dlq.as_str()).await.as_deref(),
        Some("1"),
        "oldest first"
    );
    assert_eq!(get_body(&ch, &q).await.as_deref(), Some("3"));
    let t = unique("ttl");
    declare(
        &ch,
        &t,
        args(&[
            ("x-message-ttl", AMQPValue::LongInt(10)),
            ("x-dead-letter-exchange", s(&dlx)),
        ]),
    )
    .await;
    publish(&ch, &t, "late", BasicProperties::default()).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut found = false;
    while tokio::time::Instant::now() < deadline && !found {
        while let Some(m) = ch
            .basic_get(dlq.clone(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            if m.delivery.data == b"late" {
                let h = m.delivery.properties.headers().clone().unwrap();
                assert_eq!(h.inner().get("x-first-death-reason"), Some(&s("expired")));
                found = true;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(found, "expired message dead-lettered");
}

#[tokio::test]
async fn reject_publish_nacks_the_publisher() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let q = unique("full");
    declare(
        &ch,
        &q,
        args(&[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", s("reject-publish")),
        ]),
    )
    .await;
    let first = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            Default::default(),
            b"1",
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(first.is_ack());
    let second = ch
        .basic_publish(
            "".into(),
            q.as_str().into(),
            Default::default(),
            b"2",
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(second.is_nack());
    assert_eq!(get_body(&ch, &q).await.as_deref(), Some("1"));
    assert_eq!(get_body(&ch, &q).await, None);
}

#[tokio::test]
async fn priorities_deliver_highest_first_fifo_within() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("prio");
    declare(&ch, &q, args(&[("x-max-priority", AMQPValue::LongInt(5))])).await;
    for (body, p) in [
        ("a0", 0u8),
        ("b5", 5),
        ("c1", 1),
        ("d5", 5),
        ("e9", 9),
        ("f", 255),
    ] {
        let props = if body == "f" {
            BasicProperties::default()
        } else {
            BasicProperties::default().with_priority(p)
        };
        publish(&ch, &q, body, props).await;
    }
    let mut got = Vec::new();
    while let Some(b) = get_body(&ch, &q).await {
        got.push(b);
    }
    assert_eq!(got, vec!["b5", "d5", "e9", "c1", "a0", "f"]);
}

#[tokio::test]
async fn consumer_priorities_and_single_active_consumer() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("cp");
    declare(&ch, &q, FieldTable::default()).await;
    let no_ack = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut low = ch
        .basic_consume(
            q.as_str().into(),
            "low".into(),
            no_ack,
            args(&[("x-priority", AMQPValue::LongInt(1))]),
        )
        .await
        .unwrap();
    let mut high = ch
        .basic_consume(
            q.as_str().into(),
            "high".into(),
            no_ack,
            args(&[("x-priority", AMQPValue::LongInt(10))]),
        )
        .await
        .unwrap();
    for b in ["1", "2", "3"] {
        publish(&ch, &q, b, BasicProperties::default()).await;
    }
    for _ in 0..3 {
        assert_eq!(next_delivery(&mut high).await.routing_key.as_str(), q);
    }
    no_delivery(&mut low).await;

    let sac = unique("sac");
    declare(
        &ch,
        &sac,
        args(&[("x-single-active-consumer", AMQPValue::Boolean(true))]),
    )
    .await;
    let ch2 = conn.create_channel().await.unwrap();
    let mut first = ch
        .basic_consume(
            sac.as_str().into(),
            "first".into(),
            no_ack,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut second = ch2
        .basic_consume(
            sac.as_str().into(),
            "second".into(),
            no_ack,
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&ch, &sac, "x", BasicProperties::default()).await;
    publish(&ch, &sac, "y", BasicProperties::default()).await;
    next_delivery(&mut first).await;
    next_delivery(&mut first).await;
    no_delivery(&mut second).await;
    ch.basic_cancel("first".into(), Default::default())
        .await
        .unwrap();
    publish(&ch, &sac, "z", BasicProperties::default()).await;
    assert_eq!(next_delivery(&mut second).await.data, b"z");
}

#[tokio::test]
async fn cc_and_bcc_route_to_more_queues_and_bcc_is_removed() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (a, b, c) = (unique("cc-a"), unique("cc-b"), unique("cc-c"));
    for q in [&a, &b, &c] {
        declare(&ch, q, FieldTable::default()).await;
    }
    let headers = args(&[
        ("CC", AMQPValue::FieldArray(FieldArray::from(vec![s(&b)]))),
        ("BCC", AMQPValue::FieldArray(FieldArray::from(vec![s(&c)]))),
    ]);
    publish(
        &ch,
        &a,
        "m",
        BasicProperties::default().with_headers(headers),
    )
    .await;
    for q in [&a, &b, &c] {
        let m = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .unwrap();
        let h = m.delivery.properties.headers().clone().unwrap();
        assert!(h.inner().contains_key("CC"));
        assert!(!h.inner().contains_key("BCC"), "BCC stripped");
        assert_eq!(
            m.delivery.routing_key.as_str(),
            a,
            "routing key stays the publish key"
        );
    }
}

#[tokio::test]
async fn direct_reply_to_round_trip() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let requester = conn.create_channel().await.unwrap();
    let responder = conn.create_channel().await.unwrap();
    let service = declare(&responder, &unique("rpc"), FieldTable::default()).await;
    let mut replies = consume_no_ack(&requester, "amq.rabbitmq.reply-to", "").await;
    publish(
        &requester,
        service.as_str(),
        "ping",
        BasicProperties::default().with_reply_to("amq.rabbitmq.reply-to".into()),
    )
    .await;
    assert_eq!(wait_count(&responder, service.as_str(), 1).await, 1);
    let req = responder
        .basic_get(service.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    let reply_to = req.delivery.properties.reply_to().clone().unwrap();
    assert!(
        reply_to.as_str().starts_with("amq.rabbitmq.reply-to."),
        "{reply_to}"
    );
    publish(
        &responder,
        reply_to.as_str(),
        "pong",
        BasicProperties::default(),
    )
    .await;
    let d = next_delivery(&mut replies).await;
    assert_eq!(d.data, b"pong");
    assert_eq!(d.routing_key, reply_to);
    // Without a reply consumer on the channel: 406.
    let lonely = conn.create_channel().await.unwrap();
    lonely.confirm_select(Default::default()).await.unwrap();
    let err = lonely
        .basic_publish(
            "".into(),
            service.clone(),
            Default::default(),
            b"x",
            BasicProperties::default().with_reply_to("amq.rabbitmq.reply-to".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            "PRECONDITION_FAILED - fast reply consumer does not exist".into()
        )
    );
}

#[tokio::test]
async fn unused_queues_expire() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("exp");
    declare(&ch, &q, args(&[("x-expires", AMQPValue::LongInt(100))])).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let err = ch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}

#[tokio::test]
async fn queue_types_quorum_rules_delivery_count_and_no_streams_yet() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("qq");
    let quorum = || {
        args(&[
            ("x-queue-type", s("quorum")),
            ("x-delivery-limit", AMQPValue::LongInt(1)),
        ])
    };
    let err = ch
        .queue_declare(q.as_str().into(), Default::default(), quorum())
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            format!(
                "PRECONDITION_FAILED - invalid property 'non-durable' for queue '{q}' in vhost '/'"
            )
        )
    );
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        quorum(),
    )
    .await
    .unwrap();
    publish(&ch, &q, "m", BasicProperties::default()).await;
    for expected in [0i64, 1] {
        let m = ch
            .basic_get(q.as_str().into(), Default::default())
            .await
            .unwrap()
            .unwrap();
        let h = m.delivery.properties.headers().clone().unwrap();
        assert_eq!(
            h.inner().get("x-delivery-count"),
            Some(&AMQPValue::LongLongInt(expected))
        );
        ch.basic_nack(
            m.delivery.delivery_tag,
            BasicNackOptions {
                requeue: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    // Returned more often than x-delivery-limit: gone (dead-lettered when a DLX is set).
    assert_eq!(wait_count(&ch, &q, 0).await, 0);
    let err = ch
        .queue_declare(
            "streamy".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args(&[("x-queue-type", s("stream"))]),
        )
        .await
        .unwrap_err();
    let (code, text) = amqp_error(&err);
    assert_eq!(code, 406);
    assert!(text.contains("stream queues are not supported"), "{text}");
}

#[tokio::test]
async fn consumer_ack_timeout_cancels_only_the_stuck_consumer() {
    let config = warren::Config {
        consumer_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let server = TestServer::start_with(config).await;
    let conn = server.connect().await;
    let stuck_ch = conn.create_channel().await.unwrap();
    let q = unique("slow");
    declare(&stuck_ch, &q, FieldTable::default()).await;
    let mut stuck = stuck_ch
        .basic_consume(
            q.as_str().into(),
            "stuck".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&stuck_ch, &q, "job", BasicProperties::default()).await;
    let first = next_delivery(&mut stuck).await;
    assert!(!first.redelivered);
    let other_ch = conn.create_channel().await.unwrap();
    let mut other = other_ch
        .basic_consume(
            q.as_str().into(),
            "other".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // The stuck consumer is cancelled (its stream ends) and its message goes to the other one.
    use futures::StreamExt;
    let end = tokio::time::timeout(WAIT, stuck.next()).await.unwrap();
    assert!(end.is_none(), "stuck consumer cancelled: {end:?}");
    let again = next_delivery(&mut other).await;
    assert_eq!(
        (again.data.as_slice(), again.redelivered),
        (&b"job"[..], true)
    );
    // Its channel is still usable.
    declare(&stuck_ch, &unique("still-open"), FieldTable::default()).await;
}

#[tokio::test]
async fn quorum_queues_refuse_global_qos() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = unique("qq-global");
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args(&[("x-queue-type", s("quorum"))]),
    )
    .await
    .unwrap();
    ch.basic_qos(10, BasicQosOptions { global: true })
        .await
        .unwrap();
    let err = ch
        .basic_consume(
            q.as_str().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            540,
            format!("NOT_IMPLEMENTED - queue '{q}' in vhost '/' does not support global qos")
        )
    );
}

/// Requeued messages count against x-max-length again: the head goes (drop-head), to the
/// dead-letter exchange with reason maxlen (the RabbitMQ Java client's QueueSizeLimit.requeue
/// and requeueWithDlx).
#[tokio::test]
async fn max_length_applies_again_after_a_requeue() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let dlq = declare(&ch, "", FieldTable::default()).await;
    let q = declare(
        &ch,
        "",
        args(&[
            ("x-max-length", AMQPValue::LongInt(2)),
            ("x-dead-letter-exchange", s("")),
            ("x-dead-letter-routing-key", s(dlq.as_str())),
        ]),
    )
    .await;
    publish(&ch, q.as_str(), "m1", BasicProperties::default()).await;
    publish(&ch, q.as_str(), "m2", BasicProperties::default()).await;
    let mut tags = Vec::new();
    for _ in 0..2 {
        let m = ch
            .basic_get(q.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .unwrap();
        tags.push(m.delivery.delivery_tag);
    }
    publish(&ch, q.as_str(), "m3", BasicProperties::default()).await;
    publish(&ch, q.as_str(), "m4", BasicProperties::default()).await;
    ch.basic_nack(
        tags[1],
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    assert_eq!(wait_count(&ch, q.as_str(), 2).await, 2);
    assert_eq!(get_body(&ch, q.as_str()).await.as_deref(), Some("m3"));
    assert_eq!(get_body(&ch, q.as_str()).await.as_deref(), Some("m4"));
    assert_eq!(wait_count(&ch, dlq.as_str(), 2).await, 2);
    assert_eq!(get_body(&ch, dlq.as_str()).await.as_deref(), Some("m1"));
    assert_eq!(get_body(&ch, dlq.as_str()).await.as_deref(), Some("m2"));
}

/// A message with TTL 0 reaches a consumer that is ready when it arrives; requeued, it has
/// expired and does not come back (TTLHandling.zeroTTLDelivery in the Java client's suite).
#[tokio::test]
async fn a_requeued_zero_ttl_message_expires() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = declare(&ch, "", args(&[("x-message-ttl", AMQPValue::LongInt(0))])).await;
    let mut consumer = ch
        .basic_consume(
            q.as_str().into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(&ch, q.as_str(), "now", BasicProperties::default()).await;
    let d = next_delivery(&mut consumer).await;
    assert_eq!(&d.data[..], b"now");
    // Straight back (most often within the same millisecond as the publish).
    d.reject(BasicRejectOptions { requeue: true })
        .await
        .unwrap();
    no_delivery(&mut consumer).await;
    assert_eq!(wait_count(&ch, q.as_str(), 0).await, 0);
}

/// Every exchange a message reaches matches all its keys (routing key, CC, BCC), as in
/// RabbitMQ: a CC key takes it through an exchange-to-exchange binding and the routing key
/// (or a BCC key) through the next (the Java client's CcRoutes.boundExchanges).
#[tokio::test]
async fn cc_and_bcc_keys_apply_at_every_exchange_of_a_chain() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let (x, y) = (unique("cc-x"), unique("cc-y"));
    for e in [&x, &y] {
        ch.exchange_declare(
            e.as_str().into(),
            ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    ch.exchange_bind(
        y.as_str().into(),
        x.as_str().into(),
        "k1".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = declare(&ch, "", FieldTable::default()).await;
    ch.queue_bind(
        q.clone(),
        y.as_str().into(),
        "k2".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for (key, header, list) in [("k2", "CC", "k1"), ("k1", "BCC", "k2")] {
        let headers = args(&[(
            header,
            AMQPValue::FieldArray(FieldArray::from(vec![s(list)])),
        )]);
        ch.basic_publish(
            x.as_str().into(),
            key.into(),
            Default::default(),
            b"m",
            BasicProperties::default().with_headers(headers),
        )
        .await
        .unwrap();
        assert_eq!(
            get_body(&ch, q.as_str()).await.as_deref(),
            Some("m"),
            "routing key {key} with {header} {list}"
        );
    }
}
