//! The `warren` binary: a thin command line over the library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use tracing_subscriber::EnvFilter;

mod config_file;

/// mimalloc rather than glibc's malloc: per-message allocations are cheaper, and freed large
/// bodies (1 MiB messages) are reused instead of being returned to the OS and faulted in again
/// (measured in the README's S1/S6 rows).
///
/// Wrapped in `cap`'s counter: the memory high watermark compares what the broker has
/// allocated, not the resident set, which an allocator that keeps freed pages for reuse (or
/// returns them lazily) leaves high long after messages are gone.
#[global_allocator]
static GLOBAL: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

fn allocated() -> u64 {
    GLOBAL.allocated() as u64
}

#[derive(Parser, Debug)]
#[command(name = "warren", version, about = "An AMQP 0-9-1 message broker")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    server: ServerArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the broker (the default).
    Server(Box<ServerArgs>),
    /// Load a broker and report rates and latencies (RabbitMQ's PerfTest, in spirit).
    Perf(warren_perf::PerfArgs),
    /// Operate a running node through its management API (cluster status, membership).
    Ctl(warren::ctl::CtlArgs),
}

#[derive(clap::Args, Debug, Clone)]
struct ServerArgs {
    /// A TOML file of settings, one per option with the option's name (amqp-listen =
    /// "127.0.0.1:5672", node-id = 1, [peers] with 1 = "HOST:PORT" lines, ...). An option
    /// given on the command line or by its environment variable wins over the file.
    #[arg(long, env = "WARREN_CONFIG")]
    config: Option<PathBuf>,
    /// Address to accept AMQP connections on. The default, [::]:5672, takes IPv4 and IPv6
    /// clients alike, as RabbitMQ does (IPv4 only where the host has no IPv6).
    #[arg(long, env = "WARREN_AMQP_LISTEN", default_value = "[::]:5672")]
    amqp_listen: SocketAddr,
    /// Folder for the broker's durable state.
    #[arg(long, env = "WARREN_DATA_DIR", default_value = "./data")]
    data_dir: PathBuf,
    /// Heartbeat interval offered to clients, in seconds (0 disables).
    #[arg(long, default_value_t = 60)]
    heartbeat: u16,
    /// Cancel a consumer holding a delivery unacknowledged this long, in milliseconds, and
    /// requeue what it holds (off by default).
    #[arg(long)]
    consumer_timeout_ms: Option<u64>,
    /// Block publishers while the data folder's disk has less free space than this (bytes).
    #[arg(long, default_value_t = 50_000_000)]
    disk_free_limit: u64,
    /// Address of the management HTTP API (RabbitMQ's 15672), or "none" not to serve it.
    #[arg(long, env = "WARREN_MANAGEMENT_LISTEN", default_value = "[::]:15672")]
    management_listen: String,
    /// The user created (an administrator, allowed from any address) on the first start of an
    /// empty data folder, instead of guest (RabbitMQ's default_user). Needs --default-pass.
    #[arg(long, env = "WARREN_DEFAULT_USER", requires = "default_pass")]
    default_user: Option<String>,
    /// The largest message a client may publish, in bytes (RabbitMQ's max_message_size:
    /// 128 MiB by default, 512 MiB at most); a larger one closes its channel with 406.
    #[arg(long, env = "WARREN_MAX_MESSAGE_SIZE", default_value_t = warren::config::MAX_MESSAGE_SIZE_DEFAULT, value_parser = clap::value_parser!(u64).range(1..=warren::config::MAX_MESSAGE_SIZE_LIMIT))]
    max_message_size: u64,
    /// Open AMQP connections allowed at once (RabbitMQ's connection_max); past it,
    /// connection.open is refused with 530. Default: half the process's open-file limit.
    #[arg(long, env = "WARREN_CONNECTION_MAX")]
    connection_max: Option<usize>,
    /// Block publishers while the broker's resident memory is above this (RabbitMQ's
    /// vm_memory_high_watermark): a fraction of the machine's memory (0.4, the default) or an
    /// absolute size (bytes, or with a unit: 512MiB, 2GB).
    #[arg(long, env = "WARREN_VM_MEMORY_HIGH_WATERMARK", default_value = "0.4", value_parser = warren::memory::Watermark::parse)]
    vm_memory_high_watermark: warren::memory::Watermark,
    /// A definitions file (RabbitMQ's JSON, as `GET /api/definitions` or RabbitMQ's export
    /// gives it) imported at start: users, vhosts, permissions, exchanges, queues, bindings
    /// (RabbitMQ's load_definitions). Importing adds and replaces; it deletes nothing.
    #[arg(long, env = "WARREN_LOAD_DEFINITIONS")]
    load_definitions: Option<std::path::PathBuf>,
    /// Serve AMQP over TLS here (RabbitMQ's amqps), with --tls-cert and --tls-key; by default
    /// port 5671 on --amqp-listen's address once they are given; "none" not to serve it
    /// (HTTPS management only).
    #[arg(long, env = "WARREN_AMQPS_LISTEN", requires_all = ["tls_cert", "tls_key"])]
    amqps_listen: Option<String>,
    /// Serve the management API over HTTPS on --management-listen, with --tls-cert and --tls-key
    /// (client certificates are not asked for there).
    #[arg(long, env = "WARREN_MANAGEMENT_TLS", requires_all = ["tls_cert", "tls_key"])]
    management_tls: bool,
    /// The server's certificate chain (PEM) for --amqps-listen and --management-tls.
    #[arg(long, env = "WARREN_TLS_CERT")]
    tls_cert: Option<std::path::PathBuf>,
    /// The server's private key (PEM) for --amqps-listen.
    #[arg(long, env = "WARREN_TLS_KEY")]
    tls_key: Option<std::path::PathBuf>,
    /// Certificate authorities (PEM) that client certificates are checked against.
    #[arg(long, env = "WARREN_TLS_CA")]
    tls_ca: Option<std::path::PathBuf>,
    /// Ask TLS clients for a certificate and check it against --tls-ca (RabbitMQ's verify_peer).
    #[arg(long, env = "WARREN_TLS_VERIFY_PEER", requires = "tls_ca")]
    tls_verify_peer: bool,
    /// Refuse TLS clients that give no certificate (RabbitMQ's fail_if_no_peer_cert).
    #[arg(
        long,
        env = "WARREN_TLS_FAIL_IF_NO_PEER_CERT",
        requires = "tls_verify_peer"
    )]
    tls_fail_if_no_peer_cert: bool,
    /// The default user's password (RabbitMQ's default_pass).
    #[arg(
        long,
        env = "WARREN_DEFAULT_PASS",
        requires = "default_user",
        hide_env_values = true
    )]
    default_pass: Option<String>,
    /// Users who may log in only from a loopback address (RabbitMQ's loopback_users), comma
    /// separated; "none" (or an empty value) lifts the rule for everyone.
    #[arg(
        long,
        env = "WARREN_LOOPBACK_USERS",
        default_value = "guest",
        value_parser = warren::config::parse_user_list
    )]
    loopback_users: warren::config::UserList,
    /// Start even if the store is damaged: copy it to <data-dir>/damaged-<unix time>/ first,
    /// keep what can be read, and log what was lost. Without it a damaged store stops the
    /// start with an error naming the damage.
    #[arg(
        long,
        env = "WARREN_RECOVER_DAMAGED",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    recover_damaged: bool,
    /// This node's id in a cluster (with --raft-listen and --peers); without it the broker
    /// runs alone, with no Raft.
    #[arg(long, env = "WARREN_NODE_ID", requires_all = ["raft_listen", "peers"])]
    node_id: Option<u64>,
    /// Where to accept Raft connections from the other nodes (HOST:PORT).
    #[arg(long, env = "WARREN_RAFT_LISTEN", requires = "node_id")]
    raft_listen: Option<SocketAddr>,
    /// Every initial voter's Raft address, this node's included: 1=HOST:PORT,2=HOST:PORT,...
    /// Nodes started with the same list form one cluster.
    #[arg(long, env = "WARREN_PEERS", requires = "node_id", value_parser = warren::config::parse_peers)]
    peers: Option<std::collections::BTreeMap<u64, String>>,
    /// What a follower does with AMQP clients: "proxy" them to the leader (the default) or
    /// "refuse" them with connection.close 320 naming the leader's address.
    #[arg(long, env = "WARREN_FOLLOWER_CLIENTS", default_value = "proxy")]
    follower_clients: warren::config::FollowerClients,
    /// The AMQP address other nodes hand clients to (default: --amqp-listen, with the Raft
    /// address's host when it listens on every interface).
    #[arg(long, env = "WARREN_ADVERTISE_AMQP")]
    advertise_amqp: Option<String>,
    /// The management address other nodes name for this one (default: as --advertise-amqp).
    #[arg(long, env = "WARREN_ADVERTISE_HTTP")]
    advertise_http: Option<String>,
    /// Raft log entries (each a batch of changes) between two snapshots of the state; the
    /// log before a snapshot is reclaimed but for a tenth of this.
    #[arg(long, env = "WARREN_RAFT_SNAPSHOT_EVERY", default_value_t = warren::cluster::SNAPSHOT_EVERY, value_parser = clap::value_parser!(u64).range(10..))]
    raft_snapshot_every: u64,
    /// The Raft heartbeat interval in ms: it must exceed the round trip between the nodes
    /// with a follower's fsync (openraft waits that long for an append), and elections start
    /// 3 to 6 intervals after the last heartbeat. 50 suits one machine or a LAN.
    #[arg(long, env = "WARREN_RAFT_HEARTBEAT_MS", default_value_t = warren::cluster::HEARTBEAT_MS, value_parser = clap::value_parser!(u64).range(10..=10_000))]
    raft_heartbeat_ms: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = {
        use clap::CommandFactory;
        let command = Cli::command();
        let server = command
            .find_subcommand("server")
            .ok_or_else(|| anyhow::anyhow!("no server command"))?;
        Cli::parse_from(config_file::expand(std::env::args_os().collect(), server)?)
    };
    warren::memory::set_meter(allocated);
    {
        use tracing_subscriber::prelude::*;
        tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .with_writer(std::io::stderr),
            )
            .with(EnvFilter::try_from_env("WARREN_LOG").unwrap_or_else(|_| EnvFilter::new("info")))
            .with(quiet_rpc_errors())
            .init();
    }
    if let Some(Command::Ctl(a)) = cli.command {
        return warren::ctl::run(a);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    match cli.command {
        Some(Command::Server(a)) => runtime.block_on(serve(*a)),
        Some(Command::Perf(a)) => runtime.block_on(warren_perf::run(a)).map(|_| ()),
        Some(Command::Ctl(_)) => Ok(()),
        None => runtime.block_on(serve(cli.server)),
    }
}

