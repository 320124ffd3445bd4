//! The replicated cluster (issue 15): one Raft group (openraft) whose log is the op stream of
//! the broker's one apply.
//!
//! How a change travels, on the leader: a command runs on the broker under its lock, as on a
//! single node (replies and deliveries are decided at once); `BrokerGuard::flush` hands its
//! replicated root ops to the proposer and parks its journal (the store write and whoever
//! waits for it: confirms, *-ok replies) in `Proposals::fifo`. The proposer makes one Raft
//! entry of everything that arrived meanwhile (group commit becomes batched proposals). When
//! openraft has the entry fsynced on a majority it applies it (`sm.rs`): on the leader, that
//! releases the parked journals to the committer, which writes them with the applied position
//! and then tells their waiters, so a confirm means "committed". Followers apply each op
//! through the same `Broker::apply`.
//!
//! Leadership: a node that Raft made leader proposes a barrier, an empty entry marked with a
//! new stint id (`Proposals::barrier`), and serves clients only once that entry is applied:
//! everything before it in the log, whoever proposed it, is then applied too. Its proposals
//! carry the stint id, so the state machine skips exactly the entries of this stint (applied
//! ahead on the leader) and applies every other one. The first entry of the term is not
//! enough: a leader restarted with its vote keeps its term (openraft restores it without an
//! election) and finds entries of that term from its previous life; a leader that stepped
//! down and leads again in the same term has entries of its first stint in flight, whose
//! effects its rebuild dropped. Both are applied as any follower applies them. A node that stops leading fails what was
//! parked (nothing unconfirmed is confirmed), closes its client connections and rebuilds its
//! broker from its store, which holds exactly the applied entries: whatever it had done ahead
//! of the commit is gone, and entries of its term that the next leader commits are applied to
//! it as to any follower.

pub mod log_store;
pub mod net;
pub mod proxy;
pub mod sm;
pub mod snapshot;
pub mod status;
pub mod types;

use crate::broker::ConnId;
use crate::commit::{Done, Part};
use crate::node::Shared;
use crate::outbox::Outbox;
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use tracing::{error, info, warn};
use types::{Batch, NodeId, NodeInfo, Raft};
use warren_storage::Op;

/// What the proposer, the state machine and `BrokerGuard::flush` share (under one lock, taken
/// after the broker's).
#[derive(Default)]
pub struct Proposals {
    /// While this node serves as leader: the leader id of its term (entries it proposed carry
    /// it in their log id).
    pub leading: Option<openraft::CommittedLeaderId<NodeId>>,
    /// Journals waiting for the entry that covers their ticket.
    pub fifo: VecDeque<Part>,
    /// Replicated ops not yet proposed, one group per journal batch (parked together, so
    /// proposed together: a group is atomic, a transaction's commit for one).
    unproposed: VecDeque<Unproposed>,
    /// Set by the state machine when it saw an entry it cannot reconcile with leading.
    pub diverged: bool,
    /// While leading: the stint id its proposals carry (`Batch::proposer`); 0 otherwise.
    pub stint: u64,
    /// The barrier proposed to start a stint (see the module doc).
    pub barrier: Option<Barrier>,
}

/// An empty entry whose apply shows that everything before it is applied.
#[derive(Clone, Copy, Debug)]
pub struct Barrier {
    pub leader: openraft::CommittedLeaderId<NodeId>,
    pub stint: u64,
    pub applied: bool,
}

impl Proposals {
    /// The state machine applies a normal entry of `leader` proposed by `proposer`: whether
    /// it is this node's pending barrier (then marked applied; it holds no ops).
    pub fn barrier_applied(
        &mut self,
        leader: openraft::CommittedLeaderId<NodeId>,
        proposer: u64,
    ) -> bool {
        match self.barrier.as_mut() {
            Some(b) if self.leading.is_none() && b.stint == proposer && b.leader == leader => {
                b.applied = true;
                true
            }
            _ => false,
        }
    }

    /// Whether an entry of `leader` proposed by `proposer` was proposed by this stint (and
    /// so applied on this broker already).
    pub fn is_ours(&self, leader: openraft::CommittedLeaderId<NodeId>, proposer: u64) -> bool {
        self.leading == Some(leader) && self.stint != 0 && proposer == self.stint
    }
}

/// One journal batch's replicated ops, waiting for the proposer.
struct Unproposed {
    ops: Vec<Op>,
    ticket: u64,
    clock_ms: u64,
    bytes: usize,
}

/// About how many bytes an entry gathers at most (at least one journal batch whatever its
/// size). openraft gives an AppendEntries one heartbeat interval to come back, the follower's
/// fsync of it included: an entry of all that arrived during a slow fsync, megabytes of large
/// messages, could take longer every time it was sent, and the leader would never hear a
/// majority again.
const ENTRY_BYTES: usize = 1 << 20;

/// A rough size of an op in an entry (message bodies dominate).
fn op_bytes(op: &Op) -> usize {
    match op {
        Op::Enqueue { body, .. } => body.len() + 64,
        _ => 64,
    }
}

/// Replication state of a cluster node (`Shared::replication`).
pub struct Replication {
    pub me: NodeId,
    /// `--raft-heartbeat-ms`.
    pub heartbeat_ms: u64,
    pub state: parking_lot::Mutex<Proposals>,
    /// Wakes the proposer.
    wake: tokio::sync::Notify,
    /// Set once Raft runs.
    pub raft: OnceLock<Raft>,
    /// Mirrors `state.leading.is_some()`, readable without a lock (accept loop, timers).
    leader: AtomicBool,
    /// This node's addresses (in its membership data).
    pub info: NodeInfo,
    pub cluster_id: String,
    pub log: OnceLock<log_store::LogStore>,
    /// The leader's lease: until this instant (ms since `epoch`, a monotonic clock, so a jump
    /// of the wall clock changes nothing) a majority acknowledged it recently enough that no
    /// other leader can exist. Past it, nothing is delivered and the node steps down.
    lease_until: AtomicU64,
    epoch: std::time::Instant,
    /// See `NodeInfo::incarnation` (set when the log is opened).
    incarnation: AtomicU64,
    /// The last journal batch known committed: on the leader the last of its own entries
    /// applied (a majority has it), on a follower the last it applied. Deliveries of messages
    /// enqueued by a later batch wait in their outbox for it (`hold_delivery`).
    committed: AtomicU64,
    /// Connections whose outbox holds deliveries waiting for a commit.
    held: parking_lot::Mutex<Vec<ConnId>>,
    /// When a leader's AppendEntries was last accepted here.
    pub heard: Arc<net::Heard>,
    /// A grown single node whose data is not yet in a snapshot (`first_snapshot`): no node
    /// may be added until it is.
    pub grow_pending: AtomicBool,
    /// `--load-definitions` was imported (the first time this process led).
    pub definitions_loaded: AtomicBool,
    /// A follower's message ops not applied yet (`sm::Deferred`; taken after `state`).
    pub deferred: parking_lot::Mutex<sm::Deferred>,
    /// While a node whose Raft log is new takes no part yet (`may_join`): what it waits for.
    pub joining: parking_lot::Mutex<Option<String>>,
}

