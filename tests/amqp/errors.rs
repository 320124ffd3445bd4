//! Issue 2 point 8: every error code, each closing exactly what the spec says, and never
//! affecting other clients.

use crate::common::*;
use amq_protocol::protocol::{basic, channel, queue, AMQPClass};
use lapin::types::FieldTable;
use warren_protocol::OutBuffer;

/// A bystander connection with a consumer, to show other clients carry on.
struct Bystander {
    _conn: lapin::Connection,
    ch: lapin::Channel,
    queue: lapin::types::ShortString,
}

impl Bystander {
    async fn new(server: &TestServer) -> Self {
        let conn = server.connect().await;
        let ch = conn.create_channel().await.unwrap();
        let queue = ch
            .queue_declare("".into(), Default::default(), FieldTable::default())
            .await
            .unwrap()
            .name()
            .clone();
        ch.basic_publish(
            "".into(),
            queue.clone(),
            Default::default(),
            b"kept",
            Default::default(),
        )
        .await
        .unwrap();
        Bystander {
            _conn: conn,
            ch,
            queue,
        }
    }

    async fn still_fine(&self) {
        let m = self
            .ch
            .basic_get(self.queue.clone(), Default::default())
            .await
            .unwrap()
            .expect("message still there");
        assert_eq!(m.delivery.data, b"kept");
        self.ch
            .basic_reject(
                m.delivery.delivery_tag,
                lapin::options::BasicRejectOptions { requeue: true },
            )
            .await
            .unwrap();
    }
}

async fn expect_hard(raw: &mut Raw, code: u16) -> amq_protocol::protocol::connection::Close {
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, code, "{close:?}");
    raw.expect_eof().await;
    close
}

#[tokio::test]
async fn frame_larger_than_frame_max_is_501() {
    let server = TestServer::start().await;
    let bystander = Bystander::new(&server).await;
    let (mut raw, _, _) = Raw::handshake_with(server.addr, 0, 4096, 0).await;
    raw.open_channel(1).await;
    let mut frame = vec![3u8, 0, 1];
    frame.extend_from_slice(&8000u32.to_be_bytes());
    frame.extend_from_slice(&[0u8; 8000]);
    frame.push(206);
    raw.send_bytes(&frame).await;
    let close = expect_hard(&mut raw, 501).await;
    assert_eq!(
        close.reply_text.as_str(),
        "FRAME_ERROR - type 3, all octets = <<>>: {frame_too_large,8000,4088}"
    );
    assert_eq!((close.class_id, close.method_id), (0, 0));
    bystander.still_fine().await;
}

#[tokio::test]
async fn bad_frame_end_is_501() {
    let server = TestServer::start().await;
    let bystander = Bystander::new(&server).await;
    let mut raw = Raw::handshake(server.addr).await;
    let mut out = OutBuffer::new();
    out.method(
        1,
        &AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    let mut bytes = out.to_vec();
    let last = bytes.len() - 1;
    bytes[last] = 0x00;
    raw.send_bytes(&bytes).await;
    expect_hard(&mut raw, 501).await;
    bystander.still_fine().await;
}

#[tokio::test]
async fn unknown_frame_type_is_501() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.send_bytes(&[9, 0, 0, 0, 0, 0, 0, 206]).await;
    expect_hard(&mut raw, 501).await;
}

#[tokio::test]
async fn malformed_method_arguments_are_501_naming_the_method() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    // queue.declare whose queue-name length runs past the payload.
    raw.send_bytes(&[1, 0, 1, 0, 0, 0, 6, 0, 50, 0, 10, 0, 0, 206])
        .await;
    // RabbitMQ: 501 FRAME_ERROR "cannot decode ..." with the method's ids.
    let close = expect_hard(&mut raw, 501).await;
    assert_eq!(
        close.reply_text.as_str(),
        "FRAME_ERROR - cannot decode <<0,0>>"
    );
    assert_eq!((close.class_id, close.method_id), (50, 10));
}

