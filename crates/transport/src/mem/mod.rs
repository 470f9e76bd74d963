//! The `mem` domain: an in-process NIC for tests, benches and single-machine demos.
//!
//! A [`MemFabric`] is a switch; every [`MemDomain`] made from it is one NIC on it, and NICs of
//! one fabric can reach each other (engines in one process). It behaves like hardware where
//! the engine can tell: a write outside a registered region, or through an unknown or stale
//! rkey, is a remote access error at the sender and leaves the target untouched; an immediate
//! is delivered only after its data; a send with no receive buffer posted waits
//! (receiver-not-ready) instead of being dropped. A [`FaultPlan`] makes it delay, reorder or
//! fail deliveries from a seed, and [`MemFabric::disconnect`] makes a NIC disappear.

mod domain;
mod endpoint;
mod faults;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

pub use domain::{MemDomain, SEND_QUEUE_DEPTH};
use endpoint::Endpoint;
pub use faults::FaultPlan;

use crate::addr::{DomainAddr, NetAddr};
use crate::error::TransportError;

/// The provider name of `mem` addresses.
pub const PROVIDER: &str = "mem";

/// Fabric ids are unique per process, so an address never reaches a NIC of another fabric.
static NEXT_FABRIC: AtomicU64 = AtomicU64::new(1);

/// The switch shared by the NICs of one in-process fabric.
#[derive(Debug)]
pub(crate) struct FabricInner {
    id: u64,
    next_endpoint: AtomicU64,
    endpoints: RwLock<HashMap<u64, Arc<Endpoint>>>,
}

impl FabricInner {
    fn endpoint(&self, id: u64) -> Option<Arc<Endpoint>> {
        self.endpoints
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    fn remove(&self, id: u64) {
        self.endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }
}

/// An in-process fabric: make NICs with [`MemFabric::domain`].
#[derive(Debug, Clone)]
pub struct MemFabric {
    inner: Arc<FabricInner>,
}

impl Default for MemFabric {
    fn default() -> Self {
        Self::new()
    }
}

impl MemFabric {
    /// A fabric with no NICs yet.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(FabricInner {
                id: NEXT_FABRIC.fetch_add(1, Ordering::Relaxed),
                next_endpoint: AtomicU64::new(1),
                endpoints: RwLock::new(HashMap::new()),
            }),
        }
    }

    /// A new, well-behaved NIC on this fabric.
    pub fn domain(&self) -> MemDomain {
        self.domain_with(FaultPlan::NONE)
    }

    /// A new NIC whose outgoing writes follow `faults`.
    pub fn domain_with(&self, faults: FaultPlan) -> MemDomain {
        let id = self.inner.next_endpoint.fetch_add(1, Ordering::Relaxed);
        let endpoint = Arc::new(Endpoint::new(id));
        self.inner
            .endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, endpoint.clone());
        MemDomain::new(self.inner.clone(), endpoint, faults)
    }

    /// Makes the NIC at `nic` disappear: writes and sends to it fail with `PeerUnreachable`,
    /// its own posts fail, and its regions are gone. Returns whether it was on this fabric.
    pub fn disconnect(&self, nic: &DomainAddr) -> bool {
        let Ok((fabric, id)) = decode_addr(nic) else {
            return false;
        };
        if fabric != self.inner.id {
            return false;
        }
        match self.inner.endpoint(id) {
            Some(endpoint) => {
                endpoint.kill();
                self.inner.remove(id);
                true
            }
            None => false,
        }
    }

    /// Makes every NIC of a domain group disappear (a peer process dying).
    pub fn disconnect_peer(&self, peer: &NetAddr) -> usize {
        peer.nics.iter().filter(|n| self.disconnect(n)).count()
    }

    /// NICs currently on the fabric.
    pub fn len(&self) -> usize {
        self.inner
            .endpoints
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether the fabric has no NICs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn encode_addr(fabric: u64, endpoint: u64) -> DomainAddr {
    let mut bytes = Vec::with_capacity(16);
    bytes.extend_from_slice(&fabric.to_le_bytes());
    bytes.extend_from_slice(&endpoint.to_le_bytes());
    DomainAddr {
        provider: PROVIDER.to_owned(),
        bytes,
    }
}

fn decode_addr(addr: &DomainAddr) -> Result<(u64, u64), TransportError> {
    if addr.provider != PROVIDER {
        return Err(TransportError::ProviderMismatch {
            local: PROVIDER.to_owned(),
            remote: addr.provider.clone(),
        });
    }
    let word = |range: std::ops::Range<usize>| {
        addr.bytes
            .get(range)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| {
                TransportError::MalformedAddress(format!(
                    "{}-byte mem address, expected 16",
                    addr.bytes.len()
                ))
            })
    };
    if addr.bytes.len() != 16 {
        return Err(TransportError::MalformedAddress(format!(
            "{}-byte mem address, expected 16",
            addr.bytes.len()
        )));
    }
    Ok((word(0..8)?, word(8..16)?))
}

#[cfg(test)]
mod tests;
