//! Capability probing: asks `fi_getinfo` for reliable-datagram endpoints with RMA, messages
//! and remote CQ data, under the provider the config names, and picks one `fi_info` per NIC.

use std::ffi::{CStr, CString, c_char};
use std::fmt;

use libfabric_sys as fi;
use serde::{Deserialize, Serialize};

use super::{AUTO_ORDER, FabricConfig, FabricDomain, FabricReport};
use crate::error::TransportError;

/// A provider's memory-registration requirements (`fi_domain_attr::mr_mode` bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MrMode(pub u64);

const MR_MODE_NAMES: &[(u64, &str)] = &[
    (fi::FI_MR_LOCAL, "LOCAL"),
    (fi::FI_MR_RAW, "RAW"),
    (fi::FI_MR_VIRT_ADDR, "VIRT_ADDR"),
    (fi::FI_MR_ALLOCATED, "ALLOCATED"),
    (fi::FI_MR_PROV_KEY, "PROV_KEY"),
    (fi::FI_MR_MMU_NOTIFY, "MMU_NOTIFY"),
    (fi::FI_MR_RMA_EVENT, "RMA_EVENT"),
    (fi::FI_MR_ENDPOINT, "ENDPOINT"),
    (fi::FI_MR_HMEM, "HMEM"),
    (fi::FI_MR_COLLECTIVE, "COLLECTIVE"),
];

impl MrMode {
    /// The modes this domain knows how to honour; a provider needing others is not used.
    pub const SUPPORTED: Self = Self(
        fi::FI_MR_LOCAL
            | fi::FI_MR_VIRT_ADDR
            | fi::FI_MR_ALLOCATED
            | fi::FI_MR_PROV_KEY
            | fi::FI_MR_ENDPOINT,
    );

    /// Whether every bit of `bits` is set.
    pub fn has(self, bits: u64) -> bool {
        self.0 & bits == bits
    }
}

impl fmt::Display for MrMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        let mut first = true;
        let mut rest = self.0;
        for &(bit, name) in MR_MODE_NAMES {
            if self.0 & bit != 0 {
                if !first {
                    f.write_str("|")?;
                }
                f.write_str(name)?;
                first = false;
                rest &= !bit;
            }
        }
        if rest != 0 {
            if !first {
                f.write_str("|")?;
            }
            write!(f, "{rest:#x}")?;
        }
        Ok(())
    }
}

/// Capabilities asked for: messages and writes both ways, remote writes landing here.
/// `FI_SOURCE`: receive completions name their sender (the AV entry of the peer the provider
/// attributes the message to), which is how a holder learns who proved an address.
const CAPS: u64 = fi::FI_MSG
    | fi::FI_RMA
    | fi::FI_SEND
    | fi::FI_RECV
    | fi::FI_WRITE
    | fi::FI_REMOTE_WRITE
    | fi::FI_SOURCE;
/// Modes this domain can satisfy: it always passes a 64-byte context it owns.
const MODES: u64 = fi::FI_CONTEXT | fi::FI_CONTEXT2;

/// An `fi_getinfo` result list, freed on drop.
pub(crate) struct InfoList {
    lib: &'static fi::Library,
    head: *mut fi::fi_info,
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.head.is_null() {
            // SAFETY: from fi_getinfo, freed once.
            unsafe { self.lib.freeinfo(self.head) };
        }
    }
}

impl InfoList {
    fn entries(&self) -> impl Iterator<Item = *mut fi::fi_info> + '_ {
        std::iter::successors((!self.head.is_null()).then_some(self.head), |&p| {
            // SAFETY: a node of the list this owns.
            let next = unsafe { (*p).next };
            (!next.is_null()).then_some(next)
        })
    }
}

/// Reads a C string field, or "" for null.
///
/// # Safety
/// `p` is null or NUL-terminated.
pub(crate) unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: as documented.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// One candidate endpoint as `fi_getinfo` described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub(crate) provider: String,
    pub(crate) fabric: String,
    pub(crate) domain: String,
    pub(crate) mr_mode: MrMode,
    pub(crate) cq_data_size: usize,
    pub(crate) max_msg_size: usize,
    pub(crate) inject_size: usize,
    pub(crate) mode: u64,
}

impl Candidate {
    /// # Safety
    /// `info` is a complete `fi_info` from `fi_getinfo`.
    unsafe fn read(info: *const fi::fi_info) -> Self {
        // SAFETY: fi_getinfo fills every attribute pointer of the entries it returns.
        unsafe {
            let i = &*info;
            let fabric = &*i.fabric_attr;
            let domain = &*i.domain_attr;
            Self {
                provider: c_str(fabric.prov_name),
                fabric: c_str(fabric.name),
                domain: c_str(domain.name),
                mr_mode: MrMode(domain.mr_mode as u32 as u64),
                cq_data_size: domain.cq_data_size,
                max_msg_size: (*i.ep_attr).max_msg_size,
                inject_size: (*i.tx_attr).inject_size,
                mode: i.mode,
            }
        }
    }

