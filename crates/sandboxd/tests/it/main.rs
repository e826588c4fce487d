//! sandboxd's integration tests, in one test binary (one compile of the fixture, one link):
//! the fixture in `common`, one module per area. Each test starts its own node (its own data
//! directory and cgroup folder), so tests of any modules may run at the same time.

mod common;

mod agent;
mod bad_input;
mod cleanup;
mod cli;
mod commands;
mod disk;
mod e2b;
mod edge;
mod egress;
mod files;
mod functions;
mod hardening;
mod iii;
mod images;
mod isolation;
mod moves;
mod net_limits;
mod network;
mod node_limits;
mod preview;
mod ready;
mod restart;
mod runtime;
mod runtime_settings;
mod sandboxes;
mod seccomp;
mod secrets;
mod semantics;
mod sleep;
mod store;
mod takeover;
mod terminal;
mod timeouts;
mod volumes;
