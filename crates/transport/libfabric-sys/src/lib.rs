//! # kvroute-libfabric-sys
//!
//! Bindings to the libfabric 1.x ABI and a loader that opens `libfabric.so.1` at run time, the
//! way cudarc loads CUDA: a machine without libfabric builds everything and gets a clear error,
//! naming the package to install, only when it asks for a fabric domain.
//!
//! - [`bindings`]: types and constants, generated from the libfabric 1.17 headers by
//!   `cargo xtask bindgen` and checked in (building needs neither headers nor libclang).
//! - [`Library`]: the five exported functions the rest needs (`fi_getinfo`, `fi_freeinfo`,
//!   `fi_dupinfo`, `fi_fabric`, `fi_strerror`), resolved from the loaded library, and its API
//!   version, checked against [`MIN_API_VERSION`].
//! - The header's static-inline calls (`fi_domain`, `fi_writemsg`, `fi_cq_read`, ...) as Rust
//!   functions over the ops tables of the fid structs, exactly as the header writes them. Each
//!   returns `-FI_ENOSYS` where a provider leaves the op out instead of jumping through null.
//!
//! Structs the library fills (`fi_info` and its attributes) must be allocated by the library
//! ([`Library::allocinfo`], [`Library::dupinfo`]): a newer library may have appended fields.

#![allow(unsafe_code)]

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    unsafe_op_in_unsafe_fn,
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    clippy::all,
    rustdoc::all
)]
pub mod bindings;

use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::sync::OnceLock;

pub use bindings::*;

/// `FI_ADDR_UNSPEC` (`(uint64_t) -1` in the header, which bindgen cannot evaluate).
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;
/// `FI_ADDR_NOTAVAIL`: what `fi_av_insert` leaves for an address it could not insert.
pub const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
/// `FI_KEY_NOTAVAIL`.
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;

/// `FI_VERSION(major, minor)`.
pub const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// The major part of a packed version.
pub const fn fi_major(version: u32) -> u32 {
    version >> 16
}

/// The minor part of a packed version.
pub const fn fi_minor(version: u32) -> u32 {
    version & 0xffff
}

/// The oldest libfabric API this crate runs against, and the version it asks `fi_getinfo` for.
pub const MIN_API_VERSION: u32 = fi_version(1, 14);

/// Where the library is looked for, in order: `$KVROUTE_LIBFABRIC` if set, the loader's search
/// path, and the AWS EFA installer's location.
const CANDIDATES: &[&str] = &[
    "libfabric.so.1",
    "libfabric.so",
    "/opt/amazon/efa/lib/libfabric.so.1",
    "/opt/amazon/efa/lib64/libfabric.so.1",
];

/// Why libfabric could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    /// No candidate could be opened.
    NotFound {
        /// What was tried, each with the loader's message.
        tried: Vec<String>,
    },
    /// The library lacks a function every libfabric 1.x exports.
    MissingSymbol {
        /// The library that was opened.
        path: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// The library's API is older than [`MIN_API_VERSION`].
    TooOld {
        /// The library that was opened.
        path: String,
        /// Its `fi_version()`, as (major, minor).
        found: (u32, u32),
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotFound { tried } => write!(
                f,
                "libfabric is not installed: could not load libfabric.so.1 ({}); install the \
                 `libfabric1` package (Debian/Ubuntu: apt-get install libfabric1, or \
                 `cargo xtask deps`), or set KVROUTE_LIBFABRIC to the library's path",
                tried.join("; ")
            ),
            Self::MissingSymbol { path, symbol } => {
                write!(
                    f,
                    "{path} is not a libfabric 1.x library: it lacks {symbol}"
                )
            }
            Self::TooOld { path, found } => write!(
                f,
                "{path} provides libfabric API {}.{}; kvroute needs {}.{} or newer",
                found.0,
                found.1,
                fi_major(MIN_API_VERSION),
                fi_minor(MIN_API_VERSION)
            ),
        }
    }
}

impl std::error::Error for LoadError {}

type GetInfoFn = unsafe extern "C" fn(
    version: u32,
    node: *const c_char,
    service: *const c_char,
    flags: u64,
    hints: *const fi_info,
    info: *mut *mut fi_info,
) -> c_int;
type FreeInfoFn = unsafe extern "C" fn(info: *mut fi_info);
type DupInfoFn = unsafe extern "C" fn(info: *const fi_info) -> *mut fi_info;
type FabricFn = unsafe extern "C" fn(
    attr: *mut fi_fabric_attr,
    fabric: *mut *mut fid_fabric,
    context: *mut c_void,
) -> c_int;
type StrErrorFn = unsafe extern "C" fn(errnum: c_int) -> *const c_char;
type VersionFn = unsafe extern "C" fn() -> u32;

