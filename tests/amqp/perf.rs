//! `warren perf` against the real server: counts add up, confirms and latencies are reported.

use crate::common::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    perf: warren_perf::PerfArgs,
}

fn args(server: &TestServer, extra: &[&str]) -> warren_perf::PerfArgs {
    let mut argv = vec![
        "perf".to_string(),
        "--uri".into(),
        server.url(),
        "--json".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    Cli::parse_from(argv).perf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_publishes_confirms_and_consumes_every_message() {
    let server = TestServer::start().await;
    let summary = warren_perf::run(args(
        &server,
        &[
            "--count",
            "2000",
            "--producers",
            "2",
            "--consumers",
            "2",
            "--queues",
            "2",
            "--persistent",
            "--confirm",
            "100",
            "--prefetch",
            "50",
            "--multi-ack-every",
            "10",
            "--size",
            "100",
        ],
    ))
    .await
    .unwrap();
    assert_eq!(summary.published, 4000);
    assert_eq!(summary.confirmed, 4000);
    assert_eq!(summary.consumed, 4000);
    assert!(summary.latency_us.max >= summary.latency_us.p50);
    assert!(summary.latency_us.p50 > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_fanout_counts_every_copy() {
    let server = TestServer::start().await;
    let summary = warren_perf::run(args(
        &server,
        &[
            "--count",
            "500",
            "--exchange-type",
            "fanout",
            "--queues",
            "3",
            "--consumers",
            "3",
            "--auto-ack",
            "--queue-prefix",
            "fan",
        ],
    ))
    .await
    .unwrap();
    assert_eq!(summary.published, 500);
    assert_eq!(summary.consumed, 1500);
}

/// Fill a queue with a publish-only run, then empty it with a drain-only run (scenario S5's
/// two phases): the drain consumes exactly what was published and acks all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_publish_only_then_drain_only() {
    let server = TestServer::start().await;
    let common = [
        "--persistent",
        "--size",
        "1024",
        "--count",
        "3000",
        "--queue-prefix",
        "s5",
    ];
    let mut fill = common.to_vec();
    fill.extend(["--consumers", "0", "--confirm", "100", "--random-body"]);
    let summary = warren_perf::run(args(&server, &fill)).await.unwrap();
    assert_eq!(summary.published, 3000);
    assert_eq!(summary.confirmed, 3000);
    assert_eq!(summary.consumed, 0);
    assert_eq!(summary.messages_left, Some(3000));

    let mut drain = common.to_vec();
    // 3000 is not a multiple of 7: the last partial batch needs its own ack.
    drain.extend([
        "--producers",
        "0",
        "--prefetch",
        "100",
        "--multi-ack-every",
        "7",
    ]);
    let summary = warren_perf::run(args(&server, &drain)).await.unwrap();
    assert_eq!(summary.published, 0);
    assert_eq!(summary.consumed, 3000);
    assert!(summary.consumed_per_sec > 0.0);
    assert_eq!(summary.latency_us.max, 0);
    assert_eq!(summary.messages_left, Some(0));

    // Nothing comes back once the drain's connection is gone: every delivery was acked.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            "s5-0".into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(q.message_count(), 0);
}

/// More queues than producers and consumers: one producer publishes round-robin to all three
/// queues, then one consumer subscribed to all three drains them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_spreads_workers_over_more_queues() {
    let server = TestServer::start().await;
    let common = ["--count", "99", "--queues", "3", "--queue-prefix", "spread"];
    let mut fill = common.to_vec();
    // Confirmed: all 99 are queued when the run returns.
    fill.extend(["--consumers", "0", "--confirm", "10"]);
    let summary = warren_perf::run(args(&server, &fill)).await.unwrap();
    assert_eq!(summary.confirmed, 99);
    assert_eq!(summary.messages_left, Some(99));
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for i in 0..3 {
        let q = ch
            .queue_declare(
                format!("spread-{i}").as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
        assert_eq!(q.message_count(), 33, "spread-{i}");
    }
    let mut drain = common.to_vec();
    drain.extend(["--producers", "0", "--auto-ack"]);
    let summary = warren_perf::run(args(&server, &drain)).await.unwrap();
    assert_eq!(summary.consumed, 99);
    assert_eq!(summary.messages_left, Some(0));
}