#[tokio::test]
async fn undecodable_message_properties_are_502() {
    let server = TestServer::start().await;
    let bystander = Bystander::new(&server).await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish::default())),
    )
    .await;
    // Properties with the headers flag set and a table holding field type 'Z' (no such type).
    let mut props = vec![0x20, 0x00];
    let table = [&[1u8, b'k', b'Z'][..], &[0, 0, 0, 0][..]].concat();
    props.extend_from_slice(&(table.len() as u32).to_be_bytes());
    props.extend_from_slice(&table);
    let mut out = OutBuffer::new();
    out.content_slice(1, &props, b"x", 131072);
    raw.send_bytes(&out.to_vec()).await;
    let close = expect_hard(&mut raw, 502).await;
    assert!(
        close.reply_text.as_str().starts_with("SYNTAX_ERROR"),
        "{close:?}"
    );
    assert_eq!((close.class_id, close.method_id), (60, 40));
    bystander.still_fine().await;
}

#[tokio::test]
async fn unknown_method_is_540() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send_bytes(&[1, 0, 1, 0, 0, 0, 4, 0, 50, 0, 99, 206])
        .await;
    let close = expect_hard(&mut raw, 540).await;
    assert_eq!((close.class_id, close.method_id), (50, 99));
}

#[tokio::test]
async fn prefetch_size_is_540() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    // basic.qos with prefetch_size 1000, prefetch_count 0, global false.
    raw.send_bytes(&[
        1, 0, 1, 0, 0, 0, 11, 0, 60, 0, 10, 0, 0, 3, 232, 0, 0, 0, 206,
    ])
    .await;
    let close = expect_hard(&mut raw, 540).await;
    assert_eq!(
        close.reply_text.as_str(),
        "NOT_IMPLEMENTED - prefetch_size!=0 (1000)"
    );
    assert_eq!((close.class_id, close.method_id), (60, 10));
}

#[tokio::test]
async fn immediate_publish_is_540() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            immediate: true,
            ..Default::default()
        })),
    )
    .await;
    let close = expect_hard(&mut raw, 540).await;
    assert_eq!((close.class_id, close.method_id), (60, 40));
}

#[tokio::test]
async fn content_header_without_publish_is_505() {
    let server = TestServer::start().await;
    let bystander = Bystander::new(&server).await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    let mut out = OutBuffer::new();
    out.content_slice(1, &[0, 0], b"orphan", 131072);
    raw.send_bytes(&out.to_vec()).await;
    let close = expect_hard(&mut raw, 505).await;
    assert_eq!(
        close.reply_text.as_str(),
        "UNEXPECTED_FRAME - expected method frame, got non method frame instead"
    );
    bystander.still_fine().await;
}

#[tokio::test]
async fn body_without_header_is_505() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send_bytes(&[3, 0, 1, 0, 0, 0, 1, b'x', 206]).await;
    expect_hard(&mut raw, 505).await;
}

#[tokio::test]
async fn method_where_content_is_expected_is_505() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish::default())),
    )
    .await;
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare::default())),
    )
    .await;
    let close = expect_hard(&mut raw, 505).await;
    assert_eq!(
        close.reply_text.as_str(),
        "UNEXPECTED_FRAME - expected content header for class 60, got non content header frame instead"
    );
    assert_eq!((close.class_id, close.method_id), (60, 40));
}

#[tokio::test]
async fn heartbeat_on_a_channel_is_505() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.send_bytes(&[8, 0, 1, 0, 0, 0, 0, 206]).await;
    let close = expect_hard(&mut raw, 505).await;
    assert_eq!(
        close.reply_text.as_str(),
        "UNEXPECTED_FRAME - type 8, all octets = <<>>"
    );
}

#[tokio::test]
async fn connection_method_on_a_channel_is_503() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Open(
            amq_protocol::protocol::connection::Open {
                virtual_host: "/".into(),
            },
        )),
    )
    .await;
    expect_hard(&mut raw, 503).await;
}

#[tokio::test]
async fn channel_errors_close_only_their_channel_naming_the_method() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.open_channel(2).await;
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "missing".into(),
            passive: true,
            ..Default::default()
        })),
    )
    .await;
    let close = raw.expect_channel_close(1).await;
    assert_eq!(
        (close.reply_code, close.class_id, close.method_id),
        (404, 50, 10)
    );
    // Frames on the closing channel are ignored until close-ok.
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare::default())),
    )
    .await;
    raw.send(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await;
    // Channel 2 works, and channel 1 can be opened again.
    raw.send(
        2,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare::default())),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((2, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))))
    ));
    raw.open_channel(1).await;
}