/// The loaded library and the functions it exports that this crate calls.
pub struct Library {
    path: String,
    api_version: u32,
    getinfo: GetInfoFn,
    freeinfo: FreeInfoFn,
    dupinfo: DupInfoFn,
    fabric: FabricFn,
    strerror: StrErrorFn,
    // Kept last: the function pointers above point into it.
    _lib: libloading::Library,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field(
                "api_version",
                &(fi_major(self.api_version), fi_minor(self.api_version)),
            )
            .finish_non_exhaustive()
    }
}

/// The process-wide library, loaded on first use.
pub fn library() -> Result<&'static Library, LoadError> {
    static LIBRARY: OnceLock<Result<Library, LoadError>> = OnceLock::new();
    LIBRARY
        .get_or_init(Library::load)
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens the shared library at `path` and puts back every signal disposition its constructors
/// changed.
///
/// Debian's libfabric links the PSM and PSM2 libraries, whose constructors install a handler
/// for SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGINT and SIGTERM that prints a backtrace from the
/// signal context. That handler can deadlock (it allocates), so a process that crashed after
/// loading libfabric could hang instead of dying, and Ctrl-C or SIGTERM went through it too.
/// The process's own dispositions, the defaults or the Rust runtime's, are what it keeps.
pub fn open_keeping_signal_dispositions(
    path: &str,
) -> Result<libloading::Library, libloading::Error> {
    const SIGNALS: std::ops::Range<libc::c_int> = 1..32;
    let saved: Vec<Option<libc::sigaction>> = SIGNALS
        .map(|signal| {
            // SAFETY: a zeroed sigaction is a valid out-parameter; a null new action only
            // reads the current one.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            let read = unsafe { libc::sigaction(signal, std::ptr::null(), &mut old) };
            (read == 0).then_some(old)
        })
        .collect();
    // SAFETY: loading the library runs its constructors; the only process-wide state they
    // change that this crate knows of is the signal dispositions restored below.
    let lib = unsafe { libloading::Library::new(path) };
    for (signal, old) in SIGNALS.zip(&saved) {
        if let Some(old) = old {
            // SAFETY: `old` is what sigaction itself returned for this signal.
            unsafe { libc::sigaction(signal, old, std::ptr::null_mut()) };
        }
    }
    lib
}

impl Library {
    fn load() -> Result<Self, LoadError> {
        let from_env = std::env::var("KVROUTE_LIBFABRIC").ok();
        let mut tried = Vec::new();
        for path in from_env
            .iter()
            .map(String::as_str)
            .chain(CANDIDATES.iter().copied())
        {
            match open_keeping_signal_dispositions(path) {
                Ok(lib) => return Self::resolve(path, lib),
                Err(e) => tried.push(format!("{path}: {e}")),
            }
        }
        Err(LoadError::NotFound { tried })
    }

