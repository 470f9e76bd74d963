//! In-process verbs devices: what the verbs domain's logic is tested against where there is
//! no RDMA NIC.
//!
//! A [`FakeFabric`] is a switch; each [`FakeVerbs`] made from it is one opened port with one
//! completion queue. It enforces what a ConnectX enforces where the domain can tell:
//!
//! - queue-pair states: `post_send` only in RTS, receives from INIT, transitions only
//!   RESET -> INIT -> RTR -> RTS (and to ERROR or RESET from anywhere), each with the
//!   attributes it needs;
//! - RC connections: a request reaches the remote queue pair only if that pair is in RTR or
//!   RTS and connected back to the sender; otherwise, or if the device is gone, the sender
//!   completes with retry-exceeded and its queue pair goes to ERROR, flushing what follows;
//! - memory: the local key and range of every SGE; the target's rkey, range and remote-write
//!   access of every write (a refusal is a remote access error at the sender, the target
//!   untouched, the sender's queue pair to ERROR);
//! - receives: a write with immediate or a send consumes a receive from the target's shared
//!   receive queue, waiting (receiver-not-ready, retried) while none is posted; a message
//!   longer than the buffer is a local length error there and an invalid request here; UD
//!   receives carry 40 bytes of GRH first and are dropped when no buffer is posted;
//! - send-queue depth, and one doorbell per post call.
//!
//! [`FakeFaults`] delays every request by up to `max_delay` (so requests complete out of
//! order, as RC with relaxed ordering and EFA's SRD may) and fails one in `fail_one_in`
//! with an injected status that leaves the queue pair usable.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{
    MrAccess, PortAddr, QpAttr, QpKind, QpState, RecvWr, SendOp, SendWr, Verbs, VerbsError, Wc,
    WcStatus,
};
use crate::domain::Notify;

mod switch;

/// The status number an injected failure completes with.
pub const INJECTED_STATUS: u32 = super::INJECTED_STATUS;
/// Bytes of global routing header in front of every UD receive.
pub const GRH_BYTES: u32 = super::GRH_BYTES;
/// How long a request waits before retrying when the receiver has no buffer posted.
const RNR_DELAY: Duration = Duration::from_micros(200);

/// Delays and failures a fake device applies to the requests it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeFaults {
    /// Seed of the delays and failures.
    pub seed: u64,
    /// Each request is delayed uniformly in `[0, max_delay]`.
    pub max_delay: Duration,
    /// One request in this many fails with [`INJECTED_STATUS`] (0: none).
    pub fail_one_in: u32,
}

impl FakeFaults {
    /// Every request delivered at once, none failed.
    pub const NONE: Self = Self {
        seed: 0,
        max_delay: Duration::ZERO,
        fail_one_in: 0,
    };
}

#[derive(Debug, Clone, Copy)]
struct Mr {
    addr: u64,
    len: u64,
    remote_write: bool,
}

#[derive(Debug)]
struct Qp {
    kind: QpKind,
    state: QpState,
    srq: Option<u32>,
    rq: VecDeque<RecvWr>,
    remote: Option<(u16, u32)>,
    qkey: u32,
    remote_write: bool,
    sq_depth: u32,
    outstanding: u32,
}

struct Device {
    alive: bool,
    mrs: HashMap<u32, Mr>,
    next_key: u32,
    qps: HashMap<u32, Qp>,
    srqs: HashMap<u32, (u32, VecDeque<RecvWr>)>,
    cq: VecDeque<Wc>,
    notify: Option<Arc<dyn Notify>>,
    doorbells: u64,
    faults: FakeFaults,
    rng: u64,
}

impl Device {
    /// Keeps `mr` under a fresh key (never 0); its lkey and rkey, which the fake makes equal.
    fn register(&mut self, mr: Mr) -> (u32, u32) {
        let key = self.next_key;
        self.next_key = self.next_key.wrapping_add(1).max(1);
        self.mrs.insert(key, mr);
        (key, key)
    }

    fn push(&mut self, wc: Wc) {
        self.cq.push_back(wc);
        if let Some(n) = &self.notify {
            n.notify();
        }
    }

    fn covers(&self, key: u32, addr: u64, len: u64) -> Option<Mr> {
        let mr = *self.mrs.get(&key)?;
        let end = addr.checked_add(len)?;
        (addr >= mr.addr && end <= mr.addr + mr.len).then_some(mr)
    }

    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
}

#[derive(Debug, Clone, Copy)]
struct Delivery {
    due: Instant,
    seq: u64,
    lid: u16,
    qpn: u32,
    wr: SendWr,
    inject: bool,
}

