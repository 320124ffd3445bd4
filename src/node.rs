//! The node: the state every connection, the management API and the timers share, and the one
//! way into the broker core (`Shared::execute`): the lock, the broker's clock, the journal
//! flush to the committer, and the effects (deliveries to outboxes), in that order. Below
//! `conn`, `http` and `server` in the module graph: it names none of them (the outboxes it
//! writes to are `outbox`, a leaf).

use crate::broker::cmd::{Cmd, Grant, Outcome, Reply, Who};
use crate::broker::{Broker, ConnId, Effect};
use crate::commit::{Committer, Done};
use crate::config::Config;
use crate::outbox::Outbox;
use crate::registry::Registry;
use amq_protocol::protocol::{basic, AMQPClass};
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::watch;
use tracing::{info, warn};
use warren_protocol::AmqpError;

/// State shared by all connections.
pub struct Shared {
    /// This, for work handed to other threads (`carry_out_reads`).
    me: std::sync::Weak<Shared>,
    pub config: Config,
    /// The broker core. Lock order: broker → outboxes → one outbox. Never held across an await.
    pub broker: Mutex<Broker>,
    /// Where to send frames for each connection (deliveries produced by other connections).
    pub outboxes: RwLock<rustc_hash::FxHashMap<ConnId, Arc<Outbox>>>,
    /// Writes durable changes to the store (None: nothing is kept across restarts).
    pub committer: Option<Committer>,
    /// The store the committer writes and queues page from (None with no committer).
    pub store: Option<Arc<dyn warren_storage::Store>>,
    /// A cluster node's replication state (None: a single node, no Raft).
    pub replication: Option<Arc<crate::cluster::Replication>>,
    /// The free-disk-space threshold in force (starts at `config.disk_free_limit`; adjustable
    /// while running).
    pub disk_free_limit: std::sync::atomic::AtomicU64,
    /// The disk alarm: true while free space is below the limit. Publishing connections wait
    /// on it (connection.blocked).
    pub disk_alarm: watch::Sender<bool>,
    /// The memory alarm: true while resident memory is above the high watermark. Publishing
    /// connections wait on it as on the disk alarm.
    pub memory_alarm: watch::Sender<bool>,
    /// The two alarms as one word (`DISK_ALARM`, `MEMORY_ALARM`), set with the watches
    /// (`set_alarm`): a publishing connection looks at it once per frame, and a load costs
    /// nothing where a watch's `borrow` takes and releases its lock (6% of S1's CPU).
    pub alarms: std::sync::atomic::AtomicU8,
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

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("committer", &self.committer)
            .field("replication", &self.replication)
            .field("connection_max", &self.connection_max)
            .finish_non_exhaustive()
    }
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

/// Test hooks (`Config::sync_delay`, `Config::read_delay`): a store whose synced writes, or
/// whose reads of queue backlogs, take longer.
struct SlowSync {
    inner: Arc<dyn warren_storage::Store>,
    delay: std::time::Duration,
    read_delay: std::time::Duration,
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

    fn write_applied(
        &self,
        ops: &[warren_storage::Op],
        applied: &[u8],
        sync: bool,
    ) -> Result<(), warren_storage::StoreError> {
        if sync {
            std::thread::sleep(self.delay);
        }
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
        std::thread::sleep(self.read_delay);
        self.inner
            .read(vhost, queue, from, to, max_count, max_bytes)
    }

    fn read_keys(
        &self,
        vhost: &str,
        queue: &str,
        keys: &[u64],
    ) -> Result<Vec<Option<warren_storage::StoredMessage>>, warren_storage::StoreError> {
        std::thread::sleep(self.read_delay);
        self.inner.read_keys(vhost, queue, keys)
    }
}

