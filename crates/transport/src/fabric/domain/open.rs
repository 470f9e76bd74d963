//! Opening a [`FabricDomain`]: the fabric, domain, completion queue, address vector and
//! enabled endpoints, and the registered bounce buffers small sends are copied through.

use super::*;

impl FabricDomain {
    /// Opens NIC `nic` of the chosen provider: fabric, domain, CQ, AV and an enabled endpoint.
    pub(crate) fn open(
        lib: &'static fi::Library,
        chosen: &Chosen,
        nic: usize,
        config: &FabricConfig,
    ) -> Result<Self, TransportError> {
        // SAFETY: an entry of the chosen list; the copy is ours and freed in Drop.
        let info = unsafe { lib.dupinfo(chosen.info(nic)) };
        if info.is_null() {
            return Err(TransportError::Domain("fi_dupinfo failed".to_owned()));
        }
        let candidate = &chosen.candidate;
        if candidate.provider == "shm" {
            clear_stale_shm_regions();
        }
        let mr_mode = if config.force_mr_local {
            MrMode(candidate.mr_mode.0 | fi::FI_MR_LOCAL)
        } else {
            candidate.mr_mode
        };
        // A registration bound to one endpoint (FI_MR_ENDPOINT) would have to be bound to
        // every peer's too; no provider that needs per-peer endpoints asks for that.
        let tx_per_peer = match config.tx_endpoint_per_peer {
            Some(true) if mr_mode.has(fi::FI_MR_ENDPOINT) => {
                // SAFETY: our own copy, not used after.
                unsafe { lib.freeinfo(info) };
                return Err(TransportError::InvalidArgument(
                    "per-peer transmit endpoints need a provider without FI_MR_ENDPOINT",
                ));
            }
            Some(on) => on,
            None => candidate.provider == "shm" && !mr_mode.has(fi::FI_MR_ENDPOINT),
        };
        let mut d = Self {
            lib,
            info,
            fabric: null_mut(),
            domain: null_mut(),
            cq: null_mut(),
            av: null_mut(),
            ep: null_mut(),
            provider: format!("fabric:{}", candidate.provider),
            // SAFETY: a complete fi_info.
            domain_name: unsafe { c_str((*(*info).domain_attr).name) },
            addr: DomainAddr {
                provider: String::new(),
                bytes: Vec::new(),
            },
            // SAFETY: as above.
            addr_is_string: unsafe { (*info).addr_format } == fi::FI_ADDR_STR,
            mr_mode,
            max_msg_size: candidate.max_msg_size,
            // `fi_inject_writedata` where it was measured to work: libfabric 1.17's tcp;ofi_rxm
            // answers it `-FI_EAGAIN` on every post (its emulated write is taken instead each
            // time), and efa has not been tried.
            inject_imm: candidate.provider == "shm",
            alive_for: ticks::Span::of(ALIVE_FOR),
            regions: Vec::new(),
            generations: Vec::new(),
            free_regions: Vec::new(),
            // SAFETY: a complete fi_info.
            keys: KeyDraw::new(unsafe { (*(*info).domain_attr).mr_key_size }),
            peers: Vec::new(),
            peer_ids: HashMap::new(),
            free_peers: Vec::new(),
            released_ops: Vec::new(),
            retired_senders: Vec::new(),
            lingering: Vec::new(),
            contexts: ContextPool::default(),
            cq_buf: vec![fi::fi_cq_data_entry::default(); config.cq_batch],
            cq_src: vec![fi::FI_ADDR_NOTAVAIL; config.cq_batch],
            by_fi_addr: HashMap::new(),
            bounce: None,
            idle_poll: config.idle_poll,
            last_active: Instant::now(),
            op_timeout: config.op_timeout,
            next_sweep: Instant::now(),
            polls_since_sweep: 0,
            tx_per_peer,
        };
        // Everything opened so far is closed by Drop if a later step fails.
        d.open_objects(config.cq_size)?;
        d.addr = DomainAddr {
            provider: d.provider.clone(),
            bytes: d.endpoint_name(d.ep)?,
        };
        if d.provider == "fabric:shm" {
            // 1.17's shm names the sender of a message by the `fiaddr` of its entry in the
            // peer table, and an entry it made for an endpoint that sent unasked (never
            // inserted here) keeps the value a fresh table holds: 0, the first address ever
            // inserted. This NIC's own address takes that index, and no peer gets it, so
            // such a message is from no peer (not the first one connected).
            let own = d.addr.bytes.clone();
            let reserved = d.insert(&own)?;
            d.by_fi_addr.remove(&reserved);
        }
        if d.mr_mode.has(fi::FI_MR_LOCAL) {
            d.bounce = Some(d.bounce_buffers(config.send_buffers, config.send_buffer_len)?);
        }
        tracing::debug!(provider = %d.provider, domain = %d.domain_name, nic, "opened fabric NIC");
        Ok(d)
    }

