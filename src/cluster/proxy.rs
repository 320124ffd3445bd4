//! A follower hands AMQP clients to the leader: bytes are copied both ways between the client
//! and the leader's AMQP port, so any client library works unchanged. When the leader changes,
//! the copy ends and the client reconnects: the old leader closes its connections when it
//! learns it was deposed, and this node cuts the copy as soon as it learns of another leader
//! (or of an election), since a leader that is frozen or cut off from the majority learns
//! nothing until it comes back, and its clients would wait on it until then.

use super::Replication;
use crate::node::Shared;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tracing::{debug, info};

/// How long a client waits for a leader to be known (an election under way) before it is
/// served here after all (this node may be the one elected) or refused.
const FIND_LEADER: Duration = Duration::from_secs(5);

/// How long one connection attempt to the leader's AMQP port may take.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);

pub async fn serve(
    mut client: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    rep: Arc<Replication>,
    stop: watch::Receiver<bool>,
) {
    // During an election the membership still names the old leader, whose port refuses:
    // keep looking (bounded) rather than refusing the client at once.
    let deadline = tokio::time::Instant::now() + FIND_LEADER;
    let (id, info, mut upstream) = loop {
        if rep.is_leader() {
            // Elected meanwhile: serve the client here.
            return crate::conn::serve(client, peer, shared, stop).await;
        }
        if let Some((id, info)) = rep.live_leader_info().filter(|(_, i)| !i.amqp.is_empty()) {
            // Bounded by itself too: an address that drops SYNs (a firewall, a host gone)
            // would otherwise hold the client for the kernel's connect timeout (two minutes),
            // and the loop would not see a new leader meanwhile.
            let attempt = deadline.min(tokio::time::Instant::now() + CONNECT_ATTEMPT);
            match tokio::time::timeout_at(attempt, TcpStream::connect(&info.amqp)).await {
                Ok(Ok(s)) => break (id, info, s),
                Ok(Err(e)) => {
                    debug!(leader = id, addr = %info.amqp, error = %e, "the leader's AMQP port is unreachable")
                }
                Err(_) => {
                    debug!(leader = id, addr = %info.amqp, "the leader's AMQP port does not answer")
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            info!("no reachable leader: the client is refused");
            // The normal connection path refuses it with 320 and the reason.
            return crate::conn::serve(client, peer, shared, stop).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = upstream.set_nodelay(true);
    debug!(leader = id, addr = %info.amqp, "proxying a client to the leader");
    let mut stop = stop;
    tokio::select! {
        r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
            debug!(result = ?r, "proxied connection ended");
        }
        _ = leader_changed(&rep, id) => {
            info!(leader = id, "the leader changed: a proxied client is disconnected to reconnect");
        }
        _ = stop.changed() => {}
    }
}

/// Resolves once this node's Raft no longer names `id` as the leader (another leader, or an
/// election under way); never if Raft is not running. (The server metrics change only with
/// the vote, role, leader or membership, not with every entry as the full metrics do: a task
/// per proxied client wakes only for those.)
async fn leader_changed(rep: &Replication, id: u64) {
    let Some(raft) = rep.raft.get() else {
        return std::future::pending().await;
    };
    let mut metrics = raft.server_metrics();
    loop {
        if metrics.borrow_and_update().current_leader != Some(id) {
            return;
        }
        if metrics.changed().await.is_err() {
            // Raft stopped (the node is shutting down or was removed): the stop signal or the
            // copy ends the connection.
            return std::future::pending().await;
        }
    }
}
