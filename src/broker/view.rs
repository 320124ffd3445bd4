//! The replicated state of a broker as plain values, to compare two brokers: the one that
//! served clients and one that applied the ops it recorded (`Broker::take_ops`). What is
//! leader-local (connections, channels, consumers, who holds which delivery, paging) is left
//! out; non-durable and exclusive queues, transient messages and their exchanges are local too
//! (a classic queue's transient messages stay on the node that has them, as in RabbitMQ).

use super::exchange::Dest;
use super::{encode_table, Broker};
use bytes::Bytes;

/// One durable definition or message, in a stable order (see `Broker::replicated_view`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReplicatedView {
    /// (vhost, name, kind, auto_delete, internal, arguments) of durable exchanges.
    pub exchanges: Vec<(String, String, String, bool, bool, Bytes)>,
    /// (vhost, name, auto_delete, arguments) of stored queues, with their persistent ready
    /// messages in delivery order and their count.
    pub queues: Vec<QueueView>,
    /// (vhost, source, destination, destination is a queue, routing key, arguments) of
    /// bindings between durable things.
    pub bindings: Vec<(String, String, String, bool, String, Bytes)>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueView {
    pub vhost: String,
    pub name: String,
    pub auto_delete: bool,
    pub arguments: Bytes,
    pub messages: Vec<MessageView>,
    pub message_count: usize,
}

/// A message as stored: its key (priority level and broker-wide id), where it was published,
/// its properties in wire form and its body.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MessageView {
    pub key: u64,
    pub exchange: String,
    pub routing_key: String,
    pub properties: Bytes,
    pub body: Bytes,
}

impl Broker {
    /// The replicated state (see the module doc). Reads a paged-out backlog back from the
    /// store: for tests and checks, not for a hot path.
    pub fn replicated_view(&self) -> Result<ReplicatedView, warren_storage::StoreError> {
        let mut view = ReplicatedView {
            exchanges: Vec::new(),
            queues: Vec::new(),
            bindings: Vec::new(),
        };
        for (vname, v) in &self.vhosts {
            for x in v
                .exchanges
                .values()
                .filter(|x| x.durable && !x.name.is_empty())
            {
                view.exchanges.push((
                    vname.clone(),
                    x.name.clone(),
                    x.kind.as_str().to_string(),
                    x.auto_delete,
                    x.internal,
                    encode_table(&x.arguments),
                ));
                for b in &x.bindings {
                    let (dest, is_queue) = match &b.dest {
                        Dest::Queue(id) => match self.queues.get(id) {
                            Some(q) if q.is_stored() => (q.name.to_string(), true),
                            _ => continue,
                        },
                        Dest::Exchange(name) => match v.exchanges.get(name) {
                            Some(d) if d.durable => (name.clone(), false),
                            _ => continue,
                        },
                    };
                    view.bindings.push((
                        vname.clone(),
                        x.name.clone(),
                        dest,
                        is_queue,
                        b.routing_key.clone(),
                        encode_table(&b.arguments),
                    ));
                }
            }
        }
        for q in self.queues.values().filter(|q| q.is_stored()) {
            let messages: Vec<MessageView> = q
                .ready_messages()?
                .into_iter()
                .filter(|(_, m)| m.persistent())
                .map(|(key, m)| MessageView {
                    key,
                    exchange: m.exchange.to_string(),
                    routing_key: m.routing_key.to_string(),
                    properties: m.raw_properties.clone(),
                    body: m.body.to_bytes(),
                })
                .collect();
            view.queues.push(QueueView {
                vhost: q.vhost.to_string(),
                name: q.name.to_string(),
                auto_delete: q.auto_delete,
                arguments: encode_table(&q.arguments),
                message_count: messages.len(),
                messages,
            });
        }
        view.exchanges.sort();
        view.queues.sort();
        view.bindings.sort();
        Ok(view)
    }
}