impl std::fmt::Debug for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replication")
            .field("me", &self.me)
            .field("leader", &self.is_leader())
            .finish()
    }
}

impl Replication {
    pub fn new(me: NodeId, heartbeat_ms: u64, info: NodeInfo, cluster_id: String) -> Self {
        Replication {
            me,
            heartbeat_ms,
            state: Default::default(),
            wake: Default::default(),
            raft: OnceLock::new(),
            leader: AtomicBool::new(false),
            info,
            cluster_id,
            log: OnceLock::new(),
            lease_until: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
            incarnation: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            held: Default::default(),
            heard: Arc::new(net::Heard::new(std::time::Duration::from_millis(
                3 * heartbeat_ms,
            ))),
            grow_pending: AtomicBool::new(false),
            definitions_loaded: AtomicBool::new(false),
            deferred: Default::default(),
            joining: Default::default(),
        }
    }

    /// Whether journal batch `batch` is committed (see `committed`).
    pub fn is_committed(&self, batch: u64) -> bool {
        batch <= self.committed.load(Ordering::Acquire)
    }

    /// A delivery (or get-ok) of a message enqueued by journal batch `batch` is about to be
    /// pushed to `outbox` (of connection `conn`): unless that batch is committed, what is
    /// pushed from now on waits in the outbox until it is. Under the broker lock.
    pub fn hold_delivery(&self, conn: ConnId, outbox: &Outbox, batch: u64) {
        if self.is_committed(batch) {
            return;
        }
        outbox.hold_until(batch);
        let mut held = self.held.lock();
        if !held.contains(&conn) {
            held.push(conn);
        }
    }

    /// Batches up to `batch` are committed: release the deliveries that waited for them.
    /// Under the broker lock (deliveries are held under it too, so none is missed).
    pub fn committed_upto(&self, batch: u64, outboxes: &RwLock<FxHashMap<ConnId, Arc<Outbox>>>) {
        if self.committed.fetch_max(batch, Ordering::AcqRel) >= batch {
            return;
        }
        let mut held = self.held.lock();
        if held.is_empty() {
            return;
        }
        let outboxes = outboxes.read();
        held.retain(|conn| match outboxes.get(conn) {
            Some(o) => {
                o.release(batch);
                o.is_held()
            }
            None => false,
        });
    }

    /// This node's membership data: its addresses and incarnation.
    pub fn node_info(&self) -> NodeInfo {
        NodeInfo {
            incarnation: self.incarnation.load(Ordering::Acquire),
            ..self.info.clone()
        }
    }

    fn mono_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether this leader may still deliver: a majority acknowledged it within the lease.
    /// (Confirms need no lease: they wait for a commit, which a deposed leader never gets.)
    pub fn lease_valid(&self) -> bool {
        self.mono_ms() < self.lease_until.load(Ordering::Acquire)
    }

    /// Whether this node serves clients now (the leader, its term's first entry applied).
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Acquire)
    }

    /// Park a journal batch and its replicated ops (called by `BrokerGuard::flush`, under the
    /// broker lock, so the fifo is in journal order). Hands the batch back when this node
    /// does not lead: it is then a local write (paging), for the committer directly.
    #[must_use]
    pub fn park(&self, part: Part, ops: Vec<Op>, clock_ms: u64) -> Option<Part> {
        let mut p = self.state.lock();
        if p.leading.is_none() {
            return Some(part);
        }
        let ticket = part.ticket;
        p.fifo.push_back(part);
        let bytes = ops.iter().map(op_bytes).sum();
        p.unproposed.push_back(Unproposed {
            ops,
            ticket,
            clock_ms,
            bytes,
        });
        drop(p);
        self.wake.notify_one();
        None
    }

    /// The leader's address book entry: the node currently leading and its addresses.
    pub fn leader_info(&self) -> Option<(NodeId, NodeInfo)> {
        let raft = self.raft.get()?;
        let m = raft.metrics().borrow().clone();
        let id = m.current_leader?;
        let info = m.membership_config.membership().get_node(&id).cloned()?;
        Some((id, info))
    }

    /// Why this node, which does not lead, serves no client: `node N is not the leader; the
    /// leader is node M at HOST:PORT` (the reply text of the 320 a client is closed with).
    pub fn not_leading(&self) -> String {
        let leader = match self.leader_info().filter(|(id, _)| *id != self.me) {
            Some((id, n)) => format!("node {id} at {}", n.amqp),
            None => "not known yet (an election is under way)".into(),
        };
        format!("node {} is not the leader; the leader is {leader}", self.me)
    }

    /// [`leader_info`](Self::leader_info) of a leader this follower heard from within a
    /// lease: a leader cut off from it (and likely from the majority) is not handed clients,
    /// which it could not serve, while the others elect a new one.
    pub fn live_leader_info(&self) -> Option<(NodeId, NodeInfo)> {
        let (id, info) = self.leader_info()?;
        let lease = std::time::Duration::from_millis(lease_ms(self.heartbeat_ms));
        let fresh = self.heard.since().is_some_and(|d| d < lease);
        (id != self.me && fresh).then_some((id, info))
    }
}

