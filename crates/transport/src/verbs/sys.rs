//! `libibverbs.so.1`, loaded at run time: nothing is linked and no RDMA header is needed to
//! build. [`probe`] says whether this machine can run the verbs domain at all, and if not,
//! what is missing: the library, or any device.

use std::ffi::{CStr, c_char, c_int, c_void};

use crate::error::TransportError;

/// The library's file name (rdma-core's ABI 1).
pub const LIBRARY: &str = "libibverbs.so.1";

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// The RDMA devices `libibverbs` lists here (`ibv_get_device_list`), by name.
pub fn devices() -> Result<Vec<String>, TransportError> {
    // SAFETY: loading rdma-core's libibverbs runs its initialisers, which only read the
    // system's provider configuration.
    let lib = unsafe { libloading::Library::new(LIBRARY) }.map_err(|e| {
        TransportError::ProviderUnavailable(format!(
            "verbs: {LIBRARY} cannot be loaded ({e}); install rdma-core's libibverbs1"
        ))
    })?;
    let symbol = |name: &[u8]| {
        TransportError::ProviderUnavailable(format!(
            "verbs: {LIBRARY} lacks {}",
            String::from_utf8_lossy(&name[..name.len() - 1])
        ))
    };
    // SAFETY: the signatures are those of verbs.h (stable since rdma-core's ABI 1).
    let (get, free, name) = unsafe {
        (
            lib.get::<GetDeviceList>(b"ibv_get_device_list\0")
                .map_err(|_| symbol(b"ibv_get_device_list\0"))?,
            lib.get::<FreeDeviceList>(b"ibv_free_device_list\0")
                .map_err(|_| symbol(b"ibv_free_device_list\0"))?,
            lib.get::<GetDeviceName>(b"ibv_get_device_name\0")
                .map_err(|_| symbol(b"ibv_get_device_name\0"))?,
        )
    };
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid out-pointer; the list is freed below.
    let list = unsafe { get(&mut count) };
    if list.is_null() {
        // ENOSYS where the kernel has no RDMA stack at all.
        return Err(TransportError::ProviderUnavailable(format!(
            "verbs: no RDMA device: ibv_get_device_list failed ({}; no NIC, or no RDMA stack in the kernel)",
            std::io::Error::last_os_error()
        )));
    }
    let names = (0..usize::try_from(count).unwrap_or(0))
        .map(|i| {
            // SAFETY: `list` holds `count` device pointers, each valid until it is freed.
            let name = unsafe { name(*list.add(i)) };
            if name.is_null() {
                String::new()
            } else {
                // SAFETY: a NUL-terminated name owned by the device.
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            }
        })
        .collect();
    // SAFETY: the list `get` returned, freed once.
    unsafe { free(list) };
    Ok(names)
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
