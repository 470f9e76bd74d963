//! The libfabric domain: EFA in production (paper 002 section 3.5), the `tcp;ofi_rxm` and `shm`
//! providers on any Linux machine, all through the same `FI_EP_RDM` code.
//!
//! - Endpoints are reliable datagram (`FI_EP_RDM`) with an address vector ([`FabricDomain`]
//!   per NIC); a write's immediate travels as remote CQ data (`FI_REMOTE_CQ_DATA`) and the
//!   target sees it as an `FI_REMOTE_WRITE` completion carrying the value.
//! - Memory registration honours whatever `mr_mode` the provider asks for ([`MrMode`]):
//!   descriptors where `FI_MR_LOCAL` wants them, offsets instead of virtual addresses without
//!   `FI_MR_VIRT_ADDR`, provider keys with `FI_MR_PROV_KEY`, binding to the endpoint with
//!   `FI_MR_ENDPOINT`.
//! - The provider is chosen by [`FabricConfig::provider`]; what was actually opened (provider,
//!   `mr_mode`, whether it fell back) is in the [`FabricReport`], and with
//!   [`FabricConfig::required`] a missing provider is an error, never a silent fallback.
//!
//! libfabric itself is loaded at run time ([`libfabric_sys::library`]); a machine without it
//! builds fine and gets [`TransportError::ProviderUnavailable`] naming the package to install.

#[cfg(feature = "bench")]
pub mod bench;
mod ctx;
mod domain;
mod info;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use domain::{FabricDomain, remove_shm_regions_of_dead_process};
pub use info::{MrMode, available_providers};

use crate::error::TransportError;
use crate::mr::Device;
use crate::{EngineConfig, TransferEngine};

/// Which libfabric provider to open.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ProviderChoice {
    /// `efa` if present, else `tcp;ofi_rxm`.
    Auto,
    /// AWS Elastic Fabric Adapter (SRD).
    Efa,
    /// TCP through the RxM utility provider: reliable datagrams over TCP sockets.
    Tcp,
    /// Shared memory, between processes of one host.
    Shm,
    /// Any other provider, by its libfabric name (`verbs;ofi_rxm`, ...).
    Named(String),
}

impl ProviderChoice {
    /// The libfabric provider name, or `None` for [`ProviderChoice::Auto`].
    pub fn prov_name(&self) -> Option<&str> {
        match self {
            Self::Auto => None,
            Self::Efa => Some("efa"),
            Self::Tcp => Some("tcp;ofi_rxm"),
            Self::Shm => Some("shm"),
            Self::Named(n) => Some(n),
        }
    }
}

impl fmt::Display for ProviderChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prov_name().unwrap_or("auto"))
    }
}

impl FromStr for ProviderChoice {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "auto" => Self::Auto,
            "efa" => Self::Efa,
            "tcp" | "tcp;ofi_rxm" => Self::Tcp,
            "shm" => Self::Shm,
            "" => return Err(TransportError::InvalidArgument("an empty provider name")),
            // `sockets` works but is orders of magnitude slower than tcp: allowed by name only.
            other => Self::Named(other.to_owned()),
        })
    }
}

/// The providers [`ProviderChoice::Auto`] tries, in order.
pub const AUTO_ORDER: &[&str] = &["efa", "tcp;ofi_rxm"];

/// How to open a fabric domain group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricConfig {
    /// The provider.
    pub provider: ProviderChoice,
    /// Refuse to start unless exactly [`FabricConfig::provider`] opens (no fallback to the
    /// automatic order). Meaningless with [`ProviderChoice::Auto`].
    pub required: bool,
    /// Local address to bind, for providers that take one (tcp: an IP of the interface to
    /// use, e.g. `127.0.0.1` or a veth's address). `None`: the provider's first choice.
    pub node: Option<String>,
    /// NICs in the group, 1 to 4. Where the provider reports fewer distinct NICs (tcp and
    /// shm on one host), endpoints of the same one stand in for the rest.
    pub nics: usize,
    /// Completion-queue entries read per `fi_cq_read`.
    pub cq_batch: usize,
    /// Completion-queue size asked for.
    pub cq_size: usize,
    /// Registered buffers sends are copied into when the provider requires registered
    /// sources (`FI_MR_LOCAL`), and their size (the largest message then).
    pub send_buffers: usize,
    /// Bytes per send buffer.
    pub send_buffer_len: usize,
    /// `None`: an idle worker keeps polling (lowest latency, a core per worker, as RDMA
    /// engines run). `Some(d)`: an idle worker parks between polls (for machines with more
    /// engines than cores), every `d` at first and, the longer nothing has completed or been
    /// posted, every eighth of that time, up to [`IDLE_POLL_MAX`] (or `d` if longer). What
    /// arrives after an idle spell waits at most the longer of `d` and the shorter of an
    /// eighth of the spell and `IDLE_POLL_MAX`; an engine idle for seconds wakes a thousand
    /// times a second rather than every `d` (many processes polling every 50 us starve the
    /// one that has work on a host with few cores).
    pub idle_poll: Option<Duration>,
    /// How long a posted write or send may wait for its completion before it fails with
    /// [`crate::TransferError::TimedOut`]. Bounds what a dead or refusing peer costs.
    pub op_timeout: Duration,
    /// Treat the provider as needing `FI_MR_LOCAL` (descriptors on every local buffer, sends
    /// copied into registered buffers) even if it does not: runs EFA's path on tcp or shm.
    pub force_mr_local: bool,
    /// Post each peer's writes and sends on an endpoint of their own (receives and peers'
    /// writes still arrive on the one published endpoint). `None`: only where the provider
    /// needs it, `shm`. libfabric 1.17's `shm` reports a sender's completions in post order
    /// from one response queue per endpoint, and a write to a dead peer never gets its
    /// response: with one endpoint, every later completion (to live peers too) waits behind
    /// it forever. With an endpoint per peer a dead peer stalls only its own. Costs one more
    /// shared-memory region per peer, polled through the same completion queue.
    pub tx_endpoint_per_peer: Option<bool>,
}

