//! Issue 12: defects found by abuse testing (a hostile client, an unlucky operator), each with
//! the test that failed before its fix.

use crate::common::*;
use amq_protocol::protocol::{queue, AMQPClass};
use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
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

/// A consumer on `queue` with manual acks.
async fn consume(ch: &lapin::Channel, queue: &str) -> lapin::Consumer {
    ch.basic_consume(
        queue.into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap()
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
    let mut consumer = consume(&ch, &work).await;
    let first = next_delivery(&mut consumer).await;
    assert_eq!(first.data, b"one");
    let ch2 = victim.create_channel().await.unwrap();
    let got = ch2
        .basic_get(work.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("a message");
    assert_eq!(got.delivery.data, b"two");
    assert_eq!(server.shared.registry.len(), 2);

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
        shared.registry.len() == 1 && shared.outboxes.read().len() == 1
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
    let mut consumer = consume(&ch, &dead).await;
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
        let b = if by_env {
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

/// Resident memory of a process, from /proc.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Point 5: with a memory high watermark, a publisher whose messages pile up unacknowledged
/// at a consumer is blocked (connection.blocked "low on memory") before the broker passes the
/// watermark by more than a margin; other clients carry on meanwhile (a consumer keeps
/// receiving, a new client declares and gets); once the consumer acknowledges, memory comes
/// down, the publisher is unblocked and its publishes go through.
#[tokio::test]
async fn the_memory_watermark_blocks_publishers_and_others_carry_on() {
    const WATERMARK: u64 = 160 << 20;
    // Past the watermark: what the allocator keeps of freed pages and what was in flight when
    // the block began. 64 MiB was passed twice on a slower machine (271 MB against 259: start
    // 35 + 160 + 64); without a watermark the publisher goes on to 500 MiB, so 96 still
    // shows the bound.
    const MARGIN: u64 = 96 << 20;
    let data = tempfile::tempdir().unwrap();
    let b = spawn_binary(
        data.path(),
        &["--vm-memory-high-watermark", &WATERMARK.to_string()],
    )
    .await;
    let pid = b.child.id();
    let base = rss_of(pid);
    assert!(base < WATERMARK, "the broker starts at {base} bytes");
    let connect = || async {
        tokio::time::timeout(
            WAIT,
            lapin::Connection::connect(&b.url, lapin::ConnectionProperties::default()),
        )
        .await
        .unwrap()
        .unwrap()
    };
    let consumer_conn = connect().await;
    let cch = consumer_conn.create_channel().await.unwrap();
    let q = unique("mem");
    cch.queue_declare(q.as_str().into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    let mut consumer = consume(&cch, &q).await;
    let publisher = connect().await;
    let pch = publisher.create_channel().await.unwrap();
    let body = vec![7u8; 64 * 1024];
    // Publish until blocked (bounded: 8,000 x 64 KiB is 500 MiB, far past the watermark).
    let mut published = 0u32;
    let mut peak = 0u64;
    let mut received = 0u64;
    let mut last_tag = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !publisher.status().blocked() && published < 8_000 {
        assert!(tokio::time::Instant::now() < deadline, "never blocked");
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            pch.basic_publish(
                "".into(),
                q.as_str().into(),
                Default::default(),
                &body,
                Default::default(),
            ),
        )
        .await;
        published += 1;
        // The consumer takes deliveries (without acknowledging them).
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_millis(0), consumer.next()).await
        {
            received += 1;
            last_tag = d.delivery_tag;
        }
        peak = peak.max(rss_of(pid));
    }
    assert!(
        publisher.status().blocked(),
        "published {published} without a block"
    );
    // Blocked: the broker stays under the watermark plus a margin for a while.
    for _ in 0..20 {
        peak = peak.max(rss_of(pid));
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_millis(50), consumer.next()).await
        {
            received += 1;
            last_tag = d.delivery_tag;
        }
    }
    // The watermark counts the broker's heap; its resident set also holds what it started
    // with (code, the store's caches).
    assert!(
        peak < base + WATERMARK + MARGIN,
        "peak {peak} past the start {base} + the watermark {WATERMARK} + {MARGIN}"
    );
    assert!(received > 0);
    // Another client carries on: it declares, publishes nothing, gets.
    let other = connect().await;
    let och = other.create_channel().await.unwrap();
    let q2 = unique("other");
    och.queue_declare(
        q2.as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert!(och
        .basic_get(q2.as_str().into(), Default::default())
        .await
        .unwrap()
        .is_none());
    // The consumer acknowledges what it holds: memory goes down, the publisher is unblocked.
    cch.basic_ack(last_tag, BasicAckOptions { multiple: true })
        .await
        .unwrap();
    let unblock_deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while publisher.status().blocked() {
        assert!(
            tokio::time::Instant::now() < unblock_deadline,
            "still blocked at {} bytes",
            rss_of(pid)
        );
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_millis(50), consumer.next()).await
        {
            d.ack(Default::default()).await.unwrap();
        }
    }
}

/// Point 5: unfinished message bodies a connection holds are bounded by max_message_size
/// across its channels: several partial bodies past it close the connection (530), while a
/// client publishing whole messages, one after another, is never refused and others carry on.
#[tokio::test]
async fn unfinished_bodies_on_a_connection_are_bounded() {
    use amq_protocol::protocol::{basic, AMQPClass};
    const MAX: u64 = 1 << 20;
    let server = TestServer::start_with(Config {
        max_message_size: MAX,
        ..Default::default()
    })
    .await;
    let bystander = server.connect().await;
    let bch = bystander.create_channel().await.unwrap();
    // Whole messages of nearly the maximum, one after another, are fine.
    let q = unique("whole");
    bch.queue_declare(q.as_str().into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    for _ in 0..4 {
        publish_confirmed(&bch, "", &q, &vec![1u8; MAX as usize - 10]).await;
    }

    let mut raw = Raw::handshake(server.addr).await;
    let publish = || {
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            routing_key: "nowhere".into(),
            ..Default::default()
        }))
    };
    // Three channels each start a 1 MiB message and send 600 KiB of it.
    let chunk = vec![9u8; 100 * 1024];
    for ch in 1..=3u16 {
        raw.open_channel(ch).await;
        raw.send(ch, publish()).await;
        let mut out = warren_protocol::OutBuffer::new();
        // The header frame only (its body of MAX bytes follows in parts below).
        out.content_slice(ch, &[0, 0], &vec![0u8; MAX as usize], 131072);
        let header = out.to_vec();
        raw.send_bytes(&header[..22]).await;
    }
    let mut closed = None;
    'send: for ch in 1..=3u16 {
        for _ in 0..6 {
            let mut frame = vec![3u8];
            frame.extend_from_slice(&ch.to_be_bytes());
            frame.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
            frame.extend_from_slice(&chunk);
            frame.push(206);
            if raw.stream.write_all(&frame).await.is_err() {
                break 'send;
            }
        }
        if ch == 2 {
            closed = Some(raw.expect_connection_close().await);
            break;
        }
    }
    let close = closed.expect("a connection.close");
    assert_eq!((close.reply_code, close.class_id), (530, 0), "{close:?}");
    assert!(
        close.reply_text.as_str().contains("unfinished"),
        "{close:?}"
    );
    // The bystander carries on.
    publish_confirmed(&bch, "", &q, b"still here").await;
}

