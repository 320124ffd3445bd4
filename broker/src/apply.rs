//! The apply path: the one way replicated state changes, and the only writer of the journal.
//! `Log` (`apply/log.rs`) can be written from this module alone (the compiler keeps it so).
//! Every replicated change is `apply` of its op, on the broker that decides it as on a
//! replica: a publish (`apply_enqueue`: the same, with the message already decoded), and
//! every removal of a kept message (`Broker::removed` gathers an ack's, a delivery's or a
//! drop's into one `Op::Remove` per queue and applies it; here the messages left the ready
//! list already, so it finds nothing to take, by binary search). Only local paging writes
//! are not ops of the replicated stream: a spill (`write_local`) and the removal of a spilled
//! transient message (`Broker::removed`), store writes alone.

mod log;

pub(crate) use log::Log;

use super::*;

/// Replace the limits of `name` (an empty list: it has none).
fn set_limits(
    all: &mut std::collections::BTreeMap<String, Vec<(String, i64)>>,
    name: &str,
    limits: &[(String, i64)],
) {
    if limits.is_empty() {
        all.remove(name);
    } else {
        all.insert(name.to_string(), limits.to_vec());
    }
}

/// Messages the store holds that left their queue on this broker (acknowledged, delivered or
/// got without an ack, dropped), gathered by a delivery path while it holds the queue and
/// recorded afterwards by [`Broker::removed`]: the removal of a replicated message through
/// `apply` (an `Op::Remove` per queue), that of a transient message this broker spilled as a
/// local store write.
#[derive(Debug, Default)]
pub(crate) struct Removals(Vec<(QueueId, bool, u64, u64)>);

impl Removals {
    /// `qm` left queue `qid` (`q`): recorded if the store holds it.
    pub(crate) fn add(&mut self, qid: QueueId, q: &Queue, qm: &QueuedMessage) {
        if qm.stored {
            let size = qm.msg.body.len() as u64;
            self.0.push((qid, q.keeps(&qm.msg), q.store_key(qm), size));
        }
    }
}

/// A local paging write (`Op::Spill`): to the store, never to the replicated ops.
pub(crate) fn write_local(log: &mut Log, op: Op) {
    debug_assert!(matches!(op, Op::Spill { .. }));
    log.write(op);
}

impl Broker {
    /// Start recording durable changes (after recovery, when a store is attached).
    pub fn enable_journal(&mut self) {
        self.log.enabled = true;
    }

    /// The durable changes made since the last call, in the order they were made. Each
    /// non-empty batch gets the next number ([`Broker::journal_seq`]); the committer reports
    /// the batches it has written by that number (`Pager::written`).
    pub fn take_journal(&mut self) -> Journal {
        if !self.log.enabled || self.log.writes.is_empty() {
            return Journal::new();
        }
        self.log.seq += 1;
        std::mem::take(&mut self.log.writes)
    }

    /// The number of the last batch `take_journal` returned.
    pub fn journal_seq(&self) -> u64 {
        self.log.seq
    }

    /// Go on from `old`'s counters that must never go back while the process runs: journal
    /// batch numbers (the committer's `written` mark counts them) and connection ids (a
    /// connection of the old broker still closing must not name a new one). For a broker
    /// rebuilt in place of `old`.
    pub fn continue_after(&mut self, old: &Broker) {
        self.log.seq = self.log.seq.max(old.log.seq);
        self.local.next_conn_id = self.local.next_conn_id.max(old.local.next_conn_id);
    }

    /// Message `id` was enqueued and removed by ops this broker does not apply (a replica
    /// skipping a message acknowledged within the ops it applies at once): ids go on after
    /// it, as if it had been applied (ids are never given twice).
    pub fn message_id_seen(&mut self, id: u64) {
        self.replicated.next_message_id = self.replicated.next_message_id.max(id.saturating_add(1));
    }

    /// Start recording the replicated ops (see `log.rs`), for `take_ops`.
    pub fn record_ops(&mut self) {
        self.log.ops.get_or_insert_with(Vec::new);
    }

