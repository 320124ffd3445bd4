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
async fn channel_flow_pauses_and_resumes_deliveries() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), Default::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            q.name().clone(),
            "".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
    let active = ch
        .channel_flow(ChannelFlowOptions { active: false })
        .await
        .unwrap();
    assert!(!active);
    let publisher = conn.create_channel().await.unwrap();
    publisher
        .basic_publish(
            "".into(),
            q.name().clone(),
            Default::default(),
            b"x",
            Default::default(),
        )
        .await
        .unwrap();
    no_delivery(&mut consumer).await;
    assert!(ch
        .channel_flow(ChannelFlowOptions { active: true })
        .await
        .unwrap());
    assert_eq!(next_delivery(&mut consumer).await.data, b"x");
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
async fn channel_above_channel_max_is_refused() {
    let server = TestServer::start().await;
    let (mut raw, _, _) = Raw::handshake_with(server.addr, 10, 131072, 0).await;
    raw.open_channel(10).await;
    raw.send(
        11,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
    .await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 504);
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
