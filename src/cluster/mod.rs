//! The replicated cluster (issue 15): one Raft group (openraft) whose log is the op stream of
//! the broker's one apply.

pub mod types;