impl Default for FabricConfig {
    fn default() -> Self {
        Self {
            provider: ProviderChoice::Auto,
            required: false,
            node: None,
            nics: 1,
            cq_batch: 64,
            cq_size: 16384,
            send_buffers: 64,
            send_buffer_len: 64 * 1024,
            idle_poll: None,
            op_timeout: Duration::from_secs(10),
            force_mr_local: false,
            tx_endpoint_per_peer: None,
        }
    }
}

/// The longest an idle worker with [`FabricConfig::idle_poll`] set parks between polls (when
/// `idle_poll` itself is shorter).
pub const IDLE_POLL_MAX: Duration = Duration::from_millis(1);

impl FabricConfig {
    /// A config for `provider` with everything else default.
    pub fn provider(provider: ProviderChoice) -> Self {
        Self {
            provider,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<(), TransportError> {
        if self.nics == 0 || self.nics > crate::MAX_NICS {
            return Err(TransportError::InvalidArgument(
                "a fabric domain group has 1 to 4 NICs",
            ));
        }
        if self.cq_batch == 0 || self.cq_size == 0 {
            return Err(TransportError::InvalidArgument(
                "cq_batch and cq_size must be positive",
            ));
        }
        if self.send_buffers == 0 || self.send_buffer_len == 0 {
            return Err(TransportError::InvalidArgument(
                "send_buffers and send_buffer_len must be positive",
            ));
        }
        if self.op_timeout.is_zero() {
            return Err(TransportError::InvalidArgument(
                "op_timeout must be positive",
            ));
        }
        if self.node.as_deref().is_some_and(|n| n.contains('\0')) {
            return Err(TransportError::InvalidArgument("node contains a NUL byte"));
        }
        Ok(())
    }
}

/// What [`open`] actually got: the thing to log and to check, since providers differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricReport {
    /// The provider asked for.
    pub requested: String,
    /// The provider opened (its libfabric name).
    pub provider: String,
    /// Why the provider asked for was not used, when it was not.
    pub fell_back: Option<String>,
    /// The fabric's name (tcp: the network, e.g. `127.0.0.1/32`).
    pub fabric: String,
    /// Each NIC's domain name, NIC 0 first.
    pub domains: Vec<String>,
    /// Whether some NICs are further endpoints on the same domain (fewer distinct NICs than
    /// asked for).
    pub stand_in_nics: bool,
    /// The memory-registration mode the provider requires.
    pub mr_mode: MrMode,
    /// Bytes of remote CQ data a write may carry (the immediate needs 4).
    pub cq_data_size: usize,
    /// Largest message or write.
    pub max_msg_size: usize,
    /// Largest inject (copied at post) size.
    pub inject_size: usize,
    /// The loaded library's path and API version.
    pub library: String,
    /// `major.minor` of the loaded library's API.
    pub api_version: String,
}

impl fmt::Display for FabricReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "libfabric {} ({}): provider {} on {} [{}], mr_mode {}, cq data {} B",
            self.api_version,
            self.library,
            self.provider,
            self.fabric,
            self.domains.join(", "),
            self.mr_mode,
            self.cq_data_size
        )?;
        if self.stand_in_nics {
            f.write_str(", NICs stand in on one domain")?;
        }
        if let Some(why) = &self.fell_back {
            write!(f, " (asked for {}: {why})", self.requested)?;
        }
        Ok(())
    }
}

/// Opens `config.nics` fabric domains, ready to be a domain group.
pub fn open(config: &FabricConfig) -> Result<(Vec<FabricDomain>, FabricReport), TransportError> {
    config.validate()?;
    let lib =
        libfabric_sys::library().map_err(|e| TransportError::ProviderUnavailable(e.to_string()))?;
    let chosen = info::choose(lib, config)?;
    let mut domains = Vec::with_capacity(config.nics);
    for nic in 0..config.nics {
        domains.push(FabricDomain::open(lib, &chosen, nic, config)?);
    }
    let report = chosen.report(lib, config, &domains);
    tracing::info!(%report, "opened fabric domains");
    Ok((domains, report))
}

impl TransferEngine {
    /// An engine over libfabric: one domain group of `fabric.nics` NICs serving host memory.
    pub fn fabric(
        fabric: &FabricConfig,
        config: EngineConfig,
    ) -> Result<(Self, FabricReport), TransportError> {
        let (domains, report) = open(fabric)?;
        let engine = Self::builder()
            .config(config)
            .group(Device::Host, domains)
            .build()?;
        Ok((engine, report))
    }
}

#[cfg(test)]
mod tests;
