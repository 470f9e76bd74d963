//! Posting to one NIC: a transfer's next units built and posted in batches within its
//! budget, and a send.

use crate::addr::MAX_NICS;
use crate::domain::{Domain, PeerId, SendWr};
use crate::engine::message::{LocalSrc, Work};
use crate::engine::stats::{self, DomainCounters};
use crate::engine::unit_wr::build_wr;

use super::{BATCH, BUDGET, InFlight, Posted, Posting};

/// Builds and posts the next units of `t`, NIC by NIC, within the budget.
pub(super) fn post_units<D: Domain>(
    domains: &mut [D],
    peers: &[[PeerId; MAX_NICS]],
    null_src: &LocalSrc,
    posting: &mut Posting,
    counters: &[DomainCounters],
    t: &mut InFlight,
    wr_id: u64,
) -> Posted {
    let writes = match &t.work {
        Work::Writes(writes) => writes,
        Work::Send { peer, payload } => {
            let wr = SendWr {
                wr_id,
                peer: peers[*peer as usize][0],
                addr: payload.as_ptr() as u64,
                len: payload.len() as u64,
            };
            return post_send(&mut domains[0], &counters[0], t, &wr);
        }
    };
    let nics = domains.len() as u32;
    let mut budget = BUDGET;
    let mut more = false;
    for d in 0..nics {
        let total = t.units_for(d, nics);
        while t.posted[d as usize] < total {
            if budget == 0 {
                return Posted::More;
            }
            let batch = if posting.full[d as usize] { 1 } else { BATCH };
            let n = (total - t.posted[d as usize]).min(batch).min(budget);
            let scratch = &mut posting.batch;
            scratch.clear();
            for k in t.posted[d as usize]..t.posted[d as usize] + n {
                let unit = t.unit_at(d, k, nics);
                scratch.push(build_wr(
                    writes, t.units, unit, d as usize, wr_id, peers, null_src,
                ));
            }
            if !t.state.try_post(u64::from(n)) {
                return Posted::Stopped;
            }
            let accepted = match domains[d as usize].post_writes(scratch) {
                Ok(a) => (a as u32).min(n),
                Err(e) => {
                    t.state.unpost(u64::from(n));
                    return Posted::Failed(e);
                }
            };
            if accepted < n {
                t.state.unpost(u64::from(n - accepted));
            }
            t.posted[d as usize] += accepted;
            budget -= accepted;
            let counters = &counters[d as usize];
            stats::add(&counters.posted, u64::from(accepted));
            if !cfg!(kvroute_no_metrics) {
                let bytes = scratch[..accepted as usize].iter().map(|w| w.len).sum();
                stats::add(&counters.bytes, bytes);
            }
            posting.full[d as usize] = accepted < n;
            if accepted < n {
                more = true;
                break;
            }
        }
    }
    if more {
        Posted::More
    } else {
        Posted::Exhausted
    }
}

/// Posts a transfer's one send, on NIC 0.
pub(super) fn post_send<D: Domain>(
    nic0: &mut D,
    counters: &DomainCounters,
    t: &mut InFlight,
    wr: &SendWr,
) -> Posted {
    if t.posted[0] == 1 {
        return Posted::Exhausted;
    }
    if !t.state.try_post(1) {
        return Posted::Stopped;
    }
    // SAFETY: the payload is owned by the transfer, which stays in its slot (the boxed bytes do
    // not move) until the send's completion finishes it.
    match unsafe { nic0.post_send(wr) } {
        Ok(true) => {
            t.posted[0] = 1;
            stats::add(&counters.posted, 1);
            if !cfg!(kvroute_no_metrics) {
                stats::add(&counters.bytes, wr.len);
            }
            Posted::Exhausted
        }
        Ok(false) => {
            t.state.unpost(1);
            Posted::More
        }
        Err(e) => {
            t.state.unpost(1);
            Posted::Failed(e)
        }
    }
}