/// Issue 14 point 1: `--loopback-users` (env `WARREN_LOOPBACK_USERS`) sets RabbitMQ's
/// loopback_users; "none" lifts the rule (the rule itself, per address, is `auth`'s unit test:
/// tests only listen on loopback). A list with an empty name is refused at start.
#[tokio::test]
async fn loopback_users_come_from_the_command_line() {
    let data = tempfile::tempdir().unwrap();
    let b = spawn_binary(data.path(), &["--loopback-users", "none"]).await;
    let addr: std::net::SocketAddr = b
        .url
        .trim_start_matches("amqp://guest:guest@")
        .trim_end_matches("/%2f")
        .parse()
        .unwrap();
    assert_eq!(can_log_in(addr, "guest", "guest").await, None);
    drop(b);
    let (status, stderr) =
        crate::common::run_binary_to_exit(data.path(), &["--loopback-users", "guest,,ops"]);
    assert!(!status.success());
    assert!(stderr.contains("empty user name"), "{stderr}");
}

/// Issue 14 point 8: `--max-message-size` (RabbitMQ's max_message_size, 128 MiB by default,
/// 512 MiB at most): a message of that size is taken, a larger one closes its channel with
/// 406 and RabbitMQ's text; the connection and its other channels carry on. Past 512 MiB the
/// start is refused, as RabbitMQ refuses the setting.
#[tokio::test]
async fn max_message_size_comes_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let broker = spawn_binary(&dir.path().join("data"), &["--max-message-size", "1000"]).await;
    let conn = lapin::Connection::connect(&broker.url, Default::default())
        .await
        .unwrap();
    let other = conn.create_channel().await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = unique("max-size");
    ch.queue_declare(q.as_str().into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    publish_confirmed(&ch, "", &q, &[7u8; 1000]).await;
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        Default::default(),
        &[7u8; 1001],
        Default::default(),
    )
    .await
    .unwrap();
    let err = ch
        .queue_declare(
            q.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect_err("the channel is closed");
    let text = err.to_string();
    assert!(
        text.contains(
            "PRECONDITION_FAILED - message size 1001 is larger than configured max size 1000"
        ),
        "{text}"
    );
    // The other channel goes on, and holds the one message that fit.
    let q_ok = other
        .queue_declare(
            q.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q_ok.message_count(), 1);
    // At RabbitMQ's ceiling (512 MiB) its other text: "max size", not "configured". The
    // header declaring the size is enough to be refused.
    drop(conn);
    let ceiling = spawn_binary(
        &dir.path().join("ceiling"),
        &["--max-message-size", "536870912"],
    )
    .await;
    let addr: std::net::SocketAddr = ceiling
        .url
        .trim_start_matches("amqp://guest:guest@")
        .trim_end_matches("/%2f")
        .parse()
        .unwrap();
    let mut raw = Raw::handshake(addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        amq_protocol::protocol::AMQPClass::Basic(
            amq_protocol::protocol::basic::AMQPMethod::Publish(
                amq_protocol::protocol::basic::Publish {
                    routing_key: "nowhere".into(),
                    ..Default::default()
                },
            ),
        ),
    )
    .await;
    // A content header frame: class 60, weight 0, body size 512 MiB + 1, no properties.
    let mut header = vec![2u8, 0, 1, 0, 0, 0, 14, 0, 60, 0, 0];
    header.extend_from_slice(&536_870_913u64.to_be_bytes());
    header.extend_from_slice(&[0, 0, 0xce]);
    raw.send_bytes(&header).await;
    let close = raw.expect_channel_close(1).await;
    assert_eq!(close.reply_code, 406);
    assert_eq!(
        close.reply_text.as_str(),
        "PRECONDITION_FAILED - message size 536870913 is larger than max size 536870912"
    );
    // Past RabbitMQ's ceiling the start is refused.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_warren"))
        .args(["server", "--max-message-size", "536870913", "--data-dir"])
        .arg(dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--max-message-size"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asks every connection the node lists to close, as the management API's DELETE
/// /api/connections/{name} and a leader that stops leading do.
fn close_all(server: &TestServer, reason: &str) {
    for c in server.shared.registry.list() {
        c.close(reason.to_string());
    }
}

/// A publisher blocked by the disk alarm (connection.blocked, its socket no longer read) waited
/// for the alarm to clear before it heeded a close asked for meanwhile: a leader that stopped
/// on a full disk could not close its clients, and they hung. Now it gets connection.close 320
/// at once, the alarm still on.
#[tokio::test]
async fn a_blocked_publisher_is_closed_when_asked() {
    use amq_protocol::protocol::{basic, connection, AMQPClass};
    let server = TestServer::start().await;
    let mut raw = Raw::with_queue(server.addr, "blocked").await;
    server.raise_disk_alarm().await;
    let mut out = warren_protocol::OutBuffer::new();
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            routing_key: "blocked".into(),
            ..Default::default()
        })),
    );
    out.content_slice(1, &[0, 0], b"held", 131072);
    raw.send_bytes(&out.to_vec()).await;
    assert!(matches!(
        raw.recv_method().await,
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Blocked(_))))
    ));
    close_all(&server, "closed by the test");
    match raw.recv_method().await {
        Some((0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
            assert_eq!(c.reply_code, 320);
            assert_eq!(
                c.reply_text.as_str(),
                "CONNECTION_FORCED - closed by the test"
            );
        }
        other => panic!("expected connection.close 320, got {other:?}"),
    }
    server.clear_disk_alarm();
}

