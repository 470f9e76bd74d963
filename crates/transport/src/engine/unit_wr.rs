//! A transfer unit's work request, built on the fly from the submitted request (no per-page
//! allocation): the shard, page, scatter target or barrier target `unit` names, posted on NIC
//! `d` with NIC `d`'s keys, so sharding never pairs a NIC with another NIC's key.

use super::message::{LocalSrc, RemoteTarget, Writes};
use crate::addr::MAX_NICS;
use crate::domain::{PeerId, WriteWr};
use crate::plan::shard;

/// The work request of unit `unit` (of `units`) of `writes`, posted on NIC `d`, with NIC
/// `d`'s keys.
#[inline(always)]
pub(super) fn build_wr(
    writes: &Writes,
    units: u32,
    unit: u32,
    d: usize,
    wr_id: u64,
    peers: &[[PeerId; MAX_NICS]],
    null_src: &LocalSrc,
) -> WriteWr {
    let u = unit as usize;
    let imm_only = |dst: &RemoteTarget, imm: u32| WriteWr {
        wr_id,
        peer: peers[dst.peer as usize][d],
        src_addr: null_src.addr,
        lkey: null_src.lkeys[d],
        len: 0,
        dst_addr: dst.addr,
        rkey: dst.rkeys[d],
        imm: Some(imm),
    };
    match writes {
        Writes::Single {
            src,
            dst,
            src_offset,
            dst_offset,
            len,
            imm,
        } => {
            let (offset, len) = shard(*len, units as usize, u);
            WriteWr {
                wr_id,
                peer: peers[dst.peer as usize][d],
                src_addr: src.addr + src_offset + offset,
                lkey: src.lkeys[d],
                len,
                dst_addr: dst.addr + dst_offset + offset,
                rkey: dst.rkeys[d],
                imm: *imm,
            }
        }
        Writes::Paged {
            src,
            dst,
            page_len,
            src_pages,
            dst_pages,
            imm,
        } => WriteWr {
            wr_id,
            peer: peers[dst.peer as usize][d],
            src_addr: src.addr + src_pages.byte_offset(u),
            lkey: src.lkeys[d],
            len: *page_len,
            dst_addr: dst.addr + dst_pages.byte_offset(u),
            rkey: dst.rkeys[d],
            imm: *imm,
        },
        Writes::Imm { dst, imm } => imm_only(dst, *imm),
        Writes::Scatter { src, targets, imm } => {
            let target = &targets[u];
            WriteWr {
                wr_id,
                peer: peers[target.dst.peer as usize][d],
                src_addr: src.addr + target.src_offset,
                lkey: src.lkeys[d],
                len: target.len,
                dst_addr: target.dst.addr + target.dst_offset,
                rkey: target.dst.rkeys[d],
                imm: *imm,
            }
        }
        Writes::Barrier { targets, imm } => imm_only(&targets[u], *imm),
    }
}
