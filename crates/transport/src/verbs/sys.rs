//! Whether this machine can run the verbs domain at all, and if not, what is missing: the
//! library (`libibverbs.so.1`, loaded at run time by [`super::HwVerbs`]'s loader), or any
//! device.

use crate::error::TransportError;

/// The library's file name (rdma-core's ABI 1).
pub const LIBRARY: &str = "libibverbs.so.1";

/// The RDMA devices `libibverbs` lists here (`ibv_get_device_list`), by name.
pub fn devices() -> Result<Vec<String>, TransportError> {
    super::hw::device_names()
}

/// Whether the verbs domain can run here: the device it would open, or an error naming what
/// is missing (the library, any device, the device asked for).
pub fn probe(device: Option<&str>) -> Result<String, TransportError> {
    let found = devices()?;
    match device {
        Some(want) => found.iter().find(|d| *d == want).cloned().ok_or_else(|| {
            TransportError::ProviderUnavailable(format!(
                "verbs: no RDMA device named {want} (found: {found:?})"
            ))
        }),
        None => found.first().cloned().ok_or_else(|| {
            TransportError::ProviderUnavailable(
                "verbs: no RDMA device (ibv_get_device_list is empty)".to_owned(),
            )
        }),
    }
}