/// Leaves out openraft's ERROR for each failed RPC of a replication stream (the event at
/// `openraft::replication` with an `err` field): while a peer is down it comes every 100 ms or
/// so, for as long as the peer stays down, and a PayloadTooLarge (an expected retry with fewer
/// entries) is logged the same way. Warren's transport says instead, once, when a peer stops
/// answering and when it answers again (`cluster::net::Network::outage`). openraft's other
/// errors (storage, snapshots) stay.
fn quiet_rpc_errors() -> tracing_subscriber::filter::FilterFn {
    tracing_subscriber::filter::filter_fn(|m| {
        !(m.is_event()
            && *m.level() == tracing::Level::ERROR
            && m.target() == "openraft::replication"
            && m.fields().field("err").is_some())
    })
}

async fn serve(args: ServerArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.config {
        tracing::info!(file = %file.display(), "settings read from the config file");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data folder {}", args.data_dir.display()))?;
    let config = warren::Config {
        amqp_listen: args.amqp_listen,
        data_dir: args.data_dir,
        heartbeat: args.heartbeat,
        consumer_timeout: args
            .consumer_timeout_ms
            .map(std::time::Duration::from_millis),
        disk_free_limit: args.disk_free_limit,
        management_listen: match args.management_listen.as_str() {
            "none" | "" => None,
            a => Some(
                a.parse::<SocketAddr>()
                    .with_context(|| format!("--management-listen {a}"))?,
            ),
        },
        connection_max: args.connection_max,
        max_message_size: args.max_message_size,
        vm_memory_high_watermark: args.vm_memory_high_watermark,
        users: match (args.default_user, args.default_pass) {
            (Some(user), Some(pass)) => vec![(user, pass)],
            _ => warren::Config::default().users,
        },
        recover_damaged: args.recover_damaged,
        loopback_users: args.loopback_users.0,
        amqps_listen: warren::config::amqps_listen(
            args.amqps_listen.as_deref(),
            args.tls_cert.is_some() && args.tls_key.is_some(),
            args.amqp_listen,
        )
        .map_err(anyhow::Error::msg)?,
        management_tls: args.management_tls,
        tls: match (args.tls_cert, args.tls_key) {
            (Some(cert), Some(key)) => Some(warren::config::TlsConfig {
                cert,
                key,
                ca: args.tls_ca,
                verify_peer: args.tls_verify_peer,
                fail_if_no_peer_cert: args.tls_fail_if_no_peer_cert,
            }),
            _ => None,
        },
        load_definitions: match &args.load_definitions {
            None => None,
            Some(path) => {
                let text = std::fs::read(path)
                    .with_context(|| format!("--load-definitions {}", path.display()))?;
                match serde_json::from_slice::<serde_json::Value>(&text) {
                    Ok(serde_json::Value::Object(m)) => Some(std::sync::Arc::new(m)),
                    Ok(_) => {
                        anyhow::bail!("--load-definitions {}: not a JSON object", path.display())
                    }
                    Err(e) => anyhow::bail!("--load-definitions {}: {e}", path.display()),
                }
            }
        },
        cluster: match (args.node_id, args.raft_listen, args.peers) {
            (Some(node_id), Some(raft_listen), Some(peers)) => {
                Some(warren::config::ClusterConfig {
                    node_id,
                    raft_listen,
                    peers,
                    follower_clients: args.follower_clients,
                    advertise_amqp: args.advertise_amqp,
                    advertise_http: args.advertise_http,
                    snapshot_every: args.raft_snapshot_every,
                    heartbeat_ms: args.raft_heartbeat_ms,
                })
            }
            _ => None,
        },
        ..Default::default()
    };
    let listener = warren::server::bind_dual(config.amqp_listen)
        .await
        .with_context(|| format!("binding {}", config.amqp_listen))?;
    warren::run(listener, config, shutdown_signal()).await
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("signal received");
}