/// The cluster id: a hash of the sorted initial member list, so that nodes started with
/// different lists never form one group (their handshake refuses).
pub fn cluster_id(peers: &BTreeMap<u64, String>) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for (id, addr) in peers {
        h.update(format!("{id}={addr};").as_bytes());
    }
    let d = h.finalize();
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Start Raft for `shared` (a cluster node's state, `Shared::open`): the log store in
/// `<data-dir>/raft`, the transport on `--raft-listen`, the state machine, the proposer and
/// the leadership watcher. Forms the cluster on a first start.
pub async fn start(shared: Arc<Shared>) -> anyhow::Result<()> {
    use anyhow::Context;
    let rep = shared
        .replication
        .clone()
        .ok_or_else(|| anyhow::anyhow!("not a cluster node"))?;
    let cfg = shared
        .config
        .cluster
        .clone()
        .ok_or_else(|| anyhow::anyhow!("not a cluster node"))?;
    let dir = shared.config.data_dir.join("raft");
    let log = log_store::LogStore::open(&dir)
        .with_context(|| format!("opening the Raft log in {}", dir.display()))?;
    let _ = rep.log.set(log.clone());
    // A log is new until its incarnation is recorded, the last step of a first start before
    // Raft runs. A log with an incarnation but no entry ever (stopped before the cluster
    // formed, or waiting to be added) has not joined either: it forms the cluster, or grows,
    // or waits, as on a first start.
    let known_incarnation = log.get_meta_json::<u64>("incarnation")?;
    // A node being added gets a snapshot before any entry: a vote, or a snapshot file
    // (installed, or being installed), also means it joined.
    let never_joined = known_incarnation.is_none() || {
        use openraft::storage::RaftLogStorage;
        let state = log.clone().get_log_state().await?;
        let snapshots = shared.config.data_dir.join("raft-snapshot");
        state.last_log_id.is_none()
            && state.last_purged_log_id.is_none()
            && log.clone().read_vote().await?.is_none()
            && !sm::SNAPSHOT_FILES
                .iter()
                .any(|f| snapshots.join(f).exists())
    };
    // A data folder that ran as a single node: it grows into a cluster alone (its data becomes
    // the first snapshot; the others are added), never into one whose other members know
    // nothing of its data.
    let has_data = shared.query(|b| b.has_users() || !b.queue_views(None).is_empty());
    let grows_now = never_joined && has_data;
    if grows_now && cfg.peers.len() > 1 {
        anyhow::bail!(
            "{} holds the data of a single node: start it as a cluster of one (--peers listing \
             only node {}) to grow it into a cluster, then add the other nodes with `warren ctl \
             cluster add`",
            shared.config.data_dir.display(),
            rep.me
        );
    }
    // Until its first snapshot is made and the log purged behind it, a grown node's log lacks
    // its data: a node added then would be sent that log, not the data. The mark is durable,
    // so a node stopped before the snapshot makes it when it starts again (its log is then not
    // new), and no node is added while it stands (`add_node`).
    if grows_now {
        log.put_meta_json(GROW_PENDING, &true, true)?;
    }
    let incarnation = match known_incarnation {
        Some(i) => i,
        None => {
            let i = rand::random::<u64>() | 1;
            log.put_meta_json("incarnation", &i, true)?;
            i
        }
    };
    rep.incarnation.store(incarnation, Ordering::Release);
    let grows = log.get_meta_json::<bool>(GROW_PENDING)?.unwrap_or(false);
    rep.grow_pending.store(grows, Ordering::Release);
    let sm = sm::StateMachine::new(shared.clone(), rep.clone())?;
    let config = openraft::Config {
        cluster_name: rep.cluster_id.clone(),
        heartbeat_interval: cfg.heartbeat_ms,
        election_timeout_min: 3 * cfg.heartbeat_ms,
        election_timeout_max: lease_ms(cfg.heartbeat_ms),
        // No election of its own in the first moments after a start (see below).
        enable_elect: false,
        // The whole transfer of a snapshot file and its install (a store of gigabytes).
        install_snapshot_timeout: 600_000,
        max_payload_entries: 64,
        // A snapshot is the store's replicated content (`Store::snapshot`), taken every
        // `snapshot_every` entries; the log before it is purged, keeping a tenth of that so
        // that a follower a little behind catches up from the log, not a snapshot.
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(cfg.snapshot_every),
        max_in_snapshot_log_to_keep: cfg.snapshot_every / 10,
        purge_batch_size: (cfg.snapshot_every / 10).clamp(1, 256),
        ..Default::default()
    }
    .validate()
    .context("the Raft settings")?;
    let listener = tokio::net::TcpListener::bind(cfg.raft_listen)
        .await
        .with_context(|| format!("binding --raft-listen {}", cfg.raft_listen))?;
    let network = net::NetworkFactory::new(rep.cluster_id.clone(), rep.me);
    let learned = network.learned();
    let raft = Raft::new(rep.me, Arc::new(config), network, log.clone(), sm)
        .await
        .context("starting Raft")?;
    let _ = rep.raft.set(raft.clone());
    // A node that starts gives the leader time to reach it before it asks for pre-votes
    // (`elections`; the leader retries an unreachable peer only after a backoff). A cluster
    // starting together elects after this, a leader restored by openraft leads at once.
    {
        let grace = std::time::Duration::from_millis(2 * lease_ms(cfg.heartbeat_ms));
        tokio::spawn(elections(rep.clone(), raft.clone(), grace));
    }
    // openraft's metrics hold an empty state until its core has run once: a handshake
    // answered before that (a peer's probe, `may_join`) would say this node belongs to no
    // formed cluster and records no one. A wiped member that asked a restarting member in
    // that instant took it for a cluster still forming, formed one, and voted the stale
    // member in (CI saw it). The first report comes as soon as the core runs.
    {
        let mut metrics = raft.metrics();
        let first = tokio::time::timeout(std::time::Duration::from_secs(10), metrics.changed());
        if !matches!(first.await, Ok(Ok(()))) {
            warn!("openraft reported no state within 10 s of its start");
        }
    }
    // A node whose log is new answers nothing but handshakes until it knows it may take part
    // (`may_join`): no vote, pre-vote or entry.
    let undecided = Arc::new(std::sync::atomic::AtomicBool::new(never_joined));
    let formed_with = Arc::new(parking_lot::Mutex::new(
        log.get_meta_json::<BTreeMap<NodeId, u64>>(FORMED_WITH)?
            .unwrap_or_default(),
    ));
    tokio::spawn(net::serve_as(
        listener,
        raft.clone(),
        rep.cluster_id.clone(),
        rep.me,
        shared.config.data_dir.join("raft-snapshot"),
        net::Local {
            info: Some(rep.node_info()),
            heard: rep.heard.clone(),
            log: Some(log.clone()),
            undecided: undecided.clone(),
            formed_with: formed_with.clone(),
        },
    ));
    info!(node_id = rep.me, raft = %cfg.raft_listen, cluster = %rep.cluster_id, "Raft started");
    if never_joined {
        // In a task of its own: the node serves its API meanwhile (its status says it leads
        // nothing), however long the other members stay away.
        let joining = Joining {
            incarnation,
            undecided,
            formed_with,
            log: log.clone(),
        };
        tokio::spawn(join(rep.clone(), raft.clone(), cfg, joining));
    }
    if grows {
        tokio::spawn(first_snapshot(rep.clone(), raft.clone()));
    }
    tokio::spawn(propose(shared.clone(), rep.clone(), raft.clone()));
    tokio::spawn(flush_deferred(shared.clone(), rep.clone()));
    tokio::spawn(watch_leadership(shared, rep, raft, learned));
    Ok(())
}

/// Let openraft campaign (its election timer) only while a majority of the voters would vote
/// for this node (`net::PreVote`), asked every heartbeat while this node has heard from no
/// leader for the shortest election timeout; never before `grace` has passed since the start.
/// A node that comes back from a pause or a partition, or restarts, while the others follow a
/// leader, gets no pre-vote and does not campaign, so its higher term does not depose that
/// leader. In a joint membership, a majority of each configuration.
async fn elections(rep: Arc<Replication>, raft: Raft, grace: std::time::Duration) {
    tokio::time::sleep(grace).await;
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(rep.heartbeat_ms.max(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut enabled = false;
    loop {
        tick.tick().await;
        if raft.metrics().has_changed().is_err() {
            // Raft has shut down.
            return;
        }
        let (leading, configs, nodes) = {
            let m = raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            (
                m.state == openraft::ServerState::Leader,
                membership.get_joint_config().clone(),
                membership
                    .nodes()
                    .map(|(id, n)| (*id, n.raft.clone()))
                    .collect::<BTreeMap<NodeId, String>>(),
            )
        };
        let voter = configs.iter().any(|c| c.contains(&rep.me));
        let last_log_id = match rep.log.get().map(log_store::LogStore::last_log_id) {
            Some(Ok(last)) => Some(last),
            Some(Err(e)) => {
                warn!(error = %e, "the Raft log's last entry cannot be read: no campaign");
                None
            }
            None => None,
        };
        let allow = if leading || !voter || rep.heard.lately() {
            false
        } else if let Some(last_log_id) = last_log_id {
            let asked = std::time::Instant::now();
            let p = net::PreVote {
                candidate: rep.me,
                last_log_id,
            };
            let asks = nodes
                .iter()
                .filter(|(id, _)| **id != rep.me && configs.iter().any(|c| c.contains(id)))
                .map(|(id, addr)| {
                    let p = p.clone();
                    let cluster = rep.cluster_id.clone();
                    let me = rep.me;
                    let wait = rep.heard.quiet;
                    async move {
                        let r =
                            tokio::time::timeout(wait, net::prevote(addr, &cluster, me, *id, &p))
                                .await;
                        (*id, matches!(r, Ok(Ok(true))))
                    }
                });
            let granted: std::collections::BTreeSet<NodeId> = futures::future::join_all(asks)
                .await
                .into_iter()
                .filter_map(|(id, yes)| yes.then_some(id))
                .chain(std::iter::once(rep.me))
                .collect();
            // A leader heard from while the pre-votes were out (its AppendEntries withdrew the
            // permission already, `net::serve_conn`): no campaign on these stale grants.
            // Nor on grants older than the round should take (each ask waits `quiet` at
            // most): a node frozen (SIGSTOP, a paused VM) while its pre-votes were out woke up
            // with grants from before a leader was elected, and campaigned against it.
            let fresh = asked.elapsed() <= rep.heard.quiet + rep.heard.quiet / 2;
            fresh
                && !rep.heard.lately()
                && configs.iter().all(|c| {
                    let yes = c.iter().filter(|id| granted.contains(id)).count();
                    yes * 2 > c.len()
                })
        } else {
            false
        };
        // Set every time, not only on a change: an AppendEntries from a leader withdraws the
        // permission at once, behind this loop's back (`net::serve_conn`). A permission lasts
        // two heartbeats (openraft's election tick comes every one and a half; this loop
        // renews it every one): a node frozen right after it was given (SIGSTOP, a paused VM)
        // wakes up with it expired, rather than campaigning at once, on grants from before
        // the freeze, against a leader elected meanwhile.
        if allow {
            raft.runtime_config().elect_until(
                std::time::Instant::now() + std::time::Duration::from_millis(2 * rep.heartbeat_ms),
            );
        } else {
            raft.runtime_config().elect(false);
        }
        if allow != enabled {
            if !leading {
                info!(
                    node_id = rep.me,
                    "{}",
                    if allow {
                        "no leader heard from, and a majority would vote for this node: it \
                         may campaign"
                    } else {
                        "this node does not campaign: a leader is heard from, or no majority \
                         would vote for it"
                    }
                );
            }
            enabled = allow;
        }
    }
}

/// The default Raft heartbeat interval (`--raft-heartbeat-ms`), in ms.
pub const HEARTBEAT_MS: u64 = 50;

/// How long a leader goes on after a majority last acknowledged it (sent at most a heartbeat
/// before). Followers elect no one before the election timeout (3 to 6 heartbeats) past
/// their leader's last heartbeat, and openraft makes them refuse votes within
/// `election_timeout_max` of it: a lease no longer than that ends before another leader can
/// exist.
fn lease_ms(heartbeat_ms: u64) -> u64 {
    6 * heartbeat_ms
}

/// Entries between snapshots by default (each entry is a batch of changes).
pub const SNAPSHOT_EVERY: u64 = 20_000;

/// A node whose Raft log is new (it never joined) takes part once `may_join` says it may:
/// it then forms the cluster with the other `--peers`, or waits for a member to replicate to it
/// (a late first start, or a node to be added); a member whose data was lost stops the process,
/// saying how to bring it back.
async fn join(
    rep: Arc<Replication>,
    raft: Raft,
    cfg: crate::config::ClusterConfig,
    joining: Joining,
) {
    let decided = match may_join(&rep, &cfg, joining.incarnation).await {
        Ok(Joins::Formed) => None,
        Ok(Joins::Forms(fresh)) => Some(fresh),
        Err(e) => {
            error!("{e:#}");
            std::process::exit(1);
        }
    };
    if let Some(fresh) = &decided {
        // Kept before the cluster forms: a peer that answered as new asks again later and is
        // told it may join (vouched), whatever other member is down then.
        if let Err(e) = joining.log.put_meta_json(FORMED_WITH, fresh, true) {
            error!("raft: recording the peers this node forms the cluster with: {e}");
            std::process::exit(1);
        }
        joining.formed_with.lock().clone_from(fresh);
    }
    joining.undecided.store(false, Ordering::Release);
    *rep.joining.lock() = None;
    if !cfg.peers.contains_key(&rep.me) || decided.is_none() {
        info!(
            node_id = rep.me,
            "not an initial member (--peers does not list it), or the cluster formed without \
             it: waiting for the leader, or to be added with `warren ctl cluster add {} {}` \
             on a member",
            rep.me,
            rep.info.raft
        );
    } else if !raft.is_initialized().await.unwrap_or(false) {
        // Every node started with the same list initializes with the same membership: the
        // first that wins an election leads, the others' attempts fail harmlessly.
        let members: BTreeMap<NodeId, NodeInfo> = cfg
            .peers
            .iter()
            .map(|(id, addr)| {
                // Only what every node knows alike: the initial membership entry must be the
                // same on all of them (it has the same log id everywhere). Each leader adds
                // its own AMQP and HTTP addresses once it serves (`announce`).
                let info = NodeInfo {
                    raft: addr.clone(),
                    ..Default::default()
                };
                (*id, info)
            })
            .collect();
        match raft.initialize(members).await {
            Ok(()) => info!("cluster formed from --peers"),
            Err(e) => info!(error = %e, "cluster already forming"),
        }
    }
}

/// What `join` needs of the node it starts.
struct Joining {
    /// The incarnation its log holds.
    incarnation: u64,
    /// Set while it takes no part (see `net::Local::undecided`).
    undecided: Arc<std::sync::atomic::AtomicBool>,
    /// See `net::Local::formed_with`.
    formed_with: Arc<parking_lot::Mutex<BTreeMap<NodeId, u64>>>,
    log: log_store::LogStore,
}

/// The log store's record of the peers (and their incarnations) that answered this node as
/// nodes whose log is new when it formed the cluster: `net::Local::formed_with`.
const FORMED_WITH: &str = "formed_with";

/// What `may_join` found.
#[derive(Debug)]
enum Joins {
    /// A formed cluster takes this node in.
    Formed,
    /// The cluster forms now, with the peers (id, incarnation) that answered as new.
    Forms(BTreeMap<NodeId, u64>),
}

/// How long a node whose log is new waits between two rounds of probes of its peers.
const JOIN_PROBE_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// No amnesiac votes: whether a node whose Raft log is new (`own`: the incarnation its log
/// holds, drawn when the log was made; it tells its peers in its handshakes, and a leader may
/// have recorded it meanwhile) may take part, decided from what its `--peers` (and the voters
/// they name) answer:
///
/// - a reachable member records it with another incarnation: it was a member and its data was
///   lost; it must not vote as if it had never acknowledged anything (Err, saying how to
///   re-add it);
/// - a reachable member records it as it is now, or formed the cluster when it answered as a
///   node whose log is new with the incarnation it has now (it never took part since: nothing
///   to forget): `Formed`, it joins as that cluster's membership says;
/// - members of a formed cluster answer, recording it as one that never ran or not at all,
///   and enough of its voters did that no majority is left out (see below): `Formed`;
/// - a majority of the `--peers` (itself included) answered, none in a formed cluster: `Forms`,
///   the cluster forms now (with the peers that answered, whose incarnations it keeps to vouch
///   for them).
///
/// Until one of these holds it asks again (and answers its peers nothing but handshakes): a
/// member whose data was lost, started while the others are down, would otherwise vote with an
/// empty log for the first member back, however stale, and the entries that only it and a
/// leader now down held (committed, confirmed) would be overwritten.
///
/// One member's word is not enough: a member that was down when the leader recorded this
/// node's incarnation (and is back, stale) records nothing of it. The record was committed on
/// a majority of the `n` voters, so it is held by all but at most `n - majority` of them, or
/// all but `n - majority` others when this node was one of that majority and lost its copy:
/// `n - majority + 1` voters other than this node answering without a record leave no
/// majority unheard.
async fn may_join(
    rep: &Replication,
    cfg: &crate::config::ClusterConfig,
    own: u64,
) -> anyhow::Result<Joins> {
    let majority = cfg.peers.len() / 2 + 1;
    let listed = cfg.peers.contains_key(&rep.me);
    // Whom to ask: the --peers, and the voters the answers name (a cluster grown past them).
    let mut targets: BTreeMap<NodeId, String> = cfg
        .peers
        .iter()
        .filter(|(id, _)| **id != rep.me)
        .map(|(id, addr)| (*id, addr.clone()))
        .collect();
    // What was said last, and when: said again when it changes, or every 10 s.
    let mut said: Option<(std::time::Instant, String)> = None;
    loop {
        let mut probes = tokio::task::JoinSet::new();
        for (id, addr) in &targets {
            let (id, addr, cluster, me) = (*id, addr.clone(), rep.cluster_id.clone(), rep.me);
            probes.spawn(async move {
                let probe = net::probe(&addr, &cluster, me, id, own);
                (
                    id,
                    tokio::time::timeout(std::time::Duration::from_secs(1), probe).await,
                )
            });
        }
        let (mut fresh, mut unrecorded) = (BTreeMap::new(), std::collections::BTreeSet::new());
        let mut voters: BTreeMap<NodeId, String> = BTreeMap::new();
        while let Some(answer) = probes.join_next().await {
            let Ok((id, Ok(Ok(probed)))) = answer else {
                continue;
            };
            let recorded = probed.known.as_ref().map_or(0, |k| k.incarnation);
            if probed.vouched || (recorded != 0 && recorded == own) {
                return Ok(Joins::Formed);
            }
            if recorded != 0 {
                anyhow::bail!(
                    "node {me} is a member of cluster {cluster} (node {id} records it, \
                     incarnation {inc:x}) but its Raft log in its data folder is new: its data \
                     was lost, and a member that forgot what it acknowledged must not vote. To \
                     bring it back, run `warren ctl cluster remove {me}` on a running node, then \
                     start this node again (it waits) and add it with `warren ctl cluster add \
                     {me} {raft}`",
                    me = rep.me,
                    cluster = rep.cluster_id,
                    inc = recorded,
                    raft = rep.info.raft,
                );
            }
            if probed.voters.is_empty() {
                fresh.insert(id, probed.incarnation);
            } else {
                unrecorded.insert(id);
                voters.extend(probed.voters);
            }
        }
        let (waiting, worrying) = if unrecorded.is_empty() {
            if listed && fresh.len() + 1 >= majority {
                return Ok(Joins::Forms(fresh));
            }
            let waiting = format!(
                "it takes no part (no vote) until a majority of --peers answers ({} of the \
                 others did), or members of a formed cluster do",
                fresh.len()
            );
            (waiting, false)
        } else {
            let n = voters.len();
            let need = n - (n / 2 + 1) + 1;
            let heard: Vec<NodeId> = unrecorded
                .iter()
                .copied()
                .filter(|id| *id != rep.me && voters.contains_key(id))
                .collect();
            if heard.len() >= need {
                return Ok(Joins::Formed);
            }
            let waiting = format!(
                "it takes no part (no vote) until {need} of the voters {:?} other than itself \
                 answer without a record of it ({heard:?} did): one that is down may hold a \
                 record of this node, whose data would then have been lost",
                voters.keys().collect::<Vec<_>>()
            );
            (waiting, true)
        };
        *rep.joining.lock() = Some(waiting.clone());
        if said.as_ref().is_none_or(|(t, text)| {
            *text != waiting || t.elapsed() >= std::time::Duration::from_secs(10)
        }) {
            // A cluster that is formed but cannot take this node in yet needs an operator's
            // eye (a member down); one still forming does not.
            if worrying {
                warn!(node_id = rep.me, "this node's Raft log is new: {waiting}");
            } else {
                info!(node_id = rep.me, "this node's Raft log is new: {waiting}");
            }
            said = Some((std::time::Instant::now(), waiting));
        }
        for (id, raft) in voters {
            if id != rep.me && !raft.is_empty() {
                targets.insert(id, raft);
            }
        }
        tokio::time::sleep(JOIN_PROBE_EVERY).await;
    }
}

/// The log store's mark of a grown single node whose first snapshot is not made yet.
const GROW_PENDING: &str = "grow_pending";

/// A grown single node, once it leads: a snapshot of its data and the log purged behind it, so
/// the nodes added later get the data (as a snapshot) and not a log that lacks it.
async fn first_snapshot(rep: Arc<Replication>, raft: Raft) {
    while !rep.is_leader() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    if let Err(e) = raft.trigger().snapshot().await {
        error!(error = %e, "the first snapshot of a grown node failed");
        return;
    }
    let mut metrics = raft.metrics();
    let index = loop {
        if let Some(s) = metrics.borrow_and_update().snapshot {
            break s.index;
        }
        if metrics.changed().await.is_err() {
            return;
        }
    };
    if let Err(e) = raft.trigger().purge_log(index).await {
        error!(error = %e, "purging the log behind the first snapshot failed");
        return;
    }
    // The purge is asked for, not yet done: wait for it (a restart before it would purge
    // nothing, and the mark makes it ask again).
    loop {
        if metrics
            .borrow_and_update()
            .purged
            .is_some_and(|p| p.index >= index)
        {
            break;
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
    let Some(log) = rep.log.get() else { return };
    if let Err(e) = log.put_meta_json(GROW_PENDING, &false, true) {
        error!(error = %e, "recording the first snapshot of a grown node failed");
        return;
    }
    rep.grow_pending.store(false, Ordering::Release);
    info!(
        index,
        "a single node's data is now the cluster's first snapshot"
    );
}

/// Apply a follower's deferred message ops once they are `sm::DEFER` old when no entry
/// comes to do it (the last ones before a quiet spell): its broker and store catch up with
/// what it applied.
async fn flush_deferred(shared: Arc<Shared>, rep: Arc<Replication>) {
    let mut tick = tokio::time::interval(sm::DEFER / 4);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(committer) = shared.committer.as_ref() else {
            return;
        };
        // A look first, without the broker lock (a leader never defers).
        if !rep.deferred.lock().due() {
            continue;
        }
        let mut broker = shared.broker.lock();
        let mut deferred = rep.deferred.lock();
        if !deferred.due() {
            continue;
        }
        // A failed write is the committer's to log; the state machine's next write fails too
        // and stops this node.
        let _ = deferred.write(&mut broker, committer);
    }
}

/// Proposals in flight at once: while one is being fsynced and replicated, the next gathers
/// everything that arrives (openraft 0.9 fsyncs each entry on its own).
const IN_FLIGHT: usize = 2;

async fn propose(shared: Arc<Shared>, rep: Arc<Replication>, raft: Raft) {
    // The in-flight slots of one stint. A slot is freed by its proposal's answer, and openraft
    // 0.9 never answers a proposal whose entry a snapshot installed here replaced (a deposed
    // leader whose uncommitted entries the next leader overwrote, then sent a snapshot past
    // them: the responder stays in RaftCore's map). Slots held by an earlier stint must not
    // stall a later one: a leader then served, heartbeats and lease intact, and never
    // committed again (chaos seed 49: publishers timed out, a consumer's close-ok waited
    // behind deliveries held for a commit that never came).
    let mut slots = (0u64, Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)));
    loop {
        rep.wake.notified().await;
        loop {
            let stint = {
                let p = rep.state.lock();
                if p.unproposed.is_empty() || p.leading.is_none() {
                    break;
                }
                p.stint
            };
            if slots.0 != stint {
                slots = (stint, Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)));
            }
            // Bounded, so that a new stint is noticed while this one's slots are all taken.
            let wait = std::time::Duration::from_millis(100);
            let slot = match tokio::time::timeout(wait, slots.1.clone().acquire_owned()).await {
                Ok(Ok(slot)) => slot,
                Ok(Err(_)) => return,
                Err(_) => continue,
            };
            let (ops, ticket, clock_ms, stint) = {
                let mut p = rep.state.lock();
                if p.unproposed.is_empty() || p.leading.is_none() {
                    break;
                }
                if p.stint != stint {
                    continue;
                }
                let (mut ops, mut ticket, mut clock_ms, mut bytes) = (Vec::new(), 0, 0, 0);
                while let Some(u) = p.unproposed.front() {
                    if bytes > 0 && bytes + u.bytes > ENTRY_BYTES {
                        break;
                    }
                    let Some(u) = p.unproposed.pop_front() else {
                        break;
                    };
                    ops.extend(u.ops);
                    ticket = ticket.max(u.ticket);
                    clock_ms = clock_ms.max(u.clock_ms);
                    bytes += u.bytes;
                }
                (ops, ticket, clock_ms, p.stint)
            };
            let ops = match warren_storage::op_codec::encode_ops(&ops) {
                Ok(b) => b,
                Err(e) => {
                    error!(error = %e, "a change cannot be encoded for the log; stepping down");
                    rep.state.lock().diverged = true;
                    continue;
                }
            };
            let batch = Batch {
                proposer: stint,
                ticket,
                clock_ms,
                ops,
            };
            match raft.client_write_ff(batch).await {
                Ok(rx) => {
                    let rep = rep.clone();
                    tokio::spawn(async move {
                        match rx.await {
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => warn!(error = %e, "a proposal was not committed here"),
                            Err(_) => warn!("a proposal was dropped"),
                        }
                        drop(slot);
                        drop(rep);
                    });
                }
                Err(e) => {
                    error!(error = %e, "Raft stopped");
                    return;
                }
            }
        }
        let _ = &shared;
    }
}

