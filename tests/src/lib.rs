//! Cross-crate integration tests of the kvroute workspace live in `tests/`; this library holds
//! their harness:
//!
//! - [`peer`]: a transfer engine in another process (the `fabric-peer` binary), driven over
//!   stdin/stdout, so tests run engines as separate processes that exchange their addresses and
//!   descriptors out of band, as deployments do;
//! - [`netns`]: two hosts on one machine (network namespaces joined by a veth pair);
//! - [`tree`]: the workspace's own files, for tests that read the tree.

pub mod netns;
pub mod peer;
pub mod tree;
pub mod watchdog;
