//! JSON lines on the rendezvous connection (see [`crate::session`]): one message a line,
//! each read with a byte limit and, where the socket has a timeout, a deadline for the whole
//! line, so a peer that never sends a newline, or sends one byte at a time, is cut off.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::RemoteError;

/// Writes `msg` as one line.
pub(crate) fn send_line<T: serde::Serialize>(
    w: &mut TcpStream,
    peer: SocketAddr,
    msg: &T,
) -> Result<(), RemoteError> {
    let mut line = serde_json::to_string(msg).map_err(|e| RemoteError::MalformedControl {
        peer,
        why: format!("encoding: {e}"),
    })?;
    line.push('\n');
    w.write_all(line.as_bytes())
        .map_err(|source| RemoteError::Control { peer, source })
}

/// Reads one JSON line (at most `limit` bytes). The socket's read timeout, if it has one, is
/// the deadline of the whole line, not of each read: a peer that trickles a byte at a time is
/// cut off when it runs out, with [`RemoteError::TimedOut`] naming how long it had.
pub(crate) fn recv_line<T: serde::de::DeserializeOwned>(
    r: &mut BufReader<TcpStream>,
    peer: SocketAddr,
    limit: u64,
) -> Result<T, RemoteError> {
    let timeout = r.get_ref().read_timeout().ok().flatten();
    let line = read_line_by(r, peer, limit, timeout.map(|t| (Instant::now() + t, t)));
    if let Some(t) = timeout {
        // The socket's own timeout back, for whoever reads it next.
        let _ = r.get_ref().set_read_timeout(Some(t));
    }
    let line = line?;
    serde_json::from_slice(&line).map_err(|e| RemoteError::MalformedControl {
        peer,
        why: format!("{e}: {}", truncated(String::from_utf8_lossy(&line).trim())),
    })
}

/// The bytes of one line (without its newline), at most `limit` of them, read by `deadline`
/// (when, and the whole wait it stands for).
fn read_line_by(
    r: &mut BufReader<TcpStream>,
    peer: SocketAddr,
    limit: u64,
    deadline: Option<(Instant, Duration)>,
) -> Result<Vec<u8>, RemoteError> {
    let mut line = Vec::new();
    loop {
        if let Some((at, after)) = deadline {
            let left = at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RemoteError::TimedOut {
                    holder: peer,
                    after,
                });
            }
            r.get_ref()
                .set_read_timeout(Some(left))
                .map_err(|source| RemoteError::Control { peer, source })?;
        }
        let buf = match r.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(RemoteError::TimedOut {
                    holder: peer,
                    after: deadline.map(|(_, after)| after).unwrap_or_default(),
                });
            }
            Err(source) => return Err(RemoteError::Control { peer, source }),
        };
        if buf.is_empty() {
            let why = if line.is_empty() {
                "connection closed"
            } else {
                "connection closed mid-line"
            };
            return Err(RemoteError::Control {
                peer,
                source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, why),
            });
        }
        let room = (limit as usize).saturating_sub(line.len());
        match buf.iter().position(|&b| b == b'\n') {
            Some(end) if end <= room => {
                line.extend_from_slice(&buf[..end]);
                r.consume(end + 1);
                return Ok(line);
            }
            _ if buf.len() >= room => {
                return Err(RemoteError::MalformedControl {
                    peer,
                    why: format!("a line longer than {limit} bytes"),
                });
            }
            _ => {
                let n = buf.len();
                line.extend_from_slice(buf);
                r.consume(n);
            }
        }
    }
}

/// At most 200 characters of a peer's line, for an error message.
fn truncated(line: &str) -> &str {
    match line.char_indices().nth(200) {
        Some((at, _)) => &line[..at],
        None => line,
    }
}
