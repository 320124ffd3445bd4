//! Issue 12: defects found by abuse testing (a hostile client, an unlucky operator), each with
//! the test that failed before its fix.

use crate::common::*;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use std::time::Duration;
use warren::Config;

async fn durable_queue(ch: &lapin::Channel, name: &str, args: FieldTable) {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
}

async fn publish_confirmed(ch: &lapin::Channel, exchange: &str, key: &str, body: &[u8]) {
    ch.confirm_select(Default::default()).await.unwrap();
    let confirm = ch
        .basic_publish(
            exchange.into(),
            key.into(),
            Default::default(),
            body,
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap();
    assert!(tokio::time::timeout(WAIT, confirm)
        .await
        .unwrap()
        .unwrap()
        .is_ack());
}

/// Poll `f` until it holds (bounded by `WAIT`).
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Point 1: a panic inside one connection's handling (injected with the broker lock held) is
/// caught at the task boundary: its client gets 541 INTERNAL_ERROR instead of waiting for
/// ever, its exclusive queue goes, its unacked deliveries come back to their queue, its
/// registry entries are removed, and every other client carries on.
#[tokio::test]
async fn a_panic_in_a_connection_task_closes_it_with_541_and_leaks_nothing() {
    let server = TestServer::start_with(Config {
        panic_on_declare: Some("boom".into()),
        ..Default::default()
    })
    .await;
    let work = unique("work");
    let other = server.connect().await;
    let och = other.create_channel().await.unwrap();
    durable_queue(&och, &work, FieldTable::default()).await;
    for body in [b"one", b"two"] {
        publish_confirmed(&och, "", &work, body).await;
    }

    let victim = server.connect().await;
    let ch = victim.create_channel().await.unwrap();
    let mine = unique("mine");
    ch.queue_declare(
        mine.as_str().into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    // One delivery to a consumer and one basic.get, neither acked.
    ch.basic_qos(1, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            work.as_str().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let first = next_delivery(&mut consumer).await;
    assert_eq!(first.data, b"one");
    let ch2 = victim.create_channel().await.unwrap();
    let got = ch2
        .basic_get(work.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(got.delivery.data, b"two");
    assert_eq!(server.shared.connections.read().len(), 2);

    let e = tokio::time::timeout(
        WAIT,
        ch.queue_declare("boom".into(), Default::default(), FieldTable::default()),
    )
    .await
    .expect("the client must not wait for ever")
    .unwrap_err();
    assert_eq!(amqp_error(&e).0, 541, "{e:?}");

    // Its state is released: the exclusive queue can be declared by another connection ...
    let mut redeclared = false;
    for _ in 0..50 {
        let c = other.create_channel().await.unwrap();
        if c.queue_declare(
            mine.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .is_ok()
        {
            redeclared = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        redeclared,
        "the panicked connection's exclusive queue stayed"
    );
    // ... its unacked messages are back, marked redelivered, in order ...
    for body in [b"one", b"two"] {
        let m = och
            .basic_get(work.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .expect("the message came back");
        assert_eq!(m.delivery.data, body);
        assert!(m.delivery.redelivered);
    }
    // ... and it is gone from the registries (what the management API counts and lists).
    let shared = server.shared.clone();
    eventually("the registries forget the connection", move || {
        shared.connections.read().len() == 1 && shared.outboxes.read().len() == 1
    })
    .await;
    assert_eq!(server.shared.broker.lock().connection_totals().0, 1);
}

/// Point 1: a dead-letter routing key longer than a short string (255 bytes) is accepted at
/// declare, as RabbitMQ accepts it; a message dead-lettered with it reaches its queue, and
/// basic.get hands it out with the key cut to 255 bytes, as basic.deliver does, instead of
/// panicking the connection.
#[tokio::test]
async fn a_long_dead_letter_routing_key_is_cut_on_get_and_deliver() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let dlx = unique("dlx");
    ch.exchange_declare(
        dlx.as_str().into(),
        lapin::ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let dead = unique("dead");
    durable_queue(&ch, &dead, FieldTable::default()).await;
    ch.queue_bind(
        dead.as_str().into(),
        dlx.as_str().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let key = "k".repeat(300);
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(dlx.as_str().into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(key.as_str().into()),
    );
    let src = unique("src");
    durable_queue(&ch, &src, args).await;
    for body in [b"get".as_slice(), b"deliver"] {
        publish_confirmed(&ch, "", &src, body).await;
        let m = ch
            .basic_get(src.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message");
        ch.basic_reject(
            m.delivery.delivery_tag,
            BasicRejectOptions { requeue: false },
        )
        .await
        .unwrap();
    }
    let got = ch
        .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the dead-lettered message");
    assert_eq!(got.delivery.data, b"get");
    assert_eq!(got.delivery.routing_key.as_str(), &key[..255]);
    ch.basic_ack(got.delivery.delivery_tag, Default::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            dead.as_str().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.data, b"deliver");
    assert_eq!(d.routing_key.as_str(), &key[..255]);
    d.ack(Default::default()).await.unwrap();
    // The connection is still usable.
    ch.queue_declare(
        dead.as_str().into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

/// Whether `user:pass` may log in (an AMQP handshake to the end).
async fn can_log_in(addr: std::net::SocketAddr, user: &str, pass: &str) -> Option<u16> {
    let url = format!("amqp://{user}:{pass}@{addr}/%2f");
    match tokio::time::timeout(
        WAIT,
        lapin::Connection::connect(&url, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("login timed out")
    {
        Ok(c) => {
            let _ = c.close(200, "bye".into()).await;
            None
        }
        Err(e) => Some(reply_code(&e).unwrap_or(0)),
    }
}

/// Point 7: a default user given on the first start of an empty data folder is created
/// instead of guest, and the folder keeps it: later starts with other settings change nothing
/// (RabbitMQ's default_user applies to a fresh database only).
#[tokio::test]
async fn the_default_user_replaces_guest_on_a_fresh_data_folder_and_stays() {
    let server = TestServer::start_with(Config {
        users: vec![("alice".into(), "s3cret".into())],
        ..Default::default()
    })
    .await;
    assert_eq!(can_log_in(server.addr, "alice", "s3cret").await, None);
    assert_eq!(can_log_in(server.addr, "alice", "wrong").await, Some(403));
    assert_eq!(can_log_in(server.addr, "guest", "guest").await, Some(403));
    // Restarted with the default settings (guest): the folder's users are what counts.
    let server = server.restart_with(Config::default()).await;
    assert_eq!(can_log_in(server.addr, "alice", "s3cret").await, None);
    assert_eq!(can_log_in(server.addr, "guest", "guest").await, Some(403));
    // And a fresh folder with the defaults has guest.
    let fresh = TestServer::start().await;
    assert_eq!(can_log_in(fresh.addr, "guest", "guest").await, None);
    assert_eq!(can_log_in(fresh.addr, "alice", "s3cret").await, Some(403));
}

/// Point 7: the binary takes the default user from flags and from the environment.
#[tokio::test]
async fn the_default_user_comes_from_flags_or_environment() {
    for by_env in [false, true] {
        let data = tempfile::tempdir().unwrap();
        let flags = ["--default-user", "alice", "--default-pass", "s3cret"];
        let mut b = if by_env {
            spawn_binary_env(
                data.path(),
                &[],
                &[
                    ("WARREN_DEFAULT_USER", "alice"),
                    ("WARREN_DEFAULT_PASS", "s3cret"),
                ],
            )
            .await
        } else {
            spawn_binary(data.path(), &flags).await
        };
        let addr: std::net::SocketAddr = b
            .url
            .trim_start_matches("amqp://guest:guest@")
            .trim_end_matches("/%2f")
            .parse()
            .unwrap();
        assert_eq!(can_log_in(addr, "alice", "s3cret").await, None, "{by_env}");
        assert_eq!(can_log_in(addr, "guest", "guest").await, Some(403));
        let _ = b.child.kill();
        let _ = b.child.wait();
    }
}

/// Point 6: past `connection_max`, connection.open is refused with RabbitMQ's 530 and its
/// text; the connections in place carry on, and a place freed is taken again.
#[tokio::test]
async fn connection_open_past_the_connection_limit_is_refused_with_530() {
    let server = TestServer::start_with(Config {
        connection_max: Some(3),
        ..Default::default()
    })
    .await;
    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(server.connect().await);
    }
    let e = lapin::Connection::connect(&server.url(), lapin::ConnectionProperties::default())
        .await
        .expect_err("a fourth connection");
    let (code, text) = amqp_error(&e);
    assert_eq!(code, 530);
    assert!(
        text.contains("node connection limit (3) is reached"),
        "{text}"
    );
    // Those in place still work.
    let ch = open[0].create_channel().await.unwrap();
    ch.queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    open.pop().unwrap().close(200, "bye".into()).await.unwrap();
    let mut ok = false;
    for _ in 0..50 {
        if let Ok(c) =
            lapin::Connection::connect(&server.url(), lapin::ConnectionProperties::default()).await
        {
            open.push(c);
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "the freed place was not given again");
}

/// Point 6: sockets past the limit and the handshakes it leaves room for are closed at once
/// (no descriptor is held for them and nobody hangs), while open connections carry on.
#[tokio::test]
async fn sockets_past_the_limit_are_closed_at_once() {
    let server = TestServer::start_with(Config {
        connection_max: Some(2),
        ..Default::default()
    })
    .await;
    let conn = server.connect().await;
    // 2 + 2/8 + 8 = 10 sockets at once; one is the open connection above.
    let mut idle = Vec::new();
    for _ in 0..9 {
        idle.push(Raw::tcp(server.addr).await);
    }
    // Let the accept loop take them all.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = Raw::tcp(server.addr).await;
    // Closed without an answer (expect_eof fails on a frame or on a wait past WAIT).
    extra.expect_eof().await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    drop(idle);
}

/// Also from issue 12: a PLAIN response with an authorization identity is refused as RabbitMQ
/// 3.10 refuses it (it parses only "\0user\0pass"): no frame at all, the socket closed after
/// the handshake linger, whatever the client's capabilities. The identity used to be ignored,
/// so a client could name another user there and be let in as the one it logged in as.
#[tokio::test]
async fn plain_with_an_authorization_identity_is_refused_without_a_frame() {
    use amq_protocol::protocol::{connection, AMQPClass};
    let server = TestServer::start().await;
    for response in ["admin\0guest\0guest", "guest\0guest\0guest"] {
        let mut raw = Raw::tcp(server.addr).await;
        raw.send_bytes(&warren_protocol::PROTOCOL_HEADER).await;
        assert!(matches!(
            raw.recv_method().await,
            Some((0, AMQPClass::Connection(connection::AMQPMethod::Start(_))))
        ));
        let mut caps = FieldTable::default();
        caps.insert(
            "authentication_failure_close".into(),
            AMQPValue::Boolean(true),
        );
        let mut props = FieldTable::default();
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        raw.send(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: "PLAIN".into(),
                response: response.into(),
                locale: "en_US".into(),
            })),
        )
        .await;
        let t0 = std::time::Instant::now();
        // expect_eof fails on any frame, and on a socket still open after WAIT.
        raw.expect_eof().await;
        assert!(t0.elapsed() >= Duration::from_millis(2500), "{response:?}");
    }
}
