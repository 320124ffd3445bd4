//! A store in memory: the reference the RocksDB store is checked against, and the store of a
//! broker that keeps nothing across restarts.

use crate::codec::{
    BindingKey, ExchangeRecord, LimitsRecord, MessageRecord, PermissionRecord, QueueRecord,
    TopicPermissionRecord, UserRecord, VhostRecord,
};
use crate::op::{BindingDest, Op};
use crate::{LevelSummary, QueueSummary, Recovered, Store, StoreError, StoredMessage};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

#[derive(Debug, Default)]
struct State {
    exchanges: BTreeMap<(String, String), ExchangeRecord>,
    queues: BTreeMap<(String, String), QueueRecord>,
    bindings: BTreeSet<BindingKey>,
    users: BTreeMap<String, UserRecord>,
    vhosts: BTreeMap<String, VhostRecord>,
    /// By (vhost, user).
    permissions: BTreeMap<(String, String), PermissionRecord>,
    vhost_limits: BTreeMap<String, LimitsRecord>,
    user_limits: BTreeMap<String, LimitsRecord>,
    /// By (vhost, user, exchange).
    topic_permissions: BTreeMap<(String, String, String), TopicPermissionRecord>,
    /// Each queue's messages by key; `true` marks a spilled transient one.
    messages: BTreeMap<(String, String), BTreeMap<u64, (MessageRecord, bool)>>,
    /// `Store::write_applied`'s position.
    applied: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
pub struct MemStore {
    state: Mutex<State>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
}

fn key(vhost: &str, name: &str) -> (String, String) {
    (vhost.to_string(), name.to_string())
}

impl MemStore {
    fn write_locked(
        &self,
        ops: &[Op],
        _sync: bool,
        applied: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| StoreError::Io("store lock poisoned".into()))?;
        for op in ops {
            match op {
                Op::DeclareExchange {
                    vhost,
                    name,
                    kind,
                    durable,
                    auto_delete,
                    internal,
                    arguments,
                } => {
                    s.exchanges.insert(
                        key(vhost, name),
                        ExchangeRecord {
                            kind: kind.clone(),
                            durable: *durable,
                            auto_delete: *auto_delete,
                            internal: *internal,
                            arguments: arguments.clone(),
                        },
                    );
                }
                Op::DeleteExchange { vhost, name } => {
                    s.exchanges.remove(&key(vhost, name));
                    let dest = BindingDest::Exchange(name.clone());
                    s.bindings.retain(|b| {
                        !(b.vhost == *vhost && (b.source == *name || b.destination == dest))
                    });
                }
                Op::DeclareQueue {
                    vhost,
                    name,
                    durable,
                    exclusive,
                    auto_delete,
                    arguments,
                } => {
                    s.queues.insert(
                        key(vhost, name),
                        QueueRecord {
                            durable: *durable,
                            exclusive: *exclusive,
                            auto_delete: *auto_delete,
                            arguments: arguments.clone(),
                        },
                    );
                    s.messages.entry(key(vhost, name)).or_default();
                }
                Op::DeleteQueue { vhost, name } => {
                    s.queues.remove(&key(vhost, name));
                    s.messages.remove(&key(vhost, name));
                    let dest = BindingDest::Queue(name.clone());
                    s.bindings
                        .retain(|b| !(b.vhost == *vhost && b.destination == dest));
                }
                Op::Bind {
                    vhost,
                    source,
                    destination,
                    routing_key,
                    arguments,
                } => {
                    s.bindings.insert(BindingKey {
                        vhost: vhost.clone(),
                        source: source.clone(),
                        destination: destination.clone(),
                        routing_key: routing_key.clone(),
                        arguments: arguments.clone(),
                    });
                }
                Op::Unbind {
                    vhost,
                    source,
                    destination,
                    routing_key,
                    arguments,
                } => {
                    s.bindings.remove(&BindingKey {
                        vhost: vhost.clone(),
                        source: source.clone(),
                        destination: destination.clone(),
                        routing_key: routing_key.clone(),
                        arguments: arguments.clone(),
                    });
                }
                Op::Enqueue {
                    vhost, queues, id, ..
                } => {
                    let Some(record) = op.message_record() else {
                        continue;
                    };
                    // Bodies are `Bytes`: every queue shares the one copy.
                    for (q, level) in queues {
                        if let Some(m) = s.messages.get_mut(&key(vhost, q)) {
                            m.insert(crate::message_key(*level, *id), (record.clone(), false));
                        }
                    }
                }
                Op::Remove {
                    vhost, queue, keys, ..
                } => {
                    if let Some(m) = s.messages.get_mut(&key(vhost, queue)) {
                        for k in keys {
                            m.remove(k);
                        }
                    }
                }
                Op::Spill {
                    vhost,
                    queue,
                    key: k,
                    ..
                } => {
                    if let Some(record) = op.message_record() {
                        s.messages
                            .entry(key(vhost, queue))
                            .or_default()
                            .insert(*k, (record, true));
                    }
                }
                Op::RemoveRange {
                    vhost,
                    queue,
                    from,
                    to,
                    ..
                } => {
                    if let Some(m) = s.messages.get_mut(&key(vhost, queue)) {
                        let gone: Vec<u64> = m.range(*from..=*to).map(|(k, _)| *k).collect();
                        for k in gone {
                            m.remove(&k);
                        }
                    }
                }
                Op::Purge { vhost, queue } => {
                    if let Some(m) = s.messages.get_mut(&key(vhost, queue)) {
                        m.clear();
                    }
                }
                Op::PutUser {
                    name,
                    password_hash,
                    tags,
                } => {
                    s.users.insert(
                        name.clone(),
                        UserRecord {
                            password_hash: password_hash.clone(),
                            tags: tags.clone(),
                        },
                    );
                }
                Op::DeleteUser { name } => {
                    s.users.remove(name);
                }
                Op::PutVhost {
                    name,
                    description,
                    tags,
                } => {
                    s.vhosts.insert(
                        name.clone(),
                        VhostRecord {
                            description: description.clone(),
                            tags: tags.clone(),
                        },
                    );
                }
                // The vhost's queues and exchanges come as ops of their own (the apply's
                // cascade): only the record goes here.
                Op::DeleteVhost { name } => {
                    s.vhosts.remove(name);
                }
                Op::SetPermissions {
                    user,
                    vhost,
                    configure,
                    write,
                    read,
                } => {
                    s.permissions.insert(
                        key(vhost, user),
                        PermissionRecord {
                            configure: configure.clone(),
                            write: write.clone(),
                            read: read.clone(),
                        },
                    );
                }
                Op::ClearPermissions { user, vhost } => {
                    s.permissions.remove(&key(vhost, user));
                }
                Op::PutVhostLimits { vhost, limits } => {
                    if limits.is_empty() {
                        s.vhost_limits.remove(vhost);
                    } else {
                        let rec = LimitsRecord {
                            limits: limits.clone(),
                        };
                        s.vhost_limits.insert(vhost.clone(), rec);
                    }
                }
                Op::PutUserLimits { user, limits } => {
                    if limits.is_empty() {
                        s.user_limits.remove(user);
                    } else {
                        let rec = LimitsRecord {
                            limits: limits.clone(),
                        };
                        s.user_limits.insert(user.clone(), rec);
                    }
                }
                Op::SetTopicPermissions {
                    user,
                    vhost,
                    exchange,
                    write,
                    read,
                } => {
                    let rec = TopicPermissionRecord {
                        write: write.clone(),
                        read: read.clone(),
                    };
                    s.topic_permissions
                        .insert((vhost.clone(), user.clone(), exchange.clone()), rec);
                }
                Op::ClearTopicPermissions {
                    user,
                    vhost,
                    exchange,
                } => {
                    s.topic_permissions.retain(|(v, u, x), _| {
                        !(v == vhost && u == user && (exchange.is_empty() || x == exchange))
                    });
                }
            }
        }
        if let Some(a) = applied {
            s.applied = Some(a.to_vec());
        }
        Ok(())
    }
}

