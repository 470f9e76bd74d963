//! `cargo xtask deps`: the system packages the workspace needs, checked and installed.
//!
//! The list grows with the crates (libfabric for the transport, ...). On Debian and Ubuntu a
//! missing package is installed with apt-get when running as root; otherwise the exact command
//! is printed and the task fails, so nothing is half set up silently. Running it twice changes
//! nothing the second time.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// A Debian package some crate needs at build, test or run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SystemPackage {
    /// The apt package name.
    pub(crate) apt: &'static str,
    /// Which crate needs it, and for what.
    pub(crate) needed_for: &'static str,
}

/// What the workspace needs today. The transport's fabric domain opens `libfabric.so.1` at run
/// time (a machine without it still builds), and its tests and benches need the library, the
/// `fi_pingpong` baseline and `ip` for the network-namespace hosts.
pub(crate) const SYSTEM_PACKAGES: &[SystemPackage] = &[
    SystemPackage {
        apt: "libfabric1",
        needed_for: "the transport's libfabric domain (tcp, shm, efa providers)",
    },
    SystemPackage {
        apt: "libfabric-bin",
        needed_for: "fi_pingpong and fi_info, the baseline of `kvroute bench fabric`",
    },
    SystemPackage {
        apt: "iproute2",
        needed_for: "`ip netns`, the two-host fabric tests",
    },
    SystemPackage {
        apt: "g++",
        needed_for: "libFuzzer's runtime, compiled by `cargo xtask fuzz` (libfuzzer-sys), and the CPU emulation of the CUDA decode kernel that kvroute-kernels' tests compile (C++20)",
    },
    SystemPackage {
        apt: "fio",
        needed_for: "the read baseline of `kvroute store bench` (beside dd, on the same files)",
    },
    SystemPackage {
        apt: "protobuf-compiler",
        needed_for: "protoc, which builds the etcd client's gRPC messages (kvroute-kvstore's etcd feature)",
    },
    SystemPackage {
        apt: "libprotobuf-dev",
        needed_for: "the well-known .proto files (google/protobuf/descriptor.proto) the etcd client's protos import; only recommended by protobuf-compiler, so not installed with it here",
    },
    SystemPackage {
        apt: "etcd-server",
        needed_for: "the etcd the directory's integration tests start (cargo xtask etcd)",
    },
    SystemPackage {
        apt: "prometheus",
        needed_for: "the Prometheus that `crates/cli/tests/prometheus.rs` starts to scrape holders' /metrics pages",
    },
    SystemPackage {
        apt: "python3",
        needed_for: "the Python package's build (maturin) and its pytest suite (`cargo xtask wheel`, `cargo xtask test`)",
    },
    SystemPackage {
        apt: "python3-venv",
        needed_for: "the virtualenvs under target/py that maturin and the Python package's tests run in",
    },
    SystemPackage {
        apt: "fonts-dejavu-core",
        needed_for: "the text of `kvroute sweep`'s PNG plots (plotters draws with a TrueType font)",
    },
];

/// What `deps` will do, decided from facts about the machine (kept pure so it is testable).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing is required at all.
    NothingRequired,
    /// Every required package is installed.
    AllPresent(usize),
    /// Install these with apt-get, as root.
    Install(Vec<&'static str>),
    /// These are missing and this process cannot install them.
    AskUser {
        missing: Vec<&'static str>,
        reason: &'static str,
    },
}

pub(crate) fn plan(
    packages: &[SystemPackage],
    is_installed: impl Fn(&str) -> bool,
    is_root: bool,
    has_apt: bool,
) -> Plan {
    if packages.is_empty() {
        return Plan::NothingRequired;
    }
    let missing: Vec<_> = packages
        .iter()
        .map(|p| p.apt)
        .filter(|p| !is_installed(p))
        .collect();
    if missing.is_empty() {
        Plan::AllPresent(packages.len())
    } else if !has_apt {
        Plan::AskUser {
            missing,
            reason: "apt-get is not available: install the equivalents with your package manager",
        }
    } else if !is_root {
        Plan::AskUser {
            missing,
            reason: "not running as root",
        }
    } else {
        Plan::Install(missing)
    }
}

fn apt_install_command(packages: &[&str]) -> String {
    format!(
        "sudo apt-get update && sudo apt-get install -y --no-install-recommends {}",
        packages.join(" ")
    )
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Abbrev}", package])
        .output()
        .map(|out| out.status.success() && out.stdout.starts_with(b"ii"))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| out.stdout.trim_ascii() == b"0")
        .unwrap_or(false)
}

fn has_apt() -> bool {
    Command::new("apt-get")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn run_apt(args: &[&str]) -> Result<()> {
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .with_context(|| format!("running apt-get {}", args.join(" ")))?;
    if !status.success() {
        bail!("apt-get {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Checks, and unless `check_only`, installs what is missing.
pub(crate) fn run(check_only: bool) -> Result<()> {
    ensure(SYSTEM_PACKAGES, check_only)
}

/// Checks `packages`, and unless `check_only`, installs the missing ones.
pub(crate) fn ensure(packages: &[SystemPackage], check_only: bool) -> Result<()> {
    let plan = plan(packages, dpkg_installed, is_root(), has_apt());
    match plan {
        Plan::NothingRequired => println!("deps: no system packages are required"),
        Plan::AllPresent(n) => println!("deps: all {n} required system packages are installed"),
        Plan::Install(missing) if check_only => {
            bail!(
                "deps: missing {}; run `cargo xtask deps` as root to install them",
                missing.join(" ")
            )
        }
        Plan::Install(missing) => {
            for p in packages.iter().filter(|p| missing.contains(&p.apt)) {
                println!("deps: installing {} ({})", p.apt, p.needed_for);
            }
            run_apt(&["update", "-q"])?;
            let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
            args.extend(&missing);
            run_apt(&args)?;
            let still: Vec<_> = missing.iter().filter(|p| !dpkg_installed(p)).collect();
            if !still.is_empty() {
                bail!("deps: apt-get finished but these are still missing: {still:?}");
            }
            println!("deps: installed {}", missing.join(" "));
        }
        Plan::AskUser { missing, reason } => {
            bail!(
                "deps: missing {} ({reason}); run:\n  {}",
                missing.join(" "),
                apt_install_command(&missing)
            )
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PKGS: &[SystemPackage] = &[
        SystemPackage {
            apt: "libfabric1",
            needed_for: "transport",
        },
        SystemPackage {
            apt: "cmake",
            needed_for: "kernels",
        },
    ];

    #[test]
    fn an_empty_list_requires_nothing() {
        assert_eq!(plan(&[], |_| false, false, false), Plan::NothingRequired);
    }

    #[test]
    fn installed_packages_are_left_alone() {
        assert_eq!(plan(PKGS, |_| true, true, true), Plan::AllPresent(2));
    }

    #[test]
    fn root_with_apt_installs_only_what_is_missing() {
        assert_eq!(
            plan(PKGS, |p| p == "cmake", true, true),
            Plan::Install(vec!["libfabric1"])
        );
    }

    #[test]
    fn without_root_or_apt_the_user_is_told_what_to_run() {
        let Plan::AskUser { missing, reason } = plan(PKGS, |_| false, false, true) else {
            panic!()
        };
        assert_eq!(missing, ["libfabric1", "cmake"]);
        assert_eq!(reason, "not running as root");
        assert!(matches!(
            plan(PKGS, |_| false, true, false),
            Plan::AskUser { .. }
        ));
        assert_eq!(
            apt_install_command(&missing),
            "sudo apt-get update && sudo apt-get install -y --no-install-recommends libfabric1 cmake"
        );
    }
}
