//! Issue 2 point 4: routing by each exchange type, exchange-to-exchange bindings.

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::ExchangeKind;

async fn bound_queue(
    ch: &lapin::Channel,
    exchange: &str,
    key: &str,
    args: FieldTable,
) -> ShortString {
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap()
        .name()
        .clone();
    ch.queue_bind(
        q.clone(),
        exchange.into(),
        key.into(),
        Default::default(),
        args,
    )
    .await
    .unwrap();
    q
}

async fn count(ch: &lapin::Channel, q: &ShortString) -> u32 {
    ch.queue_declare(
        q.clone(),
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

async fn publish(ch: &lapin::Channel, exchange: &str, key: &str, headers: Option<FieldTable>) {
    let mut props = lapin::BasicProperties::default();
    if let Some(h) = headers {
        props = props.with_headers(h);
    }
    ch.basic_publish(exchange.into(), key.into(), Default::default(), b"m", props)
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test]
async fn topic_routing_like_rabbitmq() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let x = unique("topic");
    ch.exchange_declare(
        x.clone().into(),
        ExchangeKind::Topic,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let cases: &[(&str, &[&str], &[&str])] = &[
        ("a.*.c", &["a.b.c", "a..c"], &["a.c", "a.b.b.c"]),
        ("a.#", &["a", "a.b", "a.b.c"], &["b.a", "ab"]),
        ("#", &["", "x", "x.y.z"], &[]),
        ("*", &["x"], &["", "x.y"]),
        ("*.#", &["x", "x.y"], &[""]),
        ("#.#", &["", "a.b"], &[]),
        ("a.#.b", &["a.b", "a.x.b", "a.x.y.b"], &["a.b.c"]),
        ("*.*", &["a.b", "a."], &["a", "a.b.c"]),
    ];
    for (pattern, hits, misses) in cases {
        let q = bound_queue(&ch, &x, pattern, FieldTable::default()).await;
        for key in *hits {
            publish(&ch, &x, key, None).await;
        }
        for key in *misses {
            publish(&ch, &x, key, None).await;
        }
        assert_eq!(count(&ch, &q).await, hits.len() as u32, "pattern {pattern}");
        ch.queue_delete(q, Default::default()).await.unwrap();
    }
}

#[tokio::test]
async fn many_matching_bindings_deliver_once() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let q = bound_queue(&ch, "amq.topic", "a.#", FieldTable::default()).await;
    for key in ["a.*", "#", "a.b"] {
        ch.queue_bind(
            q.clone(),
            "amq.topic".into(),
            key.into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    publish(&ch, "amq.topic", "a.b", None).await;
    assert_eq!(count(&ch, &q).await, 1);
}

#[tokio::test]
async fn headers_routing_all_and_any() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let table = |pairs: &[(&str, &str)]| {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        t
    };
    let all = bound_queue(
        &ch,
        "amq.headers",
        "",
        table(&[("x-match", "all"), ("a", "1"), ("b", "2")]),
    )
    .await;
    let any = bound_queue(
        &ch,
        "amq.match",
        "",
        table(&[("x-match", "any"), ("a", "1"), ("b", "2")]),
    )
    .await;
    let all_x = bound_queue(
        &ch,
        "amq.headers",
        "",
        table(&[("x-match", "all-with-x"), ("x-k", "v")]),
    )
    .await;
    publish(
        &ch,
        "amq.headers",
        "",
        Some(table(&[("a", "1"), ("b", "2")])),
    )
    .await;
    publish(&ch, "amq.headers", "", Some(table(&[("a", "1")]))).await;
    publish(&ch, "amq.headers", "", Some(table(&[("x-k", "v")]))).await;
    publish(&ch, "amq.match", "", Some(table(&[("b", "2")]))).await;
    publish(&ch, "amq.match", "", Some(table(&[("c", "3")]))).await;
    assert_eq!(count(&ch, &all).await, 1);
    assert_eq!(count(&ch, &any).await, 1);
    assert_eq!(count(&ch, &all_x).await, 1);
}

#[tokio::test]
async fn direct_fanout_and_default_exchange() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let d1 = bound_queue(&ch, "amq.direct", "k1", FieldTable::default()).await;
    let d2 = bound_queue(&ch, "amq.direct", "k2", FieldTable::default()).await;
    let f1 = bound_queue(&ch, "amq.fanout", "ignored", FieldTable::default()).await;
    let f2 = bound_queue(&ch, "amq.fanout", "", FieldTable::default()).await;
    publish(&ch, "amq.direct", "k1", None).await;
    publish(&ch, "amq.fanout", "whatever", None).await;
    publish(&ch, "", d2.as_str(), None).await;
    assert_eq!(count(&ch, &d1).await, 1);
    assert_eq!(count(&ch, &d2).await, 1);
    assert_eq!(count(&ch, &f1).await, 1);
    assert_eq!(count(&ch, &f2).await, 1);
    // Binding to the default exchange is not allowed.
    let err = ch
        .queue_bind(
            d1.clone(),
            "".into(),
            "k".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(403));
}

#[tokio::test]
async fn exchange_to_exchange_bindings_route_and_unbind() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let src = unique("src");
    let dst = unique("dst");
    ch.exchange_declare(
        src.clone().into(),
        ExchangeKind::Topic,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_declare(
        dst.clone().into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = bound_queue(&ch, &dst, "", FieldTable::default()).await;
    ch.exchange_bind(
        dst.clone().into(),
        src.clone().into(),
        "logs.#".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // A cycle back to the source must not loop.
    ch.exchange_bind(
        src.clone().into(),
        dst.clone().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish(&ch, &src, "logs.app", None).await;
    publish(&ch, &src, "metrics.app", None).await;
    assert_eq!(count(&ch, &q).await, 1);
    ch.exchange_unbind(
        dst.clone().into(),
        src.clone().into(),
        "logs.#".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    publish(&ch, &src, "logs.app", None).await;
    assert_eq!(count(&ch, &q).await, 1);
}
