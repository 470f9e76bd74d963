//! The [`Domain`] operations of a [`FabricDomain`]: registering regions, connecting peers,
//! posting writes, sends and receives, and polling the completion queue.

use super::*;

impl Domain for FabricDomain {
    fn provider(&self) -> &str {
        &self.provider
    }

    fn address(&self) -> DomainAddr {
        self.addr.clone()
    }

    fn supports(&self, device: Device) -> bool {
        device == Device::Host
    }

    unsafe fn register(
        &mut self,
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
    ) -> Result<Registration, TransportError> {
        if device != Device::Host {
            return Err(TransportError::UnsupportedDevice(device.to_string()));
        }
        let access = match access {
            Access::RemoteWrite => LOCAL_ACCESS | REMOTE_ACCESS,
            Access::Local => LOCAL_ACCESS,
        };
        let size = usize::try_from(len)
            .map_err(|_| TransportError::InvalidArgument("a region larger than memory"))?;
        let prov_key = self.mr_mode.has(fi::FI_MR_PROV_KEY);
        let mut mr: *mut fi::fid_mr = null_mut();
        let mut rc = 0;
        // A random key may collide with one in use (-FI_ENOKEY): another draw.
        for _ in 0..8 {
            let requested_key = if prov_key { 0 } else { self.keys.next() };
            // SAFETY: the caller keeps the range valid until deregistered; the domain is live.
            rc = unsafe {
                fi::fi_mr_reg(
                    self.domain,
                    addr as *const c_void,
                    size,
                    access,
                    0,
                    requested_key,
                    0,
                    &raw mut mr,
                    null_mut(),
                )
            };
            if prov_key || rc != -(fi::FI_ENOKEY as i32) {
                break;
            }
        }
        check(self.lib, "fi_mr_reg", rc)?;
        let region = Region {
            mr,
            addr,
            len,
            // SAFETY: a live registration.
            desc: unsafe { fi::fi_mr_desc(mr) },
        };
        if self.mr_mode.has(fi::FI_MR_ENDPOINT) {
            // SAFETY: live registration and endpoint.
            let bound = unsafe {
                check(
                    self.lib,
                    "fi_mr_bind",
                    fi::fi_mr_bind(mr, &raw mut (*self.ep).fid, 0),
                )
                .and_then(|()| check(self.lib, "fi_mr_enable", fi::fi_mr_enable(mr)))
            };
            if let Err(e) = bound {
                let _ = self.close_region(&region);
                return Err(e);
            }
        }
        // SAFETY: a live registration.
        let rkey = unsafe { fi::fi_mr_key(mr) };
        if rkey == fi::FI_KEY_NOTAVAIL {
            let _ = self.close_region(&region);
            return Err(TransportError::Domain(
                "the provider uses raw (over 64-bit) memory keys".to_owned(),
            ));
        }
        let slot = self.free_regions.pop().unwrap_or_else(|| {
            self.regions.push(None);
            self.generations.push(0);
            (self.regions.len() - 1) as u32
        });
        let generation = self.generations[slot as usize].wrapping_add(1).max(1);
        self.generations[slot as usize] = generation;
        self.regions[slot as usize] = Some(region);
        Ok(Registration {
            lkey: u64::from(generation) << 32 | u64::from(slot),
            rkey,
            // Without FI_MR_VIRT_ADDR peers address the region by offset from its start.
            remote_addr: if self.mr_mode.has(fi::FI_MR_VIRT_ADDR) {
                addr
            } else {
                0
            },
        })
    }

    fn deregister(&mut self, lkey: u64) -> Result<(), TransportError> {
        if self.region(lkey).is_none() {
            return Err(TransportError::UnknownRegion);
        }
        let slot = (lkey & 0xffff_ffff) as usize;
        let Some(region) = self.regions[slot].take() else {
            return Err(TransportError::UnknownRegion);
        };
        self.free_regions.push(slot as u32);
        self.close_region(&region)
    }

