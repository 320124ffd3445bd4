//! What a node says of the cluster (`GET /api/cluster`, `GET /api/nodes`, connection.start's
//! server properties, `warren ctl cluster status`): one struct built from openraft's metrics
//! and the log store's commit counter.

use super::types::NodeId;
use super::Replication;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub node_id: NodeId,
    /// leader, follower, candidate, learner, or stopped.
    pub role: String,
    pub term: u64,
    pub leader_id: Option<NodeId>,
    /// Whether this node serves clients (the leader, once its term's first entry is applied).
    pub serving: bool,
    pub commit_index: Option<u64>,
    pub applied_index: Option<u64>,
    pub last_log_index: Option<u64>,
    /// The last entry in this node's latest snapshot, and the last entry purged from its log.
    pub snapshot_index: Option<u64>,
    pub purged_index: Option<u64>,
    /// Milliseconds since a majority last acknowledged this leader (leader only).
    pub millis_since_quorum_ack: Option<u64>,
    /// While this node, whose Raft log is new, takes no part yet: what it waits for (a
    /// majority of its peers to form the cluster, or enough voters to answer that it may
    /// join). Absent once it takes part.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub joining: Option<String>,
    pub nodes: Vec<NodeStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeStatus {
    pub id: NodeId,
    pub raft: String,
    pub amqp: String,
    pub http: String,
    /// voter or learner.
    pub membership: String,
    /// See `NodeInfo::incarnation` (0 until the node has announced itself).
    pub incarnation: u64,
    /// On the leader: the last index known to be replicated to that node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched_index: Option<u64>,
    /// On the leader: how many entries that node is behind the leader's log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lag: Option<u64>,
}

/// The node's view of the cluster now (None before Raft runs).
pub fn status(rep: &Replication) -> Option<ClusterStatus> {
    let raft = rep.raft.get()?;
    let m = raft.metrics().borrow().clone();
    let role = match m.state {
        openraft::ServerState::Leader => "leader",
        openraft::ServerState::Follower => "follower",
        openraft::ServerState::Candidate => "candidate",
        openraft::ServerState::Learner => "learner",
        openraft::ServerState::Shutdown => "stopped",
    };
    let membership = m.membership_config.membership();
    let voters: std::collections::BTreeSet<NodeId> = membership.voter_ids().collect();
    let nodes = membership
        .nodes()
        .map(|(id, info)| {
            let matched = m
                .replication
                .as_ref()
                .map(|r| r.get(id).copied().flatten().map(|l| l.index))
                .map(|mi| if *id == rep.me { m.last_log_index } else { mi });
            NodeStatus {
                id: *id,
                raft: info.raft.clone(),
                amqp: info.amqp.clone(),
                http: info.http.clone(),
                membership: if voters.contains(id) {
                    "voter"
                } else {
                    "learner"
                }
                .into(),
                incarnation: info.incarnation,
                matched_index: matched.flatten(),
                lag: matched.map(|mi| {
                    m.last_log_index
                        .unwrap_or(0)
                        .saturating_sub(mi.unwrap_or(0))
                }),
            }
        })
        .collect();
    Some(ClusterStatus {
        node_id: rep.me,
        role: role.into(),
        term: m.current_term,
        // A node whose Raft stopped (its store failed) keeps the leader it last knew in its
        // metrics, itself included: it knows none now, and naming one would send clients and
        // scripts to a node it cannot vouch for.
        leader_id: if m.state == openraft::ServerState::Shutdown {
            None
        } else {
            m.current_leader
        },
        serving: rep.is_leader(),
        commit_index: rep.log.get().and_then(|l| l.committed_index()),
        applied_index: m.last_applied.map(|l| l.index),
        last_log_index: m.last_log_index,
        snapshot_index: m.snapshot.map(|l| l.index),
        purged_index: m.purged.map(|l| l.index),
        millis_since_quorum_ack: m.millis_since_quorum_ack,
        joining: rep.joining.lock().clone(),
        nodes,
    })
}
