//! Accept loop, connection limits at accept, timers and graceful shutdown.

use crate::broker::cmd::Cmd;
use crate::config::Config;
use crate::conn;
use crate::node::{Caller, Shared};
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tracing::{info, info_span, warn, Instrument};

/// Bind `addr`; the unspecified IPv6 address falls back to IPv4's on a host without IPv6.
pub async fn bind_dual(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Ok(l) => Ok(l),
        Err(e) if addr.ip() == std::net::Ipv6Addr::UNSPECIFIED => {
            let v4 = std::net::SocketAddr::from(([0, 0, 0, 0], addr.port()));
            warn!(error = %e, "no IPv6, listening on {v4}");
            TcpListener::bind(v4).await
        }
        Err(e) => Err(e),
    }
}

/// Serve AMQP on an already-bound listener until `shutdown` resolves; then close every
/// connection with 320 CONNECTION_FORCED and wait (bounded) for them to finish.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    // Certificate files that do not load stop the start before anything is opened or made.
    if let Some(t) = &config.tls {
        crate::tls::server_config(t)?;
    }
    let shared = Shared::open(config)?;
    if shared.replication.is_some() {
        crate::cluster::start(shared.clone()).await?;
    } else if let Some(doc) = shared.config.load_definitions.clone() {
        // Before any client: what they find is there.
        let steps = crate::http::definitions::import_steps(&doc, None)
            .map_err(|why| anyhow::anyhow!("--load-definitions: {why}"))?;
        let (result, _) = shared.execute(Caller::node(), Cmd::Import(steps));
        result.map_err(|e| anyhow::anyhow!("--load-definitions: {}", e.detail()))?;
        tracing::info!("definitions loaded");
    }
    serve(listener, shared, shutdown).await
}