    /// Why this endpoint cannot serve the engine, if it cannot.
    pub(crate) fn unusable(&self) -> Option<String> {
        if self.cq_data_size < 4 {
            return Some(format!(
                "provider {} carries {} bytes of remote CQ data; the engine's 4-byte immediates \
                 need at least 4 (FI_REMOTE_CQ_DATA)",
                self.provider, self.cq_data_size
            ));
        }
        if self.mr_mode.0 & !MrMode::SUPPORTED.0 != 0 {
            return Some(format!(
                "provider {} requires mr_mode {}, of which this domain honours {}",
                self.provider,
                self.mr_mode,
                MrMode::SUPPORTED
            ));
        }
        if self.mode & !MODES != 0 {
            return Some(format!(
                "provider {} requires mode bits {:#x} this domain does not provide",
                self.provider,
                self.mode & !MODES
            ));
        }
        None
    }
}

/// The entries chosen for a group: one per NIC (repeated where NICs stand in).
pub(crate) struct Chosen {
    list: InfoList,
    /// Index into the list per NIC.
    per_nic: Vec<usize>,
    pub(crate) fell_back: Option<String>,
    pub(crate) candidate: Candidate,
    pub(crate) stand_in: bool,
}

impl Chosen {
    /// The `fi_info` for NIC `nic`.
    pub(crate) fn info(&self, nic: usize) -> *mut fi::fi_info {
        let index = self.per_nic[nic % self.per_nic.len()];
        self.list.entries().nth(index).unwrap_or(self.list.head)
    }

    pub(crate) fn report(
        &self,
        lib: &fi::Library,
        config: &FabricConfig,
        domains: &[FabricDomain],
    ) -> FabricReport {
        let version = lib.api_version();
        FabricReport {
            requested: config.provider.to_string(),
            provider: self.candidate.provider.clone(),
            fell_back: self.fell_back.clone(),
            fabric: self.candidate.fabric.clone(),
            domains: domains.iter().map(|d| d.domain_name().to_owned()).collect(),
            stand_in_nics: self.stand_in,
            mr_mode: self.candidate.mr_mode,
            cq_data_size: self.candidate.cq_data_size,
            max_msg_size: self.candidate.max_msg_size,
            inject_size: self.candidate.inject_size,
            library: lib.path().to_owned(),
            api_version: format!("{}.{}", fi::fi_major(version), fi::fi_minor(version)),
        }
    }
}

/// Asks `fi_getinfo` for `provider`'s usable endpoints.
fn query(
    lib: &'static fi::Library,
    provider: &str,
    node: Option<&str>,
) -> Result<InfoList, String> {
    let prov = CString::new(provider).map_err(|_| "a provider name with a NUL".to_owned())?;
    let node = node
        .map(CString::new)
        .transpose()
        .map_err(|_| "a node with a NUL".to_owned())?;
    let hints = lib.allocinfo();
    if hints.is_null() {
        return Err("fi_allocinfo failed (out of memory)".to_owned());
    }
    let mut out: *mut fi::fi_info = std::ptr::null_mut();
    // SAFETY: `hints` and its attributes were allocated by the library; the provider name is
    // borrowed for the call and unset before the hints are freed (the library would free it).
    let rc = unsafe {
        (*hints).caps = CAPS;
        (*hints).mode = MODES;
        (*(*hints).ep_attr).type_ = fi::FI_EP_RDM;
        (*(*hints).domain_attr).mr_mode = MrMode::SUPPORTED.0 as i32;
        (*(*hints).domain_attr).threading = fi::FI_THREAD_DOMAIN;
        (*(*hints).fabric_attr).prov_name = prov.as_ptr().cast_mut();
        let (node_ptr, flags) = match &node {
            Some(n) => (n.as_ptr(), fi::FI_SOURCE),
            None => (std::ptr::null(), 0),
        };
        let rc = lib.getinfo(
            fi::MIN_API_VERSION,
            node_ptr,
            std::ptr::null(),
            flags,
            hints,
            &raw mut out,
        );
        (*(*hints).fabric_attr).prov_name = std::ptr::null_mut();
        lib.freeinfo(hints);
        rc
    };
    let list = InfoList { lib, head: out };
    if rc != 0 {
        return Err(if rc == -(fi::FI_ENODATA) {
            format!("libfabric has no usable `{provider}` endpoint here")
        } else {
            format!("fi_getinfo for `{provider}`: {}", lib.strerror(rc))
        });
    }
    if list.head.is_null() {
        return Err(format!(
            "libfabric has no usable `{provider}` endpoint here"
        ));
    }
    Ok(list)
}

