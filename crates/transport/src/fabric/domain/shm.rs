//! What libfabric 1.17's `shm` provider leaves to its users: a peer's process may die holding
//! its region's lock (checked before posting), and a killed process leaves its regions in
//! `/dev/shm` (removed by whoever reaped it, and by a later process given the same pid).

/// The process id in an `shm` address (`fi_shm://<pid>:<uid>:<n>`, NUL-terminated; the
/// scheme may be absent). libfabric 1.17's `shm` guards each process's shared region with a
/// spinlock its senders take inside `fi_writemsg`; a process killed while its progress held
/// that lock leaves it held, and every later post to it spins forever inside libfabric, out of
/// reach of any timeout (docs/fabric.md). Checking that the process exists before posting
/// turns that hang into an error, except for a death in the last [`ALIVE_FOR`]. `shm` itself
/// addresses peers by pid (its cross-memory copies), so the pid is meaningful here.
pub(super) fn shm_peer_pid(bytes: &[u8]) -> Option<libc::pid_t> {
    shm_region_name(bytes).and_then(|name| name.pid)
}

/// Checks an `shm` peer address before the provider sees it. libfabric 1.17's `shm` maps the
/// file `/dev/shm/<pid>:<uid>:<n>` the address names and trusts the region header it finds
/// there (offsets, sizes, a lock), so a file planted in the world-writable `/dev/shm` under
/// such a name crashes the process that inserts it. A real endpoint's region is a regular
/// file created mode 0600 by a process of this user, alive when the region is named by its
/// pid; anything else is refused. Within
/// one user nothing is checked further: a process of the same user may already read and
/// write this one's memory (`ptrace`, `/proc/PID/mem`, the cross-memory copies `shm` itself
/// uses), so the trust boundary `shm` can have is the user.
pub(super) fn check_shm_peer(bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let name = shm_region_name(bytes).ok_or("not an shm endpoint name (<pid>:<uid>:<n>)")?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let meta = std::fs::symlink_metadata(format!("/dev/shm/{}", name.text))
        .map_err(|e| format!("no shm region /dev/shm/{}: {e}", name.text))?;
    region_is_trusted(
        &name,
        me,
        RegionFile {
            // Not followed: a link or a fifo is not a regular file.
            regular: meta.file_type().is_file(),
            owner: meta.uid(),
            mode: meta.mode(),
        },
        name.pid.is_none_or(process_exists),
    )
}

/// Whether two `shm` endpoint names are of one process: the same pid (or node) and user.
pub(super) fn same_shm_process(a: &[u8], b: &[u8]) -> bool {
    match (shm_region_name(a), shm_region_name(b)) {
        (Some(a), Some(b)) => a.uid == b.uid && a.prefix() == b.prefix(),
        _ => false,
    }
}

/// Whether the `shm` endpoint named `bytes` may still send: its region exists and, when it is
/// named by its pid, its process too. An endpoint that closed has unlinked its region; one
/// whose process was killed sends nothing more, whatever its region's fate.
pub(super) fn shm_sender_may_send(bytes: &[u8]) -> bool {
    let Some(name) = shm_region_name(bytes) else {
        return false;
    };
    name.pid.is_none_or(process_exists)
        && std::fs::symlink_metadata(format!("/dev/shm/{}", name.text)).is_ok()
}

/// The parts of an `shm` endpoint name.
#[derive(Debug)]
pub(super) struct RegionName<'a> {
    text: &'a str,
    /// The process, when the region is named by its pid.
    pid: Option<libc::pid_t>,
    uid: u32,
}

impl RegionName<'_> {
    /// The pid or node the name starts with.
    fn prefix(&self) -> &str {
        self.text.split(':').next().unwrap_or_default()
    }
}

/// What [`region_is_trusted`] needs to know of a region's file.
#[derive(Debug, Clone, Copy)]
pub(super) struct RegionFile {
    regular: bool,
    owner: u32,
    mode: u32,
}