/// The state of the TCP socket `local` -> `remote` in /proc/net/tcp (IPv4), if it exists:
/// 1 is ESTABLISHED.
fn tcp_state(local: std::net::SocketAddr, remote: std::net::SocketAddr) -> Option<u8> {
    let hex = |a: std::net::SocketAddr| match a {
        std::net::SocketAddr::V4(v4) => format!(
            "{:08X}:{:04X}",
            u32::from_le_bytes(v4.ip().octets()),
            v4.port()
        ),
        std::net::SocketAddr::V6(_) => panic!("IPv4 only"),
    };
    let (l, r) = (hex(local), hex(remote));
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap()
        .lines()
        .skip(1)
        .find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.get(1) == Some(&l.as_str()) && f.get(2) == Some(&r.as_str()))
                .then(|| u8::from_str_radix(f[3], 16).unwrap())
        })
}

/// A client that sends requests but stops reading the replies fills its connection's outbox
/// (past 8 MB the read loop stops reading it and waits for the outbox to drain). That wait
/// heeded no close asked for meanwhile (the management API, a leader change), nor a close's
/// deadline: the connection stayed listed for ever; and a writer stuck on the full socket
/// outlived its connection and held the socket open. Now the connection is gone within the
/// close's grace (3 s) and the writer's (2 s), its socket with it; other clients carry on.
#[tokio::test]
async fn a_client_that_stops_reading_is_closed_when_asked() {
    use amq_protocol::protocol::{queue, AMQPClass};
    use tokio::io::AsyncWriteExt;
    let server = TestServer::start().await;
    let mut raw = Raw::with_queue(server.addr, "unread").await;
    // Half a million passive declares (a reply each, ~13 MB of replies), none read.
    let mut out = warren_protocol::OutBuffer::new();
    for _ in 0..500_000 {
        out.method(
            1,
            &AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: "unread".into(),
                passive: true,
                ..Default::default()
            })),
        );
    }
    let requests = out.to_vec();
    // The node stops reading once the outbox is full: the rest of the write may never go.
    let _ = tokio::time::timeout(Duration::from_secs(5), raw.stream.write_all(&requests)).await;
    let full = || {
        server
            .shared
            .outboxes
            .read()
            .values()
            .any(|o| o.len() > 8 * 1024 * 1024)
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while !full() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the outbox never filled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (client, node) = (raw.stream.local_addr().unwrap(), server.addr);
    assert_eq!(tcp_state(node, client), Some(1), "established");
    let bystander = server.connect().await;
    close_all(&server, "closed by the test");
    // The bystander goes too (it was asked); the stalled one without reading a byte.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !server.shared.registry.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} connection(s) still listed",
            server.shared.registry.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tcp_state(node, client) == Some(1) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the node still holds the stalled client's socket open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(bystander);
    // The node carries on.
    let again = server.connect().await;
    again.create_channel().await.unwrap();
}

