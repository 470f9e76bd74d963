//! Attention across instances (paper 000 sections 2.1, 3.2, 5.3): a **holder** serves partial
//! attention over the KV chunks it keeps in registered memory; a **requester** routes query
//! rows to it and merges the partials that come back (route), pulls a whole chunk into its
//! own paged pool and splices it to its positions (fetch), or pulls the selected rows of
//! several holders' chunks (gather, for sparse attention).
//!
//! Cut as quinn cuts QUIC: [`wire`] (the bytes of requests and replies) and [`session`] (the
//! rendezvous messages) are pure code with no engine, socket or clock; [`Holder`] and
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
pub mod session;
pub mod step;
pub mod wire;

pub use background::{BackgroundRequester, OwnedCall, OwnedSparse, Reply};
pub use chunks::{ChunkRows, HeldChunk, HeldChunks, Placement};
pub use error::{RemoteError, RouteError};
pub use holder::{Holder, HolderConfig};
pub use requester::{
    Call, CodecTimes, DirectorySync, Fetched, GatherPart, Gathered, Requester, RequesterConfig,
    Routed, Sparse, StagedCall, StagedRoute, UNREACHABLE_FIRST_WAIT, UNREACHABLE_LONGEST_WAIT,
};
pub use session::HolderStats;
