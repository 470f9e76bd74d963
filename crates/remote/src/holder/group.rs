//! How a holder batches a request batch's segments: the key that groups those one kernel call
//! serves together, and a group's work as the kernels take it.

use std::borrow::Cow;

use crate::Sparse;
use crate::wire;

use super::serve::Parsed;

/// What batches segments: those with one key are served by one kernel call (on a GPU, one
/// launch serves every group of a scale). Groups are served in key order: by chunk and layer,
/// then dense before sparse before transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct GroupKey {
    pub(super) chunk: u32,
    pub(super) layer: u16,
    pub(super) kind: GroupKind,
    /// The request's softmax scale, as bits (a group has one scale).
    pub(super) scale_bits: u32,
}

/// How a group's segments are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum GroupKind {
    /// Dense partial attention over the whole chunk.
    Dense,
    /// Sparse partial attention over `k` selected tokens per query token, each shared by
    /// `rows_per_token` rows (the heads).
    Sparse { k: u32, rows_per_token: u32 },
    /// Moving bytes (fetch, gather) rather than attending: each segment served on its own.
    Transfer,
}

impl GroupKind {
    /// The sparse selection of `indices`; `None` for dense.
    pub(super) fn selection(self, indices: &[i32]) -> Option<Sparse<'_>> {
        match self {
            Self::Sparse { k, rows_per_token } => Some(Sparse {
                indices,
                k,
                rows_per_token,
            }),
            Self::Dense | Self::Transfer => None,
        }
    }
}

/// A group of segments gathered for its kernel call: its chunk, layer, kind and scale, its
/// (request, segment) members, their query rows one after another (borrowed from the slot for
/// a lone segment) and their indices.
pub(super) struct GroupWork<'a> {
    pub(super) chunk: u32,
    pub(super) layer: u16,
    pub(super) kind: GroupKind,
    pub(super) scale: f32,
    pub(super) segs: Vec<Member<'a>>,
    pub(super) queries: Cow<'a, [u16]>,
    pub(super) indices: Vec<i32>,
}

/// A segment of a group: which request of the batch, which of its segments, and the segment.
#[derive(Clone, Copy)]
pub(super) struct Member<'a> {
    pub(super) request: usize,
    pub(super) segment: usize,
    pub(super) seg: &'a wire::Segment<'a>,
}

/// A partial group's segments, with their query rows one after another and their indices:
/// a lone segment's rows borrowed straight from its slot, several gathered into one batch.
pub(super) fn group_work<'a>(
    &GroupKey {
        chunk,
        layer,
        kind,
        scale_bits,
    }: &GroupKey,
    members: &[(usize, usize)],
    requests: &'a [Parsed<'a>],
) -> GroupWork<'a> {
    let segs: Vec<_> = members
        .iter()
        .filter_map(|&(r, s)| {
            let seg = requests[r].as_ref().ok()?.segments[s].as_ref().ok()?;
            Some(Member {
                request: r,
                segment: s,
                seg,
            })
        })
        .collect();
    let (queries, indices): (Cow<'_, [u16]>, Vec<i32>) = match segs.as_slice() {
        [Member { seg, .. }] => match seg.query_words() {
            Some(words) => (Cow::Borrowed(words), seg.indices()),
            None => (Cow::Owned(seg.queries()), seg.indices()),
        },
        _ => {
            let mut q = Vec::new();
            let mut idx = Vec::new();
            for Member { seg, .. } in &segs {
                match seg.query_words() {
                    Some(words) => q.extend_from_slice(words),
                    None => q.extend(seg.queries()),
                }
                idx.extend(seg.indices());
            }
            (Cow::Owned(q), idx)
        }
    };
    GroupWork {
        chunk,
        layer,
        kind,
        scale: f32::from_bits(scale_bits),
        segs,
        queries,
        indices,
    }
}
