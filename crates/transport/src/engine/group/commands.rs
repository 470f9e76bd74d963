//! The commands a worker runs on its group for the engine: registering and deregistering
//! regions on every NIC, connecting and disconnecting peers, naming and adopting senders,
//! installing the receive pool.

use std::sync::Arc;

use crate::addr::MAX_NICS;
use crate::domain::Domain;
use crate::engine::message::Command;
use crate::engine::shared::{PeerEntry, RegionEntry};
use crate::engine::stats;
use crate::error::TransportError;
use crate::mr::{Access, Device, MrDesc, MrHandle, RegionKey, RemoteKey};
use crate::recv_pool::RecvPool;

use super::{Group, RELEASED, RecvState};

impl<D: Domain> Group<D> {
    pub(crate) fn command(&mut self, command: Command) {
        // A reply whose requester has gone away (engine dropped mid-call) is moot.
        match command {
            Command::Register {
                addr,
                len,
                device,
                access,
                reply,
            } => {
                let _ = reply.send(self.register(addr, len, device, access));
            }
            Command::Deregister { key, reply } => {
                let _ = reply.send(self.deregister(key));
            }
            Command::Connect { addr, reply } => {
                let _ = reply.send(self.connect(&addr));
            }
            Command::Disconnect { addr, reply } => {
                let _ = reply.send(self.disconnect(&addr));
            }
            Command::SenderAddress { addr, reply } => {
                let _ = reply.send(self.sender_address(&addr));
            }
            Command::AdoptSender {
                addr,
                sender,
                reply,
            } => {
                let _ = reply.send(self.adopt_sender(&addr, &sender));
            }
            Command::InstallRecvPool {
                buf_len,
                count,
                reply,
            } => {
                let _ = reply.send(self.install_recv_pool(buf_len, count));
            }
            Command::Stop => {}
        }
    }

    fn register(
        &mut self,
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
    ) -> Result<(MrHandle, MrDesc), TransportError> {
        if !self.domains.iter().all(|d| d.supports(device)) {
            return Err(TransportError::UnsupportedDevice(device.to_string()));
        }
        let mut regs = Vec::with_capacity(self.domains.len());
        for d in self.domains.iter_mut() {
            // SAFETY: the caller of `reg_mr` promised the range stays valid until deregistered.
            match unsafe { d.register(addr, len, device, access) } {
                Ok(r) => regs.push(r),
                Err(e) => {
                    for (d, r) in self.domains.iter_mut().zip(&regs) {
                        let _ = d.deregister(r.lkey);
                    }
                    return Err(e);
                }
            }
        }
        if regs.iter().any(|r| r.remote_addr != regs[0].remote_addr) {
            for (d, r) in self.domains.iter_mut().zip(&regs) {
                let _ = d.deregister(r.lkey);
            }
            return Err(TransportError::Domain(
                "NICs of one group address memory differently".to_owned(),
            ));
        }
        let slot = self.free_regions.pop().unwrap_or_else(|| {
            self.regions.push(None);
            self.region_generations.push(0);
            (self.regions.len() - 1) as u32
        });
        let generation = self.region_generations[slot as usize].wrapping_add(1);
        self.region_generations[slot as usize] = generation;
        let mut lkeys = [0; MAX_NICS];
        for (k, r) in lkeys.iter_mut().zip(&regs) {
            *k = r.lkey;
        }
        let entry = RegionEntry {
            addr,
            len,
            lkeys,
            generation,
            device,
        };
        self.regions[slot as usize] = Some(entry);
        self.shared.directory.set_region(slot, Some(entry));
        stats::add(&self.shared.worker_written.registered_bytes, len);
        let desc = MrDesc {
            addr: regs[0].remote_addr,
            len,
            rkeys: self
                .domains
                .iter()
                .zip(&regs)
                .map(|(d, r)| RemoteKey {
                    nic: d.address(),
                    rkey: r.rkey,
                })
                .collect(),
        };
        let handle = MrHandle {
            engine: self.engine.id,
            group: self.shared.index,
            key: RegionKey { slot, generation },
            addr,
            len,
        };
        tracing::debug!(addr, len, %device, group = self.shared.index, "registered memory");
        Ok((handle, desc))
    }

    fn deregister(&mut self, key: RegionKey) -> Result<(), TransportError> {
        let entry = match self.regions.get(key.slot as usize) {
            Some(Some(e)) if e.generation == key.generation => *e,
            _ => return Err(TransportError::UnknownRegion),
        };
        self.shared.directory.set_region(key.slot, None);
        self.regions[key.slot as usize] = None;
        self.free_regions.push(key.slot);
        stats::sub(&self.shared.worker_written.registered_bytes, entry.len);
        for (d, lkey) in self.domains.iter_mut().zip(entry.lkeys) {
            d.deregister(lkey)?;
        }
        Ok(())
    }

