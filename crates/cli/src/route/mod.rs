//! Route and fetch across instances (issue 6; paper 000 sections 2.1, 3.2, 5.3): the wire
//! format, the rendezvous, the holder and the requester.

pub mod holder;
pub mod requester;
pub mod session;
pub mod wire;

pub use holder::{Holder, HolderConfig};
pub use requester::{
    Call, Fetched, GatherPart, Gathered, Requester, RequesterConfig, RouteError, Routed, Sparse,
    StagedCall, StagedRoute,
};
