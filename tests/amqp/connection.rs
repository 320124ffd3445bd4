//! Issue 2 point 1-2: start-up, handshake, authentication, tuning, heartbeats, close.

use crate::common::*;
use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::AMQPValue;
use lapin::ConnectionProperties;
use std::time::{Duration, Instant};
use warren_protocol::{Frame, PROTOCOL_HEADER};

#[tokio::test]
async fn server_properties_and_capabilities() {
    let server = TestServer::start().await;
    let (_raw, tune, start) = Raw::handshake_with(server.addr, 0, 0, 0).await;
    assert_eq!((start.version_major, start.version_minor), (0, 9));
    let mechanisms = String::from_utf8_lossy(start.mechanisms.as_bytes()).to_string();
    assert!(mechanisms.split(' ').any(|m| m == "PLAIN"), "{mechanisms}");
    assert!(
        mechanisms.split(' ').any(|m| m == "AMQPLAIN"),
        "{mechanisms}"
    );
    let props = start.server_properties.inner();
    for key in ["product", "version", "platform", "copyright", "information"] {
        assert!(
            matches!(props.get(key), Some(AMQPValue::LongString(_))),
            "missing {key}"
        );
    }
    // Product "RabbitMQ" (clients gate RabbitMQ's extensions on it); Warren in `platform`.
    let text = |key: &str| match props.get(key) {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).to_string(),
        other => panic!("{key}: {other:?}"),
    };
    assert_eq!(text("product"), "RabbitMQ");
    assert!(
        text("version").starts_with("3.10.8+warren."),
        "{}",
        text("version")
    );
    assert!(
        text("platform").starts_with("Warren "),
        "{}",
        text("platform")
    );
    let Some(AMQPValue::FieldTable(caps)) = props.get("capabilities") else {
        panic!("no capabilities table");
    };
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        assert_eq!(
            caps.inner().get(cap),
            Some(&AMQPValue::Boolean(true)),
            "capability {cap}"
        );
    }
    assert_eq!(
        (tune.channel_max, tune.frame_max, tune.heartbeat),
        (2047, 131072, 60)
    );
}

#[tokio::test]
async fn wrong_protocol_header_gets_ours_back_and_the_socket_closed() {
    let server = TestServer::start().await;
    for header in [
        &b"AMQP\x00\x00\x09\x00"[..],
        b"AMQP\x00\x00\x08\x00",
        b"GET / HT",
    ] {
        let mut raw = Raw::tcp(server.addr).await;
        raw.send_bytes(header).await;
        let mut got = Vec::new();
        loop {
            let chunk = raw.read_some().await;
            if chunk.is_empty() {
                break;
            }
            got.extend_from_slice(&chunk);
        }
        assert_eq!(got, PROTOCOL_HEADER, "answer to {header:?}");
    }
}

#[tokio::test]
async fn bad_credentials_are_refused_with_403() {
    let server = TestServer::start().await;
    let url = format!("amqp://guest:wrong@{}/%2f", server.addr);
    let err = lapin::Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect_err("login must fail");
    let (code, text) = amqp_error(&err);
    assert_eq!(code, 403);
    assert!(
        text.starts_with("ACCESS_REFUSED - Login was refused"),
        "{text}"
    );
    let url = format!("amqp://nobody:guest@{}/%2f", server.addr);
    assert!(
        lapin::Connection::connect(&url, ConnectionProperties::default())
            .await
            .is_err()
    );
    // The server is unaffected.
    server.connect().await.create_channel().await.unwrap();
}

#[tokio::test]
async fn amqplain_login() {
    let server = TestServer::start().await;
    let url = format!("{}?auth_mechanism=amqplain", server.url());
    let conn = server.connect_url(&url).await;
    conn.create_channel().await.unwrap();
}

#[tokio::test]
async fn other_users_log_in_too() {
    // The loopback-only rule for guest is unit-tested in handlers::connection (a test cannot
    // connect from a non-loopback address here).
    let config = warren::Config {
        users: vec![
            ("guest".into(), "guest".into()),
            ("app".into(), "secret".into()),
        ],
        ..Default::default()
    };
    let server = TestServer::start_with(config).await;
    let url = format!("amqp://app:secret@{}/%2f", server.addr);
    server.connect_url(&url).await;
}

#[tokio::test]
async fn missing_vhost_is_530() {
    let server = TestServer::start().await;
    let url = format!("amqp://guest:guest@{}/nope", server.addr);
    let err = lapin::Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect_err("no such vhost");
    assert_eq!(reply_code(&err), Some(530));
}

#[tokio::test]
async fn client_lowers_frame_max_and_large_messages_are_split() {
    let server = TestServer::start().await;
    let url = format!("{}?frame_max=4096", server.url());
    let conn = server.connect_url(&url).await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), Default::default())
        .await
        .unwrap();
    let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    ch.basic_publish(
        "".into(),
        q.name().clone(),
        Default::default(),
        &body,
        Default::default(),
    )
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
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.data, body);
}

