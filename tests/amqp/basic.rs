//! Issue 2 point 6: publish, consume, get, ack/nack/reject, recover, qos, round-robin.

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldArray, FieldTable, ShortString};
use lapin::BasicProperties;

async fn queue(ch: &lapin::Channel) -> ShortString {
    ch.queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap()
        .name()
        .clone()
}

async fn publish_n(ch: &lapin::Channel, q: &ShortString, n: usize) {
    for i in 0..n {
        ch.basic_publish(
            "".into(),
            q.clone(),
            Default::default(),
            i.to_string().as_bytes(),
            Default::default(),
        )
        .await
        .unwrap();
    }
}

fn body(d: &lapin::message::Delivery) -> String {
    String::from_utf8_lossy(&d.data).into_owned()
}

#[tokio::test]
async fn every_property_and_header_type_round_trips() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    let mut inner = FieldTable::default();
    inner.insert("deep".into(), AMQPValue::LongString("yes".into()));
    let mut headers = FieldTable::default();
    headers.insert("string".into(), AMQPValue::LongString("value".into()));
    headers.insert("int".into(), AMQPValue::LongInt(-42));
    headers.insert("long".into(), AMQPValue::LongLongInt(1 << 40));
    headers.insert("bool".into(), AMQPValue::Boolean(true));
    headers.insert("double".into(), AMQPValue::Double(1.5));
    headers.insert("timestamp".into(), AMQPValue::Timestamp(1_700_000_000));
    headers.insert("table".into(), AMQPValue::FieldTable(inner));
    headers.insert(
        "array".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            AMQPValue::LongString("two".into()),
        ])),
    );
    headers.insert("void".into(), AMQPValue::Void);
    headers.insert(
        "bytes".into(),
        AMQPValue::ByteArray(vec![0u8, 1, 255].into()),
    );
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(headers)
        .with_delivery_mode(2)
        .with_priority(7)
        .with_correlation_id("corr".into())
        .with_reply_to("replies".into())
        .with_expiration("600000".into())
        .with_message_id("id-1".into())
        .with_timestamp(1_700_000_001)
        .with_type("kind".into())
        .with_user_id("guest".into())
        .with_app_id("tests".into());
    ch.basic_publish(
        "".into(),
        q.clone(),
        Default::default(),
        b"payload",
        props.clone(),
    )
    .await
    .unwrap();
    let mut consumer = consume_no_ack(&ch, q.as_str(), "").await;
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.properties, props);
    assert_eq!(d.data, b"payload");
    assert!(!d.redelivered);
    assert_eq!(d.routing_key, q);
}

#[tokio::test]
async fn large_and_empty_bodies() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    ch.basic_publish(
        "".into(),
        q.clone(),
        Default::default(),
        &big,
        Default::default(),
    )
    .await
    .unwrap();
    ch.basic_publish(
        "".into(),
        q.clone(),
        Default::default(),
        b"",
        Default::default(),
    )
    .await
    .unwrap();
    let mut consumer = consume_no_ack(&ch, q.as_str(), "").await;
    assert_eq!(next_delivery(&mut consumer).await.data, big);
    assert!(next_delivery(&mut consumer).await.data.is_empty());
}