/// Like [`run`], with state the caller made (tests keep a handle on it).
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let tracker = TaskTracker::new();
    // The disk alarm: free space on the data folder's file system is checked every second;
    // below the limit, publishers are blocked (as RabbitMQ's disk_free_limit does) so that a
    // full disk never turns into lost confirms.
    let disk_monitor = tokio::spawn({
        let shared = shared.clone();
        async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tick.tick().await;
                let limit = shared
                    .disk_free_limit
                    .load(std::sync::atomic::Ordering::Relaxed);
                let free = free_space(&shared.config.data_dir);
                let low = free.is_some_and(|f| f < limit);
                if *shared.disk_alarm.borrow() != low {
                    if low {
                        warn!(
                            ?free,
                            limit, "disk alarm: free space below the limit, blocking publishers"
                        );
                    } else {
                        info!(?free, limit, "disk alarm cleared");
                    }
                    shared.set_alarm(crate::node::DISK_ALARM, low);
                }
            }
        }
    });
    // The memory alarm: memory is read every 100 ms (an atomic counter in the binary), so a
    // flood of publishes overshoots the watermark by at most what arrives in that time.
    let memory_monitor = tokio::spawn({
        let shared = shared.clone();
        async move {
            let total = crate::memory::total_memory().unwrap_or(u64::MAX);
            let limit = shared.config.vm_memory_high_watermark.bytes(total);
            info!(limit, total, "memory high watermark");
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(100));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(used) = crate::memory::used() else {
                    continue;
                };
                let high = used > limit;
                if *shared.memory_alarm.borrow() != high {
                    if high {
                        warn!(
                            used,
                            limit, "memory alarm: above the high watermark, blocking publishers"
                        );
                    } else {
                        info!(used, limit, "memory alarm cleared");
                    }
                    shared.set_alarm(crate::node::MEMORY_ALARM, high);
                }
            }
        }
    });
    let clock_watch = tokio::spawn(crate::clock::watch_jumps());
    // Expired messages leave their queues even when nobody consumes (RabbitMQ removes them at
    // the head); a tick is cheap when no queue holds expiring messages.
    let ticker = tokio::spawn({
        let shared = shared.clone();
        async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let timeout = shared.config.consumer_timeout;
                // Expiry and the consumer timeout make replicated changes: the leader's alone
                // (a follower applies the ops the leader's timers make).
                let leads = shared.serves_clients();
                let tick = Cmd::Tick {
                    lead: leads,
                    ack_timeout_ms: timeout.map(|t| t.as_millis() as u64),
                };
                let _ = shared.execute(Caller::node(), tick);
            }
        }
    });
    // The management API: a port that cannot be bound leaves AMQP running (as RabbitMQ's
    // management plugin failing does not stop the node).
    // Over HTTPS: the certificate must load (a bad one stops the start, as for amqps).
    let management_tls = match (&shared.config.tls, shared.config.management_tls) {
        (Some(t), true) => {
            let t = crate::config::TlsConfig {
                verify_peer: false,
                fail_if_no_peer_cert: false,
                ..t.clone()
            };
            Some(tokio_rustls::TlsAcceptor::from(crate::tls::server_config(
                &t,
            )?))
        }
        (None, true) => anyhow::bail!("--management-tls needs --tls-cert and --tls-key"),
        (_, false) => None,
    };
    let management = match shared.config.management_listen {
        Some(addr) => match bind_dual(addr).await {
            Ok(l) => {
                info!(addr = %l.local_addr()?, tls = management_tls.is_some(), "serving the management API");
                Some(match management_tls {
                    Some(acceptor) => {
                        tokio::spawn(crate::http::serve_tls(l, acceptor, shared.clone()))
                    }
                    None => tokio::spawn(crate::http::serve(l, shared.clone())),
                })
            }
            Err(e) => {
                warn!(error = %e, %addr, "management API not served");
                None
            }
        },
        None => None,
    };
    // AMQP over TLS: a listener that cannot start stops the start (as RabbitMQ's does).
    let amqps = match (shared.config.amqps_listen, &shared.config.tls) {
        (Some(addr), Some(tls)) => {
            use anyhow::Context;
            let config = crate::tls::server_config(tls)?;
            let l = bind_dual(addr)
                .await
                .with_context(|| format!("binding --amqps-listen {addr}"))?;
            info!(addr = %l.local_addr()?, "listening for AMQP over TLS");
            Some(tokio::spawn(tls_accept_loop(
                l,
                tokio_rustls::TlsAcceptor::from(config),
                shared.clone(),
                stop_rx.clone(),
                tracker.clone(),
            )))
        }
        (Some(_), None) => anyhow::bail!("--amqps-listen needs --tls-cert and --tls-key"),
        (None, _) => None,
    };
    info!(
        addr = %listener.local_addr()?,
        connection_max = shared.connection_max,
        sockets_max = shared.socket_max(),
        "listening for AMQP"
    );
    let mut accept_failing = crate::log_limit::Repeats::default();
    let mut over_limit = crate::log_limit::Repeats::default();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (socket, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: wait a bit rather than spin.
                        if let Some(unlogged) = accept_failing.hit(crate::clock::now_ms()) {
                            warn!(error = %e, failures_not_logged = unlogged, "accept failed");
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Past the connection limit (and the handshakes it leaves room for), a socket is
                // closed at once: the process keeps descriptors for the store and for clients
                // it serves. Under that, connection.open past the limit gets RabbitMQ's 530.
                if tracker.len() >= shared.socket_max() {
                    if let Some(unlogged) = over_limit.hit(crate::clock::now_ms()) {
                        warn!(
                            %peer,
                            limit = shared.connection_max,
                            refused_not_logged = unlogged,
                            "connection refused: too many connections"
                        );
                    }
                    drop(socket);
                    continue;
                }
                let _ = socket.set_nodelay(true);
                let shared = shared.clone();
                let stop = stop_rx.clone();
                if let Some(rep) = shared.replication.clone() {
                    if !rep.is_leader() && shared.config.cluster.as_ref().is_some_and(|c| {
                        c.follower_clients == crate::config::FollowerClients::Proxy
                    }) {
                        tracker.spawn(
                            crate::cluster::proxy::serve(socket, peer, shared, rep, stop)
                                .instrument(info_span!("proxy", %peer)),
                        );
                        continue;
                    }
                }
                tracker.spawn(
                    conn::serve(socket, peer, shared, stop).instrument(info_span!("conn", %peer)),
                );
            }
        }
    }
    info!("shutting down: closing connections");
    ticker.abort();
    clock_watch.abort();
    disk_monitor.abort();
    memory_monitor.abort();
    if let Some(m) = management {
        m.abort();
    }
    if let Some(t) = amqps {
        t.abort();
    }
    drop(listener);
    let _ = stop_tx.send(true);
    tracker.close();
    let grace = shared.config.shutdown_grace + std::time::Duration::from_secs(1);
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        warn!("some connections did not close in time");
    }
    info!("stopped");
    Ok(())
}

/// Free bytes for unprivileged users on the file system holding `path`.
fn free_space(path: &std::path::Path) -> Option<u64> {
    let s = rustix::fs::statvfs(path).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}

/// Accept TLS clients on `listener`: each handshake (bounded by the handshake timeout, so a
/// client that never finishes it holds nothing for long) runs in the client's own task, then
/// the connection is served as a plain one is.
async fn tls_accept_loop(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    tracker: TaskTracker,
) {
    let mut accept_failing = crate::log_limit::Repeats::default();
    loop {
        let (socket, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                if let Some(unlogged) = accept_failing.hit(crate::clock::now_ms()) {
                    warn!(error = %e, failures_not_logged = unlogged, "accept failed (amqps)");
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        if tracker.len() >= shared.socket_max() {
            drop(socket);
            continue;
        }
        let _ = socket.set_nodelay(true);
        let (acceptor, shared, stop) = (acceptor.clone(), shared.clone(), stop.clone());
        tracker.spawn(
            async move {
                let limit = shared.config.handshake_timeout;
                match tokio::time::timeout(limit, acceptor.accept(socket)).await {
                    Ok(Ok(tls)) => conn::serve_tls(tls, peer, shared, stop).await,
                    Ok(Err(e)) => info!(error = %e, "TLS handshake failed"),
                    Err(_) => info!("TLS handshake timed out"),
                }
            }
            .instrument(info_span!("conn", %peer, tls = true)),
        );
    }
}