#[tokio::test]
async fn deliveries_respect_a_negotiated_frame_max() {
    let server = TestServer::start().await;
    let (mut raw, _, _) = Raw::handshake_with(server.addr, 10, 4096, 0).await;
    raw.open_channel(1).await;
    use amq_protocol::protocol::{basic, queue};
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "split".into(),
            exclusive: true,
            ..Default::default()
        })),
    )
    .await;
    raw.recv_method().await.unwrap();
    // Publish 10,000 bytes in three body frames.
    let mut out = warren_protocol::OutBuffer::new();
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            routing_key: "split".into(),
            ..Default::default()
        })),
    );
    out.content_slice(1, &[0, 0], &[7u8; 10_000], 4096);
    raw.send_bytes(&out.to_vec()).await;
    raw.send(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: "split".into(),
            no_ack: true,
        })),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((1, AMQPClass::Basic(basic::AMQPMethod::GetOk(_))))
    ));
    assert!(matches!(
        raw.recv().await,
        Some(Frame::Header {
            body_size: 10_000,
            ..
        })
    ));
    let mut total = 0;
    let mut frames = 0;
    while total < 10_000 {
        match raw.recv().await {
            Some(Frame::Body(1, part)) => {
                assert!(part.len() <= 4096 - 8);
                total += part.len();
                frames += 1;
            }
            other => panic!("expected body, got {other:?}"),
        }
    }
    assert_eq!((total, frames), (10_000, 3));
}

#[tokio::test]
async fn frame_max_below_minimum_or_above_server_max_is_refused() {
    let server = TestServer::start().await;
    for frame_max in [1024u32, 1 << 20] {
        let mut raw = Raw::tcp(server.addr).await;
        raw.send_bytes(&PROTOCOL_HEADER).await;
        raw.recv_method().await.unwrap();
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: Default::default(),
                mechanism: "PLAIN".into(),
                response: "\0guest\0guest".into(),
                locale: "en_US".into(),
            })),
        )
        .await;
        raw.recv_method().await.unwrap();
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 0,
                frame_max,
                heartbeat: 0,
            })),
        )
        .await;
        let close = raw.expect_connection_close().await;
        assert_eq!(close.reply_code, 530, "frame_max {frame_max}");
    }
}

#[tokio::test]
async fn server_sends_heartbeats_and_drops_a_silent_peer() {
    let server = TestServer::start().await;
    let (mut raw, _, _) = Raw::handshake_with(server.addr, 0, 0, 1).await;
    let started = Instant::now();
    let mut heartbeats = 0;
    loop {
        match raw.recv().await {
            Some(Frame::Heartbeat(0)) => heartbeats += 1,
            Some(other) => panic!("unexpected {other:?}"),
            None => break,
        }
    }
    let elapsed = started.elapsed();
    assert!(heartbeats >= 1, "the server sends heartbeats");
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(5),
        "dropped after two missed intervals, not {elapsed:?}"
    );
}

#[tokio::test]
async fn a_peer_that_sends_heartbeats_stays_connected() {
    let server = TestServer::start().await;
    let (mut raw, _, _) = Raw::handshake_with(server.addr, 0, 0, 1).await;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        raw.send_bytes(&[8, 0, 0, 0, 0, 0, 0, 206]).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    raw.open_channel(1).await;
}

/// connection.close from the client: its state goes (exclusive queues included) before the
/// close-ok; then, as in RabbitMQ, the socket stays open until the client closes it (frames are
/// dropped, a repeated close gets close-ok again: clients that close from several threads at
/// once, like amqp091-go's `TestConcurrentClose`, rely on it).
#[tokio::test]
async fn close_from_the_client_gets_close_ok_and_the_socket_waits_for_the_client() {
    use amq_protocol::protocol::queue;
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "mine".into(),
            exclusive: true,
            ..Default::default()
        })),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))))
    ));
    let close = || {
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        }))
    };
    raw.send(0, close()).await;
    assert!(matches!(
        raw.recv_method().await,
        Some((0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))))
    ));
    // The exclusive queue went with the connection's state, before the close-ok.
    let other = server.connect().await;
    let ch = other.create_channel().await.unwrap();
    ch.queue_declare(
        "mine".into(),
        lapin::options::QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        Default::default(),
    )
    .await
    .unwrap();
    // Still open: anything else is dropped, a second close is answered too.
    raw.open_channel_no_wait(2).await;
    raw.send(0, close()).await;
    assert!(matches!(
        raw.recv_method().await,
        Some((0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))))
    ));
    raw.stream.shutdown().await.unwrap();
    raw.expect_eof().await;
}

#[tokio::test]
async fn shutdown_closes_connections_with_320() {
    let mut server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    let stop = tokio::spawn(async move {
        server.stop().await;
    });
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 320);
    assert!(close.reply_text.as_str().starts_with("CONNECTION_FORCED"));
    tokio::time::timeout(WAIT, stop).await.unwrap().unwrap();
}

