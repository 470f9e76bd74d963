//! Files another process or user may have planted where this crate's users look for theirs (a
//! store's directory, a rendezvous directory, a trace path): opened only if regular, never
//! blocking on a FIFO or a device on the way, never through a symlink where the caller owns
//! the directory, read up to a bound, and created only where nothing was.
//!
//! Opening uses `O_NONBLOCK`, so a FIFO with no writer returns at once instead of blocking the
//! open, and `fstat` on the opened descriptor (not the path, which may change between a check
//! and the open) decides whether it is a regular file.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Whether a symlink at the path's last component is followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Followed (a path the user named, which may well be a link to their file).
    Follow,
    /// Refused (a file inside a directory this program manages).
    Refuse,
}

/// Opens `path` for reading if it is a regular file; a FIFO, a device, a directory or a socket
/// is an `InvalidInput` error naming what it is, and with [`Links::Refuse`] so is a symlink.
pub fn open_regular(path: &Path, links: Links) -> io::Result<File> {
    let mut flags = libc::O_NONBLOCK | libc::O_CLOEXEC;
    if links == Links::Refuse {
        flags |= libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| {
            // O_NOFOLLOW on a symlink fails with ELOOP.
            if e.raw_os_error() == Some(libc::ELOOP) && links == Links::Refuse {
                io::Error::new(io::ErrorKind::InvalidInput, "a symlink, not a regular file")
            } else {
                e
            }
        })?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_symlink() {
            "a symlink"
        } else {
            use std::os::unix::fs::FileTypeExt;
            if kind.is_fifo() {
                "a FIFO"
            } else if kind.is_char_device() || kind.is_block_device() {
                "a device"
            } else if kind.is_socket() {
                "a socket"
            } else {
                "not a file"
            }
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file"),
        ));
    }
    Ok(file)
}

/// The whole of regular file `path` if it holds at most `max` bytes; a larger one is an
/// `InvalidData` error (read no further than `max + 1` bytes).
pub fn read_bounded(path: &Path, max: u64, links: Links) -> io::Result<Vec<u8>> {
    let file = open_regular(path, links)?;
    let mut out = Vec::new();
    file.take(max.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {max} bytes"),
        ));
    }
    Ok(out)
}

/// Creates `path` for writing where nothing was (`O_EXCL`, no symlink followed): a file, link
/// or FIFO planted there is an `AlreadyExists` error, never written through.
pub fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(0o644)
        .open(path)
}

/// [`create_new`] after removing what was at `path` (a crash's partial write, or a link
/// planted there: the link is removed, its target never written); a directory there is an
/// error.
pub fn create_replacing(path: &Path) -> io::Result<File> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    create_new(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kvroute-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn only_regular_files_open_and_a_fifo_does_not_block() {
        let d = dir("kinds");
        let file = d.join("f");
        std::fs::write(&file, b"abc").unwrap();
        assert!(open_regular(&file, Links::Refuse).is_ok());
        let fifo = d.join("fifo");
        nix_mkfifo(&fifo);
        let started = std::time::Instant::now();
        let e = open_regular(&fifo, Links::Follow).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let e = open_regular(Path::new("/dev/zero"), Links::Follow).unwrap_err();
        assert!(e.to_string().contains("a device"), "{e}");
        let e = open_regular(&d, Links::Follow).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let link = d.join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(open_regular(&link, Links::Follow).is_ok());
        let e = open_regular(&link, Links::Refuse).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn reads_are_bounded_and_creation_never_writes_through() {
        let d = dir("bounds");
        let file = d.join("f");
        std::fs::write(&file, vec![7u8; 100]).unwrap();
        assert_eq!(read_bounded(&file, 100, Links::Refuse).unwrap().len(), 100);
        let e = read_bounded(&file, 99, Links::Refuse).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // A planted symlink where a new file goes: refused, its target untouched.
        let target = d.join("target");
        std::fs::write(&target, b"keep").unwrap();
        let planted = d.join(".layout.tmp");
        std::os::unix::fs::symlink(&target, &planted).unwrap();
        assert_eq!(
            create_new(&planted).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert!(create_new(&d.join("new")).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    fn nix_mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path that lives across the call.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(rc, 0, "mkfifo {}", path.display());
    }
}
