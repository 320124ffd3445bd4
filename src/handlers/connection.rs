//! connection class: start / start-ok, tune / tune-ok, open, close, blocked, update-secret.

use crate::auth::login_allowed;
use crate::broker::cmd::{Cmd, Outcome};
use crate::conn::session::{Next, Phase, Session};
use amq_protocol::protocol::connection::{self, AMQPMethod as M};
use amq_protocol::protocol::AMQPClass;
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use std::sync::atomic::Ordering;
use tracing::info;
use warren_protocol::{AmqpError, Frame, ReplyCode};

fn server_properties(shared: &crate::node::Shared) -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "consumer_priorities",
        "authentication_failure_close",
        "per_consumer_qos",
        "direct_reply_to",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    let s = |v: &str| AMQPValue::LongString(LongString::from(v));
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    // "RabbitMQ": clients and their test suites turn RabbitMQ's extensions on by this name
    // (amqp091-go's suite skips its RabbitMQ tests otherwise, leaving their connections open,
    // which its leak check then fails). `platform` and `information` say what answers.
    props.insert("product".into(), s("RabbitMQ"));
    // The RabbitMQ version whose behaviour Warren follows, with Warren's own after the `+`:
    // clients and test suites compare versions to pick features (the RabbitMQ Java client's
    // read 0.1.0 as older than 3.8 and skip or change tests); they ignore what follows `+`.
    props.insert(
        "version".into(),
        s(concat!("3.10.8+warren.", env!("CARGO_PKG_VERSION"))),
    );
    props.insert(
        "platform".into(),
        s(&format!(
            "Warren {} (Rust, {} {})",
            env!("CARGO_PKG_VERSION"),
            std::env::consts::OS,
            std::env::consts::ARCH
        )),
    );
    props.insert("copyright".into(), s("Copyright (c) the Warren authors"));
    props.insert(
        "information".into(),
        s("Warren, an AMQP 0-9-1 broker compatible with RabbitMQ. Licensed under the Apache License 2.0."),
    );
    props.insert("cluster_name".into(), s("warren"));
    // A cluster node names itself and what it knows of the cluster (issue 15): which node
    // answered, its role and term, the leader, the commit and applied indexes, and each
    // follower's lag (on the leader), so a client can log where it is connected.
    if let Some(st) = shared
        .replication
        .as_ref()
        .and_then(|r| crate::cluster::status::status(r))
    {
        let mut c = FieldTable::default();
        let n = |v: u64| AMQPValue::LongLongInt(v as i64);
        c.insert("node_id".into(), n(st.node_id));
        c.insert("role".into(), s(&st.role));
        c.insert("term".into(), n(st.term));
        if let Some(l) = st.leader_id {
            c.insert("leader_id".into(), n(l));
        }
        if let Some(i) = st.commit_index {
            c.insert("commit_index".into(), n(i));
        }
        if let Some(i) = st.applied_index {
            c.insert("applied_index".into(), n(i));
        }
        let mut lag = FieldTable::default();
        for node in &st.nodes {
            if let Some(l) = node.lag {
                lag.insert(node.id.to_string().into(), n(l));
            }
        }
        c.insert("follower_lag".into(), AMQPValue::FieldTable(lag));
        props.insert("warren_cluster".into(), AMQPValue::FieldTable(c));
        props.insert(
            "cluster_name".into(),
            s(&format!("warren-{}", st_cluster(shared))),
        );
    }
    props
}

fn st_cluster(shared: &crate::node::Shared) -> String {
    shared
        .replication
        .as_ref()
        .map(|r| r.cluster_id.clone())
        .unwrap_or_default()
}

/// Split a SASL response into (user, password) for PLAIN ("authzid\0user\0pass") or AMQPLAIN
/// (a field table without its length prefix, with LOGIN and PASSWORD). A PLAIN response with
/// an authorization identity is refused, even the user's own name, as RabbitMQ 3.10 refuses it
/// (it parses only "\0user\0pass"; nobody may act as another user).
fn credentials(mechanism: &str, response: &[u8]) -> Option<(String, String)> {
    match mechanism {
        "PLAIN" => {
            let mut parts = response.split(|b| *b == 0);
            let authzid = parts.next()?;
            let user = parts.next()?;
            let pass = parts.next()?;
            if parts.next().is_some() || !authzid.is_empty() {
                return None;
            }
            Some((
                String::from_utf8(user.to_vec()).ok()?,
                String::from_utf8(pass.to_vec()).ok()?,
            ))
        }
        "AMQPLAIN" => {
            let mut framed = (response.len() as u32).to_be_bytes().to_vec();
            framed.extend_from_slice(response);
            let (_, table) = amq_protocol::types::parsing::parse_field_table(&framed[..]).ok()?;
            let get = |k: &str| match table.inner().get(k) {
                Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).ok(),
                Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
                _ => None,
            };
            Some((get("LOGIN")?, get("PASSWORD")?))
        }
        _ => None,
    }
}