impl Store for MemStore {
    fn write_applied(&self, ops: &[Op], applied: &[u8], sync: bool) -> Result<(), StoreError> {
        // One lock for both, so a reader never sees the ops without the position.
        self.write_locked(ops, sync, Some(applied))
    }

    fn snapshot_to(&self, sink: &mut dyn crate::SnapshotSink) -> Result<(), StoreError> {
        let mut ops = self.snapshot_ops()?;
        sink.taken();
        // Definitions in groups of their own, then messages (as RocksStore streams them).
        let first_message = ops
            .iter()
            .position(|op| matches!(op, Op::Enqueue { .. }))
            .unwrap_or(ops.len());
        let messages = ops.split_off(first_message);
        for part in [ops, messages] {
            let mut part = part.into_iter().peekable();
            while part.peek().is_some() {
                let group: Vec<Op> = part.by_ref().take(crate::SNAPSHOT_GROUP_OPS).collect();
                if !sink.ops(group)? {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn applied(&self) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self
            .state
            .lock()
            .map_err(|_| StoreError::Io("store lock poisoned".into()))?
            .applied
            .clone())
    }

    /// Memory holds everything written as long as it lives.
    fn persist(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        self.write_locked(ops, sync, None)
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        let mut s = self
            .state
            .lock()
            .map_err(|_| StoreError::Io("store lock poisoned".into()))?;
        let ops = definition_ops(&s);
        // What was spilled is gone, and queues that were never declared durably with it.
        let State {
            queues, messages, ..
        } = &mut *s;
        messages.retain(|k, _| queues.contains_key(k));
        let mut summaries = Vec::new();
        for ((vhost, name), msgs) in messages.iter_mut() {
            msgs.retain(|_, (_, spilled)| !*spilled);
            summaries.push(QueueSummary {
                vhost: vhost.clone(),
                name: name.clone(),
                levels: summarize(msgs.iter().map(|(k, (m, _))| {
                    (
                        *k,
                        m.body.len() as u64,
                        crate::has_expiration(&m.properties),
                    )
                })),
            });
        }
        Ok(Recovered {
            ops,
            queues: summaries,
        })
    }

    fn read(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let s = self
            .state
            .lock()
            .map_err(|_| StoreError::Io("store lock poisoned".into()))?;
        let mut out = Vec::new();
        let mut bytes = 0;
        if let Some(msgs) = s.messages.get(&key(vhost, queue)) {
            for (k, (m, _)) in msgs.range(from..=to) {
                if out.len() >= max_count || (bytes >= max_bytes && !out.is_empty()) {
                    break;
                }
                bytes += m.body.len();
                out.push(StoredMessage {
                    key: *k,
                    timestamp_ms: m.timestamp_ms,
                    exchange: m.exchange.clone(),
                    routing_key: m.routing_key.clone(),
                    properties: m.properties.clone(),
                    body: m.body.clone(),
                });
            }
        }
        Ok(out)
    }
}

/// Per-level summaries of (key, body size, carries an expiration) given in key order: what a
/// store implementation reports in [`QueueSummary::levels`] at recovery.
pub fn summarize(entries: impl Iterator<Item = (u64, u64, bool)>) -> Vec<LevelSummary> {
    let mut levels: Vec<LevelSummary> = Vec::new();
    for (k, size, expires) in entries {
        let level = crate::key_level(k);
        match levels.last_mut() {
            Some(l) if l.level == level => {
                l.count += 1;
                l.bytes += size;
                l.last = k;
                l.may_expire |= expires;
            }
            _ => levels.push(LevelSummary {
                level,
                count: 1,
                bytes: size,
                first: k,
                last: k,
                may_expire: expires,
            }),
        }
    }
    levels
}

/// Every definition as the op that makes it: users, vhosts, exchanges, queues, then bindings.
fn definition_ops(s: &State) -> Vec<Op> {
    let mut ops = Vec::new();
    for (name, u) in &s.users {
        ops.push(crate::op::put_user(name, u));
    }
    for (name, v) in &s.vhosts {
        ops.push(crate::op::put_vhost(name, v));
    }
    for ((vhost, user), p) in &s.permissions {
        ops.push(crate::op::set_permissions(vhost, user, p));
    }
    for (vhost, l) in &s.vhost_limits {
        ops.push(crate::op::put_vhost_limits(vhost, l));
    }
    for (user, l) in &s.user_limits {
        ops.push(crate::op::put_user_limits(user, l));
    }
    for ((vhost, user, exchange), p) in &s.topic_permissions {
        ops.push(crate::op::set_topic_permissions(vhost, user, exchange, p));
    }
    for ((vhost, name), x) in &s.exchanges {
        ops.push(crate::op::declare_exchange(vhost, name, x));
    }
    for ((vhost, name), q) in &s.queues {
        ops.push(crate::op::declare_queue(vhost, name, q));
    }
    for b in &s.bindings {
        ops.push(crate::op::bind(b));
    }
    ops
}

impl MemStore {
    /// What `snapshot_to` streams, taken under the lock.
    fn snapshot_ops(&self) -> Result<Vec<Op>, StoreError> {
        let s = self
            .state
            .lock()
            .map_err(|_| StoreError::Io("store lock poisoned".into()))?;
        let mut ops = definition_ops(&s);
        for ((vhost, name), messages) in &s.messages {
            if !s.queues.contains_key(&(vhost.clone(), name.clone())) {
                continue;
            }
            for (key, (m, spilled)) in messages {
                if *spilled {
                    continue;
                }
                ops.push(Op::Enqueue {
                    vhost: vhost.as_str().into(),
                    queues: std::iter::once((name.as_str().into(), crate::key_level(*key)))
                        .collect(),
                    id: crate::key_id(*key),
                    timestamp_ms: m.timestamp_ms,
                    exchange: m.exchange.as_str().into(),
                    routing_key: m.routing_key.as_str().into(),
                    properties: m.properties.clone(),
                    body: m.body.clone(),
                });
            }
        }
        Ok(ops)
    }
}
