//! A store in memory: the reference the RocksDB store is checked against, and the store of a
//! broker that keeps nothing across restarts.

use crate::codec::{BindingKey, ExchangeRecord, MessageRecord, QueueRecord};
use crate::op::{BindingDest, Op};
use crate::{Store, StoreError};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

#[derive(Debug, Default)]
struct State {
    exchanges: BTreeMap<(String, String), ExchangeRecord>,
    queues: BTreeMap<(String, String), QueueRecord>,
    bindings: BTreeSet<BindingKey>,
    messages: BTreeMap<(String, String), BTreeMap<u64, MessageRecord>>,
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

impl Store for MemStore {
    fn write(&self, ops: &[Op], _sync: bool) -> Result<(), StoreError> {
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
                    vhost,
                    queues,
                    id,
                    timestamp_ms,
                    exchange,
                    routing_key,
                    properties,
                    body,
                } => {
                    for q in queues {
                        if let Some(m) = s.messages.get_mut(&key(vhost, q)) {
                            m.insert(
                                *id,
                                MessageRecord {
                                    timestamp_ms: *timestamp_ms,
                                    exchange: exchange.clone(),
                                    routing_key: routing_key.clone(),
                                    properties: properties.clone(),
                                    body: body.clone(),
                                },
                            );
                        }
                    }
                }
                Op::Remove { vhost, queue, ids } => {
                    if let Some(m) = s.messages.get_mut(&key(vhost, queue)) {
                        for id in ids {
                            m.remove(id);
                        }
                    }
                }
                Op::Purge { vhost, queue } => {
                    if let Some(m) = s.messages.get_mut(&key(vhost, queue)) {
                        m.clear();
                    }
                }
            }
        }
        Ok(())
    }

    fn recover(&self) -> Result<Vec<Op>, StoreError> {
        let s = self
            .state
            .lock()
            .map_err(|_| StoreError::Io("store lock poisoned".into()))?;
        let mut ops = Vec::new();
        for ((vhost, name), x) in &s.exchanges {
            ops.push(crate::op::declare_exchange(vhost, name, x));
        }
        for ((vhost, name), q) in &s.queues {
            ops.push(crate::op::declare_queue(vhost, name, q));
        }
        for b in &s.bindings {
            ops.push(crate::op::bind(b));
        }
        for ((vhost, name), msgs) in &s.messages {
            for (id, m) in msgs {
                ops.push(crate::op::enqueue(vhost, name, *id, m));
            }
        }
        Ok(ops)
    }
}