/// Whether exchange `name` exists (a passive declare on a channel of its own).
async fn exchange_exists(conn: &lapin::Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    match ch
        .exchange_declare(
            name.into(),
            lapin::ExchangeKind::Fanout,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
    {
        Ok(()) => true,
        Err(e) => {
            assert_eq!(reply_code(&e), Some(404), "{e}");
            false
        }
    }
}

/// Declare exchanges `{prefix}-1..=n` (auto-delete, `durable` or not), a queue `{prefix}-q`
/// bound to the first, and each next one bound to the one before.
async fn auto_delete_chain(ch: &lapin::Channel, prefix: &str, n: usize, durable: bool) {
    durable_queue(ch, &format!("{prefix}-q"), FieldTable::default()).await;
    let declare = ExchangeDeclareOptions {
        durable,
        auto_delete: true,
        nowait: true,
        ..Default::default()
    };
    for i in 1..=n {
        ch.exchange_declare(
            format!("{prefix}-{i}").as_str().into(),
            lapin::ExchangeKind::Fanout,
            declare,
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    ch.queue_bind(
        format!("{prefix}-q").as_str().into(),
        format!("{prefix}-1").as_str().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    for i in 2..=n {
        ch.exchange_bind(
            format!("{prefix}-{}", i - 1).as_str().into(),
            format!("{prefix}-{i}").as_str().into(),
            "".into(),
            ExchangeBindOptions { nowait: true },
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
}

/// A chain of 10,000 auto-delete exchanges, each bound to the one before and the first to a
/// queue: deleting the queue deletes the whole chain. The cascade was a recursion (one
/// `exec` per exchange) and overflowed the stack of the task deleting the queue, which
/// aborts the process (here, the test binary); replicated, it would have stopped every node
/// of a cluster at once. A durable chain's deletions are written too: gone after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_chain_of_auto_delete_exchanges_goes_in_one_cascade() {
    const N: usize = 10_000;
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    auto_delete_chain(&ch, "chain", N, false).await;
    auto_delete_chain(&ch, "kept", 200, true).await;
    assert!(exchange_exists(&conn, &format!("chain-{N}")).await);
    assert!(exchange_exists(&conn, "kept-200").await);
    for q in ["chain-q", "kept-q"] {
        ch.queue_delete(q.into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    for name in [
        "chain-1",
        "chain-5000",
        &format!("chain-{N}"),
        "kept-1",
        "kept-200",
    ] {
        assert!(!exchange_exists(&conn, name).await, "{name} is still there");
    }
    conn.close(200, "bye".into()).await.unwrap();
    let server = server.restart().await;
    let conn = server.connect().await;
    for name in ["kept-1", "kept-100", "kept-200"] {
        assert!(
            !exchange_exists(&conn, name).await,
            "{name} is back after a restart"
        );
    }
}

/// A field table whose entry "a" holds arrays nested `depth` deep (the table is level 1), as
/// bytes: built by hand, since amq-protocol's generator recurses as its parser does.
fn nested_table(depth: usize) -> Vec<u8> {
    let mut value: Vec<u8> = vec![b'A', 0, 0, 0, 0];
    for _ in 2..depth {
        let mut outer = vec![b'A'];
        outer.extend_from_slice(&u32::try_from(value.len()).unwrap().to_be_bytes());
        outer.extend_from_slice(&value);
        value = outer;
    }
    let mut entry = vec![1, b'a'];
    entry.extend_from_slice(&value);
    let mut table = u32::try_from(entry.len()).unwrap().to_be_bytes().to_vec();
    table.extend_from_slice(&entry);
    table
}

/// One frame of `kind` on channel 1.
fn frame_of(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind, 0, 1];
    f.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xce);
    f
}

/// Field tables nested 20,000 deep (100 KB, within the frame size) in a queue.declare's
/// arguments and in a message's headers: each gets 502 SYNTAX_ERROR naming the limit, and
/// the broker goes on. amq-protocol parses nesting by recursion: this overflowed the stack of
/// the connection's task and aborted the process. Nesting up to the limit is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn field_tables_nested_past_the_limit_are_refused_and_the_broker_goes_on() {
    let server = TestServer::start().await;
    let deep = nested_table(20_000);
    let declare = |table: &[u8]| [&[0, 50, 0, 10, 0, 0, 1, b'n', 0][..], table].concat();

    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send_bytes(&frame_of(1, &declare(&deep))).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 502, "{close:?}");
    assert!(
        close.reply_text.as_str().contains("nested deeper than 64"),
        "{close:?}"
    );
    assert_eq!((close.class_id, close.method_id), (50, 10));

    // A publish whose headers nest as deep.
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send_bytes(&frame_of(1, &[0, 60, 0, 40, 0, 0, 0, 1, b'n', 0]))
        .await;
    let header = [&[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20, 0][..], &deep].concat();
    raw.send_bytes(&frame_of(2, &header)).await;
    let close = raw.expect_connection_close().await;
    assert_eq!(close.reply_code, 502, "{close:?}");
    assert_eq!((close.class_id, close.method_id), (60, 40));

    // 64 levels are taken (a queue declared with them; lapin carries on as before).
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    let ok = nested_table(64);
    let declare_ok = [&[0, 50, 0, 10, 0, 0, 1, b'k', 0][..], &ok[..]].concat();
    raw.send_bytes(&frame_of(1, &declare_ok)).await;
    match raw.recv_method().await {
        Some((1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)))) => {
            assert_eq!(ok.queue.as_str(), "k")
        }
        other => panic!("expected declare-ok, got {other:?}"),
    }
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    durable_queue(&ch, "after-deep", FieldTable::default()).await;
    publish_confirmed(&ch, "", "after-deep", b"still here").await;
}