/// Picks NIC entries out of `list`: the first usable entry, then up to `nics` distinct domains
/// of its provider and fabric (real NICs), repeating them where there are fewer.
fn pick(list: InfoList, nics: usize) -> Result<(InfoList, Vec<usize>, Candidate, bool), String> {
    let mut why_not = Vec::new();
    let mut chosen: Vec<(usize, Candidate)> = Vec::new();
    for (i, entry) in list.entries().enumerate() {
        // SAFETY: an entry of fi_getinfo's list.
        let c = unsafe { Candidate::read(entry) };
        if let Some(reason) = c.unusable() {
            why_not.push(reason);
            continue;
        }
        // NICs of one group share a provider and a fabric (EFA: one fabric, a domain per
        // NIC); tcp's entries for other networks are not extra NICs.
        let same_fabric = chosen
            .first()
            .is_none_or(|(_, f)| f.provider == c.provider && f.fabric == c.fabric);
        if same_fabric && chosen.len() < nics && chosen.iter().all(|(_, d)| d.domain != c.domain) {
            chosen.push((i, c));
        }
    }
    let Some((_, first)) = chosen.first().cloned() else {
        why_not.dedup();
        return Err(why_not.join("; "));
    };
    let stand_in = chosen.len() < nics;
    let per_nic = chosen.iter().map(|(i, _)| *i).collect();
    Ok((list, per_nic, first, stand_in))
}

/// Chooses the provider and its entries for `config`, falling back (visibly) only where the
/// config allows it.
pub(crate) fn choose(
    lib: &'static fi::Library,
    config: &FabricConfig,
) -> Result<Chosen, TransportError> {
    let node = config.node.as_deref();
    let attempt = |provider: &str| query(lib, provider, node).and_then(|l| pick(l, config.nics));
    let mut failures = Vec::new();
    let mut fell_back = None;
    if let Some(name) = config.provider.prov_name() {
        match attempt(name) {
            Ok((list, per_nic, candidate, stand_in)) => {
                return Ok(Chosen {
                    list,
                    per_nic,
                    fell_back: None,
                    candidate,
                    stand_in,
                });
            }
            Err(why) if config.required => {
                return Err(TransportError::ProviderUnavailable(format!(
                    "{why} (required, so not falling back)"
                )));
            }
            Err(why) => {
                tracing::warn!(provider = name, %why, "provider unavailable; falling back");
                fell_back = Some(why.clone());
                failures.push(why);
            }
        }
    }
    for &name in AUTO_ORDER {
        if config.provider.prov_name() == Some(name) {
            continue;
        }
        match attempt(name) {
            Ok((list, per_nic, candidate, stand_in)) => {
                return Ok(Chosen {
                    list,
                    per_nic,
                    fell_back,
                    candidate,
                    stand_in,
                });
            }
            Err(why) => failures.push(why),
        }
    }
    Err(TransportError::ProviderUnavailable(failures.join("; ")))
}

/// The providers libfabric lists as usable for the engine here (RDM, RMA, remote CQ data), by
/// name, each once.
pub fn available_providers() -> Result<Vec<String>, TransportError> {
    let lib =
        libfabric_sys::library().map_err(|e| TransportError::ProviderUnavailable(e.to_string()))?;
    let mut names = Vec::new();
    for name in ["efa", "tcp;ofi_rxm", "shm", "verbs;ofi_rxm", "psm3", "cxi"] {
        if query(lib, name, None).and_then(|l| pick(l, 1)).is_ok() {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mr_modes_print_by_name() {
        assert_eq!(MrMode(0).to_string(), "none");
        assert_eq!(
            MrMode(fi::FI_MR_LOCAL | fi::FI_MR_PROV_KEY).to_string(),
            "LOCAL|PROV_KEY"
        );
        assert_eq!(
            MrMode(fi::FI_MR_VIRT_ADDR | 1 << 40).to_string(),
            "VIRT_ADDR|0x10000000000"
        );
        assert!(MrMode::SUPPORTED.has(fi::FI_MR_LOCAL | fi::FI_MR_ENDPOINT));
        assert!(!MrMode::SUPPORTED.has(fi::FI_MR_RAW));
    }

    fn candidate() -> Candidate {
        Candidate {
            provider: "efa".to_owned(),
            fabric: "efa".to_owned(),
            domain: "rdmap0s31-rdm".to_owned(),
            mr_mode: MrMode(
                fi::FI_MR_LOCAL | fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_PROV_KEY,
            ),
            cq_data_size: 4,
            max_msg_size: 1 << 30,
            inject_size: 32,
            mode: 0,
        }
    }

    #[test]
    fn an_efa_like_endpoint_is_usable() {
        assert_eq!(candidate().unusable(), None);
    }

    #[test]
    fn a_provider_without_remote_cq_data_is_refused_saying_so() {
        let c = Candidate {
            cq_data_size: 0,
            ..candidate()
        };
        let why = c.unusable().unwrap();
        assert!(
            why.contains("remote CQ data") && why.contains("efa"),
            "{why}"
        );
    }

    #[test]
    fn registration_or_context_modes_beyond_ours_are_refused() {
        let raw = Candidate {
            mr_mode: MrMode(fi::FI_MR_RAW | fi::FI_MR_LOCAL),
            ..candidate()
        };
        assert!(raw.unusable().unwrap().contains("RAW"));
        let prefix = Candidate {
            mode: fi::FI_MSG_PREFIX,
            ..candidate()
        };
        assert!(prefix.unusable().unwrap().contains("mode bits"));
        let ctx = Candidate {
            mode: fi::FI_CONTEXT | fi::FI_CONTEXT2,
            ..candidate()
        };
        assert_eq!(ctx.unusable(), None, "contexts are provided");
    }
}
