//! Per-request cancellation. A [`CancellationToken`] given to any number of requests (through
//! [`crate::OnDone::cancellable`]) stops their further posts when cancelled; each then finishes
//! with [`crate::TransferError::Cancelled`] once what it had already posted completed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::transfer_state::TransferState;

#[derive(Debug, Default)]
struct Inner {
    cancelled: AtomicBool,
    /// Requests to stop; dead entries are pruned as new ones register.
    transfers: Mutex<Vec<Weak<TransferState>>>,
}

/// A cancellation handle shared by the requests it was given to. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct CancellationToken {
    inner: Arc<Inner>,
}

impl CancellationToken {
    /// A token not yet cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels every request the token was given to, and every later one.
    pub fn cancel(&self) {
        let transfers = {
            let mut list = self
                .inner
                .transfers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.inner.cancelled.store(true, Ordering::Release);
            std::mem::take(&mut *list)
        };
        for t in transfers.iter().filter_map(Weak::upgrade) {
            t.cancel();
        }
    }

    /// Whether [`CancellationToken::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancelled.load(Ordering::Acquire)
    }

    /// Ties a request's state to the token (cancelling it at once if the token already is).
    pub(crate) fn register(&self, transfer: &Arc<TransferState>) {
        let mut list = self
            .inner
            .transfers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Checked under the lock `cancel` sets the flag under: a request registers either
        // before the cancellation takes the list, or sees the flag.
        if self.inner.cancelled.load(Ordering::Acquire) {
            transfer.cancel();
            return;
        }
        if list.len() >= 64 && list.len().is_multiple_of(64) {
            list.retain(|w| w.strong_count() > 0);
        }
        list.push(Arc::downgrade(transfer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancelling_reaches_registered_and_later_requests() {
        let token = CancellationToken::new();
        let before = Arc::new(TransferState::new());
        token.register(&before);
        assert!(!before.is_cancelled());
        token.cancel();
        assert!(before.is_cancelled() && token.is_cancelled());
        let after = Arc::new(TransferState::new());
        token.register(&after);
        assert!(after.is_cancelled());
    }

    #[test]
    fn finished_requests_do_not_accumulate() {
        let token = CancellationToken::new();
        for _ in 0..1000 {
            token.register(&Arc::new(TransferState::new()));
        }
        assert!(token.inner.transfers.lock().unwrap().len() <= 64 + 1);
    }
}
