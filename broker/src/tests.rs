//! Core tests: no sockets, no runtime. They drive the broker as a connection handler would.

use super::*;
use crate::cmd::{Cmd, Grant, Outcome, ReadDone, Via, Who};
use warren_protocol::ReplyCode;

fn msg(exchange: &str, key: &str, body: &str) -> Arc<Message> {
    Arc::new(Message {
        exchange: exchange.into(),
        routing_key: key.into(),
        properties: AMQPProperties::default(),
        raw_properties: Bytes::from_static(&[0, 0]),
        body: Bytes::copy_from_slice(body.as_bytes()).into(),
        expiration: None,
    })
}

fn declare(b: &mut Broker, conn: ConnId, name: &str) -> String {
    b.queue_declare(
        conn,
        "/",
        QueueDeclare {
            name: name.into(),
            ..Default::default()
        },
        &mut Vec::new(),
    )
    .unwrap()
    .name
}

fn declare_durable(b: &mut Broker, conn: ConnId, name: &str) {
    b.queue_declare(
        conn,
        "/",
        QueueDeclare {
            name: name.into(),
            durable: true,
            ..Default::default()
        },
        &mut Vec::new(),
    )
    .unwrap();
}

fn delivered(fx: &[Effect]) -> Vec<(String, u64, bool, String)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Deliver {
                consumer_tag,
                delivery_tag,
                redelivered,
                msg,
                ..
            } => Some((
                consumer_tag.to_string(),
                *delivery_tag,
                *redelivered,
                String::from_utf8_lossy(&msg.body.to_bytes()).into_owned(),
            )),
            _ => None,
        })
        .collect()
}

fn setup() -> (Broker, ConnId) {
    let mut b = Broker::new();
    let c = b.connection_open("/");
    b.channel_open(c, 1);
    (b, c)
}

