//! Accept loop, the state every connection shares, and graceful shutdown.

use crate::broker::{Broker, ConnId, Effect};
use crate::commit::{Committer, Done};
use crate::config::Config;
use crate::conn::{self, outbox::Outbox};
use crate::registry::Registry;
use amq_protocol::protocol::{basic, AMQPClass};
use parking_lot::{Mutex, RwLock};
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
    pub outboxes: RwLock<rustc_hash::FxHashMap<ConnId, Arc<Outbox>>>,
    /// Writes durable changes to the store (None: nothing is kept across restarts).
    pub committer: Option<Committer>,
    /// The free-disk-space threshold in force (starts at `config.disk_free_limit`; adjustable
    /// while running).
    pub disk_free_limit: std::sync::atomic::AtomicU64,
    /// The disk alarm: true while free space is below the limit. Publishing connections wait
    /// on it (connection.blocked).
    pub disk_alarm: watch::Sender<bool>,
    /// The memory alarm: true while resident memory is above the high watermark. Publishing
    /// connections wait on it as on the disk alarm.
    pub memory_alarm: watch::Sender<bool>,
    /// Woken when a queue that held publishers is back under its window (`Effect::Drained`):
    /// the connections of those publishers wait on it.
    pub drained: Arc<tokio::sync::Notify>,
    /// Every client connection past its protocol header, by name (the management API).
    pub registry: Registry,
    /// Open connections allowed at once (RabbitMQ's connection_max): `config.connection_max`,
    /// or a share of the process's descriptor limit (`default_connection_max`).
    pub connection_max: usize,
    /// Client sockets accepted at most: the descriptor limit less what the store may hold
    /// open and a reserve for the broker's own (see `socket_budget`).
    pub max_connections: usize,
}

/// Descriptors kept for the broker itself: listeners, the runtime's epoll and event fds, the
/// standard streams, files the management API or a restart opens.
const OWN_FILES: u64 = 32;

/// How many client sockets fit in the process's descriptor limit beside `store_files`. Past
/// it a new connection is closed at once: a socket flood must not leave the store unable to
/// open a file (a failed log or table write stops it until it is reopened), which RabbitMQ
/// prevents the same way (its socket limit under the file handle limit).
pub fn socket_budget(store_files: u64) -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    soft.saturating_sub(store_files + OWN_FILES).max(1) as usize
}

/// Test hook (`Config::sync_delay`): a store whose synced writes take `delay` longer.
struct SlowSync {
    inner: Arc<dyn warren_storage::Store>,
    delay: std::time::Duration,
}

impl warren_storage::Store for SlowSync {
    fn write(
        &self,
        ops: &[warren_storage::Op],
        sync: bool,
    ) -> Result<(), warren_storage::StoreError> {
        if sync {
            std::thread::sleep(self.delay);
        }
        self.inner.write(ops, sync)
    }

    fn recover(&self) -> Result<warren_storage::Recovered, warren_storage::StoreError> {
        self.inner.recover()
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
        self.inner
            .read(vhost, queue, from, to, max_count, max_bytes)
    }

    fn read_keys(
        &self,
        vhost: &str,
        queue: &str,
        keys: &[u64],
    ) -> Result<Vec<Option<warren_storage::StoredMessage>>, warren_storage::StoreError> {
        self.inner.read_keys(vhost, queue, keys)
    }
}

/// The broker, locked. Dropping it hands the durable changes made meanwhile to the committer,
/// in the order they were made (the lock orders them).
pub struct BrokerGuard<'a> {
    shared: &'a Shared,
    guard: parking_lot::MutexGuard<'a, Broker>,
    notify: Option<tokio::sync::mpsc::UnboundedSender<Done>>,
}

impl std::ops::Deref for BrokerGuard<'_> {
    type Target = Broker;
    fn deref(&self) -> &Broker {
        &self.guard
    }
}

impl std::ops::DerefMut for BrokerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Broker {
        &mut self.guard
    }
}

impl BrokerGuard<'_> {
    /// Submit pending durable changes now; returns the commit ticket, if there were any.
    pub fn flush(&mut self) -> Option<u64> {
        let committer = self.shared.committer.as_ref()?;
        let ops = self.guard.take_journal();
        if ops.is_empty() {
            return None;
        }
        let ticket = self.guard.journal_seq();
        Some(committer.submit(ticket, ops, self.notify.clone()))
    }
}

impl Drop for BrokerGuard<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

