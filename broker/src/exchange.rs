//! Exchanges and their bindings; routing for each type.

use super::{headers, topic, QueueId};
use amq_protocol::types::FieldTable;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "direct" => ExchangeKind::Direct,
            "fanout" => ExchangeKind::Fanout,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

/// Where a binding leads: a queue (by id) or another exchange (by name, same vhost).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dest {
    Queue(QueueId),
    Exchange(String),
}

#[derive(Debug, Clone)]
pub struct Binding {
    pub dest: Dest,
    pub routing_key: String,
    pub arguments: FieldTable,
}

#[derive(Debug)]
pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
    /// All bindings with this exchange as source, in creation order.
    pub bindings: Vec<Binding>,
    /// Direct exchanges: routing key → indexes into `bindings`, so routing is one lookup.
    direct_index: HashMap<String, Vec<usize>>,
}

impl Exchange {
    pub fn new(
        name: String,
        kind: ExchangeKind,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    ) -> Self {
        Exchange {
            name,
            kind,
            durable,
            auto_delete,
            internal,
            arguments,
            bindings: Vec::new(),
            direct_index: HashMap::new(),
        }
    }

    fn same_binding(b: &Binding, dest: &Dest, key: &str, args: &FieldTable) -> bool {
        &b.dest == dest && b.routing_key == key && &b.arguments == args
    }

    pub fn has_binding(&self, dest: &Dest, key: &str, args: &FieldTable) -> bool {
        self.bindings
            .iter()
            .any(|b| Self::same_binding(b, dest, key, args))
    }

    /// Add a binding; returns false if it already existed.
    pub fn bind(&mut self, dest: Dest, routing_key: String, arguments: FieldTable) -> bool {
        if self.has_binding(&dest, &routing_key, &arguments) {
            return false;
        }
        self.bindings.push(Binding {
            dest,
            routing_key,
            arguments,
        });
        self.reindex();
        true
    }

    /// Remove a binding; returns false if there was none.
    pub fn unbind(&mut self, dest: &Dest, routing_key: &str, arguments: &FieldTable) -> bool {
        let before = self.bindings.len();
        self.bindings
            .retain(|b| !Self::same_binding(b, dest, routing_key, arguments));
        let removed = self.bindings.len() != before;
        if removed {
            self.reindex();
        }
        removed
    }

    /// Remove every binding to `dest`; returns how many went.
    pub fn unbind_dest(&mut self, dest: &Dest) -> usize {
        let before = self.bindings.len();
        self.bindings.retain(|b| &b.dest != dest);
        let removed = before - self.bindings.len();
        if removed > 0 {
            self.reindex();
        }
        removed
    }

    fn reindex(&mut self) {
        self.direct_index.clear();
        if self.kind == ExchangeKind::Direct {
            for (i, b) in self.bindings.iter().enumerate() {
                self.direct_index
                    .entry(b.routing_key.clone())
                    .or_default()
                    .push(i);
            }
        }
    }

    /// The destinations a message with this routing key and headers goes to (may repeat).
    pub fn route<'a>(
        &'a self,
        routing_key: &str,
        headers: Option<&FieldTable>,
        out: &mut impl Extend<&'a Dest>,
    ) {
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(ix) = self.direct_index.get(routing_key) {
                    out.extend(ix.iter().map(|&i| &self.bindings[i].dest));
                }
            }
            ExchangeKind::Fanout => out.extend(self.bindings.iter().map(|b| &b.dest)),
            ExchangeKind::Topic => out.extend(
                self.bindings
                    .iter()
                    .filter(|b| topic::matches(&b.routing_key, routing_key))
                    .map(|b| &b.dest),
            ),
            ExchangeKind::Headers => out.extend(
                self.bindings
                    .iter()
                    .filter(|b| headers::matches(&b.arguments, headers))
                    .map(|b| &b.dest),
            ),
        }
    }
}
