//! Throwaway etcd servers for tests: one member or a cluster of several, on free loopback
//! ports, each with a data directory of its own under the system's temporary directory,
//! killed and removed when dropped. Members can be killed (SIGKILL) and restarted on the same
//! ports and data, as a crash and a restart would.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The etcd binary: `$KVROUTE_ETCD_BIN`, or `etcd` on the PATH.
pub fn etcd_binary() -> PathBuf {
    std::env::var_os("KVROUTE_ETCD_BIN").map_or_else(|| PathBuf::from("etcd"), PathBuf::from)
}

/// Whether an etcd binary runs here (`etcd --version` succeeds).
pub fn etcd_available() -> bool {
    Command::new(etcd_binary())
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    data: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster of one or more members on loopback.
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: PathBuf,
    token: String,
}

impl std::fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("endpoints", &self.endpoints())
            .finish_non_exhaustive()
    }
}

/// A port free on loopback now (bound, then released).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdCluster {
    /// Starts `members` etcd processes forming one cluster and waits (up to 30 s) until it
    /// has a leader.
    pub fn start(members: usize) -> std::io::Result<Self> {
        let token = format!("kvroute-test-{}-{}", std::process::id(), unique());
        let dir = std::env::temp_dir().join(&token);
        std::fs::create_dir_all(&dir)?;
        let mut cluster = Self {
            members: Vec::with_capacity(members),
            dir,
            token,
        };
        for i in 0..members.max(1) {
            let name = format!("m{i}");
            cluster.members.push(Member {
                data: cluster.dir.join(&name),
                name,
                client: free_port()?,
                peer: free_port()?,
                child: None,
            });
        }
        for i in 0..cluster.members.len() {
            cluster.spawn(i)?;
        }
        cluster.wait_healthy(Duration::from_secs(30))?;
        Ok(cluster)
    }

    fn spawn(&mut self, i: usize) -> std::io::Result<()> {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect();
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", m.name)))?;
        let child = Command::new(etcd_binary())
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data)
            .arg("--listen-client-urls")
            .arg(format!("http://127.0.0.1:{}", m.client))
            .arg("--advertise-client-urls")
            .arg(format!("http://127.0.0.1:{}", m.client))
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{}", m.peer))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{}", m.peer))
            .arg("--initial-cluster")
            .arg(initial.join(","))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// `HOST:PORT` of every member's client listener.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect()
    }

    /// `etcd://HOST:PORT,...` naming every member.
    pub fn url(&self) -> String {
        format!("etcd://{}", self.endpoints().join(","))
    }

    /// Kills member `i` with SIGKILL (no clean shutdown) and reaps it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members.get_mut(i).and_then(|m| m.child.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its ports and data (after [`EtcdCluster::kill`]) and waits
    /// until the cluster is healthy.
    pub fn restart(&mut self, i: usize) -> std::io::Result<()> {
        self.kill(i);
        self.spawn(i)?;
        self.wait_healthy(Duration::from_secs(30))
    }

    /// Waits until a running member answers `/health` with `"health":"true"` (a leader
    /// exists).
    pub fn wait_healthy(&self, limit: Duration) -> std::io::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            for m in self.members.iter().filter(|m| m.child.is_some()) {
                if health(m.client).unwrap_or(false) {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "etcd not healthy within {limit:?}; logs in {}",
                        self.dir.display()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Where the members' data and logs are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Puts `value` under `key` as is, through the first running member's JSON gateway
    /// (`POST /v3/kv/put`): how a test plants values no kvroute writer would, such as junk
    /// too large for a listing.
    pub fn put_raw(&self, key: &str, value: &[u8]) -> std::io::Result<()> {
        let member = self
            .members
            .iter()
            .find(|m| m.child.is_some())
            .ok_or_else(|| std::io::Error::other("no etcd member is running"))?;
        let body = format!(
            "{{\"key\":\"{}\",\"value\":\"{}\"}}",
            base64(key.as_bytes()),
            base64(value)
        );
        let endpoint = format!("127.0.0.1:{}", member.client);
        let mut s = TcpStream::connect(&endpoint)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "POST /v3/kv/put HTTP/1.0\r\nHost: {endpoint}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut reply = String::new();
        s.read_to_string(&mut reply)?;
        if reply.contains(" 200 OK") {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "etcd refused the put of {key}: {}",
                reply.lines().next().unwrap_or("no answer")
            )))
        }
    }
}

/// Standard base64 with padding (the gateway's encoding of keys and values).
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A number distinct per call in this process.
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `GET /health` on a member's client port.
fn health(port: u16) -> std::io::Result<bool> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body)?;
    Ok(body.contains("\"health\":\"true\""))
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_pads_as_the_standard_does() {
        assert_eq!(super::base64(b""), "");
        assert_eq!(super::base64(b"f"), "Zg==");
        assert_eq!(super::base64(b"fo"), "Zm8=");
        assert_eq!(super::base64(b"foo"), "Zm9v");
        assert_eq!(super::base64(b"foob"), "Zm9vYg==");
    }
}