#[test]
fn round_robin_and_prefetch() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let mut fx = Vec::new();
    b.qos(c, 1, 1, false, &mut fx);
    b.consume(
        c,
        1,
        "/",
        "q",
        "a",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    b.consume(
        c,
        1,
        "/",
        "q",
        "b",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    for i in 0..4 {
        b.publish("/", msg("", "q", &i.to_string()), &mut fx)
            .unwrap();
    }
    let d = delivered(&fx);
    assert_eq!(
        d.iter()
            .map(|x| (x.0.as_str(), x.3.as_str()))
            .collect::<Vec<_>>(),
        vec![("a", "0"), ("b", "1")],
        "prefetch 1 each, round robin"
    );
    assert_eq!(b.queue_info("/", "q").unwrap().message_count, 2);
    fx.clear();
    b.ack(c, 1, d[0].1, false, &mut fx).unwrap();
    assert_eq!(delivered(&fx)[0].0, "a");
    assert_eq!(delivered(&fx)[0].3, "2");
}

#[test]
fn channel_limit_is_shared_by_its_consumers() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let mut fx = Vec::new();
    b.qos(c, 1, 3, true, &mut fx);
    b.consume(
        c,
        1,
        "/",
        "q",
        "a",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    b.consume(
        c,
        1,
        "/",
        "q",
        "b",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    for i in 0..10 {
        b.publish("/", msg("", "q", &i.to_string()), &mut fx)
            .unwrap();
    }
    assert_eq!(delivered(&fx).len(), 3);
}

#[test]
fn requeued_messages_return_to_their_place_marked_redelivered() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let mut fx = Vec::new();
    for i in 0..5 {
        b.publish("/", msg("", "q", &i.to_string()), &mut fx)
            .unwrap();
    }
    let g1 = b.get(c, 1, "/", "q", false).unwrap().unwrap();
    let g2 = b.get(c, 1, "/", "q", false).unwrap().unwrap();
    assert_eq!(g2.message_count, 3);
    b.reject(c, 1, g2.delivery_tag, false, true, &mut fx)
        .unwrap();
    b.reject(c, 1, g1.delivery_tag, false, true, &mut fx)
        .unwrap();
    let mut order = Vec::new();
    while let Some(g) = b.get(c, 1, "/", "q", true).unwrap() {
        order.push((
            String::from_utf8_lossy(&g.msg.body.to_bytes()).into_owned(),
            g.redelivered,
        ));
    }
    assert_eq!(
        order,
        vec![
            ("0".into(), true),
            ("1".into(), true),
            ("2".into(), false),
            ("3".into(), false),
            ("4".into(), false)
        ]
    );
}

#[test]
fn closing_a_channel_requeues_in_order() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let mut fx = Vec::new();
    b.consume(
        c,
        1,
        "/",
        "q",
        "a",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    for i in 0..3 {
        b.publish("/", msg("", "q", &i.to_string()), &mut fx)
            .unwrap();
    }
    assert_eq!(delivered(&fx).len(), 3);
    b.channel_close(c, 1, &mut fx);
    assert_eq!(b.queue_info("/", "q").unwrap().message_count, 3);
    assert_eq!(b.queue_info("/", "q").unwrap().consumer_count, 0);
}

#[test]
fn unknown_delivery_tag_is_406() {
    let (mut b, c) = setup();
    let e = b.ack(c, 1, 42, false, &mut Vec::new()).unwrap_err();
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    assert_eq!(e.text, "PRECONDITION_FAILED - unknown delivery tag 42");
}

#[test]
fn exclusive_queues_belong_to_their_connection() {
    let (mut b, c) = setup();
    let other = b.connection_open("/");
    b.channel_open(other, 1);
    let mut fx = Vec::new();
    b.queue_declare(
        c,
        "/",
        QueueDeclare {
            name: "ex".into(),
            exclusive: true,
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    let e = b
        .consume(
            other,
            1,
            "/",
            "ex",
            "",
            false,
            false,
            &FieldTable::default(),
            &mut fx,
        )
        .unwrap_err();
    assert_eq!(e.code, ReplyCode::ResourceLocked);
    b.connection_close(c, &mut fx);
    assert!(b.queue_info("/", "ex").is_none());
}

#[test]
fn auto_delete_queue_goes_with_its_last_consumer() {
    let (mut b, c) = setup();
    let mut fx = Vec::new();
    b.queue_declare(
        c,
        "/",
        QueueDeclare {
            name: "ad".into(),
            auto_delete: true,
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    b.consume(
        c,
        1,
        "/",
        "ad",
        "t1",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    b.consume(
        c,
        1,
        "/",
        "ad",
        "t2",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    assert!(b.cancel(c, 1, "t1", &mut fx));
    assert!(b.queue_info("/", "ad").is_some());
    assert!(b.cancel(c, 1, "t2", &mut fx));
    assert!(b.queue_info("/", "ad").is_none());
}

#[test]
fn redeclare_with_other_properties_is_406() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let e = b
        .queue_declare(
            c,
            "/",
            QueueDeclare {
                name: "q".into(),
                durable: true,
                ..Default::default()
            },
            &mut Vec::new(),
        )
        .unwrap_err();
    assert_eq!(e.code, ReplyCode::PreconditionFailed);
    assert_eq!(
        e.text,
        "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'"
    );
}

#[test]
fn exchange_to_exchange_routing_cuts_cycles_and_delivers_once() {
    let (mut b, c) = setup();
    let mut fx = Vec::new();
    for (name, kind) in [("x1", "fanout"), ("x2", "fanout")] {
        b.exchange_declare(
            "/",
            ExchangeDeclare {
                name: name.into(),
                kind: kind.into(),
                ..Default::default()
            },
            &mut fx,
        )
        .unwrap();
    }
    declare(&mut b, c, "q");
    let args = FieldTable::default();
    b.exchange_bind("/", "x2", "x1", "", &args, true, &mut fx)
        .unwrap();
    b.exchange_bind("/", "x1", "x2", "", &args, true, &mut fx)
        .unwrap();
    b.queue_bind(c, "/", "q", "x1", "", &args, true, &mut fx)
        .unwrap();
    b.queue_bind(c, "/", "q", "x2", "", &args, true, &mut fx)
        .unwrap();
    assert_eq!(
        b.publish("/", msg("x1", "k", "m"), &mut fx).unwrap().routed,
        1
    );
    assert_eq!(b.queue_info("/", "q").unwrap().message_count, 1);
}

#[test]
fn deleting_a_queue_cancels_its_consumers() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let mut fx = Vec::new();
    b.consume(
        c,
        1,
        "/",
        "q",
        "t",
        false,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    b.queue_delete(c, "/", "q", false, false, &mut fx).unwrap();
    assert!(fx.iter().any(
        |e| matches!(e, Effect::ConsumerCancelled { consumer_tag, .. } if &**consumer_tag == "t")
    ));
}

#[test]
fn a_reader_that_stops_is_throttled_then_resumed() {
    let (mut b, c) = setup();
    declare(&mut b, c, "q");
    let mut fx = Vec::new();
    b.consume(
        c,
        1,
        "/",
        "q",
        "t",
        true,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    let big = "x".repeat(1024 * 1024);
    for _ in 0..10 {
        b.publish("/", msg("", "q", &big), &mut fx).unwrap();
    }
    let first = delivered(&fx).len();
    assert!(first < 10, "budget bounds what is handed out: {first}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Throttled(_))));
    fx.clear();
    b.refill(c, DELIVERY_BUDGET as usize, &mut fx);
    assert!(!delivered(&fx).is_empty());
}

#[test]
fn ops_replay_to_the_same_state() {
    let ops = vec![
        Op::DeclareExchange {
            vhost: "/".into(),
            name: "logs".into(),
            kind: "topic".into(),
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: encode_table(&FieldTable::default()),
        },
        Op::DeclareQueue {
            vhost: "/".into(),
            name: "q".into(),
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: encode_table(&FieldTable::default()),
        },
        Op::Bind {
            vhost: "/".into(),
            source: "logs".into(),
            destination: BindingDest::Queue("q".into()),
            routing_key: "a.#".into(),
            arguments: encode_table(&FieldTable::default()),
        },
        Op::Enqueue {
            vhost: "/".into(),
            queues: vec![("q".into(), 0)].into(),
            id: 7,
            timestamp_ms: 0,
            exchange: "logs".into(),
            routing_key: "a.b".into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"hello").into(),
        },
    ];
    let mut b = Broker::new();
    let mut fx = Vec::new();
    for op in &ops {
        b.apply(op, &mut fx).unwrap();
    }
    assert_eq!(b.queue_info("/", "q").unwrap().message_count, 1);
    b.publish("/", msg("logs", "a.c", "x"), &mut fx).unwrap();
    let c = b.connection_open("/");
    b.channel_open(c, 1);
    let first = b.get(c, 1, "/", "q", true).unwrap().unwrap();
    assert_eq!(first.msg.body, b"hello");
    let second = b.get(c, 1, "/", "q", true).unwrap().unwrap();
    assert_eq!(second.msg.body, b"x");
}

#[test]
fn ttl_expires_at_the_head_and_zero_ttl_needs_a_ready_consumer() {
    let (mut b, c) = setup();
    let mut fx = Vec::new();
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(1000));
    b.set_clock(10_000);
    b.queue_declare(
        c,
        "/",
        QueueDeclare {
            name: "ttl".into(),
            arguments: args,
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    b.publish("/", msg("", "ttl", "a"), &mut fx).unwrap();
    b.set_clock(10_500);
    b.publish("/", msg("", "ttl", "b"), &mut fx).unwrap();
    assert_eq!(b.queue_info("/", "ttl").unwrap().message_count, 2);
    b.set_clock(11_000);
    assert_eq!(b.expire(&mut fx), 1, "the head expired");
    assert_eq!(b.queue_info("/", "ttl").unwrap().message_count, 1);
    // Per-message expiration 0: dropped unless a consumer takes it at once.
    declare(&mut b, c, "zero");
    let zero = Arc::new(Message {
        expiration: Some(0),
        ..Arc::try_unwrap(msg("", "zero", "z")).unwrap()
    });
    b.publish("/", zero.clone(), &mut fx).unwrap();
    assert_eq!(b.queue_info("/", "zero").unwrap().message_count, 0);
    fx.clear();
    b.consume(
        c,
        1,
        "/",
        "zero",
        "t",
        true,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    b.publish("/", zero, &mut fx).unwrap();
    assert_eq!(delivered(&fx).len(), 1);
}

/// A store whose next `fail` reads fail (an I/O error), then read normally; `reads` counts
/// the reads asked of it.
#[derive(Default)]
struct FlakyReads {
    inner: warren_storage::mem::MemStore,
    fail: std::sync::atomic::AtomicUsize,
    reads: std::sync::atomic::AtomicUsize,
}

impl warren_storage::Store for FlakyReads {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), warren_storage::StoreError> {
        self.inner.write(ops, sync)
    }

    fn recover(&self) -> Result<warren_storage::Recovered, warren_storage::StoreError> {
        self.inner.recover()
    }

    fn write_applied(
        &self,
        ops: &[Op],
        applied: &[u8],
        sync: bool,
    ) -> Result<(), warren_storage::StoreError> {
        self.inner.write_applied(ops, applied, sync)
    }

    fn applied(&self) -> Result<Option<Vec<u8>>, warren_storage::StoreError> {
        self.inner.applied()
    }

    fn persist(&self) -> Result<(), warren_storage::StoreError> {
        self.inner.persist()
    }

    fn snapshot_to(
        &self,
        sink: &mut dyn warren_storage::SnapshotSink,
    ) -> Result<(), warren_storage::StoreError> {
        self.inner.snapshot_to(sink)
    }

    fn read(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<warren_storage::StoredMessage>, warren_storage::StoreError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        let fail = &self.fail;
        if fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(warren_storage::StoreError::Io("injected read error".into()));
        }
        self.inner
            .read(vhost, queue, from, to, max_count, max_bytes)
    }
}

/// A failed read of a queue's backlog from the store does not leave its consumer waiting for
/// the next publish or ack: the broker's timer (`retry_reads`) hands the backlog out.
#[test]
fn a_failed_backlog_read_is_retried_by_the_timer() {
    let store = Arc::new(FlakyReads::default());
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (mut b, c) = setup();
    b.enable_journal();
    b.set_pager(queue::Pager {
        store: store.clone(),
        written: written.clone(),
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: false,
        clock: Default::default(),
    });
    declare(&mut b, c, "deep");
    let mut fx = Vec::new();
    let n = queue::WINDOW_MESSAGES + 10;
    for i in 0..n {
        b.publish("/", msg("", "deep", &i.to_string()), &mut fx)
            .unwrap();
    }
    // The committer's part: the spilled messages are written.
    let ops = b.take_journal();
    warren_storage::Store::write(&*store, &ops, false).unwrap();
    written.store(b.journal_seq(), Ordering::Release);
    b.release_written();
    assert_eq!(b.messages_in_memory(), queue::WINDOW_MESSAGES);

    store.fail.store(1, Ordering::SeqCst);
    b.consume(
        c,
        1,
        "/",
        "deep",
        "t",
        true,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    // The window goes out; reading the rest fails.
    assert_eq!(delivered(&fx).len(), queue::WINDOW_MESSAGES);
    fx.clear();
    b.retry_reads(&mut fx);
    let got: Vec<String> = delivered(&fx).into_iter().map(|d| d.3).collect();
    let want: Vec<String> = (queue::WINDOW_MESSAGES..n).map(|i| i.to_string()).collect();
    assert_eq!(got, want);
    assert_eq!(b.queue_info("/", "deep").unwrap().message_count, 0);
}

/// What a replica applies for queue "deep" (durable) and messages `1..=n` in it, each with the
/// body `body(id)`.
fn replicate_deep_queue(b: &mut Broker, n: u64, body: impl Fn(u64) -> Vec<u8>) {
    let mut fx = Vec::new();
    b.apply(
        &Op::DeclareQueue {
            vhost: "/".into(),
            name: "deep".into(),
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: Bytes::from_static(&[0, 0, 0, 0]),
        },
        &mut fx,
    )
    .unwrap();
    for id in 1..=n {
        b.apply(
            &Op::Enqueue {
                vhost: "/".into(),
                queues: vec![("deep".into(), 0)].into(),
                id,
                timestamp_ms: 1,
                exchange: "".into(),
                routing_key: "deep".into(),
                properties: Bytes::from_static(&[0, 0]),
                body: Bytes::from(body(id)).into(),
            },
            &mut fx,
        )
        .unwrap();
    }
}

/// A replica's queue has no consumers, so past its window the messages it is given go to its
/// store; the leader's acks then remove them from there. A `Remove` that carries the messages'
/// sizes (as a leader records it) takes them out of the counts without reading them back (one
/// read per acked message made a follower's apply several times slower than the leader's
/// work); one without sizes (an op of tag 8) reads them, to the same counts.
#[test]
fn a_replica_removes_paged_out_messages_by_the_sizes_in_the_op() {
    for sized in [true, false] {
        let store = Arc::new(FlakyReads::default());
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut b = Broker::new();
        b.enable_journal();
        b.set_pager(queue::Pager {
            store: store.clone(),
            written: written.clone(),
            hold_max_ms: 0,
            read_failed: Default::default(),
            async_reads: false,
            clock: Default::default(),
        });
        let mut fx = Vec::new();
        // Bodies of 1..=n bytes, so every size counts.
        let n = queue::WINDOW_MESSAGES as u64 + 300;
        replicate_deep_queue(&mut b, n, |id| vec![b'x'; id as usize]);
        let ops = b.take_journal();
        warren_storage::Store::write(&*store, &ops, false).unwrap();
        written.store(b.journal_seq(), Ordering::Release);
        b.release_written();
        assert_eq!(b.messages_in_memory(), queue::WINDOW_MESSAGES);
        let bytes = |b: &Broker| {
            let v = b.queue_views(Some("/"));
            (v[0].messages_ready, v[0].message_bytes_ready)
        };
        assert_eq!(bytes(&b), (n, n * (n + 1) / 2));

        // Acks of the first 10 (in memory) and of 200 from the paged-out part.
        let gone: Vec<u64> = (1..=10).chain(1101..=1300).collect();
        b.apply(
            &Op::Remove {
                vhost: "/".into(),
                queue: "deep".into(),
                keys: gone
                    .iter()
                    .map(|id| warren_storage::message_key(0, *id))
                    .collect(),
                sizes: match sized {
                    true => gone.clone(),
                    false => Vec::new(),
                },
            },
            &mut fx,
        )
        .unwrap();
        let left = n - gone.len() as u64;
        let left_bytes = n * (n + 1) / 2 - gone.iter().sum::<u64>();
        assert_eq!(bytes(&b), (left, left_bytes), "sized: {sized}");
        let reads = store.reads.load(Ordering::SeqCst);
        match sized {
            true => assert_eq!(reads, 0, "a sized removal read the store"),
            false => assert!(reads > 0),
        }
    }
}

/// A replica applies the removal of messages from its queue's disk part (the leader's acks)
/// and its store write trails (a cluster node's applies do not wait for their writes); then it
/// serves (a failover). The read of the disk part must wait for that write
/// (`ReadPlan::after`): read before it, the store still holds the removed records, a read of
/// the `disk_count` records left returned them in place of the newest, and those stayed on
/// disk uncounted, never delivered (chaos seed 1 with lingering writes).
#[test]
fn a_read_of_the_disk_part_waits_for_the_removals_the_queue_applied() {
    let (mut b, c, store, written) = async_pager();
    let mut fx = Vec::new();
    let n = queue::WINDOW_MESSAGES as u64 + 40;
    replicate_deep_queue(&mut b, n, |id| id.to_string().into_bytes());
    commit_to(&mut b, &store, &written);
    // The first WINDOW_MESSAGES in memory, the rest on disk. The leader's acks of all those
    // in memory and of 5 of the disk part: applied, not yet written.
    let gone: Vec<u64> = (1..=queue::WINDOW_MESSAGES as u64)
        .chain([1030, 1031, 1040, 1050, 1060])
        .collect();
    b.apply(
        &Op::Remove {
            vhost: "/".into(),
            queue: "deep".into(),
            keys: gone
                .iter()
                .map(|id| warren_storage::message_key(0, *id))
                .collect(),
            sizes: gone.iter().map(|id| id.to_string().len() as u64).collect(),
        },
        &mut fx,
    )
    .unwrap();
    let pending = b.take_journal();
    let pending_batch = b.journal_seq();
    assert!(written.load(Ordering::Acquire) < pending_batch);
    // Serving now: a consumer takes everything; the node reads what the queue asks for,
    // after the batch each read names has been written (as `Shared::read_plan` waits).
    fx.clear();
    b.qos(c, 1, 0, false, &mut fx);
    b.consume(
        c,
        1,
        "/",
        "deep",
        "t",
        true,
        false,
        &FieldTable::default(),
        &mut fx,
    )
    .unwrap();
    let mut waited = false;
    let mut pending = Some(pending);
    for _ in 0..100 {
        let reads = take_reads(&mut fx);
        if reads.is_empty() {
            break;
        }
        for r in reads {
            if r.plan.after > written.load(Ordering::Acquire) {
                // The committer catches up.
                waited = true;
                if let Some(ops) = pending.take() {
                    warren_storage::Store::write(&*store, &ops, false).unwrap();
                    written.store(pending_batch, Ordering::Release);
                }
            }
            let data = r.plan.read(&*store, &r.vhost, &r.name);
            b.read_done(&r, data, &mut fx);
        }
    }
    let got: Vec<u64> = delivered(&fx)
        .into_iter()
        .map(|d| d.3.parse().unwrap())
        .collect();
    let want: Vec<u64> = (1..=n).filter(|id| !gone.contains(id)).collect();
    assert_eq!(got, want);
    assert!(waited, "no read waited for the removals' write");
    assert_eq!(b.queue_info("/", "deep").unwrap().message_count, 0);
}

/// A leader's durable queue past its window holds persistent messages and transient ones it
/// spilled to its own store; a replica, past its window too, holds the persistent ones alone.
/// Every message got (no ack) on the leader: the replica ends empty, its counts right. (The
/// removal of a spilled transient message was replicated, and taken by the replica from the
/// messages it had on disk.)
#[test]
fn a_replica_takes_only_the_removals_of_replicated_messages() {
    let pager = |store: Arc<FlakyReads>, written: Arc<std::sync::atomic::AtomicU64>| queue::Pager {
        store,
        written,
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: false,
        clock: Default::default(),
    };
    let store = || Arc::new(FlakyReads::default());
    // The committer's part: the journal written, then released from memory.
    let commit = |b: &mut Broker, s: &FlakyReads, w: &std::sync::atomic::AtomicU64| {
        let ops = b.take_journal();
        warren_storage::Store::write(s, &ops, false).unwrap();
        w.store(b.journal_seq(), Ordering::Release);
        b.release_written();
    };
    let (ls, lw) = (store(), Arc::new(std::sync::atomic::AtomicU64::new(0)));
    let (rs, rw) = (store(), Arc::new(std::sync::atomic::AtomicU64::new(0)));
    let (mut leader, c) = setup();
    leader.enable_journal();
    leader.record_ops();
    leader.set_pager(pager(ls.clone(), lw.clone()));
    let mut replica = Broker::new();
    replica.enable_journal();
    replica.set_pager(pager(rs.clone(), rw.clone()));
    let mut fx = Vec::new();
    leader
        .queue_declare(
            c,
            "/",
            QueueDeclare {
                name: "deep".into(),
                durable: true,
                ..Default::default()
            },
            &mut fx,
        )
        .unwrap();
    let n = 3 * queue::WINDOW_MESSAGES;
    for i in 0..n {
        let m = match i % 2 {
            0 => {
                let properties = AMQPProperties::default().with_delivery_mode(2);
                Arc::new(Message {
                    raw_properties: warren_protocol::codec::encode_properties(&properties),
                    properties,
                    ..Arc::into_inner(msg("", "deep", &format!("{i:04}"))).unwrap()
                })
            }
            _ => msg("", "deep", &format!("{i:04}")),
        };
        leader.publish("/", m, &mut fx).unwrap();
        if i % 100 == 99 {
            commit(&mut leader, &ls, &lw);
        }
    }
    commit(&mut leader, &ls, &lw);
    let ship = |leader: &mut Broker, replica: &mut Broker, fx: &mut Vec<Effect>| {
        for op in leader.take_ops() {
            replica.apply(&op, fx).unwrap();
        }
        commit(replica, &rs, &rw);
    };
    ship(&mut leader, &mut replica, &mut fx);
    let count = |b: &Broker| {
        let v = b.queue_views(Some("/"));
        (v[0].messages_ready, v[0].message_bytes_ready)
    };
    assert_eq!(count(&replica), (n as u64 / 2, 4 * n as u64 / 2));
    for i in 0..n {
        let got = leader.get(c, 1, "/", "deep", true).unwrap().unwrap();
        assert_eq!(got.msg.body, format!("{i:04}").as_bytes());
        if i % 100 == 99 {
            commit(&mut leader, &ls, &lw);
            ship(&mut leader, &mut replica, &mut fx);
            // The persistent ones not yet got: even numbers from i + 1 on, of 4 bytes each.
            let left = (n - (i + 1)).div_ceil(2) as u64;
            assert_eq!(count(&replica), (left, 4 * left), "after {} got", i + 1);
        }
    }
    commit(&mut leader, &ls, &lw);
    ship(&mut leader, &mut replica, &mut fx);
    assert_eq!(count(&leader), (0, 0));
    assert_eq!(count(&replica), (0, 0));
}

/// The broker serving clients records acks, rejects and deliveries through `apply` of one
/// `Op::Remove` per queue (`Broker::removed`): the messages left its ready list when they were
/// delivered, so there the apply takes nothing (its counts stay right), while a replica
/// applying the same ops takes them from memory, from disk and from the staged part, and
/// reaches the same state. Requeues in between put messages back among the paged-out ones.
#[test]
fn the_leaders_removals_go_through_apply_and_leave_leader_and_replica_equal() {
    let pager = |store: Arc<FlakyReads>, written: Arc<std::sync::atomic::AtomicU64>| queue::Pager {
        store,
        written,
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: false,
        clock: Default::default(),
    };
    let commit = |b: &mut Broker, s: &FlakyReads, w: &std::sync::atomic::AtomicU64| {
        let ops = b.take_journal();
        warren_storage::Store::write(s, &ops, false).unwrap();
        w.store(b.journal_seq(), Ordering::Release);
        b.release_written();
    };
    let (ls, lw) = (
        Arc::new(FlakyReads::default()),
        Arc::new(std::sync::atomic::AtomicU64::new(0)),
    );
    let (rs, rw) = (
        Arc::new(FlakyReads::default()),
        Arc::new(std::sync::atomic::AtomicU64::new(0)),
    );
    let (mut leader, c) = setup();
    leader.enable_journal();
    leader.record_ops();
    leader.set_pager(pager(ls.clone(), lw.clone()));
    let mut replica = Broker::new();
    replica.enable_journal();
    replica.set_pager(pager(rs.clone(), rw.clone()));
    let mut fx = Vec::new();
    leader
        .queue_declare(
            c,
            "/",
            QueueDeclare {
                name: "q".into(),
                durable: true,
                ..Default::default()
            },
            &mut fx,
        )
        .unwrap();
    let persistent = |i: usize| {
        let properties = AMQPProperties::default().with_delivery_mode(2);
        Arc::new(Message {
            raw_properties: warren_protocol::codec::encode_properties(&properties),
            properties,
            ..Arc::into_inner(msg("", "q", &format!("{i:05}"))).unwrap()
        })
    };
    let n = 3 * queue::WINDOW_MESSAGES;
    for i in 0..n {
        leader.publish("/", persistent(i), &mut fx).unwrap();
        if i % 100 == 99 {
            commit(&mut leader, &ls, &lw);
        }
    }
    let ship = |leader: &mut Broker, replica: &mut Broker, fx: &mut Vec<Effect>| {
        for op in leader.take_ops() {
            replica.apply(&op, fx).unwrap();
        }
        commit(replica, &rs, &rw);
    };
    // Some of the last are still staged on both when the removals begin.
    ship(&mut leader, &mut replica, &mut fx);
    let count = |b: &Broker| {
        let v = &b.queue_views(Some("/"))[0];
        (
            v.messages_ready + v.messages_unacknowledged,
            v.messages_unacknowledged,
        )
    };
    assert_eq!(count(&replica), (n as u64, 0));
    fx.clear();
    leader.qos(c, 1, 300, false, &mut fx);
    leader
        .consume(
            c,
            1,
            "/",
            "q",
            "t",
            false,
            false,
            &FieldTable::default(),
            &mut fx,
        )
        .unwrap();
    let mut acked = 0usize;
    for round in 0.. {
        assert!(round < 1000, "the queue never drained");
        let got = delivered(&fx);
        fx.clear();
        if got.is_empty() {
            break;
        }
        // The first ones acked (multiple), the last 20 requeued for the first rounds.
        let requeue = if round < 8 { got.len().min(20) } else { 0 };
        let (ack, back) = got.split_at(got.len() - requeue);
        if let Some(last) = ack.last() {
            leader.ack(c, 1, last.1, true, &mut fx).unwrap();
            acked += ack.len();
        }
        for d in back {
            leader.reject(c, 1, d.1, false, true, &mut fx).unwrap();
        }
        commit(&mut leader, &ls, &lw);
        ship(&mut leader, &mut replica, &mut fx);
        // The leader's ready and unacked messages are the replica's ready ones.
        let (total, _) = count(&leader);
        assert_eq!(total, (n - acked) as u64, "round {round}");
        assert_eq!(count(&replica), (total, 0), "round {round}");
    }
    assert_eq!(acked, n);
    assert_eq!(count(&leader), (0, 0));
    assert_eq!(
        replica.replicated_view().unwrap(),
        leader.replicated_view().unwrap()
    );
}

/// A purge while deliveries wait for their acks removes exactly what was ready. Past the
/// window the leader holds persistent messages and transient ones it spilled to its own
/// store: the purge's replicated removal names only persistent ones, each with its size (a
/// replica reads nothing to learn them), and the spilled ones' removal stays in the leader's
/// store. The replica is left with the unacknowledged persistent messages, then nothing.
#[test]
fn a_purge_replicates_the_removal_of_replicated_messages_alone_with_their_sizes() {
    let pager = |store: Arc<FlakyReads>, written: Arc<std::sync::atomic::AtomicU64>| queue::Pager {
        store,
        written,
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: false,
        clock: Default::default(),
    };
    let commit = |b: &mut Broker, s: &FlakyReads, w: &std::sync::atomic::AtomicU64| {
        let ops = b.take_journal();
        warren_storage::Store::write(s, &ops, false).unwrap();
        w.store(b.journal_seq(), Ordering::Release);
        b.release_written();
    };
    let (ls, lw) = (
        Arc::new(FlakyReads::default()),
        Arc::new(std::sync::atomic::AtomicU64::new(0)),
    );
    let (rs, rw) = (
        Arc::new(FlakyReads::default()),
        Arc::new(std::sync::atomic::AtomicU64::new(0)),
    );
    let (mut leader, c) = setup();
    leader.enable_journal();
    leader.record_ops();
    leader.set_pager(pager(ls.clone(), lw.clone()));
    let mut replica = Broker::new();
    replica.enable_journal();
    replica.set_pager(pager(rs.clone(), rw.clone()));
    let mut fx = Vec::new();
    leader
        .queue_declare(
            c,
            "/",
            QueueDeclare {
                name: "q".into(),
                durable: true,
                ..Default::default()
            },
            &mut fx,
        )
        .unwrap();
    // Even numbers persistent, odd ones transient.
    let n = 3 * queue::WINDOW_MESSAGES;
    for i in 0..n {
        let m = match i % 2 {
            0 => {
                let properties = AMQPProperties::default().with_delivery_mode(2);
                Arc::new(Message {
                    raw_properties: warren_protocol::codec::encode_properties(&properties),
                    properties,
                    ..Arc::into_inner(msg("", "q", &format!("{i:05}"))).unwrap()
                })
            }
            _ => msg("", "q", &format!("{i:05}")),
        };
        leader.publish("/", m, &mut fx).unwrap();
        if i % 100 == 99 {
            commit(&mut leader, &ls, &lw);
        }
    }
    commit(&mut leader, &ls, &lw);
    let ship = |leader: &mut Broker, replica: &mut Broker| -> Vec<Op> {
        let ops = leader.take_ops();
        for op in &ops {
            replica.apply(op, &mut Vec::new()).unwrap();
        }
        commit(replica, &rs, &rw);
        ops
    };
    ship(&mut leader, &mut replica);
    let persistent: std::collections::BTreeSet<u64> = replica.replicated_view().unwrap().queues[0]
        .messages
        .iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(persistent.len(), n / 2);
    // Got past the first window: the head is read back from the store, spilled transient
    // messages among it.
    for _ in 0..queue::WINDOW_MESSAGES + 200 {
        leader.get(c, 1, "/", "q", true).unwrap().unwrap();
    }
    commit(&mut leader, &ls, &lw);
    ship(&mut leader, &mut replica);

    let got = ten_unacked_then_purge(&mut leader, c, &ls, &mut fx);
    commit(&mut leader, &ls, &lw);
    let ops = ship(&mut leader, &mut replica);
    let mut by_key = 0;
    for op in &ops {
        if let Op::Remove { keys, sizes, .. } = op {
            assert_eq!(
                sizes.len(),
                keys.len(),
                "a replicated removal without sizes"
            );
            for k in keys {
                assert!(
                    persistent.contains(k),
                    "the removal of {k}, not replicated, was"
                );
            }
            by_key += keys.len();
        }
    }
    assert!(by_key > 0, "nothing removed by key: {ops:?}");
    let count = |b: &Broker| b.queue_views(Some("/"))[0].messages_ready;
    assert_eq!(count(&leader), 0);
    let unacked_persistent = got
        .iter()
        .filter(|d| d.3.parse::<u32>().unwrap() % 2 == 0)
        .count() as u64;
    assert_eq!(count(&replica), unacked_persistent);

    // Acked: nothing is left anywhere.
    leader.ack(c, 1, got[9].1, true, &mut fx).unwrap();
    commit(&mut leader, &ls, &lw);
    ship(&mut leader, &mut replica);
    assert_eq!(count(&replica), 0);
    assert_eq!(
        replica.replicated_view().unwrap(),
        leader.replicated_view().unwrap()
    );
}

/// A drop-head queue longer than its window drops its head on every publish once full. With
/// reads through the node, the next batch of its head is asked for ahead (read here by the
/// test, as the node does, outside the broker), so no publish reads the store itself under
/// the broker lock; what stays is the newest, in order.
#[test]
fn a_drop_head_queue_asks_for_its_head_ahead_and_publishes_read_nothing() {
    let store = Arc::new(FlakyReads::default());
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (mut b, c) = setup();
    b.enable_journal();
    b.set_pager(queue::Pager {
        store: store.clone(),
        written: written.clone(),
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: true,
        clock: Default::default(),
    });
    let commit = |b: &mut Broker| {
        let ops = b.take_journal();
        warren_storage::Store::write(&*store, &ops, false).unwrap();
        written.store(b.journal_seq(), Ordering::Release);
        b.release_written();
    };
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(3000));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("drop-head".into()),
    );
    let mut fx = Vec::new();
    b.queue_declare(
        c,
        "/",
        QueueDeclare {
            name: "dh".into(),
            durable: true,
            arguments,
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    let persistent = |i: usize| {
        let properties = AMQPProperties::default().with_delivery_mode(2);
        Arc::new(Message {
            raw_properties: warren_protocol::codec::encode_properties(&properties),
            properties,
            ..Arc::into_inner(msg("", "dh", &format!("{i:05}"))).unwrap()
        })
    };
    let (mut in_publishes, mut asked) = (0, 0);
    for i in 0..6000 {
        fx.clear();
        let before = store.reads.load(Ordering::SeqCst);
        b.publish("/", persistent(i), &mut fx).unwrap();
        in_publishes += store.reads.load(Ordering::SeqCst) - before;
        // The node's part: what was asked for, read and handed back.
        let reads: Vec<ReadRequest> = fx
            .drain(..)
            .filter_map(|e| match e {
                Effect::Read(r) => Some(r),
                _ => None,
            })
            .collect();
        for r in reads {
            asked += 1;
            let data = r.plan.read(&*store, &r.vhost, &r.name);
            b.read_done(&r, data, &mut fx);
        }
        if i % 100 == 99 {
            commit(&mut b);
        }
    }
    assert!(asked > 0, "nothing was asked ahead");
    assert_eq!(
        in_publishes, 0,
        "publishes read the store ({asked} reads asked ahead)"
    );
    assert_eq!(b.queue_info("/", "dh").unwrap().message_count, 3000);
    for i in 3000..3010 {
        let (got, _) = get_reading_outside(&mut b, c, &store, "dh");
        assert_eq!(got.as_deref(), Some(format!("{i:05}").as_str()));
    }
}

/// Every message of a quorum queue is stored and replicated, transient ones too (RabbitMQ's
/// quorum queues keep them in their log); a transient message of a durable classic queue is
/// not.
#[test]
fn a_quorum_queue_replicates_its_transient_messages() {
    let (mut leader, c) = setup();
    leader.enable_journal();
    leader.record_ops();
    let mut fx = Vec::new();
    let mut quorum = FieldTable::default();
    quorum.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    for (name, arguments) in [("qq", quorum), ("classic", FieldTable::default())] {
        leader
            .queue_declare(
                c,
                "/",
                QueueDeclare {
                    name: name.into(),
                    durable: true,
                    arguments,
                    ..Default::default()
                },
                &mut fx,
            )
            .unwrap();
        leader
            .publish("/", msg("", name, "transient"), &mut fx)
            .unwrap();
    }
    let journal = leader.take_journal();
    assert!(
        journal
            .iter()
            .any(|op| matches!(op, Op::Enqueue { queues, .. } if &*queues[0].0 == "qq")),
        "the quorum queue's message is not stored: {journal:?}"
    );
    let mut replica = Broker::new();
    for op in leader.take_ops() {
        replica.apply(&op, &mut fx).unwrap();
    }
    let view = replica.replicated_view().unwrap();
    assert_eq!(view, leader.replicated_view().unwrap());
    let count = |q: &str| {
        view.queues
            .iter()
            .find(|v| v.name == q)
            .map(|v| v.messages.len())
    };
    assert_eq!(count("qq"), Some(1));
    assert_eq!(count("classic"), Some(0));
}

/// An auto-delete durable exchange bound to durable and to transient queues: what the leader
/// records (its replicated ops, roots only) applied to a fresh broker gives the leader's
/// durable state, whichever binding goes first. Only bindings between durable things are
/// replicated, so a replica knows fewer bindings than the leader; deciding "last binding" on
/// all of them let the two disagree.
#[test]
fn auto_delete_cascades_over_transient_bindings_replicate_to_the_same_state() {
    let none = || encode_table(&FieldTable::default());
    let exchange = |name: &str| Op::DeclareExchange {
        vhost: "/".into(),
        name: name.into(),
        kind: "fanout".into(),
        durable: true,
        auto_delete: true,
        internal: false,
        arguments: none(),
    };
    let queue = |name: &str, durable: bool| Op::DeclareQueue {
        vhost: "/".into(),
        name: name.into(),
        durable,
        exclusive: false,
        auto_delete: false,
        arguments: none(),
    };
    let bind = |x: &str, q: &str| Op::Bind {
        vhost: "/".into(),
        source: x.into(),
        destination: BindingDest::Queue(q.into()),
        routing_key: "".into(),
        arguments: none(),
    };
    let unbind = |x: &str, q: &str| Op::Unbind {
        vhost: "/".into(),
        source: x.into(),
        destination: BindingDest::Queue(q.into()),
        routing_key: "".into(),
        arguments: none(),
    };
    let delete_queue = |q: &str| Op::DeleteQueue {
        vhost: "/".into(),
        name: q.into(),
    };
    let exists = |b: &Broker, x: &str| {
        b.replicated_view()
            .unwrap()
            .exchanges
            .iter()
            .any(|e| e.1 == x)
    };
    let cases: Vec<(&str, Vec<Op>)> = vec![
        // Bound to a durable and a transient queue; the durable binding goes first.
        (
            "mixed",
            vec![unbind("mixed", "durable"), delete_queue("transient")],
        ),
        // The same, the transient one first.
        (
            "mixed",
            vec![delete_queue("transient"), unbind("mixed", "durable")],
        ),
        // Bound to a transient queue alone, deleted with it.
        ("alone", vec![delete_queue("transient")]),
        // Bound to a transient queue alone, unbound from it.
        ("alone", vec![unbind("alone", "transient")]),
    ];
    for (i, (x, steps)) in cases.into_iter().enumerate() {
        let mut fx = Vec::new();
        let mut setup = vec![
            exchange(x),
            queue("durable", true),
            queue("transient", false),
            bind(x, "transient"),
        ];
        if x == "mixed" {
            setup.push(bind(x, "durable"));
        }
        // After every step, what the leader recorded so far, on a fresh replica.
        let mut leader = Broker::new();
        leader.record_ops();
        let mut recorded = Vec::new();
        for op in setup.iter().chain(&steps) {
            leader.apply(op, &mut fx).unwrap();
            recorded.extend(leader.take_ops());
            let mut replica = Broker::new();
            for op in &recorded {
                replica.apply(op, &mut fx).unwrap();
            }
            assert_eq!(
                leader.replicated_view().unwrap(),
                replica.replicated_view().unwrap(),
                "case {i}: {x} after {op:?}"
            );
        }
        assert!(!exists(&leader, x), "case {i}: {x} outlived its bindings");
    }
}

/// Issue 13 point 2, the property: random sequences of replicated ops (what a leader records)
/// applied to a fresh broker give the same state every time (deterministic), and a broker
/// rebuilt from a snapshot taken at any point (`Broker::snapshot_ops`) and then given the rest
/// of the ops ends in the same state as one that applied them all.
mod replay_property {
    use super::*;
    use proptest::prelude::*;
    use warren_storage::{message_key, BindingDest};

    const EXCHANGES: [&str; 3] = ["e0", "e1", "e2"];
    const QUEUES: [&str; 4] = ["q0", "q1", "q2", "q3"];
    const KEYS: [&str; 2] = ["a", "b"];

    /// One op as the generator picks it (turned into an `Op` by `build`, which numbers
    /// messages in order as a leader does).
    #[derive(Debug, Clone)]
    enum Pick {
        DeclareExchange(usize, u8, bool),
        DeleteExchange(usize),
        DeclareQueue(usize, bool, u8, Option<u32>),
        DeleteQueue(usize),
        Bind(usize, usize, bool, usize),
        Unbind(usize, usize, bool, usize),
        Enqueue(Vec<usize>, u8, Option<u16>, usize),
        Remove(usize, Vec<usize>),
        RemoveRange(usize, usize, usize),
        Purge(usize),
        PutVhost(u8),
        DeleteVhost,
        PutUser,
        DeleteUser,
        SetPermissions(u8),
        ClearPermissions,
        Limits(i8),
    }

    fn pick() -> impl Strategy<Value = Pick> {
        prop_oneof![
            (0..3usize, 0..3u8, any::<bool>()).prop_map(|(x, k, a)| Pick::DeclareExchange(x, k, a)),
            (0..3usize).prop_map(Pick::DeleteExchange),
            (
                0..4usize,
                any::<bool>(),
                0..3u8,
                proptest::option::of(0..50u32)
            )
                .prop_map(|(q, a, p, t)| Pick::DeclareQueue(q, a, p, t)),
            (0..4usize).prop_map(Pick::DeleteQueue),
            (0..3usize, 0..4usize, any::<bool>(), 0..2usize)
                .prop_map(|(x, d, q, k)| Pick::Bind(x, d, q, k)),
            (0..3usize, 0..4usize, any::<bool>(), 0..2usize)
                .prop_map(|(x, d, q, k)| Pick::Unbind(x, d, q, k)),
            (
                proptest::collection::vec(0..4usize, 1..3),
                0..4u8,
                proptest::option::of(0..100u16),
                0..3usize
            )
                .prop_map(|(qs, p, e, b)| Pick::Enqueue(qs, p, e, b)),
            (0..4usize, proptest::collection::vec(0..40usize, 1..4))
                .prop_map(|(q, ids)| Pick::Remove(q, ids)),
            (0..4usize, 0..40usize, 0..40usize).prop_map(|(q, a, b)| Pick::RemoveRange(q, a, b)),
            (0..4usize).prop_map(Pick::Purge),
            // The vhost everything is in: deleted with all of it (the cascades), made again.
            (0..2u8).prop_map(Pick::PutVhost),
            Just(Pick::DeleteVhost),
            // A user and their permissions there (which go with the user or the vhost).
            Just(Pick::PutUser),
            Just(Pick::DeleteUser),
            (0..2u8).prop_map(Pick::SetPermissions),
            Just(Pick::ClearPermissions),
            (-1..3i8).prop_map(Pick::Limits),
        ]
    }

    fn build(picks: &[Pick]) -> Vec<Op> {
        let mut next_id = 1u64;
        let mut now = 1_000u64;
        let kinds = ["direct", "fanout", "topic"];
        picks
            .iter()
            .map(|p| match p {
                Pick::DeclareExchange(x, k, auto_delete) => Op::DeclareExchange {
                    vhost: "/".into(),
                    name: EXCHANGES[*x].into(),
                    kind: kinds[*k as usize].into(),
                    durable: true,
                    auto_delete: *auto_delete,
                    internal: false,
                    arguments: encode_table(&FieldTable::default()),
                },
                Pick::DeleteExchange(x) => Op::DeleteExchange {
                    vhost: "/".into(),
                    name: EXCHANGES[*x].into(),
                },
                Pick::DeclareQueue(q, auto_delete, max_priority, ttl) => {
                    let mut args = FieldTable::default();
                    if *max_priority > 0 {
                        args.insert(
                            "x-max-priority".into(),
                            AMQPValue::ShortShortUInt(*max_priority),
                        );
                    }
                    if let Some(t) = ttl {
                        args.insert("x-message-ttl".into(), AMQPValue::LongUInt(*t));
                    }
                    Op::DeclareQueue {
                        vhost: "/".into(),
                        name: QUEUES[*q].into(),
                        durable: true,
                        exclusive: false,
                        auto_delete: *auto_delete,
                        arguments: encode_table(&args),
                    }
                }
                Pick::DeleteQueue(q) => Op::DeleteQueue {
                    vhost: "/".into(),
                    name: QUEUES[*q].into(),
                },
                Pick::Bind(x, d, to_queue, k) | Pick::Unbind(x, d, to_queue, k) => {
                    let destination = if *to_queue {
                        BindingDest::Queue(QUEUES[*d].into())
                    } else {
                        BindingDest::Exchange(EXCHANGES[*d % 3].into())
                    };
                    let (vhost, source, routing_key, arguments) = (
                        "/".to_string(),
                        EXCHANGES[*x].to_string(),
                        KEYS[*k].to_string(),
                        encode_table(&FieldTable::default()),
                    );
                    if matches!(p, Pick::Bind(..)) {
                        Op::Bind {
                            vhost,
                            source,
                            destination,
                            routing_key,
                            arguments,
                        }
                    } else {
                        Op::Unbind {
                            vhost,
                            source,
                            destination,
                            routing_key,
                            arguments,
                        }
                    }
                }
                Pick::Enqueue(queues, priority, expiration, body) => {
                    let id = next_id;
                    next_id += 1;
                    now += 7;
                    let mut props = AMQPProperties::default()
                        .with_delivery_mode(2)
                        .with_priority(*priority);
                    if let Some(e) = expiration {
                        props = props.with_expiration(e.to_string().into());
                    }
                    let mut qs: Vec<usize> = queues.clone();
                    qs.sort_unstable();
                    qs.dedup();
                    Op::Enqueue {
                        vhost: "/".into(),
                        queues: qs
                            .iter()
                            .map(|q| (warren_storage::Name::from(QUEUES[*q]), 0))
                            .collect(),
                        id,
                        timestamp_ms: now,
                        exchange: "".into(),
                        routing_key: "k".into(),
                        properties: warren_protocol::codec::encode_properties(&props),
                        body: Bytes::from(vec![b'x'; *body * 3]).into(),
                    }
                }
                Pick::Remove(q, ids) => Op::Remove {
                    vhost: "/".into(),
                    queue: QUEUES[*q].into(),
                    keys: ids
                        .iter()
                        .flat_map(|id| (0..3).map(move |l| message_key(l, *id as u64)))
                        .collect(),
                    sizes: Vec::new(),
                },
                Pick::RemoveRange(q, a, b) => Op::RemoveRange {
                    vhost: "/".into(),
                    queue: QUEUES[*q].into(),
                    from: message_key(0, *a.min(b) as u64),
                    to: message_key(2, *a.max(b) as u64),
                    counted: None,
                },
                Pick::Purge(q) => Op::Purge {
                    vhost: "/".into(),
                    queue: QUEUES[*q].into(),
                },
                Pick::PutVhost(d) => Op::PutVhost {
                    name: "/".into(),
                    description: format!("d{d}"),
                    tags: vec![format!("t{d}")],
                },
                Pick::DeleteVhost => Op::DeleteVhost { name: "/".into() },
                Pick::PutUser => Op::PutUser {
                    name: "u".into(),
                    password_hash: "".into(),
                    tags: vec![],
                },
                Pick::DeleteUser => Op::DeleteUser { name: "u".into() },
                Pick::SetPermissions(p) => Op::SetPermissions {
                    user: "u".into(),
                    vhost: "/".into(),
                    configure: format!("^c{p}"),
                    write: ".*".into(),
                    read: "".into(),
                },
                Pick::ClearPermissions => Op::ClearPermissions {
                    user: "u".into(),
                    vhost: "/".into(),
                },
                // A vhost's limits (gone with it); 0 clears them.
                Pick::Limits(n) => Op::PutVhostLimits {
                    vhost: "/".into(),
                    limits: if *n == 0 {
                        vec![]
                    } else {
                        vec![("max-queues".into(), *n as i64)]
                    },
                },
            })
            .collect()
    }

    fn apply_all(b: &mut Broker, ops: &[Op]) {
        let mut fx = Vec::new();
        for op in ops {
            // A refused op (a binding to something missing) changes nothing, the same way
            // every time.
            let _ = b.apply(op, &mut fx);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn replay_is_deterministic_and_a_snapshot_plus_the_tail_gives_the_same_state(
            picks in proptest::collection::vec(pick(), 1..60),
            split in 0..60usize,
        ) {
            let ops = build(&picks);
            let mut whole = Broker::new();
            apply_all(&mut whole, &ops);
            let mut again = Broker::new();
            apply_all(&mut again, &ops);
            let expected = whole.replicated_view().unwrap();
            prop_assert_eq!(&again.replicated_view().unwrap(), &expected);

            let split = split.min(ops.len());
            let mut head = Broker::new();
            apply_all(&mut head, &ops[..split]);
            let snapshot = head.snapshot_ops().unwrap();
            // As a node rebuilds from a store that records its vhosts.
            let mut restored = Broker::without_vhosts();
            apply_all(&mut restored, &snapshot);
            prop_assert_eq!(
                &restored.replicated_view().unwrap(),
                &head.replicated_view().unwrap()
            );
            apply_all(&mut restored, &ops[split..]);
            prop_assert_eq!(&restored.replicated_view().unwrap(), &expected);
        }
    }
}

/// Issue 13 point 5: the core does no I/O and reads no clock of its own. Its crate cannot name
/// tokio or RocksDB (not among its dependencies); this keeps the standard library's I/O, threads
/// and clocks out of its source too. (A paged-out backlog is still read through the `Store`
/// trait object the server hands it, under the broker lock: the next step moves that read out.)
#[test]
fn the_core_names_no_io_thread_or_clock() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let forbidden = [
        "std::fs",
        "std::net",
        "std::thread",
        "std::process",
        "std::io::",
        "Instant::now",
        "SystemTime",
        "tokio",
    ];
    let mut found = Vec::new();
    let mut files = 0;
    let mut dirs = vec![dir.clone()];
    let mut paths = Vec::new();
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                paths.push(path);
            }
        }
    }
    for path in paths {
        if path.extension().is_none_or(|e| e != "rs") || path.ends_with("tests.rs") {
            continue;
        }
        files += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for f in forbidden {
                if code.contains(f) {
                    found.push(format!("{}:{}: {f}", path.display(), n + 1));
                }
            }
        }
    }
    assert!(
        files >= 10,
        "the core's sources were not found in {}",
        dir.display()
    );
    assert!(found.is_empty(), "{found:#?}");
}

/// A broker paging to a store that counts its reads, reading through the node (as a server
/// does), with a journal committed by `commit_to`.
fn async_pager() -> (
    Broker,
    ConnId,
    Arc<FlakyReads>,
    Arc<std::sync::atomic::AtomicU64>,
) {
    let store = Arc::new(FlakyReads::default());
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (mut b, c) = setup();
    b.enable_journal();
    b.set_pager(queue::Pager {
        store: store.clone(),
        written: written.clone(),
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: true,
        clock: Default::default(),
    });
    (b, c, store, written)
}

fn commit_to(b: &mut Broker, store: &FlakyReads, written: &std::sync::atomic::AtomicU64) {
    let ops = b.take_journal();
    warren_storage::Store::write(store, &ops, false).unwrap();
    written.store(b.journal_seq(), Ordering::Release);
    b.release_written();
}

fn persistent_msg(key: &str, body: &str) -> Arc<Message> {
    let properties = AMQPProperties::default().with_delivery_mode(2);
    Arc::new(Message {
        raw_properties: warren_protocol::codec::encode_properties(&properties),
        properties,
        ..Arc::into_inner(msg("", key, body)).unwrap()
    })
}

/// The node's part: the reads queues asked for in `fx` are read (outside the core) and
/// handed back, until none is asked. How many were read.
fn serve_reads(b: &mut Broker, store: &FlakyReads, fx: &mut Vec<Effect>) -> usize {
    let mut n = 0;
    loop {
        let reads = take_reads(fx);
        if reads.is_empty() {
            return n;
        }
        for r in reads {
            n += 1;
            let data = r.plan.read(store, &r.vhost, &r.name);
            b.read_done(&r, data, fx);
        }
    }
}

/// 10 messages of queue "q" delivered to a consumer on channel 1 and left unacknowledged
/// (what the node must read for it read, as the node does), then the queue purged: the
/// deliveries.
fn ten_unacked_then_purge(
    b: &mut Broker,
    c: ConnId,
    store: &FlakyReads,
    fx: &mut Vec<Effect>,
) -> Vec<(String, u64, bool, String)> {
    fx.clear();
    b.qos(c, 1, 10, false, fx);
    b.consume(
        c,
        1,
        "/",
        "q",
        "t",
        false,
        false,
        &FieldTable::default(),
        fx,
    )
    .unwrap();
    serve_reads(b, store, fx);
    let got = delivered(fx);
    assert_eq!(got.len(), 10);
    let purge = Op::Purge {
        vhost: "/".into(),
        queue: "q".into(),
    };
    b.apply(&purge, fx).unwrap();
    got
}

/// basic.get through the core's one entry, as a connection does it: the read a get asks for
/// is read here, outside the core, and handed back with the get. Asserts that the core read
/// nothing itself; the body got (None: get-empty) and how many reads it took.
fn get_reading_outside(
    b: &mut Broker,
    c: ConnId,
    store: &FlakyReads,
    queue: &str,
) -> (Option<String>, usize) {
    let grant = Grant::default();
    let who = Who {
        via: Via::Node,
        conn: c,
        user: "",
        vhost: "/",
        grant: &grant,
    };
    let mut read = None;
    for rounds in 0..100_000 {
        let mut fx = Vec::new();
        let before = store.reads.load(Ordering::SeqCst);
        let (outcome, reply) = b
            .execute(
                &who,
                Cmd::Get {
                    ch: 1,
                    queue: queue.into(),
                    no_ack: true,
                    read: read.take(),
                },
                &mut fx,
            )
            .unwrap();
        assert_eq!(
            store.reads.load(Ordering::SeqCst),
            before,
            "basic.get read the store under the broker lock"
        );
        match outcome {
            Outcome::Read(request) => {
                let data = request.plan.read(store, &request.vhost, &request.name);
                read = Some(Box::new(ReadDone { request, data }));
            }
            _ => {
                let body = reply
                    .and_then(|r| r.content)
                    .map(|m| String::from_utf8_lossy(&m.body.to_bytes()).into_owned());
                return (body, rounds);
            }
        }
    }
    panic!("basic.get never got past its reads");
}

/// Issue 13 point 5: a drop-head queue whose head is on disk and not read yet (the node is
/// slow) does not read it under the broker lock on the next publish: the trim waits for the
/// read (the queue is over its limit meanwhile, and delivers nothing from its head), and is
/// done when the read is handed back; what stays is the newest, in order, and what went was
/// dead-lettered oldest first.
#[test]
fn a_drop_head_trim_waits_for_its_head_to_be_read_outside_the_lock() {
    let (mut b, c, store, written) = async_pager();
    let mut fx = Vec::new();
    declare(&mut b, c, "dead");
    b.exchange_declare(
        "/",
        ExchangeDeclare {
            name: "dlx".into(),
            kind: "fanout".into(),
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    b.queue_bind(
        c,
        "/",
        "dead",
        "dlx",
        "",
        &FieldTable::default(),
        true,
        &mut fx,
    )
    .unwrap();
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(3000));
    arguments.insert(
        "x-overflow".into(),
        AMQPValue::LongString("drop-head".into()),
    );
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("dlx".into()),
    );
    b.queue_declare(
        c,
        "/",
        QueueDeclare {
            name: "dh".into(),
            durable: true,
            arguments,
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    let (mut over, mut asked) = (0, Vec::new());
    for i in 0..6000 {
        let before = store.reads.load(Ordering::SeqCst);
        b.publish("/", persistent_msg("dh", &format!("{i:05}")), &mut fx)
            .unwrap();
        // As `Broker::execute` does after every command.
        b.ask_wanted(&mut fx);
        assert_eq!(
            store.reads.load(Ordering::SeqCst),
            before,
            "publish {i} read the store under the broker lock"
        );
        // The node serves the reads asked for only every 700 publishes (a slow disk).
        asked.extend(fx.drain(..).filter(|e| matches!(e, Effect::Read(_))));
        if i % 700 == 699 {
            fx.append(&mut asked);
            serve_reads(&mut b, &store, &mut fx);
            fx.clear();
        }
        over = over.max(b.queue_info("/", "dh").unwrap().message_count);
        if i % 100 == 99 {
            commit_to(&mut b, &store, &written);
        }
    }
    assert!(over > 3000, "the trim never had to wait for a read");
    // The reads the last publishes asked for, then what is still wanted (the timer's
    // `retry_reads` asks again).
    fx.append(&mut asked);
    serve_reads(&mut b, &store, &mut fx);
    b.retry_reads(&mut fx);
    serve_reads(&mut b, &store, &mut fx);
    assert_eq!(b.queue_info("/", "dh").unwrap().message_count, 3000);
    commit_to(&mut b, &store, &written);
    for i in 3000..3010 {
        let (got, _) = get_reading_outside(&mut b, c, &store, "dh");
        assert_eq!(got.as_deref(), Some(format!("{i:05}").as_str()));
    }
    assert_eq!(b.queue_info("/", "dead").unwrap().message_count, 3000);
    for i in 0..10 {
        let (got, _) = get_reading_outside(&mut b, c, &store, "dead");
        assert_eq!(got.as_deref(), Some(format!("{i:05}").as_str()));
    }
}

/// Issue 13 point 5: basic.get of a queue whose head is paged out, and of one whose whole
/// in-memory head has expired with more on disk, reads nothing under the broker lock: it
/// asks, the read is done outside and handed back with the get, which takes it in the same
/// critical section. Gets the right message: the oldest not expired.
#[test]
fn basic_get_reads_a_paged_out_or_expired_head_outside_the_lock() {
    let (mut b, c, store, written) = async_pager();
    b.set_clock(10_000);
    let mut fx = Vec::new();
    let mut arguments = FieldTable::default();
    arguments.insert("x-message-ttl".into(), AMQPValue::LongInt(1000));
    b.queue_declare(
        c,
        "/",
        QueueDeclare {
            name: "ttl".into(),
            durable: true,
            arguments,
            ..Default::default()
        },
        &mut fx,
    )
    .unwrap();
    let publish = |b: &mut Broker, from: usize, to: usize| {
        for i in from..to {
            let mut fx = Vec::new();
            b.publish("/", persistent_msg("ttl", &format!("{i:05}")), &mut fx)
                .unwrap();
            if i % 100 == 99 {
                commit_to(b, &store, &written);
            }
        }
        commit_to(b, &store, &written);
    };
    // Expire at 11,000: three windows' worth, most of it on disk.
    publish(&mut b, 0, 3 * queue::WINDOW_MESSAGES);
    b.set_clock(10_500);
    // Expire at 11,500.
    let live = 3 * queue::WINDOW_MESSAGES;
    publish(&mut b, live, live + 2000);
    // Paged out, not expired yet: the head comes in by reads outside, in order.
    let mut rounds = 0;
    for i in 0..queue::WINDOW_MESSAGES + 600 {
        let (got, r) = get_reading_outside(&mut b, c, &store, "ttl");
        rounds += r;
        assert_eq!(got.as_deref(), Some(format!("{i:05}").as_str()));
    }
    assert!(rounds > 0, "no get had to read");
    // Everything in memory and on disk up to `live` expires: the get goes through it all,
    // read outside, to the first message alive.
    b.set_clock(11_200);
    let (got, rounds) = get_reading_outside(&mut b, c, &store, "ttl");
    assert_eq!(got.as_deref(), Some(format!("{live:05}").as_str()));
    assert!(rounds > 1, "expired on disk, yet {rounds} read");
    assert_eq!(
        b.queue_info("/", "ttl").unwrap().message_count as usize,
        2000 - 1
    );
}

/// Issue 13 point 5: a purge while deliveries wait for acks replicates the removal of what was
/// on the leader's disk as a key range with its count and bytes, so a replica whose disk part
/// reaches below that range (it never reads its backlog back) learns what left without
/// reading its store. It keeps the unacknowledged messages, then nothing once they are acked.
#[test]
fn a_purge_tells_a_replica_what_left_its_disk_without_a_read() {
    let (mut leader, c, ls, lw) = async_pager();
    leader.record_ops();
    let (rs, rw) = (
        Arc::new(FlakyReads::default()),
        Arc::new(std::sync::atomic::AtomicU64::new(0)),
    );
    let mut replica = Broker::new();
    replica.enable_journal();
    replica.set_pager(queue::Pager {
        store: rs.clone(),
        written: rw.clone(),
        hold_max_ms: 0,
        read_failed: Default::default(),
        async_reads: true,
        clock: Default::default(),
    });
    let mut fx = Vec::new();
    leader
        .queue_declare(
            c,
            "/",
            QueueDeclare {
                name: "q".into(),
                durable: true,
                ..Default::default()
            },
            &mut fx,
        )
        .unwrap();
    let ship = |leader: &mut Broker, replica: &mut Broker| -> Vec<Op> {
        let ops = leader.take_ops();
        for op in &ops {
            replica.apply(op, &mut Vec::new()).unwrap();
        }
        commit_to(replica, &rs, &rw);
        ops
    };
    let n = 3 * queue::WINDOW_MESSAGES;
    for i in 0..n {
        leader
            .publish("/", persistent_msg("q", &format!("{i:05}")), &mut fx)
            .unwrap();
        if i % 100 == 99 {
            commit_to(&mut leader, &ls, &lw);
        }
    }
    commit_to(&mut leader, &ls, &lw);
    ship(&mut leader, &mut replica);
    // The leader gets past its first window: it reads its backlog back, the replica does not.
    for i in 0..queue::WINDOW_MESSAGES + 200 {
        let (got, _) = get_reading_outside(&mut leader, c, &ls, "q");
        assert_eq!(got.as_deref(), Some(format!("{i:05}").as_str()));
    }
    commit_to(&mut leader, &ls, &lw);
    ship(&mut leader, &mut replica);

    let got = ten_unacked_then_purge(&mut leader, c, &ls, &mut fx);
    commit_to(&mut leader, &ls, &lw);
    let before = rs.reads.load(Ordering::SeqCst);
    let ops = ship(&mut leader, &mut replica);
    assert!(
        ops.iter().any(|op| matches!(
            op,
            Op::RemoveRange {
                counted: Some(_),
                ..
            }
        )),
        "no counted range: {ops:?}"
    );
    assert_eq!(
        rs.reads.load(Ordering::SeqCst),
        before,
        "the replica read its store to apply the purge"
    );
    let count = |b: &mut Broker| b.queue_info("/", "q").unwrap().message_count;
    assert_eq!(count(&mut leader), 0);
    assert_eq!(count(&mut replica), 10);
    leader.ack(c, 1, got[9].1, true, &mut fx).unwrap();
    commit_to(&mut leader, &ls, &lw);
    ship(&mut leader, &mut replica);
    assert_eq!(count(&mut replica), 0);
    assert_eq!(
        replica.replicated_view().unwrap(),
        leader.replicated_view().unwrap()
    );
}

/// A get whose read of a paged-out head fails is not asked again and again: it answers
/// get-empty (the failure is logged, the timer retries the read), and the next get gets the
/// head.
#[test]
fn a_get_whose_read_fails_answers_at_once_and_the_next_gets_the_head() {
    let (mut b, c, store, written) = async_pager();
    declare_durable(&mut b, c, "q");
    let n = 3 * queue::WINDOW_MESSAGES;
    for i in 0..n {
        b.publish(
            "/",
            persistent_msg("q", &format!("{i:05}")),
            &mut Vec::new(),
        )
        .unwrap();
        if i % 100 == 99 {
            commit_to(&mut b, &store, &written);
        }
    }
    commit_to(&mut b, &store, &written);
    for i in 0..queue::WINDOW_MESSAGES {
        let (got, _) = get_reading_outside(&mut b, c, &store, "q");
        assert_eq!(got.as_deref(), Some(format!("{i:05}").as_str()));
    }
    store.fail.store(1, Ordering::SeqCst);
    let before = store.reads.load(Ordering::SeqCst);
    let (got, rounds) = get_reading_outside(&mut b, c, &store, "q");
    assert_eq!((got, rounds), (None, 1));
    assert_eq!(store.reads.load(Ordering::SeqCst), before + 1);
    let w = queue::WINDOW_MESSAGES;
    let (got, _) = get_reading_outside(&mut b, c, &store, "q");
    assert_eq!(got.as_deref(), Some(format!("{w:05}").as_str()));
}