impl Session {
    /// Send connection.start (right after the protocol header).
    pub fn start(&mut self) {
        self.outbox.method(
            0,
            &AMQPClass::Connection(M::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: server_properties(&self.shared),
                mechanisms: if self.external_offered() {
                    "AMQPLAIN PLAIN EXTERNAL".into()
                } else {
                    "AMQPLAIN PLAIN".into()
                },
                locales: "en_US".into(),
            })),
        );
    }

    /// EXTERNAL is offered on every TLS connection, with or without a client certificate (a
    /// client without one is refused with 403), as RabbitMQ's rabbitmq_auth_mechanism_ssl
    /// offers it "since it may help clients debug their configuration".
    fn external_offered(&self) -> bool {
        self.info.as_ref().is_some_and(|i| i.tls.is_some())
    }

    /// Frames before the connection is open: start-ok, tune-ok, open, in that order.
    pub(crate) fn handshake(&mut self, frame: Frame) -> Result<Next, AmqpError> {
        let method = match frame {
            Frame::Method(0, AMQPClass::Connection(m)) => m,
            Frame::Heartbeat(0) => return Ok(Next::Continue),
            _ => {
                return Err(AmqpError::connection(
                    ReplyCode::CommandInvalid,
                    "expected a connection method during the handshake",
                ));
            }
        };
        match (self.phase, method) {
            (_, M::Close(_)) => {
                self.send_connection_close_ok();
                Ok(Next::Close)
            }
            (Phase::AwaitStartOk, M::StartOk(m)) => self.start_ok(m),
            (Phase::AwaitTuneOk, M::TuneOk(m)) => self.tune_ok(m),
            (Phase::AwaitOpen, M::Open(m)) => self.open(m),
            (_, m) => Err(AmqpError::connection(
                ReplyCode::CommandInvalid,
                format!("unexpected method {m:?} during the handshake"),
            )
            .on_method(&AMQPClass::Connection(m))),
        }
    }

    fn start_ok(&mut self, m: connection::StartOk) -> Result<Next, AmqpError> {
        self.auth_failure_close =
            Self::client_capability(&m.client_properties, "authentication_failure_close");
        self.blocked_capability =
            Self::client_capability(&m.client_properties, "connection.blocked");
        self.outbox.cancel_notify.store(
            Self::client_capability(&m.client_properties, "consumer_cancel_notify"),
            Ordering::Relaxed,
        );
        let mechanism = m.mechanism.as_str();
        let external = mechanism == "EXTERNAL" && self.external_offered();
        if mechanism != "PLAIN" && mechanism != "AMQPLAIN" && !external {
            // RabbitMQ closes the socket without a close frame here.
            info!(mechanism, "unknown authentication mechanism");
            return Ok(Next::Close);
        }
        let refused = || {
            AmqpError::connection(
                ReplyCode::AccessRefused,
                format!(
                                        "Login was refused using authentication mechanism {mechanism}. For details see the broker logfile."
                ),
            )
            .on_no_method()
        };
        let allowed = if external {
            // The certificate names the user; the response (often empty) is not looked at.
            let tls = self.info.as_ref().and_then(|i| i.tls.as_ref());
            match tls
                .and_then(|t| t.subject.as_ref())
                .and_then(|s| s.common_name.clone())
            {
                Some(n)
                    if crate::auth::external_login_allowed(&self.shared, &n, self.peer.ip()) =>
                {
                    Ok(n)
                }
                Some(n) => Err(n),
                None if tls.is_some_and(|t| t.peer_cert) => {
                    Err("(a certificate without a common name)".to_string())
                }
                None => Err("(no client certificate)".to_string()),
            }
        } else {
            let Some((user, pass)) = credentials(mechanism, m.response.as_bytes()) else {
                // RabbitMQ takes a response it cannot parse (PLAIN with an authorization
                // identity among them) as a syntax error of the handshake: no close frame,
                // whatever the client's capabilities.
                info!(mechanism, peer = %self.peer, "malformed authentication response");
                self.phase = Phase::Closed;
                return Ok(Next::Linger);
            };
            if login_allowed(&self.shared, &user, &pass, self.peer.ip()) {
                Ok(user)
            } else {
                Err(user)
            }
        };
        let user = match allowed {
            Ok(user) => user,
            Err(user) => {
                info!(user, mechanism, peer = %self.peer, "login refused");
                if !self.auth_failure_close {
                    // Old clients get the socket closed without a close frame, as RabbitMQ does.
                    self.phase = Phase::Closed;
                    return Ok(Next::Linger);
                }
                return Err(refused());
            }
        };
        if let Some(info) = &self.info {
            let mut d = info.details.lock();
            d.state = "tuning";
            d.user = user.clone();
            d.auth_mechanism = mechanism.to_string();
            d.client_properties = m.client_properties.clone();
        }
        // A deletion of the user between the check and the line above closed the connections
        // it found with the user's name, and this one had none yet: looked at again, now that
        // it has (the deletion removes the user before it looks).
        if self.shared.query(|b| b.user(&user).is_none()) {
            info!(user, peer = %self.peer, "login refused: the user was deleted");
            return Err(refused());
        }
        self.user = user;
        self.phase = Phase::AwaitTuneOk;
        let config = &self.shared.config;
        self.outbox.method(
            0,
            &AMQPClass::Connection(M::Tune(connection::Tune {
                channel_max: config.channel_max,
                frame_max: config.frame_max,
                heartbeat: config.heartbeat,
            })),
        );
        Ok(Next::Continue)
    }

    fn tune_ok(&mut self, m: connection::TuneOk) -> Result<Next, AmqpError> {
        let config = &self.shared.config;
        let not_allowed =
            |t: String| Err(AmqpError::connection(ReplyCode::NotAllowed, t).on(10, 31));
        let frame_max = if m.frame_max == 0 {
            config.frame_max
        } else {
            m.frame_max
        };
        if frame_max > config.frame_max {
            return not_allowed(format!("frame_max={frame_max} > {} max", config.frame_max));
        }
        if frame_max < crate::conn::session::FRAME_MIN_SIZE {
            return not_allowed(format!("frame_max={frame_max} < 4096 min"));
        }
        let channel_max = if m.channel_max == 0 {
            config.channel_max
        } else {
            m.channel_max
        };
        if channel_max > config.channel_max {
            return not_allowed(format!(
                "channel_max={channel_max} > {} max",
                config.channel_max
            ));
        }
        self.frame_max = frame_max;
        self.channel_max = channel_max;
        self.heartbeat = m.heartbeat;
        self.outbox.set_frame_max(frame_max);
        self.outbox.heartbeat.store(m.heartbeat, Ordering::Relaxed);
        self.phase = Phase::AwaitOpen;
        if let Some(info) = &self.info {
            let mut d = info.details.lock();
            d.state = "opening";
            (d.frame_max, d.channel_max, d.heartbeat) = (frame_max, channel_max, m.heartbeat);
        }
        Ok(Next::Continue)
    }

    fn open(&mut self, m: connection::Open) -> Result<Next, AmqpError> {
        let vhost = m.virtual_host.as_str().to_string();
        // A cluster node that does not lead serves no client: a follower configured to refuse
        // them (`--follower-clients refuse`), or one whose proxy found no reachable leader.
        // 320 naming the leader, in answer to connection.open as RabbitMQ refuses a connection
        // it will not serve (a vhost's connection limit): clients report the reason as it is
        // (the Java client and pika take a close in answer to start-ok for a failed login),
        // and none is sent a close before it answered connection.start (lapin then waited
        // for ever). The node may also have been elected since the client connected.
        if let Some(rep) = self.shared.replication.as_ref().filter(|r| !r.is_leader()) {
            let reason = rep.not_leading();
            info!(peer = %self.peer, "client refused: {reason}");
            return Err(AmqpError::connection(ReplyCode::ConnectionForced, reason).on(10, 40));
        }
        let opened = self.run(Cmd::OpenConnection {
            vhost: vhost.clone(),
            connection_max: self.shared.connection_max,
        });
        let conn = match opened.and_then(Outcome::into_opened) {
            Ok(conn) => conn,
            Err(e) => {
                info!(reason = %e.detail(), "connection.open refused");
                return Err(e.on(10, 40));
            }
        };
        self.conn = conn;
        self.outbox.conn_id.store(conn, Ordering::Release);
        if let Some(info) = &self.info {
            let mut d = info.details.lock();
            d.state = "running";
            d.vhost = vhost.clone();
            d.conn = conn;
        }
        self.conn_vhost_still_there(&vhost)?;
        self.vhost = vhost;
        self.phase = Phase::Open;
        info!(conn, user = %self.user, vhost = %self.vhost, "connection open");
        self.outbox
            .method(0, &AMQPClass::Connection(M::OpenOk(connection::OpenOk {})));
        Ok(Next::Continue)
    }

    /// A deletion of the vhost between the check in `open` and the line that names it in the
    /// registry closed the connections it found there, and this one was not yet among them:
    /// looked at again now that it is (the deletion removes the vhost before it looks).
    fn conn_vhost_still_there(&self, vhost: &str) -> Result<(), AmqpError> {
        if self.shared.query(|b| b.has_vhost(vhost)) {
            return Ok(());
        }
        Err(
            AmqpError::connection(ReplyCode::NotAllowed, format!("vhost {vhost} not found"))
                .on(10, 40),
        )
    }

    /// connection.blocked ("low on memory" or "low on disk", RabbitMQ's reasons) or
    /// connection.unblocked (None), to clients that take them.
    pub(crate) fn send_blocked(&mut self, reason: Option<&str>) {
        if !self.blocked_capability {
            return;
        }
        let m = if let Some(reason) = reason {
            M::Blocked(connection::Blocked {
                reason: reason.into(),
            })
        } else {
            M::Unblocked(connection::Unblocked {})
        };
        self.outbox.method(0, &AMQPClass::Connection(m));
    }

    pub(crate) fn send_connection_close_ok(&mut self) {
        self.outbox
            .connection_end(&AMQPClass::Connection(M::CloseOk(connection::CloseOk {})));
    }

    /// Methods on channel 0 once the connection is open.
    pub(crate) fn connection_method(&mut self, method: AMQPClass) -> Result<Next, AmqpError> {
        let AMQPClass::Connection(m) = method else {
            return Err(
                AmqpError::channel_error("unexpected method in connection state running")
                    .on_method(&method),
            );
        };
        match m {
            M::Close(c) => {
                info!(code = c.reply_code, text = %c.reply_text, "client closed the connection");
                // Channels and exclusive queues go before the close-ok, as in RabbitMQ: a client
                // that reconnects at once finds them gone.
                self.teardown();
                self.send_connection_close_ok();
                self.phase = Phase::Closed;
                Ok(Next::Drain)
            }

            M::UpdateSecret(_) => {
                self.outbox.method(
                    0,
                    &AMQPClass::Connection(M::UpdateSecretOk(connection::UpdateSecretOk {})),
                );
                Ok(Next::Continue)
            }
            // A close-ok we did not ask for, and blocked/unblocked (which only a server sends in
            // RabbitMQ's dialect), are unexpected too.
            m @ (M::Start(_)
            | M::CloseOk(_)
            | M::Blocked(_)
            | M::Unblocked(_)
            | M::StartOk(_)
            | M::Secure(_)
            | M::SecureOk(_)
            | M::Tune(_)
            | M::TuneOk(_)
            | M::Open(_)
            | M::OpenOk(_)
            | M::UpdateSecretOk(_)) => {
                // RabbitMQ answers a handshake method on an open connection as any method it
                // does not expect there: 504 CHANNEL_ERROR.
                let m = AMQPClass::Connection(m);
                Err(
                    AmqpError::channel_error("unexpected method in connection state running")
                        .on_method(&m),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::credentials;

    #[test]
    fn plain_and_amqplain() {
        assert_eq!(
            credentials("PLAIN", b"\0guest\0guest"),
            Some(("guest".into(), "guest".into()))
        );
        assert_eq!(credentials("PLAIN", b"guest"), None);
        // An authorization identity, even the user's own, is refused (as RabbitMQ 3.10).
        assert_eq!(credentials("PLAIN", b"guest\0guest\0guest"), None);
        assert_eq!(credentials("PLAIN", b"admin\0guest\0guest"), None);
        let amqplain = b"\x05LOGINS\x00\x00\x00\x05guest\x08PASSWORDS\x00\x00\x00\x05guest";
        assert_eq!(
            credentials("AMQPLAIN", amqplain),
            Some(("guest".into(), "guest".into()))
        );
    }
}
