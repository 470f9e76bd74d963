//! The handshake's wire formats: a verbs address (what a peer needs to reach this domain's
//! UD queue pair) and the handshake message that carries a pair's numbers and first PSN.

use crate::error::TransportError;
use crate::verbs::PortAddr;

/// Bytes of an encoded verbs address.
pub(super) const ADDR_BYTES: usize = 35;
/// Handshake message: magic, kind, the sender's address, its two queue pairs, its PSN.
pub(super) const HS_BYTES: usize = 4 + 1 + ADDR_BYTES + 12;
pub(super) const HS_MAGIC: u32 = 0x4b56_5256; // "KVRV"
pub(super) const HS_REQUEST: u8 = 1;
pub(super) const HS_ACCEPT: u8 = 2;
/// Handshake receive buffers kept posted on the UD queue pair, and their size (GRH first).
pub(super) const HS_RECVS: usize = 64;
pub(super) const HS_SLOT: usize = 128;
/// Handshake send slots (reused round-robin; a UD send completes at once).
pub(super) const HS_SENDS: usize = 64;

/// A verbs address, decoded: what peers need to reach this domain's handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VerbsAddr {
    /// The port (GID, LID, number).
    pub port: PortAddr,
    /// The UD queue pair handshakes go to.
    pub ud_qpn: u32,
    /// Its queue key.
    pub qkey: u32,
    /// Random per domain: a restarted process is a new address.
    pub nonce: u64,
}

impl VerbsAddr {
    /// The bytes carried in a [`DomainAddr`](crate::addr::DomainAddr).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(ADDR_BYTES);
        b.extend_from_slice(&self.port.gid);
        b.extend_from_slice(&self.port.lid.to_le_bytes());
        b.push(self.port.port);
        b.extend_from_slice(&self.ud_qpn.to_le_bytes());
        b.extend_from_slice(&self.qkey.to_le_bytes());
        b.extend_from_slice(&self.nonce.to_le_bytes());
        b
    }

    /// Parses a peer's address bytes (untrusted).
    pub fn decode(b: &[u8]) -> Result<Self, TransportError> {
        if b.len() != ADDR_BYTES {
            return Err(TransportError::MalformedAddress(format!(
                "a verbs address is {ADDR_BYTES} bytes, not {}",
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[..16]);
        let mut nonce = [0u8; 8];
        nonce.copy_from_slice(&b[27..35]);
        Ok(Self {
            port: PortAddr {
                gid,
                lid: u16::from_le_bytes([b[16], b[17]]),
                port: b[18],
            },
            ud_qpn: u32_at(19),
            qkey: u32_at(23),
            nonce: u64::from_le_bytes(nonce),
        })
    }
}

/// A handshake message, as it travels between UD queue pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    /// Request (1) or accept (2).
    pub kind: u8,
    /// The sender.
    pub from: VerbsAddr,
    /// The sender's SEND/RECV queue pair for this peer.
    pub send_qpn: u32,
    /// The sender's WRITE queue pair for this peer.
    pub write_qpn: u32,
    /// The first PSN the sender sends with.
    pub psn: u32,
}

impl Handshake {
    /// Bytes of an encoded message.
    pub const BYTES: usize = HS_BYTES;

    /// Writes the message into `out` (at least [`Handshake::BYTES`] long).
    pub fn encode(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
        out[4] = self.kind;
        out[5..5 + ADDR_BYTES].copy_from_slice(&self.from.encode());
        let rest = 5 + ADDR_BYTES;
        out[rest..rest + 4].copy_from_slice(&self.send_qpn.to_le_bytes());
        out[rest + 4..rest + 8].copy_from_slice(&self.write_qpn.to_le_bytes());
        out[rest + 8..rest + 12].copy_from_slice(&self.psn.to_le_bytes());
    }

    /// Parses what a UD receive delivered (anyone can send to a UD queue pair: untrusted).
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < HS_BYTES || b[..4] != HS_MAGIC.to_le_bytes() {
            return None;
        }
        let kind = b[4];
        if kind != HS_REQUEST && kind != HS_ACCEPT {
            return None;
        }
        let from = VerbsAddr::decode(&b[5..5 + ADDR_BYTES]).ok()?;
        let rest = 5 + ADDR_BYTES;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Self {
            kind,
            from,
            send_qpn: u32_at(rest),
            write_qpn: u32_at(rest + 4),
            psn: u32_at(rest + 8),
        })
    }
}