#[derive(Default)]
struct Switch {
    devices: HashMap<u16, Device>,
    /// Exported "dma-bufs": descriptor -> (address, length) of the memory behind it.
    dmabufs: HashMap<i32, (u64, u64)>,
    next_fd: i32,
    next_lid: u16,
    next_qpn: u32,
    next_seq: u64,
    pending: Vec<Delivery>,
}

/// An in-process switch of fake verbs devices.
#[derive(Clone, Default)]
pub struct FakeFabric {
    inner: Arc<Mutex<Switch>>,
}

impl std::fmt::Debug for FakeFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeFabric").finish_non_exhaustive()
    }
}

impl FakeFabric {
    /// A switch with no devices.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new, well-behaved device on this switch.
    pub fn device(&self) -> FakeVerbs {
        self.device_with(FakeFaults::NONE)
    }

    /// A new device whose requests follow `faults`.
    pub fn device_with(&self, faults: FakeFaults) -> FakeVerbs {
        let mut s = self.lock();
        s.next_lid += 1;
        let lid = s.next_lid;
        s.devices.insert(
            lid,
            Device {
                alive: true,
                mrs: HashMap::new(),
                next_key: 1,
                qps: HashMap::new(),
                srqs: HashMap::new(),
                cq: VecDeque::new(),
                notify: None,
                doorbells: 0,
                faults,
                rng: faults.seed | 1,
            },
        );
        FakeVerbs {
            fabric: self.clone(),
            lid,
        }
    }

    /// Makes the device at `lid` disappear (its host died): requests to it exhaust their
    /// retries, its own calls fail.
    pub fn kill(&self, lid: u16) -> bool {
        let mut s = self.lock();
        match s.devices.get_mut(&lid) {
            Some(d) => {
                d.alive = false;
                d.mrs.clear();
                true
            }
            None => false,
        }
    }

    /// A dma-buf exporter for "device" memory that is host memory standing in for it: what
    /// the verbs domain's GPU registration path is tested with.
    pub fn dmabuf_exporter(&self, ordinal: u32) -> FakeDmaBuf {
        FakeDmaBuf {
            fabric: self.clone(),
            ordinal,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Switch> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Exports host memory as fake dma-bufs of CUDA device `ordinal` ([`FakeFabric::dmabuf_exporter`]).
#[derive(Debug)]
pub struct FakeDmaBuf {
    fabric: FakeFabric,
    ordinal: u32,
}

impl super::DmaBufExporter for FakeDmaBuf {
    fn device(&self) -> crate::mr::Device {
        crate::mr::Device::Cuda {
            ordinal: self.ordinal,
        }
    }

    fn export(&self, addr: u64, len: u64) -> Result<(i32, u64), crate::error::TransportError> {
        // Page-granular, as CUDA's export is: the buffer covers whole pages around the range.
        let start = addr & !4095;
        let end = (addr + len).div_ceil(4096) * 4096;
        let mut s = self.fabric.lock();
        s.next_fd += 1;
        let fd = 1000 + s.next_fd;
        s.dmabufs.insert(fd, (start, end - start));
        Ok((fd, addr - start))
    }

    fn release(&self, fd: i32) {
        self.fabric.lock().dmabufs.remove(&fd);
    }
}

/// One opened port of a fake device.
pub struct FakeVerbs {
    fabric: FakeFabric,
    lid: u16,
}

impl std::fmt::Debug for FakeVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeVerbs").field("lid", &self.lid).finish()
    }
}

impl FakeVerbs {
    /// This device's LID (what [`FakeFabric::kill`] takes).
    pub fn lid(&self) -> u16 {
        self.lid
    }

    /// The state of queue pair `qpn`, if it exists.
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        let s = self.fabric.lock();
        s.devices.get(&self.lid)?.qps.get(&qpn).map(|q| q.state)
    }

    /// Runs `f` on this device, after delivering what is due.
    fn with<T>(
        &self,
        f: impl FnOnce(&mut Switch, u16) -> Result<T, VerbsError>,
    ) -> Result<T, VerbsError> {
        let mut s = self.fabric.lock();
        s.progress(Instant::now());
        if !s.devices.get(&self.lid).is_some_and(|d| d.alive) {
            return Err(VerbsError::DeviceGone);
        }
        f(&mut s, self.lid)
    }
}

impl Drop for FakeVerbs {
    fn drop(&mut self) {
        let mut s = self.fabric.lock();
        s.devices.remove(&self.lid);
        let lid = self.lid;
        s.pending.retain(|d| d.lid != lid);
    }
}

fn gid_of(lid: u16) -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[14..].copy_from_slice(&lid.to_be_bytes());
    gid
}