    /// The replicated ops recorded since the last call, in order (empty when not recording).
    pub fn take_ops(&mut self) -> Vec<Op> {
        self.log
            .ops
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Record what left queues on this broker (`Removals`), one removal per run of one
    /// queue's messages: a replicated message's is `apply` of an `Op::Remove` (`exec_remove`
    /// with the queue already looked up: the same root, change and store write; here it finds
    /// nothing to take, the messages left the ready list when they were delivered), a spilled
    /// transient message's a store write alone (no replica has it).
    pub(crate) fn removed(&mut self, removals: Removals) {
        let mut all = removals.0.into_iter().peekable();
        let (mut keys, mut sizes): (SmallVec<[u64; 16]>, SmallVec<[u64; 16]>) = Default::default();
        while let Some((qid, replicated, key, size)) = all.next() {
            keys.clear();
            sizes.clear();
            keys.push(key);
            sizes.push(size);
            while let Some((_, _, key, size)) =
                all.next_if(|(q, r, _, _)| *q == qid && *r == replicated)
            {
                keys.push(key);
                sizes.push(size);
            }
            let Some(q) = self.replicated.queues.get(&qid) else {
                continue;
            };
            let (vhost, name) = (q.vhost.clone(), q.name.clone());
            match replicated {
                true => self.exec_remove(&vhost, &name, Some(qid), &keys, &sizes, true),
                false => self.log.removal(&vhost, &name, &keys, &sizes, false),
            }
        }
    }

    /// `Op::Remove` of `keys` from queue `name` (`qid`: it, if it exists here), with their
    /// `sizes`: the root when `root` (`apply`), the change, the store write.
    fn exec_remove(
        &mut self,
        vhost: &warren_storage::Name,
        name: &warren_storage::Name,
        qid: Option<QueueId>,
        keys: &[u64],
        sizes: &[u64],
        root: bool,
    ) {
        // The journal batch this removal's store write goes in (the one being built).
        let batch = self.log.seq() + 1;
        if let Some(q) = qid.and_then(|id| self.replicated.queues.get_mut(&id)) {
            // On the broker that decided it the messages had left the ready list already
            // (delivered, dropped); elsewhere they leave it here.
            q.remove_keys(keys, sizes, batch);
        }
        self.log.removal(vhost, name, keys, sizes, root);
    }

    // ---------------------------------------------------------------- the apply path

    /// Apply one state change: the one way durable state changes. Live commands (AMQP, the
    /// HTTP API, timers) call this after validating and deciding; recovery calls it for each
    /// stored definition in order; a replica would call it for each replicated op. The op is
    /// recorded as a replicated root (when it changes durable state, `is_durable`), and what
    /// it makes the store do goes to the journal. Cascades (an auto-delete exchange left
    /// without bindings, a deleted queue's bindings) are derived here, on every broker that
    /// applies the op, and never recorded as ops of their own. Deterministic: same ops, same
    /// state.
    pub fn apply(&mut self, op: &Op, fx: &mut Vec<Effect>) -> Result<(), AmqpError> {
        // Purge records its own roots (`exec`); paging writes are never replicated.
        if !matches!(op, Op::Purge { .. } | Op::Spill { .. }) && self.is_durable(op) {
            self.log.root(op);
        }
        self.exec(op, fx)
    }

    /// The store write of a definition `op` (durable ones), before `exec` makes the change.
    fn journal(&mut self, op: &Op) {
        if self.log.enabled
            && matches!(
                op,
                Op::DeclareExchange { .. }
                    | Op::DeleteExchange { .. }
                    | Op::DeclareQueue { .. }
                    | Op::Bind { .. }
                    | Op::Unbind { .. }
                    | Op::PutUser { .. }
                    | Op::DeleteUser { .. }
                    | Op::PutVhost { .. }
            )
            && self.is_durable(op)
        {
            self.log.write(op.clone());
        }
    }

    /// The change `op` makes, and its store writes, without recording it as a root: `apply`
    /// for a root, and directly for what a root cascades into.
    fn exec(&mut self, op: &Op, fx: &mut Vec<Effect>) -> Result<(), AmqpError> {
        self.journal(op);
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
                let kind = ExchangeKind::parse(kind).ok_or_else(|| {
                    AmqpError::command_invalid(format!("unknown exchange type '{kind}'"))
                })?;
                let arguments = decode_table(arguments)?;
                let v = self.vhost_mut(vhost)?;
                v.exchanges.entry(name.clone()).or_insert_with(|| {
                    Exchange::new(
                        name.clone(),
                        kind,
                        *durable,
                        *auto_delete,
                        *internal,
                        arguments,
                    )
                });
            }
            Op::DeleteExchange { vhost, name } => {
                // Bindings that pointed at it go too; an auto-delete exchange left without
                // bindings goes with them, and so on up the chain (as RabbitMQ).
                let emptied = self.delete_exchange(vhost, name)?;
                self.auto_delete(vhost, emptied)?;
            }
            Op::DeclareQueue {
                vhost,
                name,
                durable,
                exclusive,
                auto_delete,
                arguments,
            } => {
                let arguments = decode_table(arguments)?;
                let id = self.replicated.next_queue_id;
                let v = self.vhost_mut(vhost)?;
                if !v.queues.contains_key(name) {
                    v.queues.insert(name.clone(), id);
                    self.replicated.next_queue_id += 1;
                    let mut q = Queue::new(
                        name.clone(),
                        vhost.clone(),
                        *durable,
                        *exclusive,
                        *auto_delete,
                        arguments,
                    );
                    q.pager = self.local.pager.clone();
                    // x-expires counts from the declaration, or from the restart that replays
                    // it (recovery used to leave durable queues with x-expires for ever).
                    q.last_used = self.local.now_ms;
                    if q.expires.is_some() {
                        self.local.expirable.insert(id);
                    }
                    self.replicated.queues.insert(id, q);
                }
            }
            Op::DeleteQueue { vhost, name } => {
                if let Some(id) = self.vhost(vhost)?.queues.get(name).copied() {
                    // The store drops what it holds for the queue (also a non-durable queue's
                    // spills, which no replica has).
                    if self
                        .replicated
                        .queues
                        .get(&id)
                        .is_some_and(|q| q.has_storage())
                    {
                        self.log.write(op.clone());
                    }
                    self.delete_queue_by_id(id, fx);
                }
            }
            Op::Bind {
                vhost,
                source,
                destination,
                routing_key,
                arguments,
            } => {
                let dest = self.resolve_dest(vhost, destination)?;
                let arguments = decode_table(arguments)?;
                let v = self.vhost_mut(vhost)?;
                if let Some(x) = v.exchanges.get_mut(source) {
                    if x.bind(dest.clone(), routing_key.clone(), arguments) {
                        *v.sources
                            .entry(dest)
                            .or_default()
                            .entry(source.clone())
                            .or_default() += 1;
                    }
                }
            }
            Op::Unbind {
                vhost,
                source,
                destination,
                routing_key,
                arguments,
            } => {
                let dest = self.resolve_dest(vhost, destination)?;
                let arguments = decode_table(arguments)?;
                let replicated = self.replicated_dest(vhost, &dest);
                let v = self.vhost_mut(vhost)?;
                let removed = v
                    .exchanges
                    .get_mut(source)
                    .is_some_and(|x| x.unbind(&dest, routing_key, &arguments));
                if removed {
                    v.forget_source(&dest, source);
                    let emptied = self.emptied(vhost, vec![source.clone()], replicated);
                    self.auto_delete(vhost, emptied)?;
                }
            }
            Op::Enqueue {
                vhost,
                queues,
                exchange,
                routing_key,
                properties,
                body,
                ..
            } => {
                let msg = Arc::new(stored_message(
                    exchange,
                    routing_key,
                    properties.clone(),
                    body.clone(),
                )?);
                let v = self.vhost(vhost)?;
                let ids: Targets = queues
                    .iter()
                    .filter_map(|(n, _)| v.queues.get(&**n).copied())
                    .collect();
                self.exec_enqueue(op.clone(), &ids, msg);
            }
            Op::Remove {
                vhost,
                queue,
                keys,
                sizes,
            } => {
                let qid = self.vhost(vhost)?.queues.get(&**queue).copied();
                // Its root, if any, `apply` recorded.
                self.exec_remove(vhost, queue, qid, keys, sizes, false);
            }
            Op::RemoveRange {
                vhost,
                queue,
                from,
                to,
                counted,
            } => {
                if let Some(qid) = self.vhost(vhost)?.queues.get(&**queue).copied() {
                    let batch = self.log.seq() + 1;
                    if let Some(q) = self.replicated.queues.get_mut(&qid) {
                        q.remove_key_range(*from, *to, *counted, batch);
                    }
                }
                self.log.write(op.clone());
            }
            Op::Purge { vhost, queue } => {
                if let Some(qid) = self.vhost(vhost)?.queues.get(&**queue).copied() {
                    self.purge_queue(qid);
                }
            }
            // Local paging: a store write, nothing more.
            Op::Spill { .. } => self.log.write(op.clone()),
            Op::PutUser {
                name,
                password_hash,
                tags,
            } => {
                self.replicated.users.insert(
                    name.clone(),
                    users::User {
                        password_hash: password_hash.clone(),
                        tags: tags.clone(),
                    },
                );
            }
            Op::DeleteUser { name } => {
                self.replicated.users.remove(name);
                // Their permissions and limits go with them (derived, in order).
                self.clear_permissions(|u, _| u == name);
                self.clear_topic_permissions(|u, _, _| u == name);
                if self.replicated.user_limits.remove(name).is_some() && self.log.enabled {
                    self.log.write(Op::PutUserLimits {
                        user: name.clone(),
                        limits: Vec::new(),
                    });
                }
            }
            Op::PutVhost {
                name,
                description,
                tags,
            } => {
                self.add_vhost(name);
                self.replicated.vhosts_recorded = true;
                if let Some(v) = self.replicated.vhosts.get_mut(name) {
                    v.description = description.clone();
                    v.tags = tags.clone();
                }
            }
            Op::DeleteVhost { name } => self.delete_vhost(name, op, fx)?,
            Op::SetPermissions {
                user,
                vhost,
                configure,
                write,
                read,
            } => {
                self.user_and_vhost(user, vhost)?;
                self.replicated.permissions.insert(
                    (user.clone(), vhost.clone()),
                    Arc::new(permissions::Permissions::new(configure, write, read)),
                );
                self.local.permissions_generation += 1;
                if self.log.enabled {
                    self.log.write(op.clone());
                }
            }
            Op::ClearPermissions { user, vhost } => {
                self.clear_permissions(|u, v| u == user && v == vhost);
            }
            Op::PutVhostLimits { vhost, limits } => {
                if !self.has_vhost(vhost) {
                    return Err(AmqpError::connection(
                        warren_protocol::ReplyCode::NotFound,
                        "vhost_not_found",
                    ));
                }
                set_limits(&mut self.replicated.vhost_limits, vhost, limits);
                if self.log.enabled {
                    self.log.write(op.clone());
                }
            }
            Op::SetTopicPermissions {
                user,
                vhost,
                exchange,
                write,
                read,
            } => {
                self.user_and_vhost(user, vhost)?;
                self.replicated.topic_permissions.insert(
                    (user.clone(), vhost.clone(), exchange.clone()),
                    Arc::new(permissions::TopicPermissions::new(write, read, user, vhost)),
                );
                self.local.permissions_generation += 1;
                if self.log.enabled {
                    self.log.write(op.clone());
                }
            }
            Op::ClearTopicPermissions {
                user,
                vhost,
                exchange,
            } => {
                self.clear_topic_permissions(|u, v, x| {
                    u == user && v == vhost && (exchange.is_empty() || x == exchange)
                });
            }
            Op::PutUserLimits { user, limits } => {
                if !self.replicated.users.contains_key(user) {
                    return Err(AmqpError::connection(
                        warren_protocol::ReplyCode::NotFound,
                        "no_such_user",
                    ));
                }
                set_limits(&mut self.replicated.user_limits, user, limits);
                if self.log.enabled {
                    self.log.write(op.clone());
                }
            }
        }
        Ok(())
    }

    /// `apply` of an `Op::Enqueue` whose message the caller has decoded and whose queues it
    /// has looked up already (the broker serving the publish; `ids` are the queues `op`
    /// lists, in its order): the same root and the same change, without decoding or looking
    /// up again. Returns what `enqueue` does (whether the publisher waits for the store, the
    /// queues holding it past their window).
    pub(crate) fn apply_enqueue(
        &mut self,
        op: Op,
        ids: &[QueueId],
        msg: Arc<Message>,
    ) -> (bool, Targets) {
        self.log.root(&op);
        self.exec_enqueue(op, ids, msg)
    }

    /// The change of an `Op::Enqueue` (`msg` is its message, decoded; `ids` its queues): into
    /// those queues, with its store write. Only the change: what the broker serving clients
    /// decides after it (deliveries, a TTL-0 drop, drop-head trimming, dead-lettering) comes
    /// as ops of its own.
    fn exec_enqueue(&mut self, op: Op, ids: &[QueueId], msg: Arc<Message>) -> (bool, Targets) {
        let Op::Enqueue {
            id, timestamp_ms, ..
        } = op
        else {
            return (false, Targets::new());
        };
        self.replicated.next_message_id = self.replicated.next_message_id.max(id.saturating_add(1));
        self.log.write(op);
        self.enqueue(ids, id, timestamp_ms, msg)
    }

    /// Permissions are set between a user and a vhost that both exist: refused otherwise
    /// (PRECONDITION_FAILED, the management API's 400 with RabbitMQ's reason; an import
    /// stops on it, saying which entry).
    fn user_and_vhost(&self, user: &str, vhost: &str) -> Result<(), AmqpError> {
        if !self.replicated.users.contains_key(user) || !self.has_vhost(vhost) {
            return Err(AmqpError::connection(
                warren_protocol::ReplyCode::PreconditionFailed,
                "vhost_or_user_not_found",
            ));
        }
        Ok(())
    }

    /// Drop every ready message of a queue (`Op::Purge`). Delivered messages waiting for an
    /// ack stay (in the store too): with none, the queue's whole keyspace goes (`Purge`);
    /// otherwise exactly what was ready, by key and by key range (`Remove`, `RemoveRange`),
    /// which is also what is replicated, since elsewhere those deliveries are ready messages.
    fn purge_queue(&mut self, id: QueueId) {
        let Some(q) = self.replicated.queues.get_mut(&id) else {
            return;
        };
        let purged = q.purge();
        if !q.has_storage() {
            return;
        }
        let replicated = q.is_stored();
        let (vhost, queue) = (q.vhost.clone(), q.name.clone());
        if q.local.unacked == 0 {
            let op = Op::Purge { vhost, queue };
            if replicated {
                self.log.root(&op);
            }
            self.log.write(op);
            return;
        }
        // Exactly what was ready (elsewhere these deliveries are ready messages): the
        // replicated messages by key with their sizes, the transient ones this broker spilled
        // by key, in the store alone (F5: their removal is not replicated), and what is on
        // disk or staged by key range.
        let (keys, sizes): (Vec<u64>, Vec<u64>) = purged.kept.into_iter().unzip();
        if !keys.is_empty() {
            self.log.removal(&vhost, &queue, &keys, &sizes, replicated);
        }
        if !purged.local.is_empty() {
            self.log.write(Op::Remove {
                vhost: vhost.clone(),
                queue: queue.clone(),
                keys: purged.local,
                sizes: Vec::new(),
            });
        }
        for (from, to, counted) in purged.ranges {
            let op = Op::RemoveRange {
                vhost: vhost.clone(),
                queue: queue.clone(),
                from,
                to,
                counted,
            };
            if replicated {
                self.log.root(&op);
            }
            self.log.write(op);
        }
    }

    /// A queue this broker decided to delete (x-expires, auto-delete, its exclusive owner
    /// gone), through `apply` like a client's queue.delete.
    pub(crate) fn delete_queue(&mut self, id: QueueId, fx: &mut Vec<Effect>) {
        let Some(q) = self.replicated.queues.get(&id) else {
            return;
        };
        let op = Op::DeleteQueue {
            vhost: q.vhost.to_string(),
            name: q.name.to_string(),
        };
        let _ = self.apply(&op, fx);
    }

    /// Remove the permissions `which(user, vhost)` selects, each with its store write (a
    /// `ClearPermissions` root, or the cascade of a user's or vhost's deletion).
    fn clear_permissions(&mut self, which: impl Fn(&str, &str) -> bool) {
        let gone: Vec<(String, String)> = self
            .replicated
            .permissions
            .keys()
            .filter(|(u, v)| which(u, v))
            .cloned()
            .collect();
        for (user, vhost) in gone {
            self.replicated
                .permissions
                .remove(&(user.clone(), vhost.clone()));
            if self.log.enabled {
                self.log.write(Op::ClearPermissions { user, vhost });
            }
        }
        self.local.permissions_generation += 1;
    }

    /// Remove the topic permissions `which(user, vhost, exchange)` selects, each with its own
    /// store write (one exchange each, so the store needs no lookup).
    fn clear_topic_permissions(&mut self, which: impl Fn(&str, &str, &str) -> bool) {
        let gone: Vec<(String, String, String)> = self
            .replicated
            .topic_permissions
            .keys()
            .filter(|(u, v, x)| which(u, v, x))
            .cloned()
            .collect();
        for (user, vhost, exchange) in gone {
            self.replicated.topic_permissions.remove(&(
                user.clone(),
                vhost.clone(),
                exchange.clone(),
            ));
            if self.log.enabled {
                self.log.write(Op::ClearTopicPermissions {
                    user,
                    vhost,
                    exchange,
                });
            }
        }
        self.local.permissions_generation += 1;
    }

    /// Remove a vhost (`Op::DeleteVhost`): its queues (with their messages; their consumers
    /// are told) and its exchanges go as the cascades `DeleteQueue` and `DeleteExchange`
    /// make, in name order (deterministic), then the vhost and its record. Its connections are
    /// closed by whoever made the change.
    fn delete_vhost(&mut self, name: &str, op: &Op, fx: &mut Vec<Effect>) -> Result<(), AmqpError> {
        let Some(v) = self.replicated.vhosts.get(name) else {
            return Ok(());
        };
        let mut queues: Vec<String> = v.queues.keys().cloned().collect();
        queues.sort();
        let mut exchanges: Vec<String> = v
            .exchanges
            .keys()
            .filter(|x| !x.is_empty())
            .cloned()
            .collect();
        exchanges.sort();
        for q in queues {
            self.exec(
                &Op::DeleteQueue {
                    vhost: name.to_string(),
                    name: q,
                },
                fx,
            )?;
        }
        for x in exchanges {
            // An auto-delete exchange may have gone with the queues already.
            if self.vhost(name)?.exchanges.contains_key(&x) {
                self.exec(
                    &Op::DeleteExchange {
                        vhost: name.to_string(),
                        name: x,
                    },
                    fx,
                )?;
            }
        }
        self.replicated.vhosts.remove(name);
        self.clear_permissions(|_, v| v == name);
        self.clear_topic_permissions(|_, v, _| v == name);
        if self.replicated.vhost_limits.remove(name).is_some() && self.log.enabled {
            self.log.write(Op::PutVhostLimits {
                vhost: name.to_string(),
                limits: Vec::new(),
            });
        }
        if self.log.enabled {
            self.log.write(op.clone());
        }
        Ok(())
    }

    /// Remove a queue: its bindings, its consumers (who are told), its messages. Only `exec`
    /// of a `DeleteQueue` calls this.
    fn delete_queue_by_id(&mut self, id: QueueId, fx: &mut Vec<Effect>) {
        self.local.expiring.remove(&id);
        let Some(q) = self.replicated.queues.remove(&id) else {
            return;
        };
        if let Some(v) = self.replicated.vhosts.get_mut(&*q.vhost) {
            v.queues.remove(&*q.name);
        }
        let emptied = self.unbind_everywhere(&q.vhost, &Dest::Queue(id), q.is_stored());
        self.local.expirable.remove(&id);
        for key in q.local.consumers.into_iter().map(|c| c.key) {
            if let Some(ch) = self
                .local
                .conns
                .get_mut(&key.conn)
                .and_then(|c| c.channels.get_mut(&key.channel))
            {
                if let Some(pos) = ch.consumers.iter().position(|c| *c.tag == *key.tag) {
                    let c = ch.consumers.remove(pos);
                    fx.push(Effect::ConsumerCancelled {
                        conn: key.conn,
                        channel: key.channel,
                        consumer_tag: c.tag,
                    });
                }
            }
        }
        let _ = self.auto_delete(&q.vhost, emptied);
    }

    // ---------------------------------------------------------------- auto-delete cascades
    //
    // An auto-delete exchange goes when it loses its last binding (RabbitMQ). In a cluster
    // only the bindings between durable things are replicated, so a replica knows fewer
    // bindings than the leader: deciding "last binding" on all of them would let the two
    // disagree (an exchange bound to a durable and a transient queue, unbound from the durable
    // one, stays on the leader and goes on the replicas; one bound to a transient queue alone,
    // deleted with it, goes on the leader alone). So a replicated binding's removal (which
    // every replica makes too) decides on the replicated bindings left, and the replicas
    // derive the same; the removal of a local binding decides on all that are left, and when
    // that deletes a durable exchange, the deletion is recorded as a root of its own (the
    // replicas saw nothing to derive it from). See the README's deviations.

    /// Whether a binding to `dest` is replicated (given a durable source).
    fn replicated_dest(&self, vhost: &str, dest: &Dest) -> bool {
        match dest {
            Dest::Queue(id) => self
                .replicated
                .queues
                .get(id)
                .is_some_and(|q| q.is_stored()),
            Dest::Exchange(name) => self
                .replicated
                .vhosts
                .get(vhost)
                .and_then(|v| v.exchanges.get(name))
                .is_some_and(|x| x.durable && !name.is_empty()),
        }
    }

    /// Remove every binding of `vhost` to `dest` (going away; `replicated`: whether it is
    /// replicated) and return the auto-delete exchanges this empties (see `emptied`).
    fn unbind_everywhere(
        &mut self,
        vhost: &str,
        dest: &Dest,
        replicated: bool,
    ) -> Vec<(String, bool)> {
        let Some(v) = self.replicated.vhosts.get_mut(vhost) else {
            return Vec::new();
        };
        let mut lost: Vec<String> = Vec::new();
        for source in v.sources.remove(dest).unwrap_or_default().into_keys() {
            if let Some(x) = v.exchanges.get_mut(&source) {
                if x.unbind_dest(dest) > 0 && x.auto_delete {
                    lost.push(source);
                }
            }
        }
        self.emptied(vhost, lost, replicated)
    }

    /// Of the auto-delete exchanges `lost` of `vhost`, which just lost bindings (replicated
    /// ones if `replicated` and the exchange is durable), those that go now, in name order
    /// (whatever the map's: the same on every broker), each with whether its deletion is
    /// recorded as a root op.
    fn emptied(&self, vhost: &str, mut lost: Vec<String>, replicated: bool) -> Vec<(String, bool)> {
        lost.sort_unstable();
        let Some(v) = self.replicated.vhosts.get(vhost) else {
            return Vec::new();
        };
        lost.into_iter()
            .filter_map(|name| {
                let x = v.exchanges.get(&name)?;
                if !x.auto_delete {
                    return None;
                }
                let goes = if x.durable && replicated {
                    // Every replica lost it too, and decides on the bindings it has.
                    !x.bindings
                        .iter()
                        .any(|b| self.replicated_dest(vhost, &b.dest))
                } else {
                    x.bindings.is_empty()
                };
                goes.then_some((name, x.durable && !replicated))
            })
            .collect()
    }

    /// Remove exchange `name` and every binding to it: the auto-delete exchanges that
    /// empties (`emptied`), which the caller deletes in turn (`auto_delete`).
    fn delete_exchange(
        &mut self,
        vhost: &str,
        name: &str,
    ) -> Result<Vec<(String, bool)>, AmqpError> {
        let v = self.vhost_mut(vhost)?;
        let gone = v.exchanges.remove(name);
        let replicated = gone.as_ref().is_some_and(|x| x.durable && !name.is_empty());
        // Its own bindings go with it.
        for b in gone.iter().flat_map(|x| x.bindings.iter()) {
            v.forget_source(&b.dest, name);
        }
        let dest = Dest::Exchange(name.to_owned());
        Ok(self.unbind_everywhere(vhost, &dest, replicated))
    }

    /// Delete the exchanges `emptied` found, each derived or recorded as a root op, and the
    /// ones each of those empties in turn, depth first: what `apply`/`exec` of each deletion
    /// would do, in the same order, but in a loop. A chain of auto-delete exchanges bound one
    /// to the next is as long as a client makes it, and deleting it by recursion (one level
    /// of `exec` per exchange) overflowed the stack at a few thousand, which aborts the
    /// process (and, replicated, every node of a cluster).
    fn auto_delete(
        &mut self,
        vhost: &str,
        mut emptied: Vec<(String, bool)>,
    ) -> Result<(), AmqpError> {
        emptied.reverse();
        let mut pending = emptied;
        while let Some((name, record)) = pending.pop() {
            let op = Op::DeleteExchange {
                vhost: vhost.to_owned(),
                name: name.clone(),
            };
            // As `apply` (a root), then `exec`, of the deletion.
            if record && self.is_durable(&op) {
                self.log.root(&op);
            }
            self.journal(&op);
            let more = self.delete_exchange(vhost, &name)?;
            pending.extend(more.into_iter().rev());
        }
        Ok(())
    }
}
