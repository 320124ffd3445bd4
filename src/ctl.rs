//! `warren ctl`: the operator's command line, a client of a node's management API.
//!
//! `warren ctl cluster status` prints what `GET /api/cluster` says; `cluster add` and
//! `cluster remove` change the Raft membership through the leader (found from any node's
//! status, so any node's address will do).

use anyhow::{bail, Context};
use serde_json::Value;

#[derive(clap::Args, Debug)]
pub struct CtlArgs {
    /// A node's management API.
    #[arg(long, env = "WARREN_CTL_URL", default_value = "http://127.0.0.1:15672")]
    pub url: String,
    #[arg(long, env = "WARREN_CTL_USER", default_value = "guest")]
    pub user: String,
    #[arg(
        long,
        env = "WARREN_CTL_PASSWORD",
        default_value = "guest",
        hide_env_values = true
    )]
    pub password: String,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum CtlCommand {
    /// The replicated cluster.
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// Each node, its role, the term, the leader, commit and applied indexes, followers' lag.
    Status {
        /// Print the JSON the API answers instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Add a node (started with --node-id ID and the cluster's --peers): first as a learner
    /// that receives the log, then as a voter.
    Add {
        id: u64,
        /// The new node's Raft address (its --raft-listen), HOST:PORT.
        raft: String,
        /// Keep it a learner (it replicates but does not vote).
        #[arg(long)]
        learner: bool,
    },
    /// Remove a node from the membership.
    Remove { id: u64 },
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(120)))
        .build()
        .into()
}

fn auth(a: &CtlArgs) -> String {
    use base64::Engine;
    let token =
        base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", a.user, a.password));
    format!("Basic {token}")
}

fn status(agent: &ureq::Agent, url: &str) -> anyhow::Result<Value> {
    let mut r = agent
        .get(&format!("{}/api/cluster", url.trim_end_matches('/')))
        .call()
        .with_context(|| format!("asking {url} for the cluster's status"))?;
    let body = r.body_mut().read_to_string()?;
    if !r.status().is_success() {
        bail!("{url} answered {}: {body}", r.status());
    }
    serde_json::from_str(&body).with_context(|| format!("{url} answered: {body}"))
}

/// The leader's management URL, from `url`'s view of the cluster.
fn leader_url(agent: &ureq::Agent, url: &str) -> anyhow::Result<String> {
    let s = status(agent, url)?;
    let leader = s["leader_id"]
        .as_u64()
        .context("no leader is known now (an election may be under way); try again")?;
    let http = s["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["id"].as_u64() == Some(leader))
        .and_then(|n| n["http"].as_str())
        .filter(|h| !h.is_empty())
        .context("the leader's management address is not known yet; try again")?;
    Ok(format!("http://{http}"))
}

pub fn run(a: CtlArgs) -> anyhow::Result<()> {
    let agent = agent();
    match &a.command {
        CtlCommand::Cluster(ClusterCommand::Status { json }) => {
            let s = status(&agent, &a.url)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&s)?);
                return Ok(());
            }
            print!("{}", render(&s));
        }
        CtlCommand::Cluster(ClusterCommand::Add { id, raft, learner }) => {
            let leader = leader_url(&agent, &a.url)?;
            let body = serde_json::json!({"id": id, "raft": raft, "voter": !learner});
            let mut r = agent
                .post(&format!("{leader}/api/cluster/nodes"))
                .header("Authorization", &auth(&a))
                .header("Content-Type", "application/json")
                .send(body.to_string())
                .with_context(|| format!("asking the leader at {leader}"))?;
            let text = r.body_mut().read_to_string()?;
            if !r.status().is_success() {
                bail!("the leader refused: {} {text}", r.status());
            }
            println!(
                "node {id} added as a {}",
                if *learner { "learner" } else { "voter" }
            );
        }
        CtlCommand::Cluster(ClusterCommand::Remove { id }) => {
            let leader = leader_url(&agent, &a.url)?;
            let mut r = agent
                .delete(&format!("{leader}/api/cluster/nodes/{id}"))
                .header("Authorization", &auth(&a))
                .call()
                .with_context(|| format!("asking the leader at {leader}"))?;
            let text = r.body_mut().read_to_string()?;
            if !r.status().is_success() {
                bail!("the leader refused: {} {text}", r.status());
            }
            println!("node {id} removed");
        }
    }
    Ok(())
}

/// The status as a table.
pub fn render(s: &Value) -> String {
    let opt = |v: &Value| {
        v.as_u64()
            .map(|n| n.to_string())
            .unwrap_or_else(|| "-".into())
    };
    if s["role"] == "single" {
        return "a single node (no cluster settings)\n".into();
    }
    let mut out = format!(
        "node {} is {} (term {}, leader {}, commit index {}, applied index {})\n",
        opt(&s["node_id"]),
        s["role"].as_str().unwrap_or("?"),
        opt(&s["term"]),
        opt(&s["leader_id"]),
        opt(&s["commit_index"]),
        opt(&s["applied_index"]),
    );
    if let Some(why) = s["joining"].as_str() {
        out.push_str(&format!("not taking part yet: {why}\n"));
    }
    out.push_str(&format!(
        "{:<4} {:<8} {:<22} {:<22} {:<22} {:>8} {:>6}\n",
        "id", "member", "raft", "amqp", "http", "matched", "lag"
    ));
    for n in s["nodes"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<4} {:<8} {:<22} {:<22} {:<22} {:>8} {:>6}\n",
            opt(&n["id"]),
            n["membership"].as_str().unwrap_or("?"),
            n["raft"].as_str().unwrap_or(""),
            n["amqp"].as_str().unwrap_or(""),
            n["http"].as_str().unwrap_or(""),
            opt(&n["matched_index"]),
            opt(&n["lag"]),
        ));
    }
    out
}
