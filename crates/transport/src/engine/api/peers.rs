//! Peers through the engine: connecting, disconnecting and adopting senders, resolving a
//! request's peer on every NIC, and peer groups.

use std::sync::Arc;

use crate::addr::NetAddr;
use crate::engine::TransferEngine;
use crate::engine::message::{Command, RemoteTarget};
use crate::engine::shared::{GroupShared, PeerEntry, PeerGroupEntry};
use crate::error::TransportError;
use crate::mr::MrDesc;

use super::{PeerGroupHandle, remote_target};

impl TransferEngine {
    /// Releases the peer engine at `addr`: every NIC forgets it (address-vector entries, a
    /// transmit endpoint of its own, a provider's mapping of its memory), so a long-running
    /// engine that many peers came and went to holds only what its current peers need. What
    /// this engine still had queued or in flight to it fails
    /// ([`crate::TransferError::PeerUnreachable`]). A later transfer to the address connects
    /// it afresh. Returns whether such a peer was connected.
    pub fn disconnect(&self, addr: &NetAddr) -> Result<bool, TransportError> {
        let mut released = false;
        for group in &self.inner.groups {
            released |= self.command(group, |reply| Command::Disconnect {
                addr: addr.clone(),
                reply,
            })??;
        }
        Ok(released)
    }

    /// Connects the peer at `addr` now (transfers connect the peers they name lazily): what a
    /// server does before it can know a message's sender
    /// ([`TransferEngine::submit_recvs_from`]). Idempotent.
    pub fn connect(&self, addr: &NetAddr) -> Result<(), TransportError> {
        self.peer(self.main_group(), addr).map(|_| ())
    }

    /// The address this engine's operations to the peer at `addr` leave from, when that is
    /// not [`TransferEngine::main_address`]: over `shm` each peer gets a transmit endpoint of
    /// its own, and the peer maps it when it first receives from it. Connects the peer (main
    /// group) if it is not yet. A receiver that keeps its senders mapped (`shm`) needs this
    /// name to forget them: tell it to the peer, which passes it to
    /// [`TransferEngine::adopt_sender`]. `None` when operations leave from the main address.
    pub fn sender_address(&self, addr: &NetAddr) -> Result<Option<NetAddr>, TransportError> {
        self.command(self.main_group(), |reply| Command::SenderAddress {
            addr: addr.clone(),
            reply,
        })?
    }

    /// Records that the peer at `addr` sends to this engine's main group from `sender` (its
    /// [`TransferEngine::sender_address`] for this engine), so that
    /// [`TransferEngine::disconnect`] releases what the provider holds for that sender too,
    /// once the sender can no longer send (`shm` keeps every endpoint that ever sent to it
    /// mapped, in a table of 256). Connects the peer if it is not yet. A `sender` of another
    /// process than the peer's, or more than 4 of them, is refused; providers that keep
    /// nothing per sender accept it and do nothing.
    pub fn adopt_sender(&self, addr: &NetAddr, sender: &NetAddr) -> Result<(), TransportError> {
        self.command(self.main_group(), |reply| Command::AdoptSender {
            addr: addr.clone(),
            sender: sender.clone(),
            reply,
        })?
    }

    pub(super) fn peer(
        &self,
        group: &GroupShared,
        addr: &NetAddr,
    ) -> Result<Arc<PeerEntry>, TransportError> {
        let nic0 = addr
            .nics
            .first()
            .ok_or_else(|| TransportError::MalformedAddress("no NICs".to_owned()))?;
        match group.directory.peer(nic0) {
            Some(entry) if entry.addr == *addr => Ok(entry),
            Some(_) => Err(TransportError::MalformedAddress(
                "NIC 0 is known as part of another peer".to_owned(),
            )),
            None => self.command(group, |reply| Command::Connect {
                addr: addr.clone(),
                reply,
            })?,
        }
    }

    /// Checks a descriptor's NICs against `entry` (if given) or resolves them, and returns
    /// the target with one rkey per NIC.
    pub(super) fn target(
        &self,
        group: &GroupShared,
        desc: &MrDesc,
        entry: Option<&PeerEntry>,
    ) -> Result<RemoteTarget, TransportError> {
        if desc.rkeys.len() != group.nics() {
            return Err(TransportError::NicCountMismatch {
                local: group.nics(),
                remote: desc.rkeys.len(),
            });
        }
        if let Some(entry) = entry {
            return remote_target(desc, entry);
        }
        // Most writes go to the peer of the one before: one comparison per NIC settles it.
        if let Some(target) = group.directory.last_peer(|e| remote_target(desc, e).ok()) {
            return Ok(target);
        }
        let provider = &desc.rkeys[0].nic.provider;
        if *provider != group.provider {
            return Err(TransportError::ProviderMismatch {
                local: group.provider.clone(),
                remote: provider.clone(),
            });
        }
        let entry = match group.directory.find_peer(&desc.rkeys[0].nic) {
            Some(e) => e,
            None => self.peer(group, &desc.net_addr())?,
        };
        remote_target(desc, &entry)
    }

    /// Connects to every peer of `addrs` (all through the main group) and registers them as a
    /// group for low-latency scatter and barrier.
    pub fn add_peer_group(&self, addrs: &[NetAddr]) -> Result<PeerGroupHandle, TransportError> {
        if addrs.is_empty() {
            return Err(TransportError::InvalidArgument(
                "a peer group needs members",
            ));
        }
        let group = self.main_group();
        let members = addrs
            .iter()
            .map(|a| self.peer(group, a))
            .collect::<Result<Vec<_>, _>>()?;
        let mut groups = self
            .inner
            .peer_groups
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        groups.push(PeerGroupEntry {
            group: group.index,
            members,
        });
        tracing::debug!(peers = addrs.len(), "added a peer group");
        Ok(PeerGroupHandle(groups.len() as u32 - 1))
    }

    /// Resolves scatter/barrier destinations, through the peer group if one is given.
    /// Resolves scatter/barrier destinations (through the peer group if one is given) and
    /// builds one `T` per destination with `build(index, target)`, in one allocation.
    pub(super) fn targets<'a, T>(
        &self,
        group: &GroupShared,
        peers: Option<PeerGroupHandle>,
        descs: impl ExactSizeIterator<Item = &'a MrDesc>,
        build: impl Fn(usize, RemoteTarget) -> T,
    ) -> Result<Vec<T>, TransportError> {
        let Some(PeerGroupHandle(h)) = peers else {
            return descs
                .enumerate()
                .map(|(i, d)| Ok(build(i, self.target(group, d, None)?)))
                .collect();
        };
        let groups = self
            .inner
            .peer_groups
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = groups
            .get(h as usize)
            .filter(|e| e.group == group.index)
            .ok_or(TransportError::UnknownPeerGroup)?;
        if descs.len() != entry.members.len() {
            return Err(TransportError::PeerGroupSizeMismatch {
                given: descs.len(),
                group: entry.members.len(),
            });
        }
        descs
            .zip(&entry.members)
            .enumerate()
            .map(
                |(index, (d, member))| match self.target(group, d, Some(member)) {
                    Ok(target) => Ok(build(index, target)),
                    Err(TransportError::MalformedAddress(_)) => {
                        Err(TransportError::NotInPeerGroup { index })
                    }
                    Err(other) => Err(other),
                },
            )
            .collect()
    }
}