/// Who asks the core for a change (`Shared::execute`).
pub enum Caller<'a> {
    /// A client connection: who it is (its user, vhost and permissions), the outbox its
    /// replies go to, the sender told when its durable changes are on disk, and its buffer
    /// of effects (kept across calls: a publish does not allocate one). A held reply also
    /// waits for commit `after` (a tx.commit-ok for the publishes routed before it).
    Conn {
        who: Who<'a>,
        outbox: &'a Arc<Outbox>,
        notify: &'a tokio::sync::mpsc::UnboundedSender<Done>,
        fx: &'a mut Vec<Effect>,
        after: Option<u64>,
    },
    /// The management API, for the logged-in `user`, in `vhost` ("" when none is concerned),
    /// told on `notify` like a connection.
    Admin {
        user: &'a str,
        vhost: &'a str,
        notify: tokio::sync::mpsc::UnboundedSender<Done>,
    },
    /// The node itself: a timer (expiry, consumer timeout, read retries), start-up
    /// (--load-definitions), or a connection's writer (`conn` and its `outbox`: delivery
    /// refills, the publisher hold).
    Node {
        conn: ConnId,
        outbox: Option<&'a Outbox>,
    },
}

impl Caller<'_> {
    /// The node itself, for no connection.
    pub fn node() -> Self {
        Caller::Node {
            conn: 0,
            outbox: None,
        }
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
        // The replicated ops go with the journal on a cluster node; elsewhere whoever records
        // them (a test) takes them.
        let replicated = if self.shared.replication.is_some() {
            self.guard.take_ops()
        } else {
            Vec::new()
        };
        let mut ops = self.guard.take_journal();
        if ops.is_empty() {
            debug_assert!(replicated.is_empty(), "replicated ops without store writes");
            return None;
        }
        let ticket = self.guard.journal_seq();
        if let Some(rep) = &self.shared.replication {
            let part = crate::commit::Part {
                ticket,
                ops,
                notify: self.notify.clone(),
            };
            // The leader's journal waits for the Raft entry that carries its ops.
            let Some(part) = rep.park(part, replicated, crate::clock::now_ms()) else {
                return Some(ticket);
            };
            // Not leading: only local paging may be written here; a replicated change on a
            // node that does not lead would be a change the cluster never agreed on.
            ops = part.ops;
            let before = ops.len();
            ops.retain(|op| matches!(op, warren_storage::Op::Spill { .. }));
            if ops.len() != before {
                // A command that ran anyway (connections stop executing once the node does
                // not lead, so this is a race at the moment of demotion): undo it and tell its
                // waiter it failed (a confirm would be a lie), then the broker is rebuilt from
                // the store, so it holds nothing the cluster did not agree on.
                tracing::error!(
                    dropped = before - ops.len(),
                    "changes made on a node that does not lead were not stored: undone"
                );
                if let Some(n) = &self.notify {
                    let _ = n.send(Done {
                        ticket,
                        ok: false,
                        deposed: true,
                    });
                }
                if let Err(e) = self.shared.rebuild_broker(&mut self.guard) {
                    tracing::error!(error = %e, "rebuilding the broker from the store failed; stopping");
                    std::process::exit(1);
                }
                committer.submit(ticket, ops, None);
                return Some(ticket);
            }
        }
        Some(committer.submit(ticket, ops, self.notify.clone()))
    }
}

impl Drop for BrokerGuard<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

/// How long a read of a queue's backlog waits for the store to write the removals it must
/// see (`Shared::read_plan`).
const STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `Shared::alarms`' bits.
pub const DISK_ALARM: u8 = 1;
pub const MEMORY_ALARM: u8 = 2;

/// Run a blocking read: on the server's runtime, the worker thread hands its other tasks to
/// another first (a task queued behind this one would otherwise wait out the read too).
fn blocking<R>(read: impl FnOnce() -> R) -> R {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(read)
    } else {
        read()
    }
}

