//! Broker settings. Everything has a default, so `warren` runs with no config file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// RabbitMQ's default max_message_size (128 MiB).
pub const MAX_MESSAGE_SIZE_DEFAULT: u64 = 128 * 1024 * 1024;
/// The most max_message_size may be set to (RabbitMQ's ?MAX_MSG_SIZE, 512 MiB).
pub const MAX_MESSAGE_SIZE_LIMIT: u64 = 512 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct Config {
    pub amqp_listen: SocketAddr,
    pub data_dir: PathBuf,
    /// Offered in connection.tune; the client may lower them.
    pub channel_max: u16,
    pub frame_max: u32,
    pub heartbeat: u16,
    /// Users created, as administrators, when the data folder holds no user yet (its first
    /// start): (name, password). RabbitMQ's default guest/guest; `--default-user` and
    /// `--default-pass` replace it (RabbitMQ's `default_user`/`default_pass`), and guest is then
    /// not created. Later starts take the users the store holds.
    pub users: Vec<(String, String)>,
    /// Users allowed from loopback addresses only (RabbitMQ's `loopback_users`).
    pub loopback_users: Vec<String>,
    /// Largest message body accepted (RabbitMQ's max_message_size default, 128 MiB).
    pub max_message_size: u64,
    /// How long a client has to send the protocol header and finish the handshake.
    pub handshake_timeout: Duration,
    /// How long shutdown waits for clients to acknowledge connection.close.
    pub shutdown_grace: Duration,
    /// Cancel a consumer that holds a delivery unacknowledged longer than this (RabbitMQ's
    /// consumer_timeout); None (the default) disables it.
    pub consumer_timeout: Option<Duration>,
    /// Block publishers (connection.blocked) while the data folder's file system has less free
    /// space than this (RabbitMQ's disk_free_limit, 50 MB by default).
    pub disk_free_limit: u64,
    /// Flow control: how long a publisher waits for a queue's consumers to bring the queue
    /// back under its in-memory window before the queue pages to the store instead.
    pub flow_hold: Duration,
    /// Where to serve the management HTTP API (RabbitMQ's port 15672); None: not served.
    pub management_listen: Option<SocketAddr>,
    /// Test hook, never set from the command line or a config file (None in every server the
    /// binary starts): a queue.declare of this name panics inside the broker lock, so tests can
    /// show a defect in one connection leaks nothing. No client input can turn it on.
    pub panic_on_declare: Option<String>,
    /// Test hook, never set by the binary: every synced store write takes this much longer (a
    /// slow disk), so tests can show that no reply waiting for an fsync leaves before it.
    pub sync_delay: Option<Duration>,
    /// Test hook, never set by the binary: every read of a queue's backlog from the store
    /// takes this much longer (a slow disk), so tests can show that such a read holds up no
    /// other client.
    pub read_delay: Option<Duration>,
    /// Open AMQP connections allowed at once (RabbitMQ's `connection_max`); None: derived from
    /// the process's file descriptor limit (`node::default_connection_max`).
    pub connection_max: Option<usize>,
    /// Block publishers while the process's resident memory is above this (RabbitMQ's
    /// vm_memory_high_watermark: 0.4 of the machine's memory by default).
    pub vm_memory_high_watermark: crate::memory::Watermark,
    /// Start from a store that fails its checks at open (a damaged log or table file, a
    /// missing MANIFEST) instead of refusing: copy it to `<data>/damaged-<time>/`, repair it,
    /// log what was lost. Off by default: a damaged store needs an operator's decision.
    pub recover_damaged: bool,
    /// Run as a node of a replicated cluster (`--node-id`, `--raft-listen`, `--peers`); None:
    /// a single node with no Raft, as before.
    pub cluster: Option<ClusterConfig>,
    /// Definitions imported at start (`--load-definitions FILE`, RabbitMQ's
    /// `load_definitions`): a single node imports them before it serves, a cluster node the
    /// first time it leads. Parsed when the file is read, so a bad file stops the start.
    pub load_definitions: Option<std::sync::Arc<serde_json::Map<String, serde_json::Value>>>,
    /// Where to serve AMQP over TLS (`--amqps-listen`, RabbitMQ's 5671), with `tls`.
    pub amqps_listen: Option<SocketAddr>,
    pub tls: Option<TlsConfig>,
    /// Serve the management API over HTTPS (with `tls`'s certificate and key).
    pub management_tls: bool,
}

