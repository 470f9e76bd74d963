//! What the process-per-requester examples (`holder_churn`, `soak`) share: engines on a named
//! provider, a partial's digest, and a process's footprint.

use kvroute_kernels::Partial;
use kvroute_transport::{FabricConfig, ProviderChoice, TransferEngine};

pub(crate) type Error = Box<dyn std::error::Error>;

/// An engine on `provider` (tcp or shm) bound to loopback.
pub(crate) fn engine(provider: &str) -> Result<TransferEngine, Error> {
    let choice = match provider {
        "shm" => ProviderChoice::Shm,
        "tcp" => ProviderChoice::Tcp,
        other => return Err(format!("unknown provider {other} (tcp or shm)").into()),
    };
    let config = FabricConfig {
        // shm names its regions by the node when one is given: processes would collide.
        node: (provider == "tcp").then(|| "127.0.0.1".to_owned()),
        required: true,
        ..FabricConfig::provider(choice)
    };
    Ok(TransferEngine::fabric(&config, Default::default())?.0)
}

/// FNV-1a over the bits of a partial's o, m and l: equal digests are bit-identical partials.
pub(crate) fn digest(p: &Partial) -> u64 {
    p.o.iter()
        .chain(&p.m)
        .chain(&p.l)
        .fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
            (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
        })
}

/// (resident KiB, open fds) of process `pid` (`"self"` for this one).
pub(crate) fn footprint(pid: &str) -> Result<(u64, usize), Error> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or("no VmRSS in /proc/PID/status")?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((rss, fds))
}

/// Entries in `/dev/shm` now.
pub(crate) fn shm_entries() -> usize {
    std::fs::read_dir("/dev/shm").map_or(0, Iterator::count)
}

/// `/dev/shm` entries named by one of `pids` (`shm` regions are named `PID:...`).
pub(crate) fn shm_entries_of(pids: &std::collections::HashSet<u32>) -> usize {
    std::fs::read_dir("/dev/shm").map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.split(':').next()?.parse::<u32>().ok())
                    .is_some_and(|pid| pids.contains(&pid))
            })
            .count()
    })
}
