//! Issue 14 point 9: clients that hold on to the broker without doing anything useful (a
//! slowloris trickling a byte at a time, a flood of handshakes left half-open, a consumer that
//! never reads its socket) are cut off or held back within bounds, and other clients carry
//! on meanwhile. The byte-level fuzzing of the same paths is `fuzz.rs`.

use crate::common::*;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warren::Config;
use warren_protocol::PROTOCOL_HEADER;

/// A client doing ordinary work: a round trip through a queue.
async fn round_trip(ch: &lapin::Channel, queue: &str) {
    ch.basic_publish(
        "".into(),
        queue.into(),
        Default::default(),
        b"ping",
        Default::default(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let got = tokio::time::timeout(WAIT, async {
        loop {
            if let Some(m) = ch
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
            {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("a round trip in time while the hostile clients hold on");
    assert_eq!(got.delivery.data, b"ping");
}

/// Whether the server closed this socket (EOF or reset) within `within`, reading and
/// dropping what it sends until then.
async fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

/// Connections the server lists (what the management API shows).
fn listed(server: &TestServer) -> usize {
    server.shared.registry.len()
}

/// Slowloris: clients that send their handshake (or, once open, a frame) a byte at a time
/// are closed when the handshake timeout (or, once open, two heartbeat intervals without a
/// whole frame) runs out, however steadily they trickle; a client working beside them is not
/// slowed down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_clients_are_cut_off_and_others_carry_on() {
    let server = TestServer::start_with(Config {
        handshake_timeout: Duration::from_secs(2),
        ..Default::default()
    })
    .await;
    let worker = server.connect().await;
    let ch = worker.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let q = unique("slowloris");
    ch.queue_declare(q.as_str().into(), Default::default(), FieldTable::default())
        .await
        .unwrap();

    // 20 in the handshake: the header and the start of a frame, one byte every 250 ms
    // (6.75 s in all).
    let mut handshake = PROTOCOL_HEADER.to_vec();
    handshake.extend_from_slice(&[1, 0, 0, 0, 0, 0, 20]);
    handshake.extend_from_slice(&[0u8; 12]);
    let mut slow = Vec::new();
    for _ in 0..20 {
        let bytes = handshake.clone();
        let addr = server.addr;
        slow.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let started = tokio::time::Instant::now();
            for b in bytes {
                if s.write_all(&[b]).await.is_err() {
                    break;
                }
                // The server's connection.start arrives after the header: read it.
                let mut sink = [0u8; 1024];
                match tokio::time::timeout(Duration::from_millis(250), s.read(&mut sink)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
                    _ => {}
                }
            }
            assert!(
                closed_by_server(&mut s, Duration::from_secs(10)).await,
                "a slowloris in the handshake was never closed"
            );
            started.elapsed()
        }));
    }
    // 10 open ones with a 1 s heartbeat, each trickling a queue.declare one byte every 250 ms
    // for 8 s: a byte keeps coming, but no whole frame, so each is closed 2 heartbeat
    // intervals after its last whole frame (its handshake), long before its trickle ends.
    let mut open = Vec::new();
    for _ in 0..10 {
        let (mut raw, _, _) = Raw::handshake_with(server.addr, 2047, 131072, 1).await;
        open.push(tokio::spawn(async move {
            let frame = [1u8, 0, 1, 0, 0, 0, 40, 0, 50, 0, 10];
            let started = tokio::time::Instant::now();
            let mut sink = [0u8; 1024];
            for i in 0..32 {
                let _ = raw.stream.write_all(&[frame[i % frame.len()]]).await;
                // The server's heartbeats are read and dropped; its close ends the trickle.
                let deadline = tokio::time::Instant::now() + Duration::from_millis(250);
                loop {
                    match tokio::time::timeout_at(deadline, raw.stream.read(&mut sink)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
                        Ok(Ok(_)) => continue,
                        Err(_) => break,
                    }
                }
            }
            None
        }));
    }
    // Meanwhile the worker's round trips go through.
    for _ in 0..20 {
        round_trip(&ch, &q).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for t in slow {
        let took = t.await.unwrap();
        assert!(
            took < Duration::from_secs(6),
            "a slowloris in the handshake held on for {took:?} (timeout 2 s; 6.75 s to finish)"
        );
    }
    for t in open {
        let closed = t.await.unwrap();
        assert!(
            closed.is_some_and(|d| d < Duration::from_millis(3500)),
            "an open slowloris was closed after {closed:?} (2 heartbeats: 2 s; its trickle: 8 s)"
        );
    }
    eventually("only the worker listed", || listed(&server) == 1).await;
    round_trip(&ch, &q).await;
}

/// A flood of half-open handshakes: 200 sockets that connect and send nothing, or only the
/// protocol header, are closed by the server at the handshake timeout, and the broker lists
/// none of them afterwards; meanwhile new clients connect and work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_open_handshakes_is_closed_and_others_carry_on() {
    let server = TestServer::start_with(Config {
        handshake_timeout: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let mut flood = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(server.addr).await.unwrap();
        if i % 2 == 0 {
            s.write_all(&PROTOCOL_HEADER).await.unwrap();
        }
        flood.push(s);
    }
    // New clients connect and work while the flood holds its sockets.
    let worker = server.connect().await;
    let ch = worker.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let q = unique("flood");
    ch.queue_declare(q.as_str().into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    round_trip(&ch, &q).await;
    // Every flood socket is closed by the server.
    let mut open = 0;
    for s in &mut flood {
        if !closed_by_server(s, WAIT).await {
            open += 1;
        }
    }
    assert_eq!(open, 0, "half-open handshakes the server kept");
    eventually("only the worker listed", || listed(&server) == 1).await;
    let again = server.connect().await;
    let ch2 = again.create_channel().await.unwrap();
    ch2.confirm_select(Default::default()).await.unwrap();
    round_trip(&ch2, &q).await;
}

/// A consumer that never reads its socket: what the broker holds for it in memory is bounded
/// (its deliveries stop when its delivery budget, 4 MiB of frames not yet written, is spent,
/// and the rest waits in the queue) while 64 MiB are published; a client beside it carries
/// on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_never_reads_is_held_at_a_bounded_outbox() {
    let server = TestServer::start().await;
    let q = unique("never-reads");
    // The stalled consumer, with no-ack (nothing limits it but the socket).
    let stalled = server.connect().await;
    let sch = stalled.create_channel().await.unwrap();
    sch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut raw = Raw::handshake(server.addr).await;
    raw.open_channel(1).await;
    raw.send(
        1,
        amq_protocol::protocol::AMQPClass::Basic(
            amq_protocol::protocol::basic::AMQPMethod::Consume(
                amq_protocol::protocol::basic::Consume {
                    queue: q.as_str().into(),
                    no_ack: true,
                    ..Default::default()
                },
            ),
        ),
    )
    .await;
    // It reads the consume-ok and then nothing more.
    raw.recv_method().await.unwrap();
    let publisher = server.connect().await;
    let pch = publisher.create_channel().await.unwrap();
    pch.confirm_select(Default::default()).await.unwrap();
    let body = vec![5u8; 256 * 1024];
    let worker_q = unique("beside");
    pch.queue_declare(
        worker_q.as_str().into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut largest = 0usize;
    for i in 0..256 {
        pch.basic_publish(
            "".into(),
            q.as_str().into(),
            Default::default(),
            &body,
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        let now = server
            .shared
            .outboxes
            .read()
            .values()
            .map(|o| o.len())
            .max()
            .unwrap_or(0);
        largest = largest.max(now);
        if i % 32 == 0 {
            round_trip(&pch, &worker_q).await;
        }
    }
    // The outbox did fill (the consumer stalled: 3 MiB measured) but stayed within the
    // delivery budget (4 MiB) and the one message that overdraws it.
    assert!(
        (1024 * 1024..=4 * 1024 * 1024 + 257 * 1024).contains(&largest),
        "the stalled consumer's outbox reached {largest} bytes"
    );
    let info = pch
        .queue_declare(
            q.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(
        info.message_count() > 100,
        "held in the queue: {}",
        info.message_count()
    );
    round_trip(&pch, &worker_q).await;
}
