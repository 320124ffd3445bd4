//! Issue 2 point 5: queues.

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

async fn publish(ch: &lapin::Channel, queue: &str, body: &[u8]) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        Default::default(),
        body,
        Default::default(),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn server_named_queue() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    assert!(q.name().as_str().starts_with("amq.gen-"), "{}", q.name());
    assert_eq!((q.message_count(), q.consumer_count()), (0, 0));
}

#[tokio::test]
async fn declare_ok_reports_messages_and_consumers() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let name = unique("counts");
    ch.queue_declare(
        name.clone().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    for _ in 0..3 {
        publish(&ch, &name, b"m").await;
    }
    ch.wait_for_confirms().await.unwrap();
    let q = ch
        .queue_declare(name.clone().into(), passive(), FieldTable::default())
        .await
        .unwrap();
    assert_eq!((q.message_count(), q.consumer_count()), (3, 0));
    let consumer_ch = conn.create_channel().await.unwrap();
    consumer_ch.basic_qos(1, Default::default()).await.unwrap();
    let _consumer = consumer_ch
        .basic_consume(
            name.clone().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let q = ch
        .queue_declare(name.clone().into(), passive(), FieldTable::default())
        .await
        .unwrap();
    assert_eq!((q.message_count(), q.consumer_count()), (2, 1));
}

#[tokio::test]
async fn passive_declare_of_a_missing_queue_is_404() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .queue_declare("missing-q".into(), passive(), FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (404, "NOT_FOUND - no queue 'missing-q' in vhost '/'".into())
    );
}

#[tokio::test]
async fn redeclare_with_other_properties_is_406() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let name = unique("q");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        name.clone().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let err = ch
        .queue_declare(
            name.clone().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(406));
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(10));
    let err = ch
        .queue_declare(name.clone().into(), Default::default(), args)
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(406));
    // Unknown arguments are not compared (as RabbitMQ).
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("my-own-arg".into(), AMQPValue::LongInt(1));
    ch.queue_declare(name.clone().into(), Default::default(), args)
        .await
        .unwrap();
}

#[tokio::test]
async fn reserved_queue_names_are_403() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .queue_declare("amq.mine".into(), Default::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            403,
            "ACCESS_REFUSED - queue name 'amq.mine' contains reserved prefix 'amq.*'".into()
        )
    );
}

