//! Two hosts on one machine: network namespaces joined by a veth pair, each with an address
//! the harness chose, for tests of what crosses a real network stack. Needs root and `ip`
//! (iproute2); [`HostPair::create`] says why when they are missing, and removes everything it
//! made when dropped.

use std::process::Command;

/// Two namespaces, `a` and `b`, with `addr_a` and `addr_b` on the two ends of a veth pair.
#[derive(Debug)]
pub struct HostPair {
    /// Namespace of host A.
    pub a: String,
    /// Namespace of host B.
    pub b: String,
    /// Host A's address.
    pub addr_a: String,
    /// Host B's address.
    pub addr_b: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

impl HostPair {
    /// Creates the pair, or says why it cannot (`Err` with the reason: not root, no `ip`, no
    /// permission to create namespaces).
    pub fn create() -> Result<Self, String> {
        if !is_root() {
            return Err("not running as root".to_owned());
        }
        let id = std::process::id();
        // Names and a /24 unique to this process, so parallel runs do not collide.
        let pair = Self {
            a: format!("kvr{id}a"),
            b: format!("kvr{id}b"),
            addr_a: format!("10.{}.{}.1", 100 + (id >> 8) % 100, id % 256),
            addr_b: format!("10.{}.{}.2", 100 + (id >> 8) % 100, id % 256),
        };
        let (veth_a, veth_b) = (
            format!("kv{}a", id % 100_000),
            format!("kv{}b", id % 100_000),
        );
        ip(&["netns", "add", &pair.a])?;
        // From here on, Drop cleans up whatever was made.
        ip(&["netns", "add", &pair.b])?;
        ip(&[
            "link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b,
        ])?;
        ip(&["link", "set", &veth_a, "netns", &pair.a])?;
        ip(&["link", "set", &veth_b, "netns", &pair.b])?;
        for (ns, dev, addr) in [
            (&pair.a, &veth_a, &pair.addr_a),
            (&pair.b, &veth_b, &pair.addr_b),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(pair)
    }
}

impl Drop for HostPair {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth, which deletes the other end.
        for ns in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
