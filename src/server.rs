//! Accept loop, the state every connection shares, and graceful shutdown.

use crate::broker::{Broker, ConnId, Effect};
use crate::config::Config;
use crate::conn::{self, outbox::Outbox};
use amq_protocol::protocol::{basic, AMQPClass};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tracing::{info, info_span, warn, Instrument};

/// State shared by all connections.
#[derive(Debug)]
pub struct Shared {
    pub config: Config,
    /// The broker core. Lock order: broker → outboxes → one outbox. Never held across an await.
    pub broker: Mutex<Broker>,
    /// Where to send frames for each connection (deliveries produced by other connections).
    pub outboxes: RwLock<HashMap<ConnId, Arc<Outbox>>>,
}

impl Shared {
    pub fn new(config: Config) -> Arc<Self> {
        Arc::new(Shared {
            config,
            broker: Mutex::new(Broker::new()),
            outboxes: RwLock::new(HashMap::new()),
        })
    }

    /// Carry out what the core asked for. Call with the broker lock held, so that frames reach
    /// each outbox in the order the core decided them.
    pub fn apply_effects(&self, fx: &mut Vec<Effect>) {
        if fx.is_empty() {
            return;
        }
        let outboxes = self.outboxes.read();
        let mut last: Option<(ConnId, &Arc<Outbox>)> = None;
        for e in fx.drain(..) {
            let conn = match &e {
                Effect::Deliver { conn, .. }
                | Effect::ConsumerCancelled { conn, .. }
                | Effect::Throttled(conn) => *conn,
            };
            let outbox = match last {
                Some((c, o)) if c == conn => o,
                _ => match outboxes.get(&conn) {
                    Some(o) => {
                        last = Some((conn, o));
                        o
                    }
                    None => continue,
                },
            };
            match e {
                Effect::Deliver {
                    channel,
                    consumer_tag,
                    delivery_tag,
                    redelivered,
                    msg,
                    ..
                } => outbox.deliver(channel, &consumer_tag, delivery_tag, redelivered, &msg),
                Effect::ConsumerCancelled {
                    channel,
                    consumer_tag,
                    ..
                } => {
                    if outbox.cancel_notify.load(Ordering::Relaxed) {
                        outbox.method(
                            channel,
                            &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                                consumer_tag: consumer_tag.as_ref().into(),
                                nowait: true,
                            })),
                        );
                    }
                }
                Effect::Throttled(_) => {
                    outbox.throttled.store(true, Ordering::Release);
                    outbox.wake.notify_one();
                }
            }
        }
    }
}

/// Serve AMQP on an already-bound listener until `shutdown` resolves; then close every
/// connection with 320 CONNECTION_FORCED and wait (bounded) for them to finish.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let shared = Shared::new(config);
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
    info!(addr = %listener.local_addr()?, "listening for AMQP");
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (socket, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: wait a bit rather than spin.
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = socket.set_nodelay(true);
                let shared = shared.clone();
                let stop = stop_rx.clone();
                tracker.spawn(
                    conn::serve(socket, peer, shared, stop).instrument(info_span!("conn", %peer)),
                );
            }
        }
    }
    info!("shutting down: closing connections");
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