/// Watch openraft's metrics: promote this node when its term's first entry is applied,
/// demote it when it stops leading (or the state machine saw a divergence).
async fn watch_leadership(
    shared: Arc<Shared>,
    rep: Arc<Replication>,
    raft: Raft,
    learned: net::Learned,
) {
    let updating = Arc::new(AtomicBool::new(false));
    let mut member = false;
    let mut metrics = raft.metrics();
    let lease = lease_ms(rep.heartbeat_ms);
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(
        (rep.heartbeat_ms / 2).max(5),
    ));
    let mut lapsed = false;
    let mut fresh = true;
    // When this loop last read the metrics (ms since `epoch`).
    let mut read_at: u64 = 0;
    loop {
        // Metrics come when something changes: a leader cut off from its followers stops
        // hearing, so its last figure ages. A figure not read before was reported after the
        // last read (the watch channel marks what was read), so its age counts from then,
        // not from now: counting from now would stretch the lease by however long the figure
        // waited to be read, without bound if the process was frozen (SIGSTOP, a paused VM)
        // between openraft reporting it and this loop reading it.
        fresh |= metrics.has_changed().unwrap_or(false);
        let now = rep.mono_ms();
        let m = metrics.borrow_and_update().clone();
        // A node not in the membership it knows is a learner to openraft: it campaigns for
        // nothing. Its Raft keeps running, because the membership it knows may be history: a
        // node wiped and added again replays its own removal (from its previous life) before
        // the entry that added it back. Said once per change.
        let listed = m.membership_config.membership().get_node(&rep.me).is_some();
        if member && !listed && m.membership_config.log_id().is_some() {
            demote(&shared, &rep, "not in the cluster's membership");
            warn!(
                node_id = rep.me,
                "this node is not in the cluster's membership (removed): it serves no one \
                 until it is added again"
            );
        }
        member = listed;
        if let (Some(since), true) = (m.millis_since_quorum_ack, fresh) {
            let until = read_at.saturating_sub(since) + lease;
            rep.lease_until.store(until, Ordering::Release);
        }
        read_at = now;
        let expired = rep.is_leader() && !rep.lease_valid();
        if expired && !lapsed {
            warn!(
                node_id = rep.me,
                lease_ms = lease,
                "no majority acknowledged this leader within its lease: stepping down"
            );
        }
        lapsed = expired;
        // What Raft says: this node leads, in the term of this leader id.
        let raft_leader = (m.state == openraft::ServerState::Leader
            && m.current_leader == Some(rep.me)
            && m.vote.is_committed())
        .then(|| *m.vote.leader_id());
        let (leading, diverged, barrier) = {
            let p = rep.state.lock();
            (p.leading, p.diverged, p.barrier)
        };
        if leading.is_some() && (leading != raft_leader || diverged || expired) {
            let why = if expired {
                "its lease expired (no majority heard from)"
            } else if diverged {
                "it applied an entry it did not propose"
            } else {
                "this node stopped leading"
            };
            demote(&shared, &rep, why);
        } else if leading.is_some() && !updating.load(Ordering::Acquire) {
            update_addresses(&rep, &raft, &m, &learned, &updating);
        } else if let (None, Some(lid)) = (leading, raft_leader) {
            match barrier {
                // The lease counts from fresh figures only (above): a leader that was frozen
                // or cut off and still reads old ones does not serve again on them.
                Some(b) if b.leader == lid && b.applied => {
                    if rep.lease_valid() {
                        promote(&shared, &rep, b);
                    }
                }
                Some(b) if b.leader == lid => {}
                _ => propose_barrier(&rep, &raft, lid),
            }
        }
        tokio::select! {
            r = metrics.changed() => {
                if r.is_err() {
                    return;
                }
                fresh = true;
            }
            _ = tick.tick() => fresh = false,
        }
    }
}