/// Parses `[fi_shm://]<pid or node>:<uid>:<n>\0`: the provider names a region by the
/// process id, or by the `node` it was opened with. Digits, letters, `.`, `-` and `_` only: no
/// path can be smuggled in.
pub(super) fn shm_region_name(bytes: &[u8]) -> Option<RegionName<'_>> {
    let text = std::str::from_utf8(bytes.strip_suffix(&[0])?).ok()?;
    let text = text.split_once("://").map_or(text, |(_, rest)| rest);
    let (name, n) = text.rsplit_once(':')?;
    let (prefix, uid) = name.rsplit_once(':')?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    let name_char = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_');
    if prefix.is_empty()
        || prefix.len() > 64
        || !prefix.bytes().all(name_char)
        || !prefix.bytes().any(|b| b != b'.')
        || !digits(uid)
        || !digits(n)
    {
        return None;
    }
    let pid = if prefix.bytes().all(|b| b.is_ascii_digit()) {
        Some(prefix.parse::<libc::pid_t>().ok().filter(|&p| p > 0)?)
    } else {
        None
    };
    Some(RegionName {
        text,
        pid,
        uid: uid.parse().ok()?,
    })
}

/// The decision of [`check_shm_peer`], without the file system: a region of this user (`me`)
/// in its name and its file's owner, private to it, of a live process.
pub(super) fn region_is_trusted(
    name: &RegionName<'_>,
    me: u32,
    file: RegionFile,
    alive: bool,
) -> Result<(), String> {
    let text = name.text;
    if name.uid != me {
        return Err(format!(
            "shm region {text} names user {}, not this process's {me}",
            name.uid
        ));
    }
    if !file.regular {
        return Err(format!("/dev/shm/{text} is not a regular file"));
    }
    if file.owner != me {
        return Err(format!(
            "/dev/shm/{text} belongs to user {}, not {me}",
            file.owner
        ));
    }
    if file.mode & 0o077 != 0 {
        return Err(format!(
            "/dev/shm/{text} is open to other users (mode {:o}); an endpoint's region is 0600",
            file.mode & 0o777
        ));
    }
    if !alive {
        return Err(format!(
            "shm region {text} names a process that does not exist"
        ));
    }
    Ok(())
}

/// Whether process `pid` exists (a zombie does; a process of another user does).
pub(super) fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the `shm` regions (`/dev/shm/<pid>:<uid>:<n>`) a process of this user left when it
/// was killed (a clean exit unlinks them; SIGKILL cannot), so a supervisor that killed and
/// reaped a peer frees its shared memory (16 MiB per endpoint). Refuses, removing nothing,
/// while a process `pid` exists. Returns how many regions were removed.
pub fn remove_shm_regions_of_dead_process(pid: u32) -> std::io::Result<usize> {
    use std::os::unix::fs::MetadataExt;
    let Ok(raw) = libc::pid_t::try_from(pid) else {
        return Ok(0);
    };
    if process_exists(raw) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ResourceBusy,
            format!("process {pid} still exists"),
        ));
    }
    let uid = std::fs::metadata("/proc/self")?.uid();
    remove_shm_regions(&format!("{pid}:{uid}:"))
}

/// Removes `/dev/shm/<prefix><digits>`; returns how many.
fn remove_shm_regions(prefix: &str) -> std::io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir("/dev/shm")?.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
            std::fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// libfabric 1.17's `shm` provider names an endpoint's shared region `/dev/shm/<pid>:<uid>:<n>`
/// (`n` counts the process's endpoints) and unlinks it when the endpoint closes. A process that
/// is killed leaves its regions behind (16 MiB each), and a later process that is given the same
/// pid then fails `fi_enable` with EBUSY (seen here after many holder processes). Before this
/// process opens its first shm endpoint, the regions of this user whose process is gone are
/// removed, once per process: those under this process's own pid (a killed process's that had
/// it before), and those of every other pid of this user that no longer exists. A region of a
/// live process, or of another user, is never touched. (A process in another pid namespace
/// sharing this `/dev/shm` would look dead from here; the provider's names carry no namespace.)
pub(super) fn clear_stale_shm_regions() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| match remove_regions_of_dead_processes(true) {
        Ok(0) => {}
        Ok(n) => tracing::warn!(
            regions = n,
            "removed shm regions that killed processes of this user left"
        ),
        Err(e) => tracing::debug!(%e, "could not remove stale shm regions"),
    });
}