impl Shared {
    /// A broker that keeps nothing across restarts.
    pub fn new(config: Config) -> Arc<Self> {
        let mut broker = Broker::new();
        let mut fx = Vec::new();
        for op in default_definitions(&broker, &config) {
            let _ = broker.apply(&op, &mut fx);
        }
        let connection_max = config_connection_max(&config);
        Arc::new_cyclic(|me| Shared {
            me: me.clone(),
            connection_max,
            config,
            broker: Mutex::new(broker),
            outboxes: RwLock::new(Default::default()),
            committer: None,
            store: None,
            replication: None,
            disk_free_limit: std::sync::atomic::AtomicU64::new(0),
            disk_alarm: watch::channel(false).0,
            memory_alarm: watch::channel(false).0,
            alarms: Default::default(),
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
            // A cluster node's Raft log is the durable record (see `OpenOptions::unlogged`;
            // the state machine persists the store before the log behind a snapshot goes).
            unlogged: config.cluster.is_some(),
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
        let definitions = recovered.ops.len();
        let (mut broker, messages) = broker_from(&recovered)?;
        // The first start of a data folder (no user stored yet) creates the default users, as
        // RabbitMQ creates default_user only on a fresh database; they are on disk before any
        // client can log in. (A cluster node leaves that to its first leader: users are
        // replicated like any definition.)
        let defaults = if config.cluster.is_none() {
            default_definitions(&broker, &config)
        } else {
            Vec::new()
        };
        if !defaults.is_empty() {
            // Through the one apply like any change; its journal written before the start
            // goes on (the committer is not running yet).
            let mut fx = Vec::new();
            for op in &defaults {
                broker
                    .apply(op, &mut fx)
                    .map_err(|e| anyhow::anyhow!("creating the default user: {e}"))?;
            }
            let journal = broker.take_journal();
            warren_storage::Store::write(&store, &journal, true)
                .with_context(|| format!("storing the default user in {}", path.display()))?;
        }
        info!(definitions, messages, path = %path.display(), "recovered");
        let store_files = store.max_open_files() as u64 + warren_rocks::open::STORE_OTHER_FILES;
        let store: Arc<dyn warren_storage::Store> = match (config.sync_delay, config.read_delay) {
            (None, None) => Arc::new(store),
            (delay, read_delay) => Arc::new(SlowSync {
                inner: Arc::new(store),
                delay: delay.unwrap_or_default(),
                read_delay: read_delay.unwrap_or_default(),
            }),
        };
        let committer = Committer::start(store.clone(), config.cluster.is_none());
        // Journal batches taken so far are written (the default users' above).
        committer
            .written
            .store(broker.journal_seq(), std::sync::atomic::Ordering::Release);
        broker.set_pager(pager(&store, &committer, &config));
        let replication = config.cluster.as_ref().map(|c| {
            Arc::new(crate::cluster::Replication::new(
                c.node_id,
                c.heartbeat_ms,
                {
                    // A node listed in --peers is known by that address; one joining later
                    // (not listed) by its --raft-listen.
                    let raft = c
                        .peers
                        .get(&c.node_id)
                        .cloned()
                        .unwrap_or_else(|| advertised(c.raft_listen, "127.0.0.1"));
                    crate::cluster::types::NodeInfo {
                        amqp: c
                            .advertise_amqp
                            .clone()
                            .unwrap_or_else(|| advertised(config.amqp_listen, &raft)),
                        http: c.advertise_http.clone().unwrap_or_else(|| {
                            config
                                .management_listen
                                .map(|a| advertised(a, &raft))
                                .unwrap_or_default()
                        }),
                        raft,
                        incarnation: 0,
                    }
                },
                crate::cluster::cluster_id(&c.peers),
            ))
        });
        let limit = config.disk_free_limit;
        let connection_max = config_connection_max(&config);
        Ok(Arc::new_cyclic(|me| Shared {
            me: me.clone(),
            connection_max,
            config,
            broker: Mutex::new(broker),
            outboxes: RwLock::new(Default::default()),
            committer: Some(committer),
            store: Some(store),
            replication,
            disk_free_limit: std::sync::atomic::AtomicU64::new(limit),
            disk_alarm: watch::channel(false).0,
            memory_alarm: watch::channel(false).0,
            alarms: Default::default(),
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

    /// The one way into the broker core for a change: AMQP handlers, the management API and
    /// the timers hand their command here (issue 13 point 6). Under the broker lock, in this
    /// order: the broker's clock is set; for a command whose reply is held
    /// (`Cmd::holds_reply`), the hold on the caller's outbox begins; the core carries the
    /// command out (`Broker::execute`: permission checks, the change, the reply); the reply
    /// is written to the caller's outbox, the effects go to the outboxes, the journal goes to
    /// the committer, and the hold ends with the commit ticket (see `Outbox::hold_begin`).
    /// Reads the core asked for are done after the lock is released. Returns the command's
    /// outcome and the commit ticket of the durable changes it made (None: none). The place
    /// where a metric or (in a cluster) a proposal hooks in; permission checks are the core's
    /// (`Broker::execute`), so AMQP and the API share them.
    pub fn execute(
        &self,
        caller: Caller<'_>,
        cmd: Cmd,
    ) -> (Result<Outcome, AmqpError>, Option<u64>) {
        let (grant, mut own_fx) = (Grant::default(), Vec::new());
        // `client`: a client connection's outbox, registered when connection.open succeeds.
        let (who, client, outbox, notify, fx, after) = match caller {
            Caller::Conn {
                who,
                outbox,
                notify,
                fx,
                after,
            } => (
                who,
                Some(outbox),
                Some(&**outbox),
                Some(notify.clone()),
                fx,
                after,
            ),
            Caller::Admin {
                user,
                vhost,
                notify,
            } => {
                let who = Who::api(user, vhost, &grant);
                (who, None, None, Some(notify), &mut own_fx, None)
            }
            Caller::Node { conn, outbox } => {
                let who = Who {
                    conn,
                    ..Who::node(&grant)
                };
                (who, None, outbox, None, &mut own_fx, None)
            }
        };
        let mut broker = self.lock_notify(notify);
        broker.set_clock(crate::clock::now_ms());
        if let (Cmd::Refill { .. }, Some(outbox)) = (&cmd, outbox) {
            // Deliveries are only pushed with the broker lock held, so "empty" is exact here.
            if !outbox.is_empty() {
                return (Ok(Outcome::Done), None);
            }
            outbox.throttled.store(false, Ordering::Release);
        }
        let held = outbox.filter(|_| cmd.holds_reply());
        let began = held.map(|outbox| outbox.hold_begin());
        // Test hook (off unless a test sets it): a client's declare of this name panics once
        // the core has carried it out (past its permission checks), with the broker lock
        // held, to show the connection task recovers from a defect there (conn::serve).
        let panics = match (&cmd, &self.config.panic_on_declare) {
            (Cmd::DeclareQueue { decl, .. }, Some(name)) if client.is_some() => {
                (decl.name == *name).then(|| name.clone())
            }
            _ => None,
        };
        let closes = matches!(cmd, Cmd::CloseConnection);
        let result = broker.execute(&who, cmd, fx).map(|(outcome, reply)| {
            if let (Outcome::Opened(conn), Some(client)) = (&outcome, client) {
                // Registered while the broker lock is held: deliveries find it from now on.
                self.outboxes.write().insert(*conn, Arc::clone(client));
            }
            if let (Some(reply), Some(outbox)) = (reply, outbox) {
                self.write_reply(who.conn, outbox, reply);
            }
            outcome
        });
        if let (Some(name), Ok(_)) = (panics, &result) {
            panic!("injected panic declaring {name}");
        }
        if closes {
            // Removed while the broker lock is held: nothing can route to it after.
            self.outboxes.write().remove(&who.conn);
        }
        let reads = crate::broker::take_reads(fx);
        self.apply_effects(fx);
        let mut ticket = broker.flush();
        if let (Some(outbox), Some(hold)) = (held, began) {
            ticket = ticket.max(after);
            outbox.hold_end(hold, ticket);
        }
        drop(broker);
        self.read_elsewhere(reads);
        (result, ticket)
    }

    /// Write a command's reply to the caller's outbox (a get-ok of a cluster's leader waits
    /// for the commit of the batch that replicated its message).
    fn write_reply(&self, conn: ConnId, outbox: &Outbox, reply: Reply) {
        if let (Some(batch), Some(rep)) = (reply.batch, &self.replication) {
            rep.hold_delivery(conn, outbox, batch);
        }
        match &reply.content {
            Some(msg) => outbox.method_with_content(reply.channel, &reply.method, msg),
            None => outbox.method(reply.channel, &reply.method),
        }
    }

    /// Hand reads queues asked for to a blocking thread of the runtime (there is none outside
    /// one: read here), so that whoever's change set them off (a publisher, the timer, a
    /// connection's writer) does not wait for them.
    fn read_elsewhere(&self, reads: Vec<crate::broker::ReadRequest>) {
        if reads.is_empty() {
            return;
        }
        match (tokio::runtime::Handle::try_current(), self.me.upgrade()) {
            (Ok(rt), Some(me)) => {
                rt.spawn_blocking(move || me.carry_out_reads(reads));
            }
            _ => self.carry_out_reads(reads),
        }
    }

    /// Read what queues asked for (`Effect::Read`) with the broker lock released, and hand
    /// each result back; what that hands out may ask for more (the next batch of a backlog),
    /// read in turn. A slow disk read so holds up only this thread, never the broker (issue 13
    /// point 5). It ends when the queues' consumers have no credit left (their connections'
    /// delivery budgets bound it); past 10,000 rounds what is left is asked again at the
    /// queues' next dispatch.
    pub(crate) fn carry_out_reads(&self, mut reads: Vec<crate::broker::ReadRequest>) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let mut rounds = 0;
        while !reads.is_empty() && rounds < 10_000 {
            rounds += 1;
            let done = blocking(|| {
                reads
                    .drain(..)
                    .map(|r| {
                        let data = self.read_plan(&*store, &r);
                        (r, data)
                    })
                    .collect::<Vec<_>>()
            });
            let mut fx = Vec::new();
            let mut broker = self.lock_notify(None);
            broker.set_clock(crate::clock::now_ms());
            for (r, data) in done {
                broker.read_done(&r, data, &mut fx);
            }
            reads = crate::broker::take_reads(&mut fx);
            self.apply_effects(&mut fx);
        }
        if !reads.is_empty() {
            // Left over: the queues ask again at their next dispatch.
            let mut broker = self.lock_notify(None);
            for r in &reads {
                broker.read_dropped(r);
            }
        }
    }

    /// Carry out a queue's read (blocking): once the store has every removal the queue's
    /// counts reflect (`ReadPlan::after`; a replica's store writes trail its applies). A store
    /// that has not caught up within `STORE_WAIT` fails the read (the queue tries again).
    fn read_plan(
        &self,
        store: &dyn warren_storage::Store,
        r: &crate::broker::ReadRequest,
    ) -> Result<crate::broker::queue::ReadData, warren_storage::StoreError> {
        if !self.wait_written(r.plan.after) {
            return Err(warren_storage::StoreError::Io(format!(
                "the store has not written journal batch {} (removals from the queue's \
                 backlog) within {STORE_WAIT:?}",
                r.plan.after
            )));
        }
        r.plan.read(store, &r.vhost, &r.name)
    }

    /// Wait (blocking this thread) until the committer has written journal batch `batch`, at
    /// most `STORE_WAIT`; whether it has.
    fn wait_written(&self, batch: u64) -> bool {
        let Some(c) = &self.committer else {
            return true;
        };
        let deadline = std::time::Instant::now() + STORE_WAIT;
        while c.written.load(Ordering::Acquire) < batch {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            // A cluster node's writes may linger (`commit::LINGER`): not the ones waited for.
            c.hurry();
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        true
    }

    /// Read what a get asked for (`Outcome::Read`) with the broker lock released; the get
    /// hands it back (`Cmd::Get`'s `read`).
    pub(crate) fn read_for(
        &self,
        request: crate::broker::ReadRequest,
    ) -> crate::broker::cmd::ReadDone {
        let data = match &self.store {
            Some(store) => blocking(|| self.read_plan(&**store, &request)),
            None => Err(warren_storage::StoreError::Io(
                "no store to read a queue back from".into(),
            )),
        };
        crate::broker::cmd::ReadDone { request, data }
    }

    /// Raise (`on`) or clear the disk or memory alarm (`DISK_ALARM`, `MEMORY_ALARM`): the word
    /// first, then the watch, whose waiters look at the word when woken.
    pub fn set_alarm(&self, which: u8, on: bool) {
        if on {
            self.alarms.fetch_or(which, Ordering::AcqRel);
        } else {
            self.alarms.fetch_and(!which, Ordering::AcqRel);
        }
        let watch = if which == DISK_ALARM {
            &self.disk_alarm
        } else {
            &self.memory_alarm
        };
        watch.send_replace(on);
    }

    /// Whether the disk or the memory alarm is raised (publishers wait while one is).
    pub fn alarmed(&self) -> bool {
        self.alarms.load(Ordering::Acquire) != 0
    }

    /// Whether this node serves clients and runs the timers that change state: a single
    /// node always; a cluster node while it leads.
    pub fn serves_clients(&self) -> bool {
        self.replication.as_ref().is_none_or(|r| r.is_leader())
    }

    /// A read of the broker's state (the management API's lists): the lock, nothing else.
    pub fn query<R>(&self, f: impl FnOnce(&Broker) -> R) -> R {
        f(&self.broker.lock())
    }

    /// Carry out what the core asked for. Call with the broker lock held, so that frames reach
    /// each outbox in the order the core decided them.
    pub fn apply_effects(&self, fx: &mut Vec<Effect>) {
        if fx.is_empty() {
            return;
        }
        if let Some(rep) = &self.replication {
            if !rep.lease_valid() {
                // A leader past its lease may be deposed already: it delivers nothing (what
                // it decided stays unacknowledged and comes back from the next leader).
                fx.retain(|e| !matches!(e, Effect::Deliver { .. }));
            }
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
                // Carried out by `execute` once the lock is released; one that reaches here
                // (not from `execute`) is asked again by the timer.
                Effect::Read(_) => continue,
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
                    batch,
                    ..
                } => {
                    if let Some(rep) = &self.replication {
                        // Not before the cluster has it (see `QueuedMessage::batch`).
                        rep.hold_delivery(conn, outbox, batch);
                    }
                    outbox.deliver(channel, &consumer_tag, delivery_tag, redelivered, &msg)
                }
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
                Effect::Drained | Effect::Read(_) => {}
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

/// A broker holding what the store recovered: definitions replayed through the same `apply`
/// live traffic uses, messages restored (they stay on disk; queues read them back a window at
/// a time), every message marked redelivered, and every change journaled from then on.
fn broker_from(recovered: &warren_storage::Recovered) -> anyhow::Result<(Broker, usize)> {
    // A store that records vhosts holds every one there is ("/" too, unless deleted).
    let mut broker = if recovered
        .ops
        .iter()
        .any(|op| matches!(op, warren_storage::Op::PutVhost { .. }))
    {
        Broker::without_vhosts()
    } else {
        Broker::new()
    };
    // Replayed declarations of queues with x-expires count their lease from now.
    broker.set_clock(crate::clock::now_ms());
    let mut fx = Vec::new();
    for op in &recovered.ops {
        match broker.apply(op, &mut fx) {
            Ok(()) => {}
            // What names a user or vhost a repaired store (--recover-damaged) lost is left
            // out, said in the log, rather than stop the start.
            Err(e)
                if matches!(
                    op,
                    warren_storage::Op::SetPermissions { .. }
                        | warren_storage::Op::PutVhostLimits { .. }
                        | warren_storage::Op::PutUserLimits { .. }
                        | warren_storage::Op::SetTopicPermissions { .. }
                ) =>
            {
                warn!(error = %e.text, ?op, "a stored permission or limit names a user or vhost the store lacks: left out");
            }
            Err(e) => anyhow::bail!("replaying {op:?}: {e}"),
        }
    }
    // From here on every change is journaled (replayed definitions were not: they are what
    // the store holds).
    broker.enable_journal();
    let messages = broker.restore(&recovered.queues);
    broker.mark_recovered();
    Ok((broker, messages))
}

fn pager(
    store: &Arc<dyn warren_storage::Store>,
    committer: &Committer,
    config: &Config,
) -> crate::broker::queue::Pager {
    crate::broker::queue::Pager {
        store: store.clone(),
        written: committer.written.clone(),
        hold_max_ms: config.flow_hold.as_millis() as u64,
        read_failed: Default::default(),
        clock: Default::default(),
        // Deliveries ask the node to read a paged-out backlog (`Shared::execute`), so that a
        // slow disk read holds up only the connection whose work needed it.
        async_reads: true,
    }
}

/// The address others reach `listen` on: as given, or with the host of this node's Raft
/// address when it listens on every interface.
fn advertised(listen: std::net::SocketAddr, raft: &str) -> String {
    if listen.ip().is_unspecified() {
        let host = raft.rsplit_once(':').map(|(h, _)| h).unwrap_or(raft);
        format!("{host}:{}", listen.port())
    } else {
        listen.to_string()
    }
}

impl Shared {
    /// Replace the broker with one rebuilt from the store (a node that stopped leading: its
    /// broker may hold changes no entry committed). Waits for the committer first, so the
    /// store holds every applied entry. Counters that outlive a broker (journal tickets,
    /// connection ids) go on from the old one.
    pub fn rebuild_broker(&self, broker: &mut Broker) -> anyhow::Result<()> {
        let (Some(store), Some(committer)) = (&self.store, &self.committer) else {
            return Ok(());
        };
        if !committer.barrier() {
            anyhow::bail!("the store failed a write");
        }
        let recovered = store.recover()?;
        let (mut fresh, _) = broker_from(&recovered)?;
        fresh.set_pager(pager(store, committer, &self.config));
        fresh.continue_after(broker);
        *broker = fresh;
        info!(
            definitions = recovered.ops.len(),
            "broker rebuilt from the store"
        );
        Ok(())
    }
}

/// The ops that create `config.users` (administrators) when the broker has no user yet, and
/// record the default vhost "/" when no vhost is recorded yet (a fresh data folder, or one of
/// a version that did not record vhosts, whose data is all in "/"), as RabbitMQ creates its
/// default user and vhost only on a fresh database.
///
/// Users get full permissions on "/" with it (as RabbitMQ gives its default user): the
/// default users, and on a data folder of a version before vhosts and permissions were
/// recorded, every user it has (they could all use "/" then).
pub fn default_definitions(broker: &Broker, config: &Config) -> Vec<warren_storage::Op> {
    use warren_storage::Op;
    let mut ops = Vec::new();
    let mut granted: Vec<String> = Vec::new();
    if !broker.vhosts_recorded() {
        ops.push(Op::PutVhost {
            name: "/".into(),
            description: "Default virtual host".into(),
            tags: Vec::new(),
        });
        granted.extend(broker.users().into_iter().map(|(name, _)| name));
    }
    if !broker.has_users() {
        for (name, pass) in &config.users {
            let salt: [u8; 4] = rand::random();
            info!(user = %name, "creating the default user");
            ops.push(Op::PutUser {
                name: name.clone(),
                password_hash: crate::broker::users::hash_password(pass, salt),
                tags: vec!["administrator".into()],
            });
            granted.push(name.clone());
        }
    }
    if !broker.vhosts_recorded() || broker.has_vhost("/") {
        ops.extend(granted.into_iter().map(|user| Op::SetPermissions {
            user,
            vhost: "/".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        }));
    }
    ops
}

#[cfg(test)]
mod tests {
    /// Issue 13 point 6: AMQP handlers, the management API, the connection tasks and the
    /// server's timers reach the broker core only by handing a command to `Shared::execute`
    /// (or read it through `Shared::query`): none of them locks the broker or holds it
    /// mutably. (The cluster's Raft state machine applies committed ops, and its leadership
    /// takeover installs state; both live in `cluster/`, which this does not scan.)
    #[test]
    fn only_the_node_changes_the_core() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let forbidden = [
            ".broker.lock(",
            "lock_notify(",
            "shared.lock(",
            "&mut Broker",
            "BrokerGuard",
            "Caller::Conn {",
        ];
        let mut paths = vec![src.join("server.rs")];
        for dir in ["handlers", "http", "conn"] {
            for entry in std::fs::read_dir(src.join(dir)).unwrap() {
                paths.push(entry.unwrap().path());
            }
        }
        let mut found = Vec::new();
        let mut executes = 0;
        for path in &paths {
            let text = std::fs::read_to_string(path).unwrap();
            let allowed_conn = path.ends_with("conn/session.rs");
            // The code without its comments, line by line (a call may span lines).
            let code: Vec<&str> = text
                .lines()
                .map(|line| line.split("//").next().unwrap_or(""))
                .collect();
            for (n, line) in code.iter().enumerate() {
                for f in forbidden {
                    // The session builds its own caller, once, in `run_as`.
                    if line.contains(f) && !(allowed_conn && f == "Caller::Conn {") {
                        found.push(format!("{}:{}: {f}", path.display(), n + 1));
                    }
                }
            }
            let joined = code.join("\n");
            for (at, _) in joined.match_indices(".execute(") {
                executes += 1;
                // Its arguments, to the matching parenthesis: a command value, never a
                // closure.
                let args = &joined[at + ".execute(".len()..];
                let mut depth = 1;
                let end = args
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '(' => 1,
                            ')' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .map_or(args.len(), |(i, _)| i);
                if args[..end].contains('|') {
                    let line = joined[..at].matches('\n').count() + 1;
                    found.push(format!("{}:{line}: a closure", path.display()));
                }
            }
        }
        assert!(executes >= 5, "the scan found {executes} calls of execute");
        assert!(
            found.is_empty(),
            "the core reached around execute: {found:#?}"
        );
    }
}
