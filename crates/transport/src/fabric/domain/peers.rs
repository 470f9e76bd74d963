//! A [`FabricDomain`]'s peers over time: addresses inserted and released, the endpoints a
//! released peer leaves lingering (taken up again or closed), and the senders adopted and
//! retired.

use super::*;

impl FabricDomain {
    /// The endpoint `peer`'s operations are posted on.
    pub(super) fn tx_ep(&self, peer: PeerId) -> *mut fi::fid_ep {
        self.peers
            .get(peer as usize)
            .map(|p| p.ep)
            .filter(|ep| !ep.is_null())
            .unwrap_or(self.ep)
    }

    /// [`Domain::disconnect`]: fails what `peer` holds, closes its transmit endpoint, removes
    /// it from the address vector (which unmaps an `shm` peer's region) and frees its id.
    pub(super) fn release_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.peer_addr(peer)?;
        for ctx in self.contexts.abandon_peer(peer) {
            self.released_ops.push(Completion {
                wr_id: ctx.wr_id,
                count: 1,
                kind: completion_kind(ctx.kind, 0, None),
                result: Err(TransferError::PeerUnreachable),
            });
        }
        let p = &mut self.peers[peer as usize];
        p.released = true;
        let posted = p.posted;
        let pid = p.pid.take();
        let bytes = p.bytes.clone();
        self.by_fi_addr.remove(&p.fi_addr);
        for s in &p.senders {
            self.by_fi_addr.remove(&s.fi_addr);
        }
        self.retired_senders.append(&mut p.senders);
        self.peer_ids.remove(&p.bytes);
        let (ep, mut fi_addr) = (std::mem::replace(&mut p.ep, null_mut()), p.fi_addr);
        self.free_peers.push(peer);
        if let Some(pid) = pid.filter(|&pid| posted && !ep.is_null() && process_exists(pid)) {
            let of_pid = |l: &&Lingering| l.pid == pid;
            if self.lingering.iter().filter(of_pid).count() >= MAX_LINGERING_PER_PROCESS
                && let Some(oldest) = (0..self.lingering.len())
                    .filter(|&i| self.lingering[i].pid == pid)
                    .min_by_key(|&i| self.lingering[i].released)
            {
                self.close_lingering_at(oldest);
            }
            self.lingering.push(Lingering {
                ep,
                bytes,
                pid,
                fi_addr,
                gone_since: None,
                released: Instant::now(),
            });
            return self.reap_senders();
        }
        if !ep.is_null() {
            // SAFETY: the peer's own endpoint, live, closed once (the field is now null); its
            // operations were abandoned above, so no context of it is waited on.
            let rc = unsafe { fi::fi_close(ep.cast()) };
            check(self.lib, "fi_close (peer endpoint)", rc)?;
        }
        // SAFETY: the AV is live and `fi_addr` is one of its entries, removed once.
        let rc = unsafe { fi::fi_av_remove(self.av, &raw mut fi_addr, 1, 0) };
        check(self.lib, "fi_av_remove", rc)?;
        self.reap_senders()
    }

    /// [`Domain::adopt_sender`]: over `shm`, inserts `sender` (an endpoint of `peer`'s own
    /// process, checked like any peer address) into the address vector, which finds the entry
    /// `shm` made when that endpoint first sent here, so that it can be removed later.
    pub(super) fn adopt(
        &mut self,
        peer: PeerId,
        sender: &DomainAddr,
    ) -> Result<(), TransportError> {
        let p = self
            .peers
            .get(peer as usize)
            .filter(|p| !p.released)
            .ok_or_else(|| TransportError::Domain(format!("unknown or released peer id {peer}")))?;
        if self.provider != "fabric:shm" || p.bytes == sender.bytes {
            return Ok(());
        }
        if sender.provider != self.provider {
            return Err(TransportError::ProviderMismatch {
                local: self.provider.clone(),
                remote: sender.provider.clone(),
            });
        }
        if p.senders.iter().any(|s| s.bytes == sender.bytes) {
            return Ok(());
        }
        if p.senders.len() >= MAX_SENDERS {
            return Err(TransportError::MalformedAddress(format!(
                "a peer names at most {MAX_SENDERS} sending endpoints"
            )));
        }
        if !same_shm_process(&p.bytes, &sender.bytes) {
            return Err(TransportError::MalformedAddress(
                "a sending endpoint of another process than the peer's".to_owned(),
            ));
        }
        if self.peer_ids.contains_key(&sender.bytes) {
            return Err(TransportError::MalformedAddress(
                "a sending endpoint that is a peer of its own".to_owned(),
            ));
        }
        // A sender retired with an earlier session of the same process, still open: its entry
        // is still in the address vector (inserting it again would count it twice).
        let adopted = match self
            .retired_senders
            .iter()
            .position(|s| s.bytes == sender.bytes)
        {
            Some(i) => Sender {
                silent_since: None,
                ..self.retired_senders.swap_remove(i)
            },
            None => {
                check_shm_peer(&sender.bytes).map_err(TransportError::MalformedAddress)?;
                Sender {
                    bytes: sender.bytes.clone(),
                    fi_addr: self.insert(&sender.bytes)?,
                    silent_since: None,
                }
            }
        };
        self.by_fi_addr.insert(adopted.fi_addr, peer);
        self.peers[peer as usize].senders.push(adopted);
        Ok(())
    }

    /// A lingering endpoint of the peer at `bytes`, taken out of the list for it to use again.
    pub(super) fn take_lingering(
        &mut self,
        bytes: &[u8],
    ) -> Option<(fi::fi_addr_t, *mut fi::fid_ep)> {
        let at = self.lingering.iter().position(|l| l.bytes == bytes)?;
        let l = self.lingering.swap_remove(at);
        Some((l.fi_addr, l.ep))
    }

    /// Closes the lingering endpoints whose peer's process has exited, and those whose peer's
    /// region has been gone for [`SENDER_GRACE`] (its engine was dropped, its process lives
    /// on: one process's engines coming and going must not each keep an endpoint, 16 MiB of
    /// `shm` region, until the process exits).
    pub(super) fn close_lingering(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.lingering.len() {
            let l = &mut self.lingering[i];
            if process_exists(l.pid) {
                if shm_sender_may_send(&l.bytes) {
                    l.gone_since = None;
                    i += 1;
                    continue;
                }
                if now.duration_since(*l.gone_since.get_or_insert(now)) < SENDER_GRACE {
                    i += 1;
                    continue;
                }
            }
            self.close_lingering_at(i);
        }
    }

    /// Closes lingering endpoint `i` and removes its peer's address entry.
    fn close_lingering_at(&mut self, i: usize) {
        let Lingering {
            ep, mut fi_addr, ..
        } = self.lingering.swap_remove(i);
        // SAFETY: an endpoint `release_peer` kept open, closed once (removed from the list),
        // its operations abandoned then; then the peer's entry, which it kept too.
        let closed = check(self.lib, "fi_close (lingering endpoint)", unsafe {
            fi::fi_close(ep.cast())
        })
        .and_then(|()| {
            check(self.lib, "fi_av_remove (lingering peer)", unsafe {
                fi::fi_av_remove(self.av, &raw mut fi_addr, 1, 0)
            })
        });
        if let Err(e) = closed {
            tracing::warn!(%e, "closing a released peer's endpoint");
        }
    }

    /// Removes the retired senders that can no longer send: their region is gone (the
    /// endpoint closed) or their process has exited.
    pub(super) fn reap_senders(&mut self) -> Result<(), TransportError> {
        let mut first_error = Ok(());
        let mut i = 0;
        let now = Instant::now();
        while i < self.retired_senders.len() {
            let s = &mut self.retired_senders[i];
            if shm_sender_may_send(&s.bytes) {
                s.silent_since = None;
                i += 1;
                continue;
            }
            if now.duration_since(*s.silent_since.get_or_insert(now)) < SENDER_GRACE {
                i += 1;
                continue;
            }
            let mut gone = self.retired_senders.swap_remove(i);
            // SAFETY: the AV is live and the entry is one `adopt` inserted, removed once.
            let rc = unsafe { fi::fi_av_remove(self.av, &raw mut gone.fi_addr, 1, 0) };
            if let Err(e) = check(self.lib, "fi_av_remove (sender)", rc) {
                first_error = first_error.and(Err(e));
            }
        }
        first_error
    }

    /// Inserts an address (already checked for length) into the AV.
    pub(super) fn insert(&mut self, bytes: &[u8]) -> Result<fi::fi_addr_t, TransportError> {
        let mut fi_addr: fi::fi_addr_t = fi::FI_ADDR_NOTAVAIL;
        // SAFETY: the AV is live; the address has the length of this provider's addresses;
        // one output slot for one address.
        let rc = unsafe {
            fi::fi_av_insert(
                self.av,
                bytes.as_ptr().cast(),
                1,
                &raw mut fi_addr,
                0,
                null_mut(),
            )
        };
        if rc != 1 || fi_addr == fi::FI_ADDR_NOTAVAIL {
            return Err(TransportError::MalformedAddress(format!(
                "{} refused the address ({})",
                self.provider,
                if rc < 0 {
                    self.lib.strerror(rc)
                } else {
                    "not inserted".to_owned()
                }
            )));
        }
        Ok(fi_addr)
    }
}