#[tokio::test]
async fn exclusive_queue_is_locked_to_its_connection_and_goes_with_it() {
    let server = TestServer::start().await;
    let owner = server.connect().await;
    let ch = owner.create_channel().await.unwrap();
    let name = unique("excl");
    ch.queue_declare(
        name.clone().into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let other = server.connect().await;
    let och = other.create_channel().await.unwrap();
    let err = och
        .queue_declare(name.clone().into(), passive(), FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(405));
    let och = other.create_channel().await.unwrap();
    let err = och
        .basic_consume(
            name.clone().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(405));
    owner.close(200, "bye".into()).await.unwrap();
    // Gone with its connection (the close is processed before close-ok is sent).
    let och = other.create_channel().await.unwrap();
    let err = och
        .queue_declare(name.clone().into(), passive(), FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}

#[tokio::test]
async fn auto_delete_queue_goes_when_its_last_consumer_cancels() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let name = unique("ad");
    ch.queue_declare(
        name.clone().into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let _c1 = ch
        .basic_consume(
            name.clone().into(),
            "c1".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _c2 = ch
        .basic_consume(
            name.clone().into(),
            "c2".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    ch.basic_cancel("c1".into(), Default::default())
        .await
        .unwrap();
    ch.queue_declare(name.clone().into(), passive(), FieldTable::default())
        .await
        .unwrap();
    ch.basic_cancel("c2".into(), Default::default())
        .await
        .unwrap();
    let err = ch
        .queue_declare(name.clone().into(), passive(), FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}

#[tokio::test]
async fn bind_unbind_purge_delete() {
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
    ch.queue_bind(
        name.clone().into(),
        "amq.direct".into(),
        "k".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    for _ in 0..4 {
        ch.basic_publish(
            "amq.direct".into(),
            "k".into(),
            Default::default(),
            b"m",
            Default::default(),
        )
        .await
        .unwrap();
    }
    ch.wait_for_confirms().await.unwrap();
    ch.queue_unbind(
        name.clone().into(),
        "amq.direct".into(),
        "k".into(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.basic_publish(
        "amq.direct".into(),
        "k".into(),
        Default::default(),
        b"m",
        Default::default(),
    )
    .await
    .unwrap();
    ch.wait_for_confirms().await.unwrap();
    assert_eq!(
        ch.queue_purge(name.clone().into(), Default::default())
            .await
            .unwrap(),
        4
    );
    publish(&ch, &name, b"again").await;
    ch.wait_for_confirms().await.unwrap();
    assert_eq!(
        ch.queue_delete(name.clone().into(), Default::default())
            .await
            .unwrap(),
        1
    );
    // Deleting a queue that does not exist answers delete-ok with 0, as RabbitMQ.
    assert_eq!(
        ch.queue_delete(name.clone().into(), Default::default())
            .await
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn bind_to_missing_things_is_404() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .queue_bind(
            "no-queue".into(),
            "amq.direct".into(),
            "k".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let err = ch
        .queue_bind(
            q.name().clone(),
            "no-exchange".into(),
            "k".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}

#[tokio::test]
async fn delete_if_unused_and_if_empty() {
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
    let _c = ch
        .basic_consume(
            name.clone().into(),
            "c".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let err = ch
        .queue_delete(
            name.clone().into(),
            QueueDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            format!("PRECONDITION_FAILED - queue '{name}' in vhost '/' in use")
        )
    );
    let ch = conn.create_channel().await.unwrap();
    publish(&ch, &name, b"m").await;
    let err = ch
        .queue_delete(
            name.clone().into(),
            QueueDeleteOptions {
                if_empty: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            format!("PRECONDITION_FAILED - queue '{name}' in vhost '/' not empty")
        )
    );
}

#[tokio::test]
async fn deleting_a_queue_notifies_its_consumers() {
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
    let mut consumer = ch
        .basic_consume(
            name.clone().into(),
            "c".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let other = conn.create_channel().await.unwrap();
    other
        .queue_delete(name.clone().into(), Default::default())
        .await
        .unwrap();
    // lapin ends the consumer stream when the server cancels it (consumer_cancel_notify).
    use futures::StreamExt;
    let next = tokio::time::timeout(WAIT, consumer.next()).await.unwrap();
    assert!(next.is_none(), "consumer stream ends: {next:?}");
}

/// RabbitMQ removes CR and LF from the names in declare, delete and bindings (the RabbitMQ Java
/// client's QueueLifecycle and ExchangeDeclare tests rely on it); declare-ok names the result.
#[tokio::test]
async fn names_lose_cr_and_lf_in_declare_delete_and_bindings() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            "crlf\n_q\r".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.name().as_str(), "crlf_q");
    ch.exchange_declare(
        "crlf_x\r\n".into(),
        lapin::ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    ch.queue_declare("crlf_q".into(), passive, FieldTable::default())
        .await
        .unwrap();
    ch.exchange_declare(
        "crlf_x".into(),
        lapin::ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        "crl\nf_q".into(),
        "\ncrlf_x".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.basic_publish(
        "crlf_x".into(),
        "".into(),
        Default::default(),
        b"m",
        Default::default(),
    )
    .await
    .unwrap();
    let got = ch
        .basic_get("crlf_q".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(got.is_some(), "the binding made with CR/LF names routes");
    ch.queue_delete("crlf_q\n".into(), Default::default())
        .await
        .unwrap();
    let err = ch
        .queue_declare("crlf_q".into(), passive, FieldTable::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}