    fn resolve(path: &str, lib: libloading::Library) -> Result<Self, LoadError> {
        fn symbol<T: Copy>(
            lib: &libloading::Library,
            path: &str,
            name: &'static str,
        ) -> Result<T, LoadError> {
            // SAFETY: `T` is the C signature of `name` in libfabric 1.x's fabric.h.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|_| LoadError::MissingSymbol {
                    path: path.to_owned(),
                    symbol: name,
                })
        }
        let version: VersionFn = symbol(&lib, path, "fi_version")?;
        // SAFETY: fi_version takes nothing and returns the packed API version.
        let api_version = unsafe { version() };
        if api_version < MIN_API_VERSION {
            return Err(LoadError::TooOld {
                path: path.to_owned(),
                found: (fi_major(api_version), fi_minor(api_version)),
            });
        }
        Ok(Self {
            path: path.to_owned(),
            api_version,
            getinfo: symbol(&lib, path, "fi_getinfo")?,
            freeinfo: symbol(&lib, path, "fi_freeinfo")?,
            dupinfo: symbol(&lib, path, "fi_dupinfo")?,
            fabric: symbol(&lib, path, "fi_fabric")?,
            strerror: symbol(&lib, path, "fi_strerror")?,
            _lib: lib,
        })
    }

    /// The path the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The library's `fi_version()`.
    pub fn api_version(&self) -> u32 {
        self.api_version
    }

    /// `fi_getinfo`.
    ///
    /// # Safety
    /// `node` and `service` are null or NUL-terminated; `hints` is null or from
    /// [`Library::allocinfo`]; `info` is writable.
    pub unsafe fn getinfo(
        &self,
        version: u32,
        node: *const c_char,
        service: *const c_char,
        flags: u64,
        hints: *const fi_info,
        info: *mut *mut fi_info,
    ) -> c_int {
        // SAFETY: the caller's contract is fi_getinfo's.
        unsafe { (self.getinfo)(version, node, service, flags, hints, info) }
    }

    /// `fi_freeinfo`.
    ///
    /// # Safety
    /// `info` came from this library and is not used afterwards.
    pub unsafe fn freeinfo(&self, info: *mut fi_info) {
        // SAFETY: as documented.
        unsafe { (self.freeinfo)(info) }
    }

    /// `fi_dupinfo`: a deep copy, allocated by the library.
    ///
    /// # Safety
    /// `info` is null or a valid `fi_info` from this library.
    pub unsafe fn dupinfo(&self, info: *const fi_info) -> *mut fi_info {
        // SAFETY: as documented.
        unsafe { (self.dupinfo)(info) }
    }

    /// `fi_allocinfo`: an empty `fi_info` with its attribute structs, for hints.
    pub fn allocinfo(&self) -> *mut fi_info {
        // SAFETY: fi_dupinfo(NULL) allocates a zeroed fi_info and its attributes.
        unsafe { (self.dupinfo)(std::ptr::null()) }
    }

    /// `fi_fabric`.
    ///
    /// # Safety
    /// `attr` is a fabric attribute returned by `fi_getinfo`; `fabric` is writable.
    pub unsafe fn fabric(
        &self,
        attr: *mut fi_fabric_attr,
        fabric: *mut *mut fid_fabric,
        context: *mut c_void,
    ) -> c_int {
        // SAFETY: as documented.
        unsafe { (self.fabric)(attr, fabric, context) }
    }

    /// `fi_strerror` for a (positive or negative) libfabric error number.
    pub fn strerror(&self, errnum: c_int) -> String {
        // SAFETY: fi_strerror returns a static string for any number.
        let s = unsafe { (self.strerror)(errnum.saturating_abs()) };
        if s.is_null() {
            return format!("libfabric error {errnum}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

/// `-FI_ENOSYS`, returned where a provider leaves an op out.
const NOSYS: c_int = -FI_ENOSYS;

/// Calls an op of an ops table, or returns `-FI_ENOSYS` (as the return type) if it is absent.
macro_rules! op {
    ($table:expr, $op:ident, $missing:expr, ($($arg:expr),* $(,)?)) => {{
        // SAFETY (for the callers): the fid is live, so its ops table is.
        let table = unsafe { &*$table };
        match table.$op {
            Some(f) => unsafe { f($($arg),*) },
            None => $missing,
        }
    }};
}

/// `fi_close`.
///
/// # Safety
/// `fid` is a live fid, not used afterwards.
pub unsafe fn fi_close(fid: *mut fid) -> c_int {
    op!((*fid).ops, close, NOSYS, (fid))
}

/// `fi_domain`.
///
/// # Safety
/// `fabric` is live; `info` came from `fi_getinfo`; `domain` is writable.
pub unsafe fn fi_domain(
    fabric: *mut fid_fabric,
    info: *mut fi_info,
    domain: *mut *mut fid_domain,
    context: *mut c_void,
) -> c_int {
    op!(
        (*fabric).ops,
        domain,
        NOSYS,
        (fabric, info, domain, context)
    )
}

/// `fi_endpoint`.
///
/// # Safety
/// `domain` is live; `info` came from `fi_getinfo`; `ep` is writable.
pub unsafe fn fi_endpoint(
    domain: *mut fid_domain,
    info: *mut fi_info,
    ep: *mut *mut fid_ep,
    context: *mut c_void,
) -> c_int {
    op!((*domain).ops, endpoint, NOSYS, (domain, info, ep, context))
}

/// `fi_cq_open`.
///
/// # Safety
/// `domain` is live; `attr` is valid; `cq` is writable.
pub unsafe fn fi_cq_open(
    domain: *mut fid_domain,
    attr: *mut fi_cq_attr,
    cq: *mut *mut fid_cq,
    context: *mut c_void,
) -> c_int {
    op!((*domain).ops, cq_open, NOSYS, (domain, attr, cq, context))
}

/// `fi_av_open`.
///
/// # Safety
/// `domain` is live; `attr` is valid; `av` is writable.
pub unsafe fn fi_av_open(
    domain: *mut fid_domain,
    attr: *mut fi_av_attr,
    av: *mut *mut fid_av,
    context: *mut c_void,
) -> c_int {
    op!((*domain).ops, av_open, NOSYS, (domain, attr, av, context))
}

/// `fi_ep_bind`.
///
/// # Safety
/// `ep` and `bfid` are live.
pub unsafe fn fi_ep_bind(ep: *mut fid_ep, bfid: *mut fid, flags: u64) -> c_int {
    op!(
        (*ep).fid.ops,
        bind,
        NOSYS,
        (&raw mut (*ep).fid, bfid, flags)
    )
}

/// `fi_mr_bind`.
///
/// # Safety
/// `mr` and `bfid` are live.
pub unsafe fn fi_mr_bind(mr: *mut fid_mr, bfid: *mut fid, flags: u64) -> c_int {
    op!(
        (*mr).fid.ops,
        bind,
        NOSYS,
        (&raw mut (*mr).fid, bfid, flags)
    )
}

/// `fi_enable`.
///
/// # Safety
/// `ep` is live and bound to its CQ and AV.
pub unsafe fn fi_enable(ep: *mut fid_ep) -> c_int {
    op!(
        (*ep).fid.ops,
        control,
        NOSYS,
        (&raw mut (*ep).fid, FI_ENABLE as c_int, std::ptr::null_mut())
    )
}

/// `fi_mr_enable`.
///
/// # Safety
/// `mr` is live.
pub unsafe fn fi_mr_enable(mr: *mut fid_mr) -> c_int {
    op!(
        (*mr).fid.ops,
        control,
        NOSYS,
        (&raw mut (*mr).fid, FI_ENABLE as c_int, std::ptr::null_mut())
    )
}

/// `fi_mr_reg`.
///
/// # Safety
/// `domain` is live; `[buf, buf + len)` stays valid until the region is closed; `mr` is
/// writable.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_mr_reg(
    domain: *mut fid_domain,
    buf: *const c_void,
    len: usize,
    access: u64,
    offset: u64,
    requested_key: u64,
    flags: u64,
    mr: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    op!(
        (*domain).mr,
        reg,
        NOSYS,
        (
            &raw mut (*domain).fid,
            buf,
            len,
            access,
            offset,
            requested_key,
            flags,
            mr,
            context
        )
    )
}

/// `fi_mr_key`.
///
/// # Safety
/// `mr` is live.
pub unsafe fn fi_mr_key(mr: *mut fid_mr) -> u64 {
    // SAFETY: as documented.
    unsafe { (*mr).key }
}

/// `fi_mr_desc`.
///
/// # Safety
/// `mr` is live.
pub unsafe fn fi_mr_desc(mr: *mut fid_mr) -> *mut c_void {
    // SAFETY: as documented.
    unsafe { (*mr).mem_desc }
}

/// `fi_av_insert`.
///
/// # Safety
/// `av` is live; `addr` holds `count` addresses in the AV's format; `fi_addr` has room for
/// `count` entries.
pub unsafe fn fi_av_insert(
    av: *mut fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi_addr_t,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    op!(
        (*av).ops,
        insert,
        NOSYS,
        (av, addr, count, fi_addr, flags, context)
    )
}

/// `fi_av_remove`.
///
/// # Safety
/// `av` is live; `fi_addr` holds `count` addresses it returned.
pub unsafe fn fi_av_remove(
    av: *mut fid_av,
    fi_addr: *mut fi_addr_t,
    count: usize,
    flags: u64,
) -> c_int {
    op!((*av).ops, remove, NOSYS, (av, fi_addr, count, flags))
}

/// `fi_getname` on an endpoint.
///
/// # Safety
/// `ep` is live and enabled; `addr` has `*addrlen` bytes of room.
pub unsafe fn fi_getname(ep: *mut fid_ep, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    op!(
        (*ep).cm,
        getname,
        NOSYS,
        (&raw mut (*ep).fid, addr, addrlen)
    )
}

/// `fi_writemsg`.
///
/// # Safety
/// `ep` is live; `msg` and everything it points to are valid; the source stays valid until
/// the write completes.
pub unsafe fn fi_writemsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    op!((*ep).rma, writemsg, NOSYS as isize, (ep, msg, flags))
}

/// `fi_writedata`.
///
/// # Safety
/// As [`fi_writemsg`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_writedata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest_addr: fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
) -> isize {
    op!(
        (*ep).rma,
        writedata,
        NOSYS as isize,
        (ep, buf, len, desc, data, dest_addr, addr, key, context)
    )
}