/// Removes every `/dev/shm/<pid>:<uid>:<n>` region of this user (by name and by owner) whose
/// process is gone, and with `own` this process's own (before it has opened an endpoint, they
/// can only be a predecessor's); returns how many.
fn remove_regions_of_dead_processes(own: bool) -> std::io::Result<usize> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self")?.uid();
    let me = std::process::id();
    let mut removed = 0;
    for entry in std::fs::read_dir("/dev/shm")?.flatten() {
        let name = entry.file_name();
        let Some((pid, name_uid, _)) = name.to_str().and_then(region_name) else {
            continue;
        };
        if name_uid != uid {
            continue;
        }
        let owned = entry
            .metadata()
            .is_ok_and(|m| m.uid() == uid && m.file_type().is_file());
        let gone = if pid == me {
            own
        } else {
            libc::pid_t::try_from(pid).is_ok_and(|p| p > 0 && !process_exists(p))
        };
        if owned && gone && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// `(pid, uid, n)` of a region name `<pid>:<uid>:<n>` (all decimal digits).
fn region_name(name: &str) -> Option<(u32, u32, u32)> {
    let mut parts = name.split(':');
    let mut num = || {
        let p = parts.next()?;
        (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .then(|| p.parse().ok())
            .flatten()
    };
    let out = (num()?, num()?, num()?);
    parts.next().is_none().then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_names_parse_and_nothing_else_does() {
        assert_eq!(region_name("4242:1000:3"), Some((4242, 1000, 3)));
        for bad in [
            "4242:1000",
            "4242:1000:3:1",
            "a:0:0",
            ":0:0",
            "4242:0:",
            "sem.x",
            "",
        ] {
            assert_eq!(region_name(bad), None, "{bad}");
        }
    }

    /// A region a killed process of this user left (here: a file named for a pid that does
    /// not exist) is removed when an engine starts; one of a live process is kept.
    #[test]
    fn regions_of_dead_processes_are_removed_and_live_ones_kept() {
        use std::os::unix::fs::MetadataExt;
        let uid = std::fs::metadata("/proc/self").unwrap().uid();
        // The highest pids are unlikely to exist; find one that does not.
        let dead = (4_000_000u32..4_194_304)
            .rev()
            .find(|&p| !process_exists(p as libc::pid_t))
            .unwrap();
        let dead_region = format!("/dev/shm/{dead}:{uid}:0");
        let live_region = format!("/dev/shm/1:{uid}:77");
        std::fs::write(&dead_region, b"x").unwrap();
        let live_planted = !std::path::Path::new(&live_region).exists()
            && std::fs::write(&live_region, b"x").is_ok();
        // Not this process's own: other tests here may have endpoints open.
        assert!(remove_regions_of_dead_processes(false).unwrap() >= 1);
        assert!(!std::path::Path::new(&dead_region).exists());
        if live_planted {
            // pid 1 exists: its region stays.
            assert!(std::path::Path::new(&live_region).exists());
            std::fs::remove_file(&live_region).unwrap();
        }
    }

    #[test]
    fn shm_addresses_name_their_process() {
        assert_eq!(shm_peer_pid(b"fi_shm://4242:0:1\0"), Some(4242));
        assert_eq!(shm_peer_pid(b"4242:1000:0\0"), Some(4242));
        // Not NUL-terminated, not a pid, not positive, not text: no check, never a panic.
        for bad in [
            &b"fi_shm://4242:0:1"[..],
            b"fi_shm://abc:0:1\0",
            b"fi_shm://0:0:1\0",
            b"fi_shm://-1:0:1\0",
            b"\xff\xfe:0\0",
            b"\0",
            b"",
        ] {
            assert_eq!(shm_peer_pid(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_sender_is_of_its_peers_process_only() {
        assert!(same_shm_process(
            b"fi_shm://42:1000:0\0",
            b"fi_shm://42:1000:7\0"
        ));
        assert!(same_shm_process(
            b"node-a:1000:0\0",
            b"fi_shm://node-a:1000:2\0"
        ));
        for (peer, sender) in [
            (&b"fi_shm://42:1000:0\0"[..], &b"fi_shm://43:1000:1\0"[..]),
            (b"fi_shm://42:1000:0\0", b"fi_shm://42:1001:1\0"),
            (b"fi_shm://42:1000:0\0", b"fi_shm://420:1000:1\0"),
            (b"fi_shm://42:1000:0\0", b"not a name"),
            (b"junk", b"fi_shm://42:1000:1\0"),
        ] {
            assert!(!same_shm_process(peer, sender), "{sender:?}");
        }
    }

    #[test]
    fn a_sender_may_send_while_its_region_and_process_exist() {
        use std::os::unix::fs::OpenOptionsExt;
        let me = std::process::id();
        let name = format!("{me}:0:{}", u32::MAX - 3);
        let path = format!("/dev/shm/{name}");
        let bytes = format!("fi_shm://{name}\0").into_bytes();
        assert!(!shm_sender_may_send(&bytes), "no region yet");
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .expect("creating a region file");
        assert!(shm_sender_may_send(&bytes));
        std::fs::remove_file(&path).expect("removing it");
        assert!(!shm_sender_may_send(&bytes), "its endpoint closed");
        // A region whose process has exited: a reaped child.
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawning true");
        let pid = child.id();
        child.wait().expect("reaping it");
        let name = format!("{pid}:0:{}", u32::MAX - 4);
        let path = format!("/dev/shm/{name}");
        std::fs::write(&path, b"").expect("planting a region file");
        let gone = shm_sender_may_send(format!("{name}\0").as_bytes());
        std::fs::remove_file(&path).expect("removing it");
        assert!(!gone, "a killed sender's leftover region");
        assert!(!shm_sender_may_send(b"/etc/passwd\0"));
    }

    #[test]
    fn only_private_regions_of_this_user_and_a_live_process_are_trusted() {
        let name = shm_region_name(b"fi_shm://42:1000:3\0").expect("a region name");
        let ok = RegionFile {
            regular: true,
            owner: 1000,
            mode: 0o100600,
        };
        assert!(region_is_trusted(&name, 1000, ok, true).is_ok());
        // Another user's name, another user's file, a shared mode, a directory, a dead
        // process: each is refused on its own.
        assert!(region_is_trusted(&name, 0, ok, true).is_err());
        for file in [
            RegionFile { owner: 0, ..ok },
            RegionFile {
                mode: 0o100666,
                ..ok
            },
            RegionFile {
                mode: 0o100640,
                ..ok
            },
            RegionFile {
                regular: false,
                ..ok
            },
        ] {
            assert!(
                region_is_trusted(&name, 1000, file, true).is_err(),
                "{file:?}"
            );
        }
        assert!(region_is_trusted(&name, 1000, ok, false).is_err());
        // Named by the node it was opened with (`FabricConfig::node`): no process to check.
        let node = shm_region_name(b"fi_shm://127.0.0.1:1000:0\0").expect("a node name");
        assert_eq!(node.pid, None);
        assert!(region_is_trusted(&node, 1000, ok, true).is_ok());
        for bad in [
            &b"fi_shm://42:1000:3"[..],
            b"fi_shm://42:1000\0",
            b"fi_shm://42:1000:3:4\0",
            b"fi_shm://../../etc/passwd\0",
            b"fi_shm://42:1000:x/..\0",
            b"fi_shm://0:1000:3\0",
            b"fi_shm://..:1000:3\0",
            b"fi_shm://a/b:1000:3\0",
            b"fi_shm://99999999999:0:0\0",
            b"\0",
        ] {
            assert!(shm_region_name(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn this_process_exists_and_a_reaped_child_does_not() {
        assert!(process_exists(std::process::id() as libc::pid_t));
        let mut child = std::process::Command::new("true")
            .spawn()
            .unwrap_or_else(|e| panic!("spawning true: {e}"));
        let pid = child.id() as libc::pid_t;
        let _ = child.wait();
        assert!(!process_exists(pid));
    }

    #[test]
    fn regions_of_a_dead_process_are_removed_and_of_a_live_one_refused() {
        use std::os::unix::fs::MetadataExt;
        let mut child = std::process::Command::new("true")
            .spawn()
            .unwrap_or_else(|e| panic!("spawning true: {e}"));
        let pid = child.id();
        let _ = child.wait();
        let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
        let region = format!("/dev/shm/{pid}:{uid}:0");
        let unrelated = format!("/dev/shm/{pid}:{uid}:x");
        for f in [&region, &unrelated] {
            std::fs::write(f, b"left behind").unwrap_or_else(|e| panic!("{f}: {e}"));
        }
        assert_eq!(remove_shm_regions_of_dead_process(pid).ok(), Some(1));
        assert!(!std::path::Path::new(&region).exists());
        assert!(
            std::path::Path::new(&unrelated).exists(),
            "not a region name"
        );
        let _ = std::fs::remove_file(&unrelated);
        let me = std::process::id();
        assert!(remove_shm_regions_of_dead_process(me).is_err());
    }
}
