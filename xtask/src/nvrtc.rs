//! NVRTC for CI: the `nvidia-cuda-nvrtc` wheel from PyPI carries `libnvrtc.so.13` and its
//! builtins, enough to compile the CUDA kernels to sm_90 cubins on a machine without a GPU or
//! a CUDA install. `cargo xtask deps` downloads the pinned wheel (hash-checked by pip) and
//! unpacks the two libraries into `target/nvrtc/lib`; `cargo xtask test` puts that folder on
//! `LD_LIBRARY_PATH` and makes the sm_90 compile test required. Nothing is installed system-wide.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The pinned wheel: CUDA 13.0's NVRTC, manylinux x86-64.
const WHEEL: &str = "nvidia-cuda-nvrtc==13.0.88";
const WHEEL_SHA256: &str = "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575";
/// The files taken from it.
const LIBRARIES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc-builtins.so.13.0"];

/// Where the libraries live: put this on `LD_LIBRARY_PATH`.
pub(crate) fn lib_dir(root: &Path) -> PathBuf {
    root.join("target").join("nvrtc").join("lib")
}

/// Whether the libraries are unpacked.
pub(crate) fn present(root: &Path) -> bool {
    LIBRARIES.iter().all(|l| lib_dir(root).join(l).is_file())
}

fn pip_works() -> bool {
    Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Ensures the libraries are in [`lib_dir`]: downloads and unpacks the wheel unless they are
/// (with `check_only`, fails instead of downloading).
pub(crate) fn ensure(root: &Path, check_only: bool) -> Result<()> {
    let lib = lib_dir(root);
    if present(root) {
        println!("deps: NVRTC ({WHEEL}) unpacked in {}", lib.display());
        return Ok(());
    }
    if check_only {
        bail!(
            "deps: NVRTC is missing from {}; run `cargo xtask deps`",
            lib.display()
        );
    }
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        bail!(
            "deps: the pinned NVRTC wheel is for x86-64 Linux; put CUDA 13's lib64 on LD_LIBRARY_PATH instead"
        );
    }
    if !pip_works() {
        crate::deps::ensure(
            &[crate::deps::SystemPackage {
                apt: "python3-pip",
                needed_for: "downloading the NVRTC wheel the CUDA compile test uses",
            }],
            false,
        )?;
    }
    let download = root.join("target").join("nvrtc").join("download");
    std::fs::create_dir_all(&download)
        .with_context(|| format!("creating {}", download.display()))?;
    let requirements = download.join("requirements.txt");
    std::fs::write(
        &requirements,
        format!("{WHEEL} --hash=sha256:{WHEEL_SHA256}\n"),
    )?;
    println!("deps: downloading {WHEEL} (about 90 MB) for the CUDA compile test");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--require-hashes",
            "--only-binary=:all:",
        ])
        .arg("--dest")
        .arg(&download)
        .arg("-r")
        .arg(&requirements)
        .status()
        .context("running pip download")?;
    if !status.success() {
        bail!("deps: pip download {WHEEL} failed ({status})");
    }
    let wheel = std::fs::read_dir(&download)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip reported success but left no wheel")?;
    std::fs::create_dir_all(&lib)?;
    // A wheel is a zip; take only the two libraries, flattened into `lib`.
    let unpack = "import sys, zipfile, os\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        want = set(sys.argv[3:])\n\
        for n in z.namelist():\n\
        \x20   if os.path.basename(n) in want:\n\
        \x20       open(os.path.join(sys.argv[2], os.path.basename(n)), 'wb').write(z.read(n))\n";
    let status = Command::new("python3")
        .args(["-c", unpack])
        .arg(&wheel)
        .arg(&lib)
        .args(LIBRARIES)
        .status()
        .context("unpacking the wheel")?;
    if !status.success() || !present(root) {
        bail!(
            "deps: unpacking {} did not produce {LIBRARIES:?}",
            wheel.display()
        );
    }
    std::fs::remove_dir_all(&download).ok();
    println!("deps: NVRTC unpacked in {}", lib.display());
    Ok(())
}

/// `LD_LIBRARY_PATH` with [`lib_dir`] first.
pub(crate) fn library_path(root: &Path) -> String {
    let mut path = lib_dir(root).to_string_lossy().into_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        path.push(':');
        path.push_str(&old.to_string_lossy());
    }
    path
}