#[tokio::test]
async fn update_secret_from_a_client_is_answered() {
    let server = TestServer::start().await;
    let mut raw = Raw::handshake(server.addr).await;
    raw.send(
        0,
        AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(
            connection::UpdateSecret {
                new_secret: "guest".into(),
                reason: "rotation".into(),
            },
        )),
    )
    .await;
    assert!(matches!(
        raw.recv_method().await,
        Some((
            0,
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(_))
        ))
    ));
    raw.open_channel(1).await;
}

/// Issue 12: methods only a server sends (and blocked/unblocked, and a close-ok nobody asked
/// for) on an open connection are 504 CHANNEL_ERROR naming the method, as RabbitMQ 3.10
/// answers them (Warren answered 503 before).
#[tokio::test]
async fn server_side_connection_methods_from_a_client_are_504() {
    let server = TestServer::start().await;
    let methods = [
        (
            connection::AMQPMethod::Blocked(connection::Blocked {
                reason: "low memory".into(),
            }),
            60,
        ),
        (
            connection::AMQPMethod::Unblocked(connection::Unblocked {}),
            61,
        ),
        (connection::AMQPMethod::CloseOk(connection::CloseOk {}), 51),
        (
            connection::AMQPMethod::Tune(connection::Tune {
                channel_max: 0,
                frame_max: 131072,
                heartbeat: 0,
            }),
            30,
        ),
        (connection::AMQPMethod::OpenOk(connection::OpenOk {}), 41),
    ];
    for (method, id) in methods {
        let mut raw = Raw::handshake(server.addr).await;
        raw.send(0, AMQPClass::Connection(method)).await;
        let close = raw.expect_connection_close().await;
        assert_eq!(
            (
                close.reply_code,
                close.reply_text.as_str(),
                close.class_id,
                close.method_id
            ),
            (
                504,
                "CHANNEL_ERROR - unexpected method in connection state running",
                10,
                id
            )
        );
    }
}

/// Large bodies are kept as the publisher's frames (not concatenated) and written from that
/// memory: every path must still hand out the exact bytes: a consumer with the server's
/// frame_max (slices shared), a client with a smaller frame_max (re-split), two queues sharing
/// one stored body, and the store after a restart.
#[tokio::test]
async fn large_bodies_arrive_intact_on_every_path() {
    let mut server = TestServer::start().await;
    let body: Vec<u8> = (0..1_000_003u32).map(|i| (i * 31 % 253) as u8).collect();
    {
        let conn = server.connect().await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        let durable = lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        for q in ["big-a", "big-b"] {
            ch.queue_declare(q.into(), durable, Default::default())
                .await
                .unwrap();
            ch.queue_bind(
                q.into(),
                "amq.fanout".into(),
                "".into(),
                Default::default(),
                Default::default(),
            )
            .await
            .unwrap();
        }
        for _ in 0..3 {
            let confirm = ch
                .basic_publish(
                    "amq.fanout".into(),
                    "".into(),
                    Default::default(),
                    &body,
                    lapin::BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap();
            assert!(confirm.await.unwrap().is_ack());
        }
        // Server frame_max: the deliveries carry the publisher's own slices.
        let mut consumer = consume_no_ack(&ch, "big-a", "").await;
        for _ in 0..3 {
            assert!(next_delivery(&mut consumer).await.data == body);
        }
        conn.close(200, "bye".into()).await.unwrap();
    }
    // A smaller frame_max: the same bytes, split again.
    {
        let url = format!("{}?frame_max=4096", server.url());
        let conn = server.connect_url(&url).await;
        let ch = conn.create_channel().await.unwrap();
        let got = ch
            .basic_get("big-b".into(), Default::default())
            .await
            .unwrap()
            .expect("a message");
        assert!(got.delivery.data == body);
        got.delivery.ack(Default::default()).await.unwrap();
        conn.close(200, "bye".into()).await.unwrap();
    }
    // And from the store.
    server = server.restart().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for _ in 0..2 {
        let got = ch
            .basic_get("big-b".into(), Default::default())
            .await
            .unwrap()
            .expect("a message after restart");
        assert!(got.delivery.data == body);
        got.delivery.ack(Default::default()).await.unwrap();
    }
}

/// Before tune-ok, frames are limited to 4096 bytes (the protocol's minimum frame size), as
/// in RabbitMQ: a larger connection.start-ok gets no connection.tune (the RabbitMQ Java
/// client's FrameMax.rejectLargeFramesDuringConnectionNegotiation).
#[tokio::test]
async fn a_start_ok_larger_than_4096_bytes_is_refused() {
    let server = TestServer::start().await;
    let mut raw = Raw::tcp(server.addr).await;
    raw.send_bytes(&PROTOCOL_HEADER).await;
    assert!(matches!(
        raw.recv_method().await,
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Start(_))))
    ));
    let mut props = amq_protocol::types::FieldTable::default();
    props.insert(
        "padding".into(),
        AMQPValue::LongString("x".repeat(4200).into()),
    );
    raw.send(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: props,
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        })),
    )
    .await;
    loop {
        match raw.recv().await {
            None => break,
            Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                assert_eq!(c.reply_code, 501);
                break;
            }
            Some(Frame::Heartbeat(_)) => continue,
            other => panic!("expected the connection refused, got {other:?}"),
        }
    }
}
