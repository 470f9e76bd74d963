//! Addresses a peer needs: [`DomainAddr`] names one NIC, [`NetAddr`] a domain group (one device
//! and its 1-4 NICs). Both are serde types exchanged out of band; both are untrusted when they
//! arrive, so [`NetAddr::validate`] checks them before use.

use serde::{Deserialize, Serialize};

use crate::error::TransportError;

/// Most NICs one device may be served by (paper 002 section 3.1: up to four EFA NICs).
pub const MAX_NICS: usize = 4;

/// The address of one NIC (one domain), opaque to everything but its provider.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DomainAddr {
    /// The provider that understands `bytes` (`mem`, `fabric:efa`, `verbs`, ...).
    pub provider: String,
    /// Provider-specific address bytes.
    pub bytes: Vec<u8>,
}

/// The address of a domain group: one [`DomainAddr`] per NIC, NIC 0 first.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NetAddr {
    /// The NICs, in the order writes are sharded over them.
    pub nics: Vec<DomainAddr>,
}

impl NetAddr {
    /// Checks an address from a peer: 1 to [`MAX_NICS`] NICs, all of one provider.
    pub fn validate(&self) -> Result<(), TransportError> {
        if self.nics.is_empty() || self.nics.len() > MAX_NICS {
            return Err(TransportError::MalformedAddress(format!(
                "{} NICs; an address names 1 to {MAX_NICS}",
                self.nics.len()
            )));
        }
        let provider = &self.nics[0].provider;
        if self.nics.iter().any(|n| &n.provider != provider) {
            return Err(TransportError::MalformedAddress(
                "NICs of different providers".to_owned(),
            ));
        }
        Ok(())
    }

    /// The provider of the group's NICs.
    pub fn provider(&self) -> &str {
        self.nics.first().map_or("", |n| n.provider.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic(provider: &str, b: u8) -> DomainAddr {
        DomainAddr {
            provider: provider.to_owned(),
            bytes: vec![b],
        }
    }

    #[test]
    fn addresses_need_one_to_four_nics_of_one_provider() {
        assert!(
            NetAddr {
                nics: vec![nic("mem", 1)]
            }
            .validate()
            .is_ok()
        );
        assert!(NetAddr { nics: vec![] }.validate().is_err());
        assert!(
            NetAddr {
                nics: (0..5).map(|i| nic("mem", i)).collect()
            }
            .validate()
            .is_err()
        );
        assert!(
            NetAddr {
                nics: vec![nic("mem", 1), nic("verbs", 2)]
            }
            .validate()
            .is_err()
        );
    }
}