    fn connect(&mut self, peer: &DomainAddr) -> Result<PeerId, TransportError> {
        if peer.provider != self.provider {
            return Err(TransportError::ProviderMismatch {
                local: self.provider.clone(),
                remote: peer.provider.clone(),
            });
        }
        if let Some(&id) = self.peer_ids.get(&peer.bytes) {
            return Ok(id);
        }
        // The provider reads as many bytes as its address format has: a binary address must
        // be exactly as long as ours, a string address (shm names vary in length) must end
        // with its NUL within the bytes given.
        let well_formed = if self.addr_is_string {
            peer.bytes.len() <= MAX_ADDR_LEN && peer.bytes.last() == Some(&0)
        } else {
            peer.bytes.len() == self.addr.bytes.len()
        };
        if !well_formed {
            return Err(TransportError::MalformedAddress(format!(
                "a {}-byte {} address (this NIC's are {} bytes)",
                peer.bytes.len(),
                self.provider,
                self.addr.bytes.len()
            )));
        }
        if self.provider == "fabric:shm" {
            check_shm_peer(&peer.bytes).map_err(TransportError::MalformedAddress)?;
        }
        // A peer released earlier and connected again gets back the endpoint it already
        // knows, and its address entry (see `lingering`).
        let reused = self.take_lingering(&peer.bytes);
        let (fi_addr, ep) = match reused {
            Some((fi_addr, ep)) => (fi_addr, ep),
            None => {
                let fi_addr = self.insert(&peer.bytes)?;
                let ep = if self.tx_per_peer {
                    self.open_endpoint()?
                } else {
                    null_mut()
                };
                (fi_addr, ep)
            }
        };
        let pid = (self.provider == "fabric:shm")
            .then(|| shm_peer_pid(&peer.bytes))
            .flatten();
        let entry = Peer {
            bytes: peer.bytes.clone(),
            released: false,
            fi_addr,
            refusing_since: None,
            ep,
            pid,
            process: Process::Alive(None),
            senders: Vec::new(),
            posted: reused.is_some(),
        };
        let id = match self.free_peers.pop() {
            Some(id) => {
                self.peers[id as usize] = entry;
                id
            }
            None => {
                self.peers.push(entry);
                (self.peers.len() - 1) as PeerId
            }
        };
        self.peer_ids.insert(peer.bytes.clone(), id);
        self.by_fi_addr.insert(fi_addr, id);
        Ok(id)
    }

    fn disconnect(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.release_peer(peer)
    }

    fn sender_name(&mut self, peer: PeerId) -> Result<Option<DomainAddr>, TransportError> {
        self.peer_addr(peer)?;
        let ep = self.tx_ep(peer);
        if ep == self.ep {
            return Ok(None);
        }
        let bytes = self.endpoint_name(ep)?;
        Ok(Some(DomainAddr {
            provider: self.provider.clone(),
            bytes,
        }))
    }