/// TLS settings (RabbitMQ's `ssl_options`).
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// The server's certificate chain and private key (PEM).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The certificate authorities client certificates are checked against (PEM).
    pub ca: Option<PathBuf>,
    /// Ask clients for a certificate and check the one they give (`verify_peer`).
    pub verify_peer: bool,
    /// Refuse clients that give none (`fail_if_no_peer_cert`).
    pub fail_if_no_peer_cert: bool,
}

/// A cluster node's settings (issue 15).
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's id (`--node-id`), one of `peers`.
    pub node_id: u64,
    /// Where this node accepts Raft connections from its peers (`--raft-listen`).
    pub raft_listen: SocketAddr,
    /// Every initial voter's Raft address, this node's included (`--peers`). Nodes started
    /// with the same list form one cluster.
    pub peers: std::collections::BTreeMap<u64, String>,
    /// What a follower does with an AMQP client: hand it to the leader (the default) or
    /// refuse it with connection.close 320 naming the leader's address.
    pub follower_clients: FollowerClients,
    /// The AMQP and management addresses other nodes and clients reach this node on (in its
    /// membership data); None: the listen addresses, with an unspecified IP as the Raft
    /// address's host.
    pub advertise_amqp: Option<String>,
    pub advertise_http: Option<String>,
    /// Log entries between two snapshots (`--raft-snapshot-every`); the log before a
    /// snapshot is purged but for a tenth of this.
    pub snapshot_every: u64,
    /// The Raft heartbeat interval in ms (`--raft-heartbeat-ms`). openraft gives every
    /// AppendEntries this long to come back, so it must exceed the round trip between
    /// nodes (with a follower's fsync); elections start 3 to 6 intervals after the last
    /// heartbeat, and a leader's lease is 6 intervals.
    pub heartbeat_ms: u64,
}

/// See [`ClusterConfig::follower_clients`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FollowerClients {
    #[default]
    Proxy,
    Refuse,
}

impl std::str::FromStr for FollowerClients {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "proxy" => Ok(FollowerClients::Proxy),
            "refuse" => Ok(FollowerClients::Refuse),
            _ => Err(format!("'{s}': expected proxy or refuse")),
        }
    }
}

/// Parse `--peers`: `ID=HOST:PORT` items separated by commas, ids unique and non-zero.
pub fn parse_peers(s: &str) -> Result<std::collections::BTreeMap<u64, String>, String> {
    let mut peers = std::collections::BTreeMap::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (id, addr) = item
            .split_once('=')
            .ok_or_else(|| format!("'{item}': expected ID=HOST:PORT"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| format!("'{item}': the node id must be a number"))?;
        if id == 0 {
            return Err(format!("'{item}': node ids start at 1"));
        }
        let addr = addr.trim();
        if addr
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .is_none()
        {
            return Err(format!("'{item}': expected HOST:PORT after '='"));
        }
        if peers.insert(id, addr.to_string()).is_some() {
            return Err(format!("node {id} is listed twice"));
        }
    }
    if peers.is_empty() {
        return Err("no peers listed".into());
    }
    Ok(peers)
}

impl Default for Config {
    fn default() -> Self {
        Config {
            amqp_listen: SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 5672)),
            data_dir: PathBuf::from("./data"),
            channel_max: 2047,
            frame_max: 131072,
            heartbeat: 60,
            users: vec![("guest".into(), "guest".into())],
            loopback_users: vec!["guest".into()],
            max_message_size: MAX_MESSAGE_SIZE_DEFAULT,
            handshake_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(3),
            consumer_timeout: None,
            flow_hold: Duration::from_millis(100),
            disk_free_limit: 50_000_000,
            management_listen: None,
            panic_on_declare: None,
            sync_delay: None,
            read_delay: None,
            connection_max: None,
            vm_memory_high_watermark: Default::default(),
            recover_damaged: false,
            cluster: None,
            load_definitions: None,
            amqps_listen: None,
            tls: None,
            management_tls: false,
        }
    }
}