/// `fi_inject_writedata`: the source is copied before the call returns and no completion is
/// generated for the write (a failure may still be reported as an error entry).
///
/// # Safety
/// `ep` is live; `buf` is valid for `len` bytes for the call.
pub unsafe fn fi_inject_writedata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest_addr: fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    op!(
        (*ep).rma,
        injectdata,
        NOSYS as isize,
        (ep, buf, len, data, dest_addr, addr, key)
    )
}

/// `fi_send`.
///
/// # Safety
/// `ep` is live; the buffer stays valid until the send completes.
pub unsafe fn fi_send(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    op!(
        (*ep).msg,
        send,
        NOSYS as isize,
        (ep, buf, len, desc, dest_addr, context)
    )
}

/// `fi_recv`.
///
/// # Safety
/// `ep` is live; the buffer stays valid and untouched until the receive completes.
pub unsafe fn fi_recv(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    src_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    op!(
        (*ep).msg,
        recv,
        NOSYS as isize,
        (ep, buf, len, desc, src_addr, context)
    )
}

/// `fi_cq_read`.
///
/// # Safety
/// `cq` is live; `buf` has room for `count` entries of the CQ's format.
pub unsafe fn fi_cq_read(cq: *mut fid_cq, buf: *mut c_void, count: usize) -> isize {
    op!((*cq).ops, read, NOSYS as isize, (cq, buf, count))
}