impl Shared {
    /// A broker that keeps nothing across restarts.
    pub fn new(config: Config) -> Arc<Self> {
        let mut broker = Broker::new();
        let mut fx = Vec::new();
        for op in default_users(&broker, &config) {
            let _ = broker.apply(&op, &mut fx);
        }
        let connection_max = config_connection_max(&config);
        Arc::new(Shared {
            connection_max,
            config,
            broker: Mutex::new(broker),
            outboxes: RwLock::new(Default::default()),
            committer: None,
            disk_free_limit: std::sync::atomic::AtomicU64::new(0),
            disk_alarm: watch::channel(false).0,
            memory_alarm: watch::channel(false).0,
            drained: Default::default(),
            registry: Registry::default(),
            max_connections: socket_budget(0),
        })
    }

    /// A broker on its data folder: open the store, rebuild the state from it through the same
    /// `apply` live traffic uses, then record every durable change.
    pub fn open(config: Config) -> anyhow::Result<Arc<Self>> {
        use anyhow::Context;
        let path = config.data_dir.join("store");
        let options = warren_rocks::OpenOptions {
            recover_damaged: config.recover_damaged,
        };
        let store = match warren_rocks::RocksStore::open_with(&path, &options) {
            Ok(store) => store,
            Err(e @ warren_storage::StoreError::Corrupt { .. }) if !config.recover_damaged => {
                return Err(anyhow::Error::new(e).context(format!(
                    "the store in {} is damaged; Warren does not start on it (nothing was \
                     changed or discarded). To start with what can still be read, run once \
                     with --recover-damaged (or WARREN_RECOVER_DAMAGED=1): it copies the store \
                     to {}/damaged-<unix time>/ first, repairs it, and logs what was lost",
                    path.display(),
                    config.data_dir.display()
                )));
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!("opening the store in {}", path.display())))
            }
        };
        let recovered = warren_storage::Store::recover(&store)
            .with_context(|| format!("reading the store in {}", path.display()))?;
        let mut broker = Broker::new();
        // Replayed declarations of queues with x-expires count their lease from now.
        broker.set_clock(crate::clock::now_ms());
        let mut fx = Vec::new();
        for op in &recovered.ops {
            broker
                .apply(op, &mut fx)
                .map_err(|e| anyhow::anyhow!("replaying {op:?}: {e}"))?;
        }
        // The first start of a data folder (no user stored yet) creates the default users, as
        // RabbitMQ creates default_user only on a fresh database; they are on disk before any
        // client can log in.
        // From here on every change is journaled (replayed definitions were not: they are
        // what the store holds).
        broker.enable_journal();
        let defaults = default_users(&broker, &config);
        if !defaults.is_empty() {
            // Through the one apply like any change; its journal written before the start
            // goes on (the committer is not running yet).
            for op in &defaults {
                broker
                    .apply(op, &mut fx)
                    .map_err(|e| anyhow::anyhow!("creating the default user: {e}"))?;
            }
            let journal = broker.take_journal();
            warren_storage::Store::write(&store, &journal, true)
                .with_context(|| format!("storing the default user in {}", path.display()))?;
        }
        // Messages stay on disk; queues read them back a window at a time.
        let messages = broker.restore(&recovered.queues);
        broker.mark_recovered();
        let definitions = recovered.ops.len();
        info!(definitions, messages, path = %path.display(), "recovered");
        let store_files = store.max_open_files() as u64 + warren_rocks::open::STORE_OTHER_FILES;
        let store: Arc<dyn warren_storage::Store> = match config.sync_delay {
            Some(delay) => Arc::new(SlowSync {
                inner: Arc::new(store),
                delay,
            }),
            None => Arc::new(store),
        };
        let committer = Committer::start(store.clone());
        // Journal batches taken so far are written (the default users' above).
        committer
            .written
            .store(broker.journal_seq(), std::sync::atomic::Ordering::Release);
        broker.set_pager(crate::broker::queue::Pager {
            store,
            written: committer.written.clone(),
            hold_max_ms: config.flow_hold.as_millis() as u64,
            read_failed: Default::default(),
            clock: Default::default(),
        });
        let limit = config.disk_free_limit;
        let connection_max = config_connection_max(&config);
        Ok(Arc::new(Shared {
            connection_max,
            config,
            broker: Mutex::new(broker),
            outboxes: RwLock::new(Default::default()),
            committer: Some(committer),
            disk_free_limit: std::sync::atomic::AtomicU64::new(limit),
            disk_alarm: watch::channel(false).0,
            memory_alarm: watch::channel(false).0,
            drained: Default::default(),
            registry: Registry::default(),
            max_connections: socket_budget(store_files),
        }))
    }

    /// Lock the broker; durable changes made under this lock go to the store when it drops.
    pub fn lock(&self) -> BrokerGuard<'_> {
        self.lock_notify(None)
    }

    /// Like `lock`, telling `notify` when the changes are durable.
    pub fn lock_notify(
        &self,
        notify: Option<tokio::sync::mpsc::UnboundedSender<Done>>,
    ) -> BrokerGuard<'_> {
        BrokerGuard {
            shared: self,
            guard: self.broker.lock(),
            notify,
        }
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
                Effect::Drained => {
                    self.drained.notify_waiters();
                    continue;
                }
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
                                consumer_tag: warren_protocol::short(&consumer_tag),
                                nowait: true,
                            })),
                        );
                    }
                }
                Effect::Throttled(_) => {
                    outbox.throttled.store(true, Ordering::Release);
                    outbox.wake.notify_one();
                }
                Effect::Drained => {}
            }
        }
    }
}

