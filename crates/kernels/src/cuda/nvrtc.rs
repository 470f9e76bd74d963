//! Compiling `kernels.cu` with NVRTC through cudarc, to a cubin for one GPU architecture, with
//! ptxas's resource report (registers, shared memory, spills) parsed from the program log.
//!
//! NVRTC needs no GPU and no driver: the same call that builds the kernels at run time on a
//! GPU machine builds them for sm_90 in CI on a CPU-only machine (with the `nvidia-cuda-nvrtc`
//! wheel that `cargo xtask deps` unpacks into `target/nvrtc`), so a kernel that does not
//! compile fails `cargo xtask test`.

use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::{result, sys};
use serde::Serialize;

use crate::error::KernelError;

/// The CUDA C source of every kernel: the shared definitions, the CUDA-core kernels, and the
/// tensor-core decode kernels, as one program.
pub const SOURCE: &str = concat!(
    include_str!("common.cu"),
    include_str!("kernels.cu"),
    include_str!("decode.cu")
);

/// The kernels' entry points, in the order the runtime loads them.
pub const KERNELS: [&str; 8] = [
    "mla_combine",
    "mla_splice",
    "mla_decode_m1",
    "mla_decode_m2",
    "mla_decode_m4",
    "mla_decode_fp8_m1",
    "mla_decode_fp8_m2",
    "mla_decode_fp8_m4",
];

/// What ptxas reported for one kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct KernelResources {
    /// The entry point.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Stack frame per thread, bytes.
    pub stack_bytes: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_stores: u32,
    /// Bytes reloaded from spills.
    pub spill_loads: u32,
}

/// A compiled module.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The architecture it was built for (`sm_90`, ...).
    pub arch: String,
    /// The cubin, loadable with `cuModuleLoadData`.
    pub cubin: Vec<u8>,
    /// NVRTC's program log (ptxas's `-v` report).
    pub log: String,
    /// Per-kernel resources, parsed from `log`.
    pub resources: Vec<KernelResources>,
}

/// Whether `libnvrtc` can be loaded (cudarc panics inside any NVRTC call otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

fn nvrtc_error(what: &str, err: impl std::fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("NVRTC {what}: {err:?}"))
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    if !nvrtc_present() {
        return Err(missing_nvrtc());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_error("version", e))?;
    Ok((major, minor))
}

pub(crate) fn missing_nvrtc() -> KernelError {
    KernelError::CudaUnavailable(
        "libnvrtc.so.13 not found: put CUDA 13's lib64, or the lib folder of the \
         nvidia-cuda-nvrtc wheel (`cargo xtask deps` unpacks it into target/nvrtc), \
         on LD_LIBRARY_PATH"
            .into(),
    )
}

/// Owns an `nvrtcProgram` so every exit path destroys it.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here. A failure to free is
        // not actionable (and must not panic in drop).
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn c_text(raw: &[c_char]) -> String {
    if raw.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC's log and PTX buffers are NUL-terminated (their sizes include the NUL).
    unsafe { CStr::from_ptr(raw.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Compiles [`SOURCE`] for `arch` (`sm_90`, `sm_100`, ...): no fast math, no contraction
/// (`--fmad=false`; the kernels' FMAs are explicit), ptxas verbose for the resource report.
pub fn compile(arch: &str) -> Result<Compiled, KernelError> {
    if !arch.starts_with("sm_")
        || arch.len() < 5
        || !arch[3..].bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return Err(KernelError::Cuda(format!(
            "architecture `{arch}`: expected sm_XY (a cubin target)"
        )));
    }
    if !nvrtc_present() {
        return Err(missing_nvrtc());
    }
    let src = CString::new(SOURCE).map_err(|e| nvrtc_error("source", e))?;
    let name = CString::new("kvroute_kernels.cu").map_err(|e| nvrtc_error("name", e))?;
    let prog =
        Program(result::create_program(&src, Some(&name)).map_err(|e| nvrtc_error("create", e))?);
    let options = [
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_owned(),
        "--std=c++17".to_owned(),
        "--ptxas-options=-v".to_owned(),
    ];
    // SAFETY: a live program and valid option strings.
    let compiled = unsafe { result::compile_program(prog.0, &options) };
    // SAFETY: a live program; the log exists whether or not compilation succeeded.
    let log = unsafe { result::get_program_log(prog.0) }
        .map(|raw| c_text(&raw))
        .map_err(|e| nvrtc_error("log", e))?;
    if let Err(err) = compiled {
        return Err(KernelError::Cuda(format!(
            "NVRTC could not compile the kernels for {arch} ({err:?}):\n{log}"
        )));
    }
    let mut size = 0usize;
    // SAFETY: a compiled program and a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_error("cubin size", e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds exactly the size NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| nvrtc_error("cubin", e))?;
    let resources = parse_resources(&log);
    Ok(Compiled {
        arch: arch.to_owned(),
        cubin,
        log,
        resources,
    })
}

/// The unsigned number just before the first `suffix` in `text` (`"Used 40 registers"`,
/// `"registers"` -> 40).
fn number_before(text: &str, suffix: &str) -> Option<u32> {
    let end = text.find(suffix)?;
    let head = text[..end].trim_end();
    let start = head
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |i| i + 1);
    head[start..].parse().ok()
}

/// ptxas `-v` lines, per entry function:
/// ```text
/// ptxas info    : Compiling entry function 'mla_partial' for 'sm_90'
/// ptxas info    : Function properties for mla_partial
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 72 registers, used 1 barriers, 36928 bytes smem, 436 bytes cmem[0]
/// ```
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(KernelResources {
                name: name.to_owned(),
                ..KernelResources::default()
            });
            continue;
        }
        let Some(current) = out.last_mut() else {
            continue;
        };
        if line.contains("bytes stack frame") {
            current.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            current.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            current.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("registers") {
            current.registers = number_before(line, "registers").unwrap_or(0);
            current.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resource_report_is_parsed_per_kernel() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'mla_partial' for 'sm_90'\n\
            ptxas info    : Function properties for mla_partial\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 72 registers, used 1 barriers, 36928 bytes smem, 436 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'mla_splice' for 'sm_90'\n\
            ptxas info    : Function properties for mla_splice\n\
            \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
            ptxas info    : Used 30 registers, 408 bytes cmem[0]\n";
        let r = parse_resources(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                name: "mla_partial".into(),
                registers: 72,
                shared_bytes: 36928,
                stack_bytes: 8,
                spill_stores: 4,
                spill_loads: 12,
            }
        );
        assert_eq!(
            (r[1].name.as_str(), r[1].registers, r[1].shared_bytes),
            ("mla_splice", 30, 0)
        );
    }

    #[test]
    fn only_cubin_targets_are_accepted() {
        for bad in ["compute_90", "sm_", "sm_9 0", "90"] {
            assert!(matches!(compile(bad), Err(KernelError::Cuda(_))), "{bad}");
        }
    }
}
