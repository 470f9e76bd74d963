//! Registered memory: the local [`MrHandle`] used as a transfer source and the serializable
//! [`MrDesc`] a peer writes through. A descriptor carries the region's length so the sender
//! can check every range before posting; the target checks again, because a descriptor that
//! arrives from a peer may be forged.

use serde::{Deserialize, Serialize};

use crate::addr::{DomainAddr, NetAddr};
use crate::error::{Side, TransportError};

/// Where registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Device {
    /// Host memory.
    #[default]
    Host,
    /// Memory of a CUDA device (GPUDirect RDMA); not served by the `mem` domain.
    Cuda {
        /// The CUDA device ordinal.
        ordinal: u32,
    },
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// What peers may do to a registered region. Every region is the source or target of this
/// process's own writes, sends and receives; remote access is opt-in per region, so that a
/// descriptor that leaks or is forged cannot reach memory no peer should write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    /// Peers may write into the region (an inbox, a reply region, a pool that fetches land
    /// in). What [`crate::TransferEngine::reg_mr`] and `alloc_mr` register.
    #[default]
    RemoteWrite,
    /// Only this process reads and writes the region (a store served by writing from it, a
    /// staging buffer): a peer's write into it is refused by the target's NIC and lands
    /// nothing, whatever key it presents.
    Local,
}

/// One NIC's remote key for a region.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteKey {
    /// The NIC the key belongs to.
    pub nic: DomainAddr,
    /// The key a write through that NIC must present.
    pub rkey: u64,
}

/// What a peer needs to write into a registered region: its address, its length, and one
/// (NIC, rkey) pair per NIC of the owning domain group.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MrDesc {
    /// The region's base address as the owning domains address it.
    pub addr: u64,
    /// The region's length in bytes.
    pub len: u64,
    /// One key per NIC, NIC 0 first.
    pub rkeys: Vec<RemoteKey>,
}

impl MrDesc {
    /// The address of the domain group that owns the region.
    pub fn net_addr(&self) -> NetAddr {
        NetAddr {
            nics: self.rkeys.iter().map(|k| k.nic.clone()).collect(),
        }
    }
}

/// A registered region's identity inside one engine (slot and generation, so a handle that
/// outlives its registration is recognised as stale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct RegionKey {
    pub(crate) slot: u32,
    pub(crate) generation: u32,
}

/// The local handle of a registered region: the source of writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrHandle {
    pub(crate) engine: u64,
    pub(crate) group: u16,
    pub(crate) key: RegionKey,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl MrHandle {
    /// The region's length in bytes.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's local base address.
    pub const fn addr(&self) -> u64 {
        self.addr
    }
}

/// Checks that `[offset, offset + len)` lies inside a region of `region_len` bytes.
pub(crate) fn check_range(
    side: Side,
    region_len: u64,
    offset: u64,
    len: u64,
) -> Result<(), TransportError> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransportError::OutOfBounds {
            side,
            offset,
            len,
            region_len,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_must_fit_and_never_wrap() {
        assert!(check_range(Side::Source, 100, 0, 100).is_ok());
        assert!(check_range(Side::Source, 100, 100, 0).is_ok());
        assert!(check_range(Side::Source, 100, 1, 100).is_err());
        assert!(
            check_range(Side::Destination, 100, u64::MAX, 2).is_err(),
            "overflow is out of bounds"
        );
    }
}
