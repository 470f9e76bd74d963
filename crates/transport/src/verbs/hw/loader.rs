//! `libibverbs.so.1`, loaded at run time: the exported functions used, resolved once, and
//! the device list.

use std::ffi::{CStr, c_char, c_int, c_void};

use super::abi::*;
use crate::error::TransportError;

/// The exported functions used, resolved once.
pub(super) struct Lib {
    pub(super) _lib: libloading::Library,
    pub(super) get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    pub(super) free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    pub(super) get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    pub(super) open_device: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    pub(super) close_device: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) alloc_pd: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    pub(super) dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) reg_mr_iova2:
        unsafe extern "C" fn(*mut c_void, *mut c_void, usize, u64, u32) -> *mut c_void,
    pub(super) reg_dmabuf_mr:
        Option<unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut c_void>,
    pub(super) dereg_mr: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) create_cq:
        unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut c_void, c_int) -> *mut c_void,
    pub(super) destroy_cq: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) create_srq: unsafe extern "C" fn(*mut c_void, *mut IbvSrqInitAttr) -> *mut c_void,
    pub(super) destroy_srq: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) create_qp: unsafe extern "C" fn(*mut c_void, *mut IbvQpInitAttr) -> *mut c_void,
    pub(super) modify_qp: unsafe extern "C" fn(*mut c_void, *mut IbvQpAttr, c_int) -> c_int,
    pub(super) destroy_qp: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) create_ah: unsafe extern "C" fn(*mut c_void, *mut IbvAhAttr) -> *mut c_void,
    pub(super) destroy_ah: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub(super) query_port: unsafe extern "C" fn(*mut c_void, u8, *mut IbvPortAttr) -> c_int,
    pub(super) query_gid: unsafe extern "C" fn(*mut c_void, u8, c_int, *mut IbvGid) -> c_int,
}

pub(super) fn unavailable(what: String) -> TransportError {
    TransportError::ProviderUnavailable(format!("verbs: {what}"))
}

impl Lib {
    pub(super) fn load() -> Result<Self, TransportError> {
        // SAFETY: loading rdma-core's libibverbs runs its initialisers, which only read the
        // system's provider configuration.
        let lib = unsafe { libloading::Library::new(crate::verbs::sys::LIBRARY) }.map_err(|e| {
            unavailable(format!(
                "{} cannot be loaded ({e}); install rdma-core's libibverbs1",
                crate::verbs::sys::LIBRARY
            ))
        })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is its declaration in verbs.h.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|_| {
                    unavailable(format!("{} lacks {}", crate::verbs::sys::LIBRARY, $name))
                })?
            };
        }
        Ok(Self {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr_iova2: sym!("ibv_reg_mr_iova2"),
            // SAFETY: as `sym!`; absent before rdma-core 34, then dma-buf is unavailable.
            reg_dmabuf_mr: unsafe { lib.get(b"ibv_reg_dmabuf_mr\0") }.ok().map(|s| *s),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            create_srq: sym!("ibv_create_srq"),
            destroy_srq: sym!("ibv_destroy_srq"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            create_ah: sym!("ibv_create_ah"),
            destroy_ah: sym!("ibv_destroy_ah"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            _lib: lib,
        })
    }
}

/// Runs `f` on the devices `ibv_get_device_list` returns (pointer and name) while the list is
/// alive, then frees it.
pub(super) fn with_devices<T>(
    lib: &Lib,
    f: impl FnOnce(&[(*mut c_void, String)]) -> T,
) -> Result<T, TransportError> {
    let mut count: c_int = 0;
    // SAFETY: a valid out-pointer; the list is freed below.
    let list = unsafe { (lib.get_device_list)(&mut count) };
    if list.is_null() {
        // ENOSYS where the kernel has no RDMA stack at all.
        return Err(unavailable(format!(
            "no RDMA device: ibv_get_device_list failed ({}; no NIC, or no RDMA stack in the kernel)",
            std::io::Error::last_os_error()
        )));
    }
    let devices: Vec<(*mut c_void, String)> = (0..usize::try_from(count).unwrap_or(0))
        .map(|i| {
            // SAFETY: `list` holds `count` devices, valid until it is freed.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; its name, if any, is NUL-terminated and owned by it.
            let name = unsafe { (lib.get_device_name)(dev) };
            let name = if name.is_null() {
                String::new()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            };
            (dev, name)
        })
        .collect();
    let out = f(&devices);
    // SAFETY: the list `get_device_list` returned, freed once.
    unsafe { (lib.free_device_list)(list) };
    Ok(out)
}

/// The RDMA devices `libibverbs` lists here, by name.
pub(in crate::verbs) fn device_names() -> Result<Vec<String>, TransportError> {
    let lib = Lib::load()?;
    with_devices(&lib, |devices| {
        devices.iter().map(|(_, n)| n.clone()).collect()
    })
}