/// A list of user names from the command line (`--loopback-users`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserList(pub Vec<String>);

/// Where AMQP over TLS is served, from `--amqps-listen` (None: not given), whether a
/// certificate and key are configured, and where plain AMQP is served: "none" serves none;
/// without the flag, a configured certificate serves it on RabbitMQ's port, 5671, on the
/// address plain AMQP listens on (so that it is reachable from where AMQP is, no further).
pub fn amqps_listen(
    arg: Option<&str>,
    tls: bool,
    amqp_listen: SocketAddr,
) -> Result<Option<SocketAddr>, String> {
    match arg.map(str::trim) {
        Some(a) if a.is_empty() || a.eq_ignore_ascii_case("none") => Ok(None),
        Some(a) => a
            .parse()
            .map(Some)
            .map_err(|e| format!("--amqps-listen {a}: {e}")),
        None if tls => Ok(Some(SocketAddr::new(amqp_listen.ip(), AMQPS_PORT))),
        None => Ok(None),
    }
}

/// RabbitMQ's AMQP-over-TLS port.
pub const AMQPS_PORT: u16 = 5671;

/// Parse a comma-separated list of user names; "none" or nothing is the empty list (RabbitMQ's
/// `loopback_users = none`). Names are trimmed; an empty name in the list is refused.
pub fn parse_user_list(s: &str) -> Result<UserList, String> {
    let s = s.trim();
    if s.is_empty() || s.eq_ignore_ascii_case("none") {
        return Ok(UserList(Vec::new()));
    }
    s.split(',')
        .map(|n| {
            let n = n.trim();
            if n.is_empty() {
                Err(format!("an empty user name in '{s}'"))
            } else {
                Ok(n.to_string())
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .map(UserList)
}

#[cfg(test)]
mod tests {
    use super::{amqps_listen, parse_peers, parse_user_list, UserList};

    #[test]
    fn amqps_is_served_on_5671_once_a_certificate_is_configured() {
        let any = "[::]:5672".parse().unwrap();
        let lo = "127.0.0.1:5672".parse().unwrap();
        assert_eq!(
            amqps_listen(None, true, any),
            Ok(Some("[::]:5671".parse().unwrap()))
        );
        assert_eq!(
            amqps_listen(None, true, lo),
            Ok(Some("127.0.0.1:5671".parse().unwrap()))
        );
        assert_eq!(amqps_listen(None, false, any), Ok(None));
        assert_eq!(amqps_listen(Some("none"), true, any), Ok(None));
        assert_eq!(
            amqps_listen(Some("127.0.0.1:7000"), true, any),
            Ok(Some("127.0.0.1:7000".parse().unwrap()))
        );
        assert!(amqps_listen(Some("nowhere"), true, any).is_err());
    }

    #[test]
    fn peer_lists_parse_and_bad_ones_are_refused() {
        let p = parse_peers("1=127.0.0.1:5701, 2=localhost:5702,3=[::1]:5703").unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[&2], "localhost:5702");
        assert_eq!(p[&3], "[::1]:5703");
        for bad in ["", "1", "x=h:1", "0=h:1", "1=h", "1=h:1,1=h:2", "1=h:99999"] {
            assert!(parse_peers(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn user_lists_parse_as_rabbitmq_names_them() {
        let list = |v: &[&str]| Ok(UserList(v.iter().map(|s| s.to_string()).collect()));
        assert_eq!(parse_user_list("guest"), list(&["guest"]));
        assert_eq!(parse_user_list(" guest, ops "), list(&["guest", "ops"]));
        assert_eq!(parse_user_list("none"), list(&[]));
        assert_eq!(parse_user_list(""), list(&[]));
        assert!(parse_user_list("guest,,ops").is_err());
    }
}