/// Start a stint: propose its barrier (an entry with no ops, marked with a new stint id).
/// Should it not commit (leadership lost meanwhile), the next leadership proposes another.
fn propose_barrier(
    rep: &Arc<Replication>,
    raft: &Raft,
    leader: openraft::CommittedLeaderId<NodeId>,
) {
    let stint = rand::random::<u64>() | 1;
    let ops = match warren_storage::op_codec::encode_ops(&[]) {
        Ok(b) => b,
        Err(e) => {
            error!(error = %e, "the barrier entry cannot be encoded");
            return;
        }
    };
    rep.state.lock().barrier = Some(Barrier {
        leader,
        stint,
        applied: false,
    });
    info!(node_id = rep.me, leader = %leader, "Raft leader: proposing the barrier of a new stint");
    let (rep, raft) = (rep.clone(), raft.clone());
    tokio::spawn(async move {
        let batch = Batch {
            proposer: stint,
            ticket: 0,
            clock_ms: 0,
            ops,
        };
        let committed = match raft.client_write_ff(batch).await {
            Ok(rx) => matches!(rx.await, Ok(Ok(_))),
            Err(_) => false,
        };
        if !committed {
            let mut p = rep.state.lock();
            if p.barrier.is_some_and(|b| b.stint == stint) {
                p.barrier = None;
            }
        }
    });
}