/// `fi_cq_readfrom`: as `fi_cq_read`, with each entry's source address in `src_addr`
/// (`FI_ADDR_NOTAVAIL` where the provider cannot name one).
///
/// # Safety
/// `cq` is live; `buf` has room for `count` entries of the CQ's format and `src_addr` for
/// `count` addresses.
pub unsafe fn fi_cq_readfrom(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    src_addr: *mut fi_addr_t,
) -> isize {
    op!(
        (*cq).ops,
        readfrom,
        NOSYS as isize,
        (cq, buf, count, src_addr)
    )
}

/// `fi_cq_readerr`.
///
/// # Safety
/// `cq` is live; `buf` is a valid error entry (with `err_data_size` 0 or its buffer).
pub unsafe fn fi_cq_readerr(cq: *mut fid_cq, buf: *mut fi_cq_err_entry, flags: u64) -> isize {
    op!((*cq).ops, readerr, NOSYS as isize, (cq, buf, flags))
}

/// `fi_cq_strerror`: the provider's message for an error entry, or `None`.
///
/// # Safety
/// `cq` is live; `err_data` is the entry's.
pub unsafe fn fi_cq_strerror(
    cq: *mut fid_cq,
    prov_errno: c_int,
    err_data: *const c_void,
) -> Option<String> {
    let mut buf = [0 as c_char; 256];
    let s = op!(
        (*cq).ops,
        strerror,
        std::ptr::null(),
        (cq, prov_errno, err_data, buf.as_mut_ptr(), buf.len())
    );
    if s.is_null() {
        return None;
    }
    // SAFETY: the provider returns a NUL-terminated string (possibly `buf` itself).
    Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_pack_as_the_header_does() {
        assert_eq!(fi_version(1, 14), 0x0001_000e);
        assert_eq!(
            (fi_major(MIN_API_VERSION), fi_minor(MIN_API_VERSION)),
            (1, 14)
        );
        assert_eq!(
            fi_version(FI_MAJOR_VERSION as u32, FI_MINOR_VERSION as u32),
            fi_version(1, 17),
            "the bindings were generated from libfabric 1.17"
        );
    }

    #[test]
    fn a_missing_library_names_the_package_to_install() {
        let e = LoadError::NotFound {
            tried: vec!["libfabric.so.1: not found".to_owned()],
        };
        let msg = e.to_string();
        assert!(
            msg.contains("libfabric1") && msg.contains("cargo xtask deps"),
            "{msg}"
        );
    }

    #[test]
    fn an_old_library_is_refused_with_both_versions() {
        let e = LoadError::TooOld {
            path: "x".to_owned(),
            found: (1, 9),
        };
        assert!(e.to_string().contains("1.9") && e.to_string().contains("1.14"));
    }

    /// Runs where libfabric is installed (CI installs it through `cargo xtask deps`).
    #[test]
    fn the_installed_library_loads_and_reports_its_version() {
        match library() {
            Ok(lib) => {
                assert!(lib.api_version() >= MIN_API_VERSION);
                assert!(!lib.strerror(FI_EAGAIN).is_empty());
            }
            Err(e) => eprintln!("skipped: {e}"),
        }
    }
}
