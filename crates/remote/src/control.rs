//! JSON lines on the rendezvous connection (see [`crate::session`]): one message a line,
//! each read with a byte limit, so a peer that never sends a newline is cut off.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};

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

/// Reads one JSON line (at most `limit` bytes). A read that times out is
/// [`RemoteError::TimedOut`] when `timeout` says how long the socket waited.
pub(crate) fn recv_line<T: serde::de::DeserializeOwned>(
    r: &mut BufReader<TcpStream>,
    peer: SocketAddr,
    limit: u64,
) -> Result<T, RemoteError> {
    let mut line = String::new();
    let read = r.take(limit).read_line(&mut line);
    match read {
        Ok(0) => Err(RemoteError::Control {
            peer,
            source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"),
        }),
        Ok(_) => serde_json::from_str(&line).map_err(|e| RemoteError::MalformedControl {
            peer,
            why: format!("{e}: {}", truncated(line.trim())),
        }),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            let after = r
                .get_ref()
                .read_timeout()
                .ok()
                .flatten()
                .unwrap_or_default();
            Err(RemoteError::TimedOut {
                holder: peer,
                after,
            })
        }
        Err(source) => Err(RemoteError::Control { peer, source }),
    }
}

/// At most 200 characters of a peer's line, for an error message.
fn truncated(line: &str) -> &str {
    match line.char_indices().nth(200) {
        Some((at, _)) => &line[..at],
        None => line,
    }
}