fn promote(shared: &Arc<Shared>, rep: &Replication, barrier: Barrier) {
    let lid = barrier.leader;
    let mut broker = shared.lock();
    // Applied at the barrier already (`sm::Deferred`): nothing is left, but a leader must
    // serve from everything it applied.
    if let Some(committer) = shared.committer.as_ref() {
        let _ = rep.deferred.lock().write(&mut broker, committer);
    }
    {
        let mut p = rep.state.lock();
        p.leading = Some(lid);
        p.stint = barrier.stint;
        p.barrier = None;
        p.diverged = false;
    }
    rep.leader.store(true, Ordering::Release);
    // Everything applied so far came through the log: committed.
    rep.committed_upto(broker.journal_seq(), &shared.outboxes);
    broker.record_ops();
    // Deliveries are the leader's own: after a failover any message may have been delivered
    // by the previous leader, so every one is redelivered=true (false keeps meaning never
    // delivered).
    broker.mark_recovered();
    broker.set_clock(crate::clock::now_ms());
    let mut fx = Vec::new();
    for op in crate::node::default_definitions(&broker, &shared.config) {
        if let Err(e) = broker.apply(&op, &mut fx) {
            error!(error = %e.text, "creating the default user");
        }
    }
    // `--load-definitions`, the first time this process leads (a single node imports at
    // start; here only a leader can change anything).
    if let Some(doc) = &shared.config.load_definitions {
        if !rep.definitions_loaded.swap(true, Ordering::AcqRel) {
            let grant = crate::broker::cmd::Grant::default();
            let who = crate::broker::cmd::Who::node(&grant);
            let imported = crate::http::definitions::import_steps(doc, None).and_then(|steps| {
                let cmd = crate::broker::cmd::Cmd::Import(steps);
                broker
                    .execute(&who, cmd, &mut fx)
                    .map_err(|e| e.detail().to_string())
            });
            match imported {
                Ok(_) => info!("definitions loaded"),
                Err(why) => error!(%why, "--load-definitions"),
            }
        }
    }
    // What the default user and the import set off (none reaches a client yet: none is
    // served before this; a read a queue asked for is asked again by the timer).
    shared.apply_effects(&mut fx);
    info!(node_id = rep.me, leader = %lid, "leading: serving clients");
    // The guard's drop parks the default users' journal for the first entry.
}