    fn adopt_sender(&mut self, peer: PeerId, sender: &DomainAddr) -> Result<(), TransportError> {
        self.adopt(peer, sender)
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, TransportError> {
        if self.idle_poll.is_some() {
            self.last_active = Instant::now();
        }
        for (i, wr) in wrs.iter().enumerate() {
            match self.post_write(wr) {
                Ok(true) => {}
                Ok(false) => return Ok(i),
                // What was posted before the failing write stands; the engine retries the
                // rest, and the failing write fails again at the head of the next batch.
                Err(_) if i > 0 => return Ok(i),
                Err(e) => return Err(e),
            }
        }
        Ok(wrs.len())
    }

    fn post_unreported(&mut self, wr: &WriteWr) -> Result<Unreported, TransportError> {
        self.inject_imm(wr)
    }

    fn posts_unreported(&self) -> bool {
        self.inject_imm
    }

    unsafe fn post_send(&mut self, wr: &SendWr) -> Result<bool, TransportError> {
        let dest = self.peer_addr(wr.peer)?;
        let now = Instant::now();
        self.last_active = now;
        self.check_alive(wr.peer)?;
        let len = wr.len as usize;
        let (buf, desc, bounce) = match self.bounce.as_mut() {
            Some(b) => {
                if len > b.slot_len {
                    return Err(TransportError::MessageTooLarge {
                        len,
                        max: b.slot_len,
                    });
                }
                let Some(slot) = b.free.pop() else {
                    return Ok(false);
                };
                let start = slot as usize * b.slot_len;
                // SAFETY: the caller keeps the payload valid for the call.
                let payload = unsafe { std::slice::from_raw_parts(wr.addr as *const u8, len) };
                b.memory[start..start + len].copy_from_slice(payload);
                let lkey = b.lkey;
                let ptr = b.memory[start..].as_ptr() as u64;
                (ptr, self.local_desc(lkey, ptr, len as u64)?, Some(slot))
            }
            None => (wr.addr, null_mut(), None),
        };
        let context = self
            .contexts
            .acquire(wr.wr_id, OpKind::Send, wr.peer, bounce, now);
        // SAFETY: the endpoint is live; the buffer (bounce slot or the caller's payload, which
        // it keeps until the completion) outlives the send; `context` is a pool slot.
        let ep = self.tx_ep(wr.peer);
        let rc = unsafe { fi::fi_send(ep, buf as *const c_void, len, desc, dest, context) };
        let posted = self
            .posted(rc, context, "fi_send")
            .and_then(|accepted| self.note_post(wr.peer, accepted, || now).map(|()| accepted));
        if !matches!(posted, Ok(true))
            && let Some(slot) = bounce
        {
            self.give_back_bounce(slot);
        }
        posted
    }

    unsafe fn post_recv(&mut self, wr: &RecvWr) -> Result<bool, TransportError> {
        let desc = self.local_desc(wr.lkey, wr.addr, wr.len)?;
        let context = self
            .contexts
            .acquire(wr.wr_id, OpKind::Recv, u32::MAX, None, Instant::now());
        // SAFETY: the caller keeps the registered buffer valid and untouched until the
        // completion; the endpoint is live; `context` is a pool slot.
        let rc = unsafe {
            fi::fi_recv(
                self.ep,
                wr.addr as *mut c_void,
                wr.len as usize,
                desc,
                fi::FI_ADDR_UNSPEC,
                context,
            )
        };
        self.posted(rc, context, "fi_recv")
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let start = out.len();
        out.append(&mut self.released_ops);
        let want = max.min(self.cq_buf.len());
        if want == 0 {
            return out.len() - start;
        }
        // SAFETY: the CQ is live and in FI_CQ_FORMAT_DATA; both buffers have `want` entries.
        let n = unsafe {
            fi::fi_cq_readfrom(
                self.cq,
                self.cq_buf.as_mut_ptr().cast(),
                want,
                self.cq_src.as_mut_ptr(),
            )
        };
        if n > 0 {
            for i in 0..n as usize {
                let e = self.cq_buf[i];
                let remote_write = e.flags & fi::FI_REMOTE_WRITE != 0
                    || (e.flags & fi::FI_REMOTE_CQ_DATA != 0 && e.flags & fi::FI_RECV == 0);
                if remote_write {
                    // A peer's write with an immediate has landed (the data is placed before
                    // the target completion is generated).
                    out.push(Completion {
                        wr_id: 0,
                        count: 1,
                        kind: CompletionKind::Arrival { imm: e.data as u32 },
                        result: Ok(()),
                    });
                    continue;
                }
                match self.contexts.release(e.op_context) {
                    Released::Live(ctx) => {
                        if let Some(b) = ctx.bounce {
                            self.give_back_bounce(b);
                        }
                        // Only a receive has a sender to name; writes and sends skip the
                        // lookup.
                        let from = match ctx.kind {
                            OpKind::Recv => self.by_fi_addr.get(&self.cq_src[i]).copied(),
                            OpKind::Write | OpKind::Send => None,
                        };
                        out.push(Completion {
                            wr_id: ctx.wr_id,
                            count: 1,
                            kind: completion_kind(ctx.kind, e.len, from),
                            result: Ok(()),
                        });
                    }
                    Released::Abandoned { bounce } => {
                        if let Some(b) = bounce {
                            self.give_back_bounce(b);
                        }
                    }
                    Released::Unknown => {
                        tracing::error!(flags = e.flags, "a completion for no posted operation");
                    }
                }
            }
        } else if n == -(fi::FI_EAVAIL as isize) {
            self.error_completion(out);
        } else if n != -(fi::FI_EAGAIN as isize) {
            tracing::error!(error = %self.lib.strerror(n as i32), "fi_cq_read failed");
        }
        if out.len() - start < max {
            self.sweep(out);
        }
        // The clock is read only when something completed, and only for a parking worker.
        if out.len() > start && self.idle_poll.is_some() {
            self.last_active = Instant::now();
        }
        out.len() - start
    }

    fn set_notify(&mut self, _notify: Arc<dyn Notify>) {
        // Nothing pushes to the worker: it polls the CQ (libfabric's progress needs that).
    }

    fn next_deadline(&self) -> Option<Instant> {
        let first = self.idle_poll?;
        let now = Instant::now();
        let idle = now.saturating_duration_since(self.last_active);
        Some(now + idle_period(first, idle))
    }

    fn may_park(&self) -> bool {
        self.idle_poll.is_some()
    }
}

impl Drop for FabricDomain {
    fn drop(&mut self) {
        let live = self.contexts.live();
        if live > 0 {
            tracing::debug!(live, "closing a fabric NIC with operations outstanding");
        }
        for slot in 0..self.regions.len() {
            if let Some(region) = self.regions[slot].take() {
                let _ = self.close_region(&region);
            }
        }
        // SAFETY: each object is live or null, closed once, endpoint before what it is bound
        // to; the info copy is ours. The context pool and bounce memory are dropped after
        // this, so nothing the provider still references is freed before the endpoint closes.
        unsafe {
            let peer_eps = self.peers.iter().map(|p| p.ep.cast::<fi::fid>());
            let lingering = self.lingering.iter().map(|l| l.ep.cast::<fi::fid>());
            for fid in peer_eps.chain(lingering).chain([
                self.ep.cast::<fi::fid>(),
                self.av.cast(),
                self.cq.cast(),
                self.domain.cast(),
                self.fabric.cast(),
            ]) {
                if !fid.is_null() {
                    let rc = fi::fi_close(fid);
                    if rc != 0 {
                        tracing::warn!(error = %self.lib.strerror(rc), "fi_close failed");
                    }
                }
            }
            self.lib.freeinfo(self.info);
        }
    }
}

/// How long a parking worker waits before its next poll after `idle` with nothing posted or
/// completed: `first`, growing to an eighth of the idle time, up to `IDLE_POLL_MAX` (never
/// below `first`). The delay it adds to the first arrival after a spell is thus bounded by
/// an eighth of the spell and by `IDLE_POLL_MAX`.
pub(super) fn idle_period(first: Duration, idle: Duration) -> Duration {
    (idle / 8).clamp(first, crate::fabric::IDLE_POLL_MAX.max(first))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::idle_period;

    #[test]
    fn the_idle_poll_period_grows_with_an_eighth_of_the_spell_up_to_its_cap() {
        let us = Duration::from_micros;
        assert_eq!(idle_period(us(50), us(0)), us(50));
        assert_eq!(idle_period(us(50), us(400)), us(50));
        assert_eq!(idle_period(us(50), us(4_000)), us(500));
        assert_eq!(idle_period(us(50), Duration::from_secs(3)), us(1_000));
        // A first period above the cap is kept as it is.
        assert_eq!(idle_period(us(5_000), Duration::from_secs(3)), us(5_000));
    }
}
