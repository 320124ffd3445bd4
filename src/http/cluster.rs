//! `GET /api/cluster`: this node's view of the replicated cluster (see `cluster::status`).

use super::Api;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub(super) async fn cluster(State(shared): Api) -> Response {
    match shared
        .replication
        .as_ref()
        .and_then(|r| crate::cluster::status::status(r))
    {
        Some(s) => Json(s).into_response(),
        None if shared.replication.is_some() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": "starting", "reason": "Raft is not running yet"})),
        )
            .into_response(),
        // A single node: a cluster of one, with no Raft.
        None => Json(serde_json::json!({
            "node_id": null,
            "role": "single",
            "term": 0,
            "leader_id": null,
            "serving": true,
            "commit_index": null,
            "applied_index": null,
            "nodes": [],
        }))
        .into_response(),
    }
}

/// `GET /api/nodes`: RabbitMQ's node list (name, type, running), each node with what this
/// node knows of it in the cluster: id, addresses, role, the term, the leader, and on the
/// leader its replication lag.
pub(super) async fn nodes(State(shared): Api) -> Response {
    let me = super::node_name();
    let Some(st) = shared
        .replication
        .as_ref()
        .and_then(|r| crate::cluster::status::status(r))
    else {
        return Json(serde_json::json!([{
            "name": me,
            "type": "disc",
            "running": true,
        }]))
        .into_response();
    };
    let list: Vec<serde_json::Value> = st
        .nodes
        .iter()
        .map(|n| {
            let role = if Some(n.id) == st.leader_id {
                "leader"
            } else if n.id == st.node_id {
                st.role.as_str()
            } else if n.membership == "learner" {
                "learner"
            } else {
                "follower"
            };
            serde_json::json!({
                "name": format!("warren@node{}", n.id),
                "type": "disc",
                // What this node can tell: itself, and on the leader every node it replicates
                // to with no lag beyond what is in flight.
                "running": n.id == st.node_id || n.matched_index.is_some() || Some(n.id) == st.leader_id,
                "node_id": n.id,
                "raft_address": n.raft,
                "amqp_address": n.amqp,
                "http_address": n.http,
                "role": role,
                "membership": n.membership,
                "term": st.term,
                "leader_id": st.leader_id,
                "commit_index": if n.id == st.node_id { st.commit_index } else { None },
                "applied_index": if n.id == st.node_id { st.applied_index } else { None },
                "matched_index": n.matched_index,
                "lag": n.lag,
            })
        })
        .collect();
    Json(list).into_response()
}

/// `POST /api/cluster/nodes` `{"id": 4, "raft": "HOST:PORT", "voter": true}` on the leader:
/// add the node as a learner (openraft replicates the log to it and waits until it has caught
/// up), then, unless `voter` is false, promote it to voter. Both are Raft membership changes.
pub(super) async fn add_node(
    State(shared): Api,
    axum::extract::Extension(super::Login(me)): axum::extract::Extension<super::Login>,
    body: axum::body::Bytes,
) -> Response {
    // Membership is an administrator's change, as every change of RabbitMQ's cluster is.
    if !super::users::is_administrator(&shared, &me) {
        return super::users::not_administrator();
    }
    let m = match super::json::body_object(&body) {
        Ok(m) => m,
        Err(reason) => return super::bad_request(&reason),
    };
    let Some(id) = m.get("id").and_then(|v| v.as_u64()).filter(|id| *id > 0) else {
        return super::bad_request("'id' must be a node id (a number from 1)");
    };
    let Some(raft_addr) = m.get("raft").and_then(|v| v.as_str()) else {
        return super::bad_request("'raft' must be the node's Raft address, HOST:PORT");
    };
    if raft_addr
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .is_none()
    {
        return super::bad_request("'raft' must be HOST:PORT");
    }
    let voter = match m.get("voter") {
        None => true,
        Some(v) => match v.as_bool() {
            Some(b) => b,
            None => return super::bad_request("'voter' must be true or false"),
        },
    };
    let Some(raft) = shared
        .replication
        .as_ref()
        .and_then(|r| r.raft.get().cloned())
    else {
        return super::bad_request("this node runs without a cluster (start it with --node-id)");
    };
    // A grown single node's log lacks its data until its first snapshot: a node added now
    // would get the log without the data.
    if shared
        .replication
        .as_ref()
        .is_some_and(|r| r.grow_pending.load(std::sync::atomic::Ordering::Acquire))
    {
        return change_failed(
            "this node grew from a single node and its data is not yet in its first snapshot \
             (made once it leads): try again in a moment",
        );
    }
    let info = crate::cluster::types::NodeInfo {
        raft: raft_addr.to_string(),
        ..Default::default()
    };
    // Blocking: until the learner has the log (a learner that cannot be reached keeps this
    // request waiting; the client's timeout ends it, the learner stays listed).
    if let Err(e) = raft.add_learner(id, info, true).await {
        return change_failed(&format!("adding node {id} as a learner: {e}"));
    }
    if voter {
        if let Err(e) =
            change_membership(&raft, openraft::ChangeMembers::AddVoterIds([id].into())).await
        {
            return change_failed(&format!("making node {id} a voter: {e}"));
        }
    }
    tracing::info!(
        node = id,
        raft = raft_addr,
        voter,
        "node added to the cluster"
    );
    (StatusCode::CREATED, cluster(State(shared)).await).into_response()
}

/// `DELETE /api/cluster/nodes/{id}` on the leader: remove the node from the membership (it
/// stops replicating; a removed node notices and stops its Raft).
pub(super) async fn remove_node(
    State(shared): Api,
    axum::extract::Extension(super::Login(me)): axum::extract::Extension<super::Login>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if !super::users::is_administrator(&shared, &me) {
        return super::users::not_administrator();
    }
    let Ok(id) = id.parse::<u64>() else {
        return super::bad_request("the node id must be a number");
    };
    let Some(raft) = shared
        .replication
        .as_ref()
        .and_then(|r| r.raft.get().cloned())
    else {
        return super::bad_request("this node runs without a cluster (start it with --node-id)");
    };
    let members = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .clone();
    if members.get_node(&id).is_none() {
        return super::not_found();
    }
    let change = if members.voter_ids().any(|v| v == id) {
        openraft::ChangeMembers::RemoveVoters([id].into())
    } else {
        openraft::ChangeMembers::RemoveNodes([id].into())
    };
    if let Err(e) = change_membership(&raft, change).await {
        return change_failed(&format!("removing node {id}: {e}"));
    }
    tracing::info!(node = id, "node removed from the cluster");
    StatusCode::NO_CONTENT.into_response()
}

fn change_failed(reason: &str) -> Response {
    (
        StatusCode::CONFLICT,
        Json(serde_json::json!({"error": "membership_change_failed", "reason": reason})),
    )
        .into_response()
}

/// A membership change, retried for a while when another one is under way (the leader
/// publishes nodes' addresses as changes of its own).
async fn change_membership(
    raft: &crate::cluster::types::Raft,
    change: openraft::ChangeMembers<u64, crate::cluster::types::NodeInfo>,
) -> Result<(), String> {
    use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match raft.change_membership(change.clone(), false).await {
            Ok(_) => return Ok(()),
            Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(
                ChangeMembershipError::InProgress(_),
            ))) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}