impl Verbs for FakeVerbs {
    fn port_addr(&self) -> PortAddr {
        PortAddr {
            gid: gid_of(self.lid),
            lid: self.lid,
            port: 1,
        }
    }

    unsafe fn reg_mr(
        &mut self,
        addr: u64,
        len: u64,
        access: MrAccess,
    ) -> Result<(u32, u32), VerbsError> {
        if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
            return Err(VerbsError::Invalid(
                "an empty or wrapping region".to_owned(),
            ));
        }
        self.with(|s, lid| {
            Ok(s.device(lid)?.register(Mr {
                addr,
                len,
                remote_write: access.remote_write,
            }))
        })
    }

    unsafe fn reg_dmabuf_mr(
        &mut self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<(u32, u32), VerbsError> {
        self.with(|s, lid| {
            let &(base, size) = s
                .dmabufs
                .get(&fd)
                .ok_or_else(|| VerbsError::Invalid(format!("{fd} is not a dma-buf")))?;
            if offset.checked_add(len).is_none_or(|end| end > size) || len == 0 {
                return Err(VerbsError::Invalid("range outside the dma-buf".to_owned()));
            }
            // The fake's device memory is host memory: the iova must be where it lives.
            if iova != base + offset {
                return Err(VerbsError::Invalid(
                    "iova is not the exported address".to_owned(),
                ));
            }
            Ok(s.device(lid)?.register(Mr {
                addr: iova,
                len,
                remote_write: access.remote_write,
            }))
        })
    }

    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError> {
        self.with(|s, lid| {
            s.device(lid)?
                .mrs
                .remove(&lkey)
                .map(|_| ())
                .ok_or_else(|| VerbsError::Invalid(format!("no region with key {lkey}")))
        })
    }

    fn create_srq(&mut self, depth: u32) -> Result<u32, VerbsError> {
        self.with(|s, lid| {
            s.next_qpn += 1;
            let id = s.next_qpn;
            s.device(lid)?.srqs.insert(id, (depth, VecDeque::new()));
            Ok(id)
        })
    }

    fn create_qp(
        &mut self,
        kind: QpKind,
        srq: Option<u32>,
        sq_depth: u32,
    ) -> Result<u32, VerbsError> {
        self.with(|s, lid| {
            if let Some(id) = srq
                && !s.device(lid)?.srqs.contains_key(&id)
            {
                return Err(VerbsError::Invalid(format!("no shared receive queue {id}")));
            }
            s.next_qpn += 1;
            let qpn = s.next_qpn;
            s.device(lid)?.qps.insert(
                qpn,
                Qp {
                    kind,
                    state: QpState::Reset,
                    srq,
                    rq: VecDeque::new(),
                    remote: None,
                    qkey: 0,
                    remote_write: false,
                    sq_depth,
                    outstanding: 0,
                },
            );
            Ok(qpn)
        })
    }

    fn modify_qp(&mut self, qpn: u32, attr: &QpAttr) -> Result<(), VerbsError> {
        self.with(|s, lid| {
            let qp = s.qp(lid, qpn)?;
            let refuse = |what| VerbsError::QpState {
                qpn,
                state: qp.state,
                what,
            };
            match (qp.state, attr.state) {
                (_, QpState::Error) => {
                    qp.state = QpState::Error;
                    // Everything outstanding is flushed, reported on the completion queue.
                    let (flushed, keep): (Vec<Delivery>, Vec<Delivery>) =
                        std::mem::take(&mut s.pending)
                            .into_iter()
                            .partition(|d| d.lid == lid && d.qpn == qpn);
                    s.pending = keep;
                    for d in &flushed {
                        s.complete(d, WcStatus::Flushed);
                    }
                    return Ok(());
                }
                (_, QpState::Reset) => {
                    qp.remote = None;
                }
                (QpState::Reset, QpState::Init) => {
                    if attr.port == 0 {
                        return Err(VerbsError::Invalid("INIT needs a port".to_owned()));
                    }
                    qp.remote_write = attr.remote_write;
                    qp.qkey = attr.qkey;
                }
                (QpState::Init, QpState::Rtr) => {
                    if qp.kind == QpKind::Rc {
                        let Some(dest) = attr.dest.filter(|_| attr.dest_qp_num != 0) else {
                            return Err(VerbsError::Invalid(
                                "RTR of an RC queue pair needs the remote port and queue pair"
                                    .to_owned(),
                            ));
                        };
                        if ![256, 512, 1024, 2048, 4096].contains(&attr.mtu) {
                            return Err(VerbsError::Invalid(format!("path MTU {}", attr.mtu)));
                        }
                        qp.remote = Some((dest.lid, attr.dest_qp_num));
                    }
                }
                (QpState::Rtr, QpState::Rts) => {
                    if qp.kind == QpKind::Rc && (attr.retry_cnt > 7 || attr.rnr_retry > 7) {
                        return Err(VerbsError::Invalid("retry counts above 7".to_owned()));
                    }
                }
                _ => return Err(refuse("that transition")),
            }
            qp.state = attr.state;
            Ok(())
        })
    }

    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError> {
        self.with(|s, lid| {
            s.device(lid)?
                .qps
                .remove(&qpn)
                .ok_or_else(|| VerbsError::Invalid(format!("no queue pair {qpn}")))?;
            s.pending.retain(|d| !(d.lid == lid && d.qpn == qpn));
            Ok(())
        })
    }

    unsafe fn post_send(&mut self, qpn: u32, wrs: &[SendWr]) -> Result<(), VerbsError> {
        let now = Instant::now();
        self.with(|s, lid| {
            let qp = s.qp(lid, qpn)?;
            if qp.state != QpState::Rts {
                return Err(VerbsError::QpState {
                    qpn,
                    state: qp.state,
                    what: "posting sends",
                });
            }
            if qp.outstanding as usize + wrs.len() > qp.sq_depth as usize {
                return Err(VerbsError::Full("the send queue"));
            }
            let is_ud = qp.kind == QpKind::Ud;
            if wrs
                .iter()
                .any(|w| matches!(w.op, SendOp::UdSend { .. }) != is_ud)
            {
                return Err(VerbsError::Invalid(
                    "UD sends go on UD queue pairs, writes and sends on RC ones".to_owned(),
                ));
            }
            qp.outstanding += wrs.len() as u32;
            let dev = s.device(lid)?;
            dev.doorbells += 1;
            let faults = dev.faults;
            let mut timed = Vec::with_capacity(wrs.len());
            for wr in wrs {
                let delay = if faults.max_delay.is_zero() {
                    Duration::ZERO
                } else {
                    let r = dev.next_random();
                    faults.max_delay.mul_f64((r % 1_000_000) as f64 / 1e6)
                };
                let inject = faults.fail_one_in > 0
                    && dev.next_random() % u64::from(faults.fail_one_in) == 0;
                timed.push((now + delay, *wr, inject));
            }
            for (due, wr, inject) in timed {
                let seq = s.next_seq;
                s.next_seq += 1;
                s.pending.push(Delivery {
                    due,
                    seq,
                    lid,
                    qpn,
                    wr,
                    inject,
                });
            }
            s.progress(now);
            Ok(())
        })
    }

    unsafe fn post_srq_recv(&mut self, srq: u32, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        self.with(|s, lid| {
            let dev = s.device(lid)?;
            dev.doorbells += 1;
            let (depth, queue) = dev
                .srqs
                .get_mut(&srq)
                .ok_or_else(|| VerbsError::Invalid(format!("no shared receive queue {srq}")))?;
            if queue.len() + wrs.len() > *depth as usize {
                return Err(VerbsError::Full("the shared receive queue"));
            }
            queue.extend(wrs.iter().copied());
            s.progress(Instant::now());
            Ok(())
        })
    }

    unsafe fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        self.with(|s, lid| {
            let qp = s.qp(lid, qpn)?;
            if qp.state == QpState::Reset || qp.srq.is_some() {
                return Err(VerbsError::QpState {
                    qpn,
                    state: qp.state,
                    what: "posting receives (RESET, or a shared receive queue's pair)",
                });
            }
            qp.rq.extend(wrs.iter().copied());
            s.device(lid)?.doorbells += 1;
            Ok(())
        })
    }

    fn poll_cq(&mut self, out: &mut Vec<Wc>, max: usize) -> usize {
        let mut s = self.fabric.lock();
        s.progress(Instant::now());
        let Some(dev) = s.devices.get_mut(&self.lid) else {
            return 0;
        };
        let n = max.min(dev.cq.len());
        out.extend(dev.cq.drain(..n));
        n
    }

    fn doorbells(&self) -> u64 {
        let s = self.fabric.lock();
        s.devices.get(&self.lid).map_or(0, |d| d.doorbells)
    }

    fn set_notify(&mut self, notify: Arc<dyn Notify>) {
        let mut s = self.fabric.lock();
        if let Some(d) = s.devices.get_mut(&self.lid) {
            d.notify = Some(notify);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let s = self.fabric.lock();
        s.pending
            .iter()
            .filter(|d| d.lid == self.lid)
            .map(|d| d.due)
            .min()
    }
}