/// The connection limit in force: the configured one, else half the process's soft limit on
/// open files (RLIMIT_NOFILE) less a reserve. The other half is for the store (its table
/// files are capped at a quarter of the limit) and the WAL, the management API and handshakes
/// in progress, so the process never runs out of descriptors by accepting clients (issue 12:
/// at the file limit, persistence stopped and new clients hung in the handshake).
fn config_connection_max(config: &Config) -> usize {
    if let Some(n) = config.connection_max {
        return n;
    }
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    default_connection_max(soft)
}

/// Half the descriptor limit less 32 (at least 16; "unlimited" counts as a million).
pub fn default_connection_max(nofile_soft: u64) -> usize {
    let n = nofile_soft.min(1 << 20) / 2;
    (n.saturating_sub(32)).max(16) as usize
}

impl Shared {
    /// Sockets accepted at once: the connection limit plus room for clients still in their
    /// handshake (which connection.open then refuses with 530 when the limit is reached).
    /// Never more than the descriptor budget beside the store (`max_connections`).
    pub fn socket_max(&self) -> usize {
        self.connection_max
            .saturating_add(self.connection_max / 8 + 8)
            .min(self.max_connections)
    }
}

/// The ops that create `config.users` (administrators) when the broker has no user yet.
fn default_users(broker: &Broker, config: &Config) -> Vec<warren_storage::Op> {
    if broker.has_users() {
        return Vec::new();
    }
    config
        .users
        .iter()
        .map(|(name, pass)| {
            let salt: [u8; 4] = rand::random();
            info!(user = %name, "creating the default user");
            warren_storage::Op::PutUser {
                name: name.clone(),
                password_hash: crate::broker::users::hash_password(pass, salt),
                tags: vec!["administrator".into()],
            }
        })
        .collect()
}

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
    let shared = Shared::open(config)?;
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
                    shared.disk_alarm.send_replace(low);
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
                    shared.memory_alarm.send_replace(high);
                }
            }
        }
    });
    // Expired messages leave their queues even when nobody consumes (RabbitMQ removes them at
    // the head); a tick is cheap when no queue holds expiring messages.
    let ticker = tokio::spawn({
        let shared = shared.clone();
        async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let mut broker = shared.lock();
                broker.set_clock(crate::clock::now_ms());
                let mut fx = Vec::new();
                broker.expire(&mut fx);
                broker.release_written();
                broker.retry_reads(&mut fx);
                if let Some(t) = shared.config.consumer_timeout {
                    broker.enforce_ack_timeout(t.as_millis() as u64, &mut fx);
                }
                shared.apply_effects(&mut fx);
            }
        }
    });
    // The management API: a port that cannot be bound leaves AMQP running (as RabbitMQ's
    // management plugin failing does not stop the node).
    let management = match shared.config.management_listen {
        Some(addr) => match bind_dual(addr).await {
            Ok(l) => {
                info!(addr = %l.local_addr()?, "serving the management API");
                Some(tokio::spawn(crate::http::serve(l, shared.clone())))
            }
            Err(e) => {
                warn!(error = %e, %addr, "management API not served");
                None
            }
        },
        None => None,
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
                tracker.spawn(
                    conn::serve(socket, peer, shared, stop).instrument(info_span!("conn", %peer)),
                );
            }
        }
    }
    info!("shutting down: closing connections");
    ticker.abort();
    disk_monitor.abort();
    memory_monitor.abort();
    if let Some(m) = management {
        m.abort();
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
