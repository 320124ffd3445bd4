//! The connection registry: every client connection from its protocol header to its end, by
//! name. The accept loop's connection tasks register themselves; the management API lists,
//! shows and closes connections through it.

use crate::broker::ConnId;
use amq_protocol::types::FieldTable;
use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::Notify;

/// The connections listed, in name order (the management API's order).
#[derive(Debug, Default)]
pub struct Registry {
    connections: RwLock<BTreeMap<String, Arc<ConnInfo>>>,
}

impl Registry {
    /// List `info` until the returned guard drops, however the connection's task ends.
    pub fn register(&self, info: Arc<ConnInfo>) -> Listed<'_> {
        self.connections
            .write()
            .insert(info.name.clone(), info.clone());
        Listed {
            registry: self,
            info,
        }
    }

    /// Every connection listed, by name.
    pub fn list(&self) -> Vec<Arc<ConnInfo>> {
        self.connections.read().values().cloned().collect()
    }

    /// The connection called `name`.
    pub fn find(&self, name: &str) -> Option<Arc<ConnInfo>> {
        self.connections.read().get(name).cloned()
    }

    /// Ask the connection called `name` to close (see [`ConnInfo::close`]); false when there is
    /// none.
    pub fn close(&self, name: &str, reason: String) -> bool {
        match self.find(name) {
            Some(c) => {
                c.close(reason);
                true
            }
            None => false,
        }
    }

    /// Close (320, `reason`) every listed connection whose details `which` selects: those of
    /// a deleted user or vhost.
    pub fn close_where(&self, which: impl Fn(&ConnDetails) -> bool, reason: &str) {
        for c in self.list() {
            if which(&c.details.lock()) {
                c.close(reason.to_string());
            }
        }
    }

    /// How many connections are listed.
    pub fn len(&self) -> usize {
        self.connections.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connection's place in the [`Registry`]: dropping it takes the connection off the list.
pub struct Listed<'a> {
    registry: &'a Registry,
    info: Arc<ConnInfo>,
}

impl Drop for Listed<'_> {
    fn drop(&mut self) {
        self.registry.connections.write().remove(&self.info.name);
    }
}

/// One client connection, from its protocol header to its end: what the API shows of it, and
/// the way to close it from outside.
#[derive(Debug)]
pub struct ConnInfo {
    /// RabbitMQ's connection name: "peer-ip:port -> local-ip:port".
    pub name: String,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// Milliseconds since the Unix epoch.
    pub connected_at: u64,
    pub details: Mutex<ConnDetails>,
    /// The TLS session the connection came over (`--amqps-listen`), if it did.
    pub tls: Option<TlsPeer>,
    close_reason: Mutex<Option<String>>,
    /// Woken when the connection is to be closed (`close`).
    pub close_requested: Notify,
}

/// What a TLS connection's handshake settled.
#[derive(Debug, Clone, Default)]
pub struct TlsPeer {
    /// RabbitMQ's `ssl_protocol` ("tlsv1.3").
    pub protocol: String,
    /// The negotiated cipher suite.
    pub cipher: String,
    /// The client gave a certificate and the CA verified it (`--tls-verify-peer`): EXTERNAL
    /// is offered.
    pub peer_cert: bool,
    /// That certificate's subject: its distinguished name, and its common name (the name
    /// EXTERNAL logs in with).
    pub subject: Option<crate::tls::Subject>,
}

/// What the handshake told us, filled in as it goes.
#[derive(Debug, Default)]
pub struct ConnDetails {
    /// starting, tuning, opening, running, closing.
    pub state: &'static str,
    pub user: String,
    pub vhost: String,
    pub auth_mechanism: String,
    pub client_properties: FieldTable,
    pub channel_max: u16,
    pub frame_max: u32,
    pub heartbeat: u16,
    /// The broker core's id, once open.
    pub conn: ConnId,
}

impl ConnInfo {
    pub fn new(peer: SocketAddr, local: SocketAddr) -> Self {
        let addr = |a: SocketAddr| format!("{}:{}", a.ip().to_canonical(), a.port());
        let connected_at = crate::clock::now_ms();
        ConnInfo {
            name: format!("{} -> {}", addr(peer), addr(local)),
            peer,
            local,
            connected_at,
            details: Mutex::new(ConnDetails {
                state: "starting",
                ..Default::default()
            }),
            tls: None,
            close_reason: Mutex::new(None),
            close_requested: Notify::new(),
        }
    }

    /// The same, for a connection over TLS.
    pub fn with_tls(self, tls: Option<TlsPeer>) -> Self {
        ConnInfo { tls, ..self }
    }

    /// Ask the connection to close with 320 CONNECTION_FORCED and `reason`.
    pub fn close(&self, reason: String) {
        *self.close_reason.lock() = Some(reason);
        self.close_requested.notify_one();
    }

    /// The reason given to `close`, once.
    pub fn take_close_reason(&self) -> Option<String> {
        self.close_reason.lock().take()
    }
}