    fn connect(&mut self, addr: &crate::addr::NetAddr) -> Result<Arc<PeerEntry>, TransportError> {
        addr.validate()?;
        if addr.nics.len() != self.domains.len() {
            return Err(TransportError::NicCountMismatch {
                local: self.domains.len(),
                remote: addr.nics.len(),
            });
        }
        if addr.provider() != self.shared.provider {
            return Err(TransportError::ProviderMismatch {
                local: self.shared.provider.clone(),
                remote: addr.provider().to_owned(),
            });
        }
        if let Some(entry) = self.shared.directory.peer(&addr.nics[0]) {
            return if entry.addr == *addr {
                Ok(entry)
            } else {
                Err(TransportError::MalformedAddress(
                    "NIC 0 is known as part of another peer".to_owned(),
                ))
            };
        }
        // A NIC belongs to one peer: an address that borrows a known peer's NIC is forged or
        // stale. (NICs never seen before cannot be checked here; the targets' rkey and bounds
        // checks still refuse any write that does not fit.)
        if let Some(i) = addr
            .nics
            .iter()
            .position(|nic| self.shared.directory.peer(nic).is_some())
        {
            return Err(TransportError::MalformedAddress(format!(
                "NIC {i} belongs to another peer"
            )));
        }
        let mut ids = [0; MAX_NICS];
        for (i, (d, nic)) in self.domains.iter_mut().zip(&addr.nics).enumerate() {
            ids[i] = d.connect(nic)?;
        }
        let entry = Arc::new(PeerEntry {
            index: self.peers.len() as u32,
            addr: addr.clone(),
        });
        self.peers.push(ids);
        stats::add(&self.shared.worker_written.peers, 1);
        self.by_nic0.insert(ids[0], entry.clone());
        self.shared.directory.insert_peer(&entry);
        tracing::debug!(
            peer = entry.index,
            group = self.shared.index,
            "connected a peer"
        );
        Ok(entry)
    }

    /// Releases the peer at `addr` on every NIC ([`Domain::disconnect`]); `false` if no peer
    /// has that address. Its index is never reused: a transfer resolved to it before the
    /// release (on another thread, queued after this command) finds it released and fails,
    /// never reaching a later peer. What the peer's transfers still had queued or in flight
    /// fails with [`TransferError::PeerUnreachable`].
    fn disconnect(&mut self, addr: &crate::addr::NetAddr) -> Result<bool, TransportError> {
        let Some(entry) = addr
            .nics
            .first()
            .and_then(|nic| self.shared.directory.peer(nic))
            .filter(|e| e.addr == *addr)
        else {
            return Ok(false);
        };
        self.shared.directory.remove_peer(&entry);
        let ids = std::mem::replace(&mut self.peers[entry.index as usize], [RELEASED; MAX_NICS]);
        stats::sub(&self.shared.worker_written.peers, 1);
        self.by_nic0.remove(&ids[0]);
        let mut first_error = None;
        for (d, id) in self.domains.iter_mut().zip(ids) {
            if let Err(e) = d.disconnect(id) {
                first_error.get_or_insert(e);
            }
        }
        tracing::debug!(
            peer = entry.index,
            group = self.shared.index,
            "released a peer"
        );
        first_error.map_or(Ok(true), Err)
    }

    /// The address this group's operations to `addr` leave from ([`Domain::sender_name`] per
    /// NIC, this NIC's own address where it has no other), connecting the peer first;
    /// `None` when every NIC sends from its own address.
    fn sender_address(
        &mut self,
        addr: &crate::addr::NetAddr,
    ) -> Result<Option<crate::addr::NetAddr>, TransportError> {
        let entry = self.connect(addr)?;
        let ids = self.peers[entry.index as usize];
        let mut nics = Vec::with_capacity(self.domains.len());
        let mut differs = false;
        for (d, id) in self.domains.iter_mut().zip(ids) {
            match d.sender_name(id)? {
                Some(name) => {
                    differs = true;
                    nics.push(name);
                }
                None => nics.push(d.address()),
            }
        }
        Ok(differs.then_some(crate::addr::NetAddr { nics }))
    }

    /// Records that the peer at `addr` sends to this group from `sender`
    /// ([`Domain::adopt_sender`] per NIC), connecting the peer first.
    fn adopt_sender(
        &mut self,
        addr: &crate::addr::NetAddr,
        sender: &crate::addr::NetAddr,
    ) -> Result<(), TransportError> {
        sender.validate()?;
        if sender.nics.len() != self.domains.len() {
            return Err(TransportError::NicCountMismatch {
                local: self.domains.len(),
                remote: sender.nics.len(),
            });
        }
        let entry = self.connect(addr)?;
        let ids = self.peers[entry.index as usize];
        for ((d, id), nic) in self.domains.iter_mut().zip(ids).zip(&sender.nics) {
            d.adopt_sender(id, nic)?;
        }
        Ok(())
    }

    fn install_recv_pool(&mut self, buf_len: usize, count: u32) -> Result<(), TransportError> {
        if self.recv.is_some() {
            return Err(TransportError::AlreadyReceiving);
        }
        let pool = Arc::new(RecvPool::new(count, buf_len));
        let bytes = u64::from(count) * buf_len as u64;
        // SAFETY: the pool's memory lives as long as the Arc kept in `self.recv` (and any
        // callback job's clone), which outlives NIC 0 and so its registration.
        // Receive buffers are filled by this NIC's receives, never by peers' writes.
        let reg = unsafe {
            self.domains[0].register(pool.buffer_addr(0), bytes, Device::Host, Access::Local)
        }?;
        self.recv = Some(RecvState {
            pool,
            lkey: reg.lkey,
            to_post: (0..count).collect(),
        });
        self.repost_recvs();
        Ok(())
    }
}
