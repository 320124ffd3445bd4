#![allow(clippy::unwrap_used)]
//! Integration tests: the real server over TCP, real lapin clients, raw frames for errors.
//! One binary for all (one link step instead of one per file).

mod common;

mod basic;
mod channel;
mod cluster;
mod cluster_faults;
mod confirm_tx;
mod connection;
mod crash;
mod damage;
mod descriptors;
mod diskfull;
mod durability;
mod errors;
mod exchange;
mod extensions;
mod fuzz;
mod hardening;
mod hostile;
mod paging;
mod perf;
mod queue;
mod replay;
mod routing;
mod tls;
