//! Issue 2 point 7: publisher confirms and transactions.

use crate::common::*;
use amq_protocol::protocol::{basic, confirm, queue, AMQPClass};
use lapin::options::*;
use lapin::types::FieldTable;
use warren_protocol::OutBuffer;

#[tokio::test]
async fn every_publish_is_confirmed_with_its_sequence_number() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((1, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))))
    ));
    // 50 publishes in one write: acks may be coalesced with `multiple`.
    let mut out = OutBuffer::new();
    for _ in 0..50 {
        out.method(
            1,
            &AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "amq.fanout".into(),
                ..Default::default()
            })),
        );
        out.content_slice(1, &[0, 0], b"m", 131072);
    }
    raw.send_bytes(&out.to_vec()).await;
    let mut confirmed = 0u64;
    while confirmed < 50 {
        match raw.recv_method().await {
            Some((1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))) => {
                assert!(a.delivery_tag > confirmed);
                if !a.multiple {
                    assert_eq!(a.delivery_tag, confirmed + 1);
                }
                confirmed = a.delivery_tag;
            }
            other => panic!("expected basic.ack, got {other:?}"),
        }
    }
    assert_eq!(confirmed, 50);
    // One more, alone: acked singly with tag 51.
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "amq.fanout".into(),
            ..Default::default()
        })),
    )
    .await;
    let mut out = OutBuffer::new();
    out.content_slice(1, &[0, 0], b"m", 131072);
    raw.send_bytes(&out.to_vec()).await;
    match raw.recv_method().await {
        Some((1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))) => {
            assert_eq!((a.delivery_tag, a.multiple), (51, false));
        }
        other => panic!("expected basic.ack, got {other:?}"),
    }
}

#[tokio::test]
async fn lapin_confirms() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let mut pending = Vec::new();
    for i in 0..200u32 {
        pending.push(
            ch.basic_publish(
                "".into(),
                q.name().clone(),
                Default::default(),
                &i.to_be_bytes(),
                Default::default(),
            )
            .await
            .unwrap(),
        );
    }
    for p in pending {
        assert!(p.await.unwrap().is_ack());
    }
    let q = ch
        .queue_declare(
            q.name().clone(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 200);
}

#[tokio::test]
async fn tx_publishes_and_acks_take_effect_on_commit_only() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let observer = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap()
        .name()
        .clone();
    let count = |ch: lapin::Channel, q: lapin::types::ShortString| async move {
        ch.queue_declare(
            q,
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
    };
    ch.tx_select().await.unwrap();
    ch.basic_publish(
        "".into(),
        q.clone(),
        Default::default(),
        b"a",
        Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(count(observer.clone(), q.clone()).await, 0);
    ch.tx_commit().await.unwrap();
    assert_eq!(count(observer.clone(), q.clone()).await, 1);
    ch.basic_publish(
        "".into(),
        q.clone(),
        Default::default(),
        b"b",
        Default::default(),
    )
    .await
    .unwrap();
    ch.tx_rollback().await.unwrap();
    ch.tx_commit().await.unwrap();
    assert_eq!(
        count(observer.clone(), q.clone()).await,
        1,
        "rolled back publish is gone"
    );
    // Acks inside a transaction.
    let m = ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .unwrap();
    ch.basic_ack(m.delivery.delivery_tag, Default::default())
        .await
        .unwrap();
    ch.tx_rollback().await.unwrap();
    // Rolled-back ack: still unacked; recover puts it back.
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    assert_eq!(count(observer.clone(), q.clone()).await, 1);
    let m = ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .unwrap();
    assert!(m.delivery.redelivered);
    ch.basic_ack(m.delivery.delivery_tag, Default::default())
        .await
        .unwrap();
    ch.tx_commit().await.unwrap();
    assert_eq!(count(observer.clone(), q.clone()).await, 0);
}

#[tokio::test]
async fn confirm_and_tx_on_one_channel_is_406() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.tx_select().await.unwrap();
    let err = ch.confirm_select(Default::default()).await.unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            "PRECONDITION_FAILED - cannot switch from tx to confirm mode".into()
        )
    );
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let err = ch.tx_select().await.unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            "PRECONDITION_FAILED - cannot switch from confirm to tx mode".into()
        )
    );
}

#[tokio::test]
async fn commit_without_select_is_406() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Tx(amq_protocol::protocol::tx::AMQPMethod::Commit(
            amq_protocol::protocol::tx::Commit {},
        )),
    )
    .await;
    let close = raw.expect_channel_close(1).await;
    assert_eq!(
        (close.reply_code, close.class_id, close.method_id),
        (406, 90, 20)
    );
    // The connection stays usable.
    raw.open_channel(2).await;
    raw.send(
        2,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare::default())),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((2, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))))
    ));
}

/// Acks in a transaction, as RabbitMQ: the tag is checked at once (406 unknown delivery tag
/// on the ack, not at commit), and an acked-but-uncommitted delivery is not redelivered by
/// basic.recover (the RabbitMQ Java client's InvalidAcksTx and
/// Transactions.redeliverAckedUncommitted).
#[tokio::test]
async fn tx_acks_are_checked_at_once_and_recover_skips_acked_uncommitted() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap()
        .name()
        .clone();
    for body in [b"a", b"b"] {
        ch.basic_publish(
            "".into(),
            q.clone(),
            Default::default(),
            body,
            Default::default(),
        )
        .await
        .unwrap();
    }
    ch.tx_select().await.unwrap();
    let a = ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .unwrap();
    let b = ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .unwrap();
    ch.basic_ack(a.delivery.delivery_tag, Default::default())
        .await
        .unwrap();
    ch.basic_recover(BasicRecoverOptions { requeue: true })
        .await
        .unwrap();
    // Only "b" came back; "a" is acked (not yet committed).
    let again = ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&again.delivery.data[..], b"b");
    assert!(again.delivery.redelivered);
    assert!(ch
        .basic_get(q.clone(), Default::default())
        .await
        .unwrap()
        .is_none());
    ch.tx_commit().await.unwrap();
    let _ = b;
    // A tag acked twice in one transaction: 406 at the second ack.
    ch.basic_ack(again.delivery.delivery_tag, Default::default())
        .await
        .unwrap();
    ch.basic_ack(again.delivery.delivery_tag, Default::default())
        .await
        .unwrap();
    let err = ch.tx_commit().await.unwrap_err();
    assert_refused_after_unanswered(
        &err,
        406,
        &format!(
            "PRECONDITION_FAILED - unknown delivery tag {}",
            again.delivery.delivery_tag
        ),
    );
    // An unknown tag: 406 too, on a fresh channel.
    let ch = conn.create_channel().await.unwrap();
    ch.tx_select().await.unwrap();
    ch.basic_ack(123456, Default::default()).await.unwrap();
    let err = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_refused_after_unanswered(
        &err,
        406,
        "PRECONDITION_FAILED - unknown delivery tag 123456",
    );
    // The connection carries on.
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
}