#[tokio::test]
async fn a_client_that_stops_reading_does_not_hurt_others() {
    let server = TestServer::start().await;
    let bystander = Bystander::new(&server).await;
    // The stalled client consumes with no-ack from a queue we fill, but never reads.
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "flood".into(),
            ..Default::default()
        })),
    )
    .await;
    raw.recv_method().await.unwrap();
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: "flood".into(),
            no_ack: true,
            ..Default::default()
        })),
    )
    .await;
    let publisher = server.connect().await;
    let ch = publisher.create_channel().await.unwrap();
    let body = vec![0u8; 64 * 1024];
    for _ in 0..500 {
        ch.basic_publish(
            "".into(),
            "flood".into(),
            Default::default(),
            &body,
            Default::default(),
        )
        .await
        .unwrap();
    }
    // 32 MB were published; the server handed out only a bounded part and keeps the rest queued.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let q = ch
        .queue_declare(
            "flood".into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(q.message_count() > 300, "held back: {}", q.message_count());
    bystander.still_fine().await;
    // Once the client reads again, it receives everything.
    let mut received = 0usize;
    while received < 500 {
        match raw.recv().await {
            Some(warren_protocol::Frame::Method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Deliver(_)),
            )) => received += 1,
            Some(_) => {}
            None => panic!("closed"),
        }
    }
}

/// Issue 12: a content frame on a channel that is not open (never opened, or closed) closes the
/// connection with 505, naming no method, as RabbitMQ 3.10 does (Warren answered 504 before).
/// On a channel closed by the broker and waiting for the client's close-ok, content is dropped
/// (amqp091-go's suite pipelines publishes into such a channel).
#[tokio::test]
async fn content_frames_on_a_channel_that_is_not_open_are_505() {
    let server = TestServer::start().await;
    let bystander = Bystander::new(&server).await;
    for state in ["never-opened", "closed"] {
        for header in [true, false] {
            let mut raw = Raw::handshake(server.addr).await;
            match state {
                "closed" => {
                    raw.open_channel(5).await;
                    raw.send(
                        5,
                        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                            reply_code: 200,
                            reply_text: "bye".into(),
                            class_id: 0,
                            method_id: 0,
                        })),
                    )
                    .await;
                    assert!(matches!(
                        raw.recv_method().await,
                        Some((5, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))))
                    ));
                }
                "closing" => {
                    raw.open_channel(5).await;
                    raw.send(
                        5,
                        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                            queue: "missing-queue".into(),
                            passive: true,
                            ..Default::default()
                        })),
                    )
                    .await;
                    assert_eq!(raw.expect_channel_close(5).await.reply_code, 404);
                }
                _ => {}
            }
            let mut out = OutBuffer::new();
            if header {
                out.content_slice(5, &[0, 0], b"", 131072);
            } else {
                out.content_slice(5, &[0, 0], b"hello", 131072);
            }
            let bytes = out.to_vec();
            // The body-only case sends just the body frame (after the header's 7+12+2+1 bytes).
            let frames = if header { &bytes[..] } else { &bytes[22..] };
            raw.send_bytes(frames).await;
            let close = expect_hard(&mut raw, 505).await;
            assert_eq!(
                (close.reply_text.as_str(), close.class_id, close.method_id),
                (
                    "UNEXPECTED_FRAME - expected method frame, got non method frame instead",
                    0,
                    0
                ),
                "{state} header={header}"
            );
        }
    }
    bystander.still_fine().await;
}

/// Issue 12: content frames on channel 0 are named as RabbitMQ names them.
#[tokio::test]
async fn content_frames_on_channel_zero_are_505_with_their_octets() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    let mut out = OutBuffer::new();
    out.content_slice(0, &[0, 0], b"hello", 131072);
    let bytes = out.to_vec();
    raw.send_bytes(&bytes[22..]).await;
    let close = expect_hard(&mut raw, 505).await;
    assert_eq!(
        close.reply_text.as_str(),
        "UNEXPECTED_FRAME - type 3, all octets = <<\"hello\">>"
    );
    let mut raw = Raw::handshake(server.addr).await;
    raw.send_bytes(&bytes[..22]).await;
    let close = expect_hard(&mut raw, 505).await;
    assert_eq!(
        close.reply_text.as_str(),
        "UNEXPECTED_FRAME - type 2, all octets = <<0,60,0,0,0,0,0,0,0,0,0,5,0,0>>"
    );
}
