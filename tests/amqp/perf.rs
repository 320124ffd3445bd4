//! `warren perf` against the real server: counts add up, confirms and latencies are reported.

use crate::common::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    perf: warren::perf::PerfArgs,
}

fn args(server: &TestServer, extra: &[&str]) -> warren::perf::PerfArgs {
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
    let summary = warren::perf::run(args(
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
    let summary = warren::perf::run(args(
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
