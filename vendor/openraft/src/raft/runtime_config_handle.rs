//! RuntimeConfigHandle is an interface to change Raft runtime config.

use std::sync::atomic::Ordering;

use crate::raft::RaftInner;
use crate::RaftTypeConfig;

/// RuntimeConfigHandle is an interface to update runtime config.
///
/// These config are mainly designed for testing purpose and special use cases.
/// Usually you don't need to change runtime config.
pub struct RuntimeConfigHandle<'r, C>
where C: RaftTypeConfig
{
    raft_inner: &'r RaftInner<C>,
}

impl<'r, C> RuntimeConfigHandle<'r, C>
where C: RaftTypeConfig
{
    pub(in crate::raft) fn new(raft_inner: &'r RaftInner<C>) -> Self {
        Self { raft_inner }
    }

    /// Enable or disable raft internal ticker.
    ///
    /// Disabling tick will disable election and heartbeat.
    pub fn tick(&self, enabled: bool) {
        self.raft_inner.tick_handle.enable(enabled);
    }

    /// Enable or disable heartbeat message when a leader has no more log to replicate.
    ///
    /// Note that the follower's leader-lease will not be renewed if it does receive message from
    /// the leader, and it will start election(if `Self::elect()` is enabled) when the lease timed
    /// out.
    pub fn heartbeat(&self, enabled: bool) {
        self.raft_inner.runtime_config.enable_heartbeat.store(enabled, Ordering::Relaxed);
    }

    /// Enable or disable election for a follower when its leader lease timed out.
    pub fn elect(&self, enabled: bool) {
        let rc = &self.raft_inner.runtime_config;
        *rc.elect_until.lock().unwrap_or_else(|e| e.into_inner()) = None;
        rc.enable_elect.store(enabled, Ordering::Relaxed);
    }

    /// Warren's patch: enable election for a follower whose leader lease timed out, until
    /// `deadline` only. A tick after it does not start an election (until this or `elect` is
    /// called again): a permission given on what the node knew then does not outlive a freeze
    /// of the process (SIGSTOP, a paused VM) that came right after it.
    pub fn elect_until(&self, deadline: std::time::Instant) {
        let rc = &self.raft_inner.runtime_config;
        *rc.elect_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(deadline);
        rc.enable_elect.store(true, Ordering::Relaxed);
    }
}