/// On the leader: put the addresses its followers gave in their handshake answers (and its
/// own) in the membership where it holds others, one change at a time. Only the addresses
/// clients use change: the Raft address is the node's identity here, so replacing its data is
/// safe (openraft's SetNodes caveat is about moving a node).
fn update_addresses(
    rep: &Replication,
    raft: &Raft,
    m: &openraft::RaftMetrics<NodeId, NodeInfo>,
    learned: &net::Learned,
    updating: &Arc<AtomicBool>,
) {
    // A membership change still on its way (an add, a promotion, a removal): openraft takes
    // one at a time, so asking now would only fail (it did, on every metrics change).
    let config_at = m.membership_config.log_id().map(|l| l.index);
    if config_at > m.last_applied.map(|l| l.index) {
        return;
    }
    let membership = m.membership_config.membership();
    let mut changed: BTreeMap<NodeId, NodeInfo> = BTreeMap::new();
    let mut known = learned.lock().clone();
    known.insert(rep.me, rep.node_info());
    for (id, info) in known {
        match membership.get_node(&id) {
            // A member's incarnation is recorded once: another one means its log was made
            // anew (its data was lost), and only `cluster remove` and `cluster add` make it a
            // member again (`may_join` refuses it meanwhile).
            Some(current)
                if current.incarnation != 0 && current.incarnation != info.incarnation =>
            {
                tracing::debug!(
                    node = id,
                    "a member answers with another incarnation than the one recorded: not recorded"
                );
            }
            Some(current) if current.raft == info.raft && *current != info => {
                changed.insert(id, info);
            }
            _ => {}
        }
    }
    if changed.is_empty() {
        return;
    }
    updating.store(true, Ordering::Release);
    let (raft, updating) = (raft.clone(), updating.clone());
    tokio::spawn(async move {
        if let Err(e) = raft
            .change_membership(openraft::ChangeMembers::SetNodes(changed), true)
            .await
        {
            warn!(error = %e, "putting the nodes' addresses in the membership failed");
            // Asked again on a later metrics change or tick, not at once.
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        updating.store(false, Ordering::Release);
    });
}

/// Stop serving as leader: fail what waits for an entry (it may or may not commit; either
/// way nobody is told it did), close the clients, and rebuild the broker from the store.
pub fn demote(shared: &Arc<Shared>, rep: &Replication, why: &str) {
    // The broker lock first (as everywhere): no command runs between the end of leading and
    // the rebuild.
    let mut broker = shared.broker.lock();
    let parked: Vec<Part> = {
        let mut p = rep.state.lock();
        if p.leading.is_none() {
            return;
        }
        p.leading = None;
        p.stint = 0;
        p.barrier = None;
        p.diverged = false;
        p.unproposed.clear();
        p.fifo.drain(..).collect()
    };
    rep.leader.store(false, Ordering::Release);
    warn!(
        node_id = rep.me,
        reason = why,
        unconfirmed = parked.len(),
        "no longer leading: closing client connections"
    );
    for part in parked {
        if let Some(n) = part.notify {
            let _ = n.send(Done {
                ticket: part.ticket,
                ok: false,
                deposed: true,
            });
        }
    }
    // Deliveries held for entries not known committed never go out: dropped now, under the
    // broker lock, before this node applies the next leader's entries (whose batch numbers
    // would release them) and before each connection gets to its close (`force_close` drops
    // them too).
    for o in shared.outboxes.read().values() {
        o.abandon_held();
    }
    rep.held.lock().clear();
    for c in shared.registry.list() {
        c.close(format!("leader changed: node {} no longer leads", rep.me));
    }
    if let Err(e) = shared.rebuild_broker(&mut broker) {
        error!(error = %e, "rebuilding the broker from the store failed; stopping");
        std::process::exit(1);
    }
}