    fn open_objects(&mut self, cq_size: usize) -> Result<(), TransportError> {
        let lib = self.lib;
        // SAFETY: each call gets live objects opened just before and a fresh out-pointer;
        // attribute structs live across the call.
        unsafe {
            check(
                lib,
                "fi_fabric",
                lib.fabric((*self.info).fabric_attr, &raw mut self.fabric, null_mut()),
            )?;
            check(
                lib,
                "fi_domain",
                fi::fi_domain(self.fabric, self.info, &raw mut self.domain, null_mut()),
            )?;
            let mut cq_attr = fi::fi_cq_attr {
                size: cq_size,
                format: fi::FI_CQ_FORMAT_DATA,
                wait_obj: fi::FI_WAIT_NONE,
                ..Default::default()
            };
            check(
                lib,
                "fi_cq_open",
                fi::fi_cq_open(self.domain, &raw mut cq_attr, &raw mut self.cq, null_mut()),
            )?;
            let av_type = match (*(*self.info).domain_attr).av_type {
                fi::FI_AV_UNSPEC => fi::FI_AV_TABLE,
                t => t,
            };
            let mut av_attr = fi::fi_av_attr {
                type_: av_type,
                count: 64,
                ..Default::default()
            };
            check(
                lib,
                "fi_av_open",
                fi::fi_av_open(self.domain, &raw mut av_attr, &raw mut self.av, null_mut()),
            )?;
        }
        self.ep = self.open_endpoint()?;
        Ok(())
    }

    /// Opens and enables an endpoint bound to this NIC's CQ (both directions) and AV.
    pub(super) fn open_endpoint(&mut self) -> Result<*mut fi::fid_ep, TransportError> {
        let lib = self.lib;
        let mut ep: *mut fi::fid_ep = null_mut();
        // SAFETY: domain, CQ and AV are live; `ep` is a fresh out-pointer; a failure after it
        // was opened closes it before returning.
        unsafe {
            check(
                lib,
                "fi_endpoint",
                fi::fi_endpoint(self.domain, self.info, &raw mut ep, null_mut()),
            )?;
            let bound = check(
                lib,
                "fi_ep_bind (cq)",
                fi::fi_ep_bind(ep, &raw mut (*self.cq).fid, fi::FI_TRANSMIT | fi::FI_RECV),
            )
            .and_then(|()| {
                check(
                    lib,
                    "fi_ep_bind (av)",
                    fi::fi_ep_bind(ep, &raw mut (*self.av).fid, 0),
                )
            })
            .and_then(|()| check(lib, "fi_enable", fi::fi_enable(ep)));
            if let Err(e) = bound {
                fi::fi_close(ep.cast());
                return Err(e);
            }
        }
        Ok(ep)
    }

    /// The name of `ep`, one of this NIC's enabled endpoints.
    pub(super) fn endpoint_name(&self, ep: *mut fi::fid_ep) -> Result<Vec<u8>, TransportError> {
        let mut buf = vec![0u8; MAX_ADDR_LEN];
        let mut len = buf.len();
        // SAFETY: the endpoint is enabled; `buf` has `len` bytes.
        let rc = unsafe { fi::fi_getname(ep.cast(), buf.as_mut_ptr().cast(), &raw mut len) };
        check(self.lib, "fi_getname", rc)?;
        buf.truncate(len);
        Ok(buf)
    }

    fn bounce_buffers(&mut self, count: usize, slot_len: usize) -> Result<Bounce, TransportError> {
        let memory = vec![0u8; count * slot_len].into_boxed_slice();
        // SAFETY: the memory is owned by the Bounce, which is dropped only after Drop closed
        // its registration.
        // Sources of sends only.
        let reg = unsafe {
            self.register(
                memory.as_ptr() as u64,
                memory.len() as u64,
                Device::Host,
                Access::Local,
            )
        }?;
        Ok(Bounce {
            memory,
            slot_len,
            lkey: reg.lkey,
            free: (0..count as u32).rev().collect(),
        })
    }
}
