//! Issue 2 point 3: channels.

use crate::common::*;
use amq_protocol::protocol::{channel, queue, AMQPClass};
use lapin::options::ChannelFlowOptions;

#[tokio::test]
async fn many_channels_open_and_close() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let mut channels = Vec::new();
    for _ in 0..100 {
        channels.push(conn.create_channel().await.unwrap());
    }
    for ch in &channels {
        ch.close(200, "bye".into()).await.unwrap();
    }
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare("".into(), Default::default(), Default::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn channel_flow_active_is_acknowledged_and_pausing_is_refused_like_rabbitmq() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    assert!(ch
        .channel_flow(ChannelFlowOptions { active: true })
        .await
        .unwrap());
    // RabbitMQ answers flow(active=false) with 540 NOT_IMPLEMENTED on the connection.
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: false })),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(
        (
            close.reply_code,
            close.reply_text.as_str(),
            close.class_id,
            close.method_id
        ),
        (540, "NOT_IMPLEMENTED - active=false", 20, 20)
    );
}

#[tokio::test]
async fn method_on_a_channel_that_is_not_open_is_504() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.send(
        5,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "x".into(),
            ..Default::default()
        })),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 504);
    assert_eq!((close.class_id, close.method_id), (50, 10));
}

#[tokio::test]
async fn second_open_on_the_same_channel_is_504() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 504);
    assert_eq!((close.class_id, close.method_id), (20, 10));
}

#[tokio::test]
async fn channel_max_limits_how_many_channels_are_open() {
    // As RabbitMQ: channel_max bounds the number of open channels, not the channel numbers.
    let server = TestServer::start().await;
    let (mut raw, _, _) = Raw::handshake_with(server.addr, 2, 131072, 0).await;
    raw.open_channel(7).await;
    raw.open_channel(3000).await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 530);
    assert_eq!(
        close.reply_text.as_str(),
        "NOT_ALLOWED - number of channels opened (2) has reached the negotiated channel_max (2)"
    );
}

#[tokio::test]
async fn unsolicited_channel_close_ok_is_503() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(
        (close.reply_code, close.class_id, close.method_id),
        (503, 20, 41)
    );
}

#[tokio::test]
async fn queue_method_on_channel_zero_is_504() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.send(
        0,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare::default())),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(
        (close.reply_code, close.class_id, close.method_id),
        (504, 50, 10)
    );
}

/// The server closes a channel (an error) while the client closes it too: each close gets its
/// close-ok, the server forgets the channel only at the client's close-ok (not at its close),
/// and the connection carries on (amqp091-go's `TestChannelExceptionWithCloseIssue43`).
#[tokio::test]
async fn crossing_channel_closes_are_both_answered_and_the_connection_carries_on() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    // A channel error and the client's own close, back to back.
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "no-such-queue".into(),
            passive: true,
            ..Default::default()
        })),
    )
    .await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    let close = raw.expect_channel_close(1).await;
    assert_eq!(close.reply_code, 404);
    assert!(matches!(
        raw.recv_method().await,
        Some((1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))))
    ));
    // The client's answer to the server's close: not a 504 on an unknown channel.
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await;
    raw.open_channel(2).await;
    raw.open_channel(1).await;
}

#[tokio::test]
async fn a_closed_channel_number_can_be_reused() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "ok".into(),
            class_id: 0,
            method_id: 0,
        })),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))))
    ));
    raw.open_channel(1).await;
}
