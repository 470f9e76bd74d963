//! Completions a [`FabricDomain`] makes of what the completion queue reports: error entries
//! mapped to the engine's errors, and the sweep of operations that will never complete.

use super::*;

impl FabricDomain {
    /// Turns one CQ error entry into a completion of its operation.
    pub(super) fn error_completion(&mut self, out: &mut Vec<Completion>) -> bool {
        let mut err = fi::fi_cq_err_entry::default();
        // SAFETY: the CQ is live; `err` asks for no provider-specific error data buffer.
        let rc = unsafe { fi::fi_cq_readerr(self.cq, &raw mut err, 0) };
        if rc < 0 {
            return false;
        }
        // SAFETY: the entry's err_data is the provider's, valid until the next CQ read.
        let detail = unsafe { fi::fi_cq_strerror(self.cq, err.prov_errno, err.err_data) }
            .unwrap_or_default();
        let error = transfer_error(err.err, &self.lib.strerror(err.err), &detail);
        match self.contexts.release(err.op_context) {
            Released::Live(ctx) => {
                if let Some(b) = ctx.bounce {
                    self.give_back_bounce(b);
                }
                tracing::debug!(%error, wr_id = ctx.wr_id, peer = ctx.peer, "operation failed");
                out.push(Completion {
                    wr_id: ctx.wr_id,
                    count: 1,
                    kind: completion_kind(ctx.kind, err.len, None),
                    result: Err(error),
                });
            }
            Released::Abandoned { bounce } => {
                if let Some(b) = bounce {
                    self.give_back_bounce(b);
                }
            }
            Released::Unknown => {
                tracing::warn!(%error, flags = err.flags, "a completion error for no posted operation (target side)");
            }
        }
        true
    }

    /// Fails the writes and sends the provider has not completed within the deadline.
    pub(super) fn sweep(&mut self, out: &mut Vec<Completion>) {
        self.polls_since_sweep += 1;
        if self.polls_since_sweep < SWEEP_EVERY {
            return;
        }
        self.polls_since_sweep = 0;
        let now = Instant::now();
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + (self.op_timeout / 4).min(Duration::from_millis(100));
        // An shm peer whose process has exited will never answer: fail what it holds now
        // rather than at the deadline.
        for id in 0..self.peers.len() {
            let p = &mut self.peers[id];
            let Some(pid) = p.pid.filter(|_| !p.released) else {
                continue;
            };
            match p.process {
                Process::Settled => continue,
                Process::Alive(_) if process_exists(pid) => continue,
                Process::Alive(_) | Process::Exited => p.process = Process::Settled,
            }
            for ctx in self.contexts.abandon_peer(id as PeerId) {
                out.push(Completion {
                    wr_id: ctx.wr_id,
                    count: 1,
                    kind: completion_kind(ctx.kind, 0, None),
                    result: Err(TransferError::PeerUnreachable),
                });
            }
            tracing::warn!(
                peer = id,
                pid,
                "an shm peer's process has exited; failed its operations"
            );
        }
        if !self.retired_senders.is_empty()
            && let Err(e) = self.reap_senders()
        {
            tracing::warn!(%e, "releasing a departed peer's sending endpoint");
        }
        self.close_lingering();
        for ctx in self.contexts.expire(now, self.op_timeout) {
            tracing::warn!(wr_id = ctx.wr_id, peer = ctx.peer, timeout = ?self.op_timeout, "an operation was not completed in time; failing it");
            out.push(Completion {
                wr_id: ctx.wr_id,
                count: 1,
                kind: completion_kind(ctx.kind, 0, None),
                result: Err(TransferError::TimedOut(self.op_timeout)),
            });
        }
    }
}

/// The kind of completion an operation of `kind` reports (`from`: a receive's sender).
pub(super) fn completion_kind(kind: OpKind, len: usize, from: Option<PeerId>) -> CompletionKind {
    match kind {
        OpKind::Write => CompletionKind::Write,
        OpKind::Send => CompletionKind::Send,
        OpKind::Recv => CompletionKind::Recv {
            len: len as u64,
            from,
        },
    }
}

/// Maps a CQ error (positive errno) to what the transfer reports.
fn transfer_error(errno: i32, text: &str, provider_detail: &str) -> TransferError {
    let message = if provider_detail.is_empty() || provider_detail == text {
        text.to_owned()
    } else {
        format!("{text} ({provider_detail})")
    };
    match errno {
        e if e == fi::FI_ECONNREFUSED
            || e == fi::FI_ECONNRESET
            || e == fi::FI_ECONNABORTED
            || e == fi::FI_EHOSTUNREACH
            || e == fi::FI_ENETUNREACH
            || e == fi::FI_EHOSTDOWN
            || e == fi::FI_ENOTCONN
            || e == fi::FI_ESHUTDOWN
            || e == fi::FI_ETIMEDOUT
            || e == fi::FI_ENETDOWN =>
        {
            tracing::debug!(%message, "peer unreachable");
            TransferError::PeerUnreachable
        }
        e if e == fi::FI_EACCES || e == fi::FI_EKEYREJECTED || e == fi::FI_EFAULT => {
            TransferError::RemoteAccess(message)
        }
        _ => TransferError::Provider(message),
    }
}