#[tokio::test]
async fn mandatory_unroutable_message_is_returned_with_312() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let confirm = ch
        .basic_publish(
            "amq.direct".into(),
            "nobody-listens".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"lost",
            BasicProperties::default().with_message_id("m1".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    let returned = confirm.take_message().expect("returned message");
    assert_eq!(returned.reply_code, 312);
    assert_eq!(returned.reply_text.as_str(), "NO_ROUTE");
    assert_eq!(returned.delivery.data, b"lost");
    assert_eq!(
        returned.delivery.properties.message_id(),
        &Some("m1".into())
    );
    // Not mandatory: silently dropped, still confirmed.
    let confirm = ch
        .basic_publish(
            "amq.direct".into(),
            "nobody".into(),
            Default::default(),
            b"x",
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack() && confirm.take_message().is_none());
}

#[tokio::test]
async fn consumer_tags_client_and_server_generated() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    let c = ch
        .basic_consume(
            q.clone(),
            "mine".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(c.tag().as_str(), "mine");
    let c = ch
        .basic_consume(
            q.clone(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(c.tag().as_str().starts_with("amq.ctag-"), "{}", c.tag());
}

#[tokio::test]
async fn reusing_a_consumer_tag_on_a_channel_is_530() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    let _held = ch
        .basic_consume(
            q.clone(),
            "dup".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let err = ch
        .basic_consume(
            q.clone(),
            "dup".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(530));
}

#[tokio::test]
async fn exclusive_consumer_keeps_others_out() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let name = unique("q");
    ch.queue_declare(
        name.clone().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // Keep the consumer: lapin cancels a consumer when it is dropped.
    let _held = ch
        .basic_consume(
            name.clone().into(),
            "".into(),
            BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let other = conn.create_channel().await.unwrap();
    let err = other
        .basic_consume(
            name.clone().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            403,
            format!("ACCESS_REFUSED - queue '{name}' in vhost '/' in exclusive use")
        )
    );
}

#[tokio::test]
async fn cancel_stops_deliveries() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    let mut consumer = consume_no_ack(&ch, q.as_str(), "c").await;
    publish_n(&ch, &q, 1).await;
    next_delivery(&mut consumer).await;
    ch.basic_cancel("c".into(), Default::default())
        .await
        .unwrap();
    publish_n(&ch, &q, 1).await;
    let msg = ch
        .basic_get(q.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(msg.is_some(), "after cancel the message stays in the queue");
}

#[tokio::test]
async fn get_ok_counts_and_get_empty() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    publish_n(&ch, &q, 3).await;
    for remaining in [2u32, 1, 0] {
        let m = ch
            .basic_get(q.clone(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("a message");
        assert_eq!(m.message_count, remaining);
    }
    assert!(ch
        .basic_get(q.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn nack_and_reject_requeue_to_the_original_place_marked_redelivered() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    publish_n(&ch, &q, 5).await;
    let mut tags = Vec::new();
    for _ in 0..3 {
        let m = ch
            .basic_get(q.clone(), Default::default())
            .await
            .unwrap()
            .unwrap();
        tags.push(m.delivery.delivery_tag);
    }
    // Reject #1 (requeue), nack #0 and up to #2 with multiple... in reverse to check ordering.
    ch.basic_reject(tags[1], BasicRejectOptions { requeue: true })
        .await
        .unwrap();
    ch.basic_nack(
        tags[2],
        BasicNackOptions {
            multiple: true,
            requeue: true,
        },
    )
    .await
    .unwrap();
    let mut seen = Vec::new();
    while let Some(m) = ch
        .basic_get(q.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        seen.push((body(&m.delivery), m.delivery.redelivered));
    }
    assert_eq!(
        seen,
        vec![
            ("0".into(), true),
            ("1".into(), true),
            ("2".into(), true),
            ("3".into(), false),
            ("4".into(), false)
        ]
    );
}

#[tokio::test]
async fn reject_without_requeue_drops_and_ack_multiple_acks_all() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    publish_n(&ch, &q, 4).await;
    let mut last = 0;
    for _ in 0..3 {
        last = ch
            .basic_get(q.clone(), Default::default())
            .await
            .unwrap()
            .unwrap()
            .delivery
            .delivery_tag;
    }
    ch.basic_ack(last - 1, BasicAckOptions { multiple: true })
        .await
        .unwrap();
    ch.basic_reject(last, BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let m = ch
        .basic_get(q.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(body(&m.delivery), "3");
    assert!(ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn acking_an_unknown_tag_is_406_on_the_channel() {
    // Raw frames: the 406 arrives asynchronously as channel.close, and a client library may
    // report it in different ways depending on timing.
    use amq_protocol::protocol::{basic, AMQPClass};
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 99,
            multiple: false,
        })),
    )
    .await;
    let close = raw.expect_channel_close(1).await;
    assert_eq!(
        (
            close.reply_code,
            close.reply_text.as_str(),
            close.class_id,
            close.method_id
        ),
        (406, "PRECONDITION_FAILED - unknown delivery tag 99", 60, 80)
    );
    raw.open_channel(2).await;
}

#[tokio::test]
async fn recover_requeues_unacked_messages() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    publish_n(&ch, &q, 2).await;
    let mut consumer = ch
        .basic_consume(
            q.clone(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let a = next_delivery(&mut consumer).await;
    let b = next_delivery(&mut consumer).await;
    assert!(!a.redelivered && !b.redelivered);
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    let a2 = next_delivery(&mut consumer).await;
    let b2 = next_delivery(&mut consumer).await;
    assert_eq!((body(&a2), a2.redelivered), ("0".into(), true));
    assert_eq!((body(&b2), b2.redelivered), ("1".into(), true));
}

#[tokio::test]
async fn prefetch_per_consumer_limits_unacked_deliveries() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    ch.basic_qos(2, BasicQosOptions { global: false })
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            q.clone(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish_n(&ch, &q, 5).await;
    let first = next_delivery(&mut consumer).await;
    next_delivery(&mut consumer).await;
    no_delivery(&mut consumer).await;
    first.ack(Default::default()).await.unwrap();
    assert_eq!(body(&next_delivery(&mut consumer).await), "2");
    no_delivery(&mut consumer).await;
}

#[tokio::test]
async fn global_prefetch_is_shared_by_the_channel() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q1 = queue(&ch).await;
    let q2 = queue(&ch).await;
    ch.basic_qos(3, BasicQosOptions { global: true })
        .await
        .unwrap();
    let mut c1 = ch
        .basic_consume(
            q1.clone(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut c2 = ch
        .basic_consume(
            q2.clone(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish_n(&ch, &q1, 2).await;
    publish_n(&ch, &q2, 2).await;
    next_delivery(&mut c1).await;
    next_delivery(&mut c1).await;
    next_delivery(&mut c2).await;
    no_delivery(&mut c2).await;
}

#[tokio::test]
async fn round_robin_among_consumers() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = queue(&ch).await;
    let opts = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut a = ch
        .basic_consume(q.clone(), "a".into(), opts, FieldTable::default())
        .await
        .unwrap();
    let mut b = ch
        .basic_consume(q.clone(), "b".into(), opts, FieldTable::default())
        .await
        .unwrap();
    publish_n(&ch, &q, 6).await;
    let mut got_a = Vec::new();
    let mut got_b = Vec::new();
    for _ in 0..3 {
        got_a.push(body(&next_delivery(&mut a).await));
        got_b.push(body(&next_delivery(&mut b).await));
    }
    assert_eq!(got_a, vec!["0", "2", "4"]);
    assert_eq!(got_b, vec!["1", "3", "5"]);
}

#[tokio::test]
async fn unacked_messages_return_in_order_when_the_channel_closes() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let setup = conn.create_channel().await.unwrap();
    let q = queue(&setup).await;
    publish_n(&setup, &q, 4).await;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            q.clone(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..4 {
        next_delivery(&mut consumer).await;
    }
    ch.close(200, "bye".into()).await.unwrap();
    let mut seen = Vec::new();
    while let Some(m) = setup
        .basic_get(q.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        seen.push((body(&m.delivery), m.delivery.redelivered));
    }
    assert_eq!(
        seen,
        (0..4).map(|i| (i.to_string(), true)).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn unacked_messages_return_when_the_connection_drops() {
    let server = TestServer::start().await;
    let keeper = server.connect().await;
    let kch = keeper.create_channel().await.unwrap();
    let q = queue(&kch).await;
    publish_n(&kch, &q, 2).await;
    {
        let conn = server.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let m = ch
            .basic_get(q.clone(), Default::default())
            .await
            .unwrap()
            .unwrap();
        assert!(!m.delivery.redelivered);
        conn.close(200, "bye".into()).await.unwrap();
    }
    let m = kch
        .basic_get(q.clone(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (body(&m.delivery), m.delivery.redelivered),
        ("0".into(), true)
    );
}

#[tokio::test]
async fn user_id_must_match_the_login() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let err = ch
        .basic_publish(
            "".into(),
            "anything".into(),
            Default::default(),
            b"x",
            BasicProperties::default().with_user_id("mallory".into()),
        )
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (406, "PRECONDITION_FAILED - user_id property set to 'mallory' but authenticated user was 'guest'".into())
    );
}

async fn consume_on(ch: &lapin::Channel, q: &str, tag: &str, no_ack: bool) -> lapin::Consumer {
    ch.basic_consume(
        q.into(),
        tag.into(),
        BasicConsumeOptions {
            no_ack,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
}

async fn publish_to(ch: &lapin::Channel, q: &str, body: &str) {
    ch.basic_publish(
        "".into(),
        q.into(),
        Default::default(),
        body.as_bytes(),
        BasicProperties::default(),
    )
    .await
    .unwrap();
}

/// basic.qos(global): while the channel's limit is reached, its no-ack consumers wait too
/// (they do not count against it), as RabbitMQ's limiter (the Java client's
/// QosTests.noAckObeysLimit); freed credit goes to the channel's queues in turn
/// (QosTests.fairness).
#[tokio::test]
async fn the_channel_limit_holds_no_ack_consumers_and_is_shared_fairly() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let setup = conn.create_channel().await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1, BasicQosOptions { global: true })
        .await
        .unwrap();
    let qs: Vec<String> = (0..3).map(|i| unique(&format!("glob{i}"))).collect();
    for q in &qs {
        setup
            .queue_declare(q.as_str().into(), Default::default(), FieldTable::default())
            .await
            .unwrap();
    }
    // One delivery unacked: the limit is reached; a no-ack consumer of the channel waits.
    publish_to(&setup, &qs[0], "held").await;
    let mut acking = consume_on(&ch, &qs[0], "acking", false).await;
    let held = next_delivery(&mut acking).await;
    let mut free = consume_on(&ch, &qs[1], "free", true).await;
    publish_to(&setup, &qs[1], "waits").await;
    no_delivery(&mut free).await;
    held.ack(BasicAckOptions::default()).await.unwrap();
    assert_eq!(body(&next_delivery(&mut free).await), "waits");
    ch.basic_cancel("free".into(), Default::default())
        .await
        .unwrap();
    // Three queues of six, one limit of one: each ack hands the credit to the next queue.
    for q in &qs {
        for i in 0..6 {
            publish_to(&setup, q, &format!("{q}-{i}")).await;
        }
    }
    let mut others = vec![
        consume_on(&ch, &qs[1], "c1", false).await,
        consume_on(&ch, &qs[2], "c2", false).await,
    ];
    let mut consumers = vec![acking];
    consumers.append(&mut others);
    let mut merged = futures::stream::select_all(consumers);
    let mut per_queue = std::collections::HashMap::<String, usize>::new();
    for _ in 0..9 {
        let d = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut merged))
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        *per_queue.entry(d.routing_key.to_string()).or_default() += 1;
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    for q in &qs {
        let n = per_queue.get(q).copied().unwrap_or(0);
        assert!(n >= 2, "{q} got {n} of 9: {per_queue:?}");
    }
}
