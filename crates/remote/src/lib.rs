//! Attention across instances (paper 000 sections 2.1, 3.2, 5.3): a **holder** serves partial
//! attention over the KV chunks it keeps in registered memory; a **requester** routes query
//! rows to it and merges the partials that come back (route), pulls a whole chunk into its
//! own paged pool and splices it to its positions (fetch), or pulls the selected rows of
//! several holders' chunks (gather, for sparse attention).
//!
//! Cut as quinn cuts QUIC: `wire` (the bytes of requests and replies) and `session` (the
//! rendezvous messages) are pure code with no engine, socket or clock, public only with the
//! `testing` feature (for the fuzz targets and the tests that play forged peers); [`Holder`] and
//! [`Requester`] drive them over [`kvroute_transport`]; [`dispatch`] runs a decode step over
//! every chunk with replica fallback, and [`probe`] measures the fabric constants the cost
//! model's route / fetch predicate needs.
//!
//! ```no_run
#![doc = include_str!("../examples/route_step.rs")]
//! ```
//!
//! Everything a peer sends is untrusted: requests, replies and rendezvous lines are parsed
//! into typed values or refused with a status or a [`RemoteError`], never a panic; a held
//! region must be registered local only, so no peer write can land in the KV.

// Registered memory is reached only through the transport's safe types: held chunks sealed
// (`SealedBuffer`), the fetch pool written by peers through grants alone (`GrantedBuffer`),
// staging lent out only while no write reads it (`Staging`), and what peers write copied
// out before it is checked.
#![forbid(unsafe_code)]

mod background;
pub mod checked;
mod chunks;
mod control;
pub mod dispatch;
mod error;
mod holder;
pub mod kernel_rate;
#[cfg(feature = "measure")]
pub mod measure;
pub mod observe;
pub mod probe;
mod requester;
// Internals a user never needs; the fuzz targets and the forged-peer tests reach them through
// the `testing` feature. Without it, what only those use is unused here, and their `pub`
// items are reachable only through the re-exports below.
#[cfg(feature = "testing")]
pub mod session;
#[cfg(not(feature = "testing"))]
#[allow(dead_code, unreachable_pub)]
mod session;
pub mod step;
#[cfg(feature = "testing")]
pub mod wire;
#[cfg(not(feature = "testing"))]
#[allow(dead_code, unreachable_pub)]
mod wire;

pub use background::{BackgroundRequester, OwnedCall, OwnedSparse, Reply};
pub use chunks::{ChunkRows, HeldChunk, HeldChunks, Placement};
pub use error::{RemoteError, RouteError};
pub use holder::{Holder, HolderConfig};
pub use requester::{
    Call, CodecTimes, DirectorySync, Fetched, GatherPart, Gathered, Requester, RequesterConfig,
    Routed, Sparse, StagedCall, StagedRoute, UNREACHABLE_FIRST_WAIT, UNREACHABLE_LONGEST_WAIT,
};
pub use session::HolderStats;
pub use wire::{PING_HEADER, Pong, Status, reply_len, route_request_len};
