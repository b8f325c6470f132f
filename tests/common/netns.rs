//! "Hosts" on one machine for the network transport's tests: network namespaces joined by veth
//! pairs to a bridge that lives in a namespace of its own, with private addresses
//! (`10.77.0.<host + 1>/24`) that exist only inside them. Nothing is changed in the machine's
//! own namespace; dropping [`Hosts`] deletes every namespace, and with them their links.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `hosts` namespaces behind one bridge.
pub struct Hosts {
    names: Vec<String>,
    hub: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` ({e}); install iproute2"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Hosts {
    /// Makes the namespaces, or says why it cannot (not root, no `ip`, no veth support): the
    /// caller reports that as a skip.
    pub fn new(hosts: usize) -> Result<Hosts, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        // Interface names stay under 16 bytes; the tag keeps parallel tests apart.
        let tag = format!(
            "fx{}{}",
            std::process::id() % 100_000,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut h = Hosts {
            names: Vec::new(),
            hub: format!("{tag}hub"),
        };
        ip(&["netns", "add", &h.hub])
            .map_err(|e| format!("cannot make network namespaces (needs root): {e}"))?;
        ip(&["-n", &h.hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &h.hub, "link", "set", "br0", "up"])?;
        for i in 0..hosts {
            let name = format!("{tag}h{i}");
            ip(&["netns", "add", &name])?;
            h.names.push(name.clone());
            let port = format!("p{i}");
            ip(&[
                "-n", &name, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &h.hub,
            ])?;
            ip(&["-n", &h.hub, "link", "set", &port, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &name,
                "addr",
                "add",
                &format!("{}/24", h.addr(i)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &name, "link", "set", "eth0", "up"])?;
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// A command run inside host `i`.
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[i]]).arg(program);
        c
    }

    /// Kills every process inside host `i` (SIGKILL): the host is gone.
    pub fn kill(&self, i: usize) {
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.names[i]])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.names.len() {
            self.kill(i);
        }
        for n in self.names.iter().chain(std::iter::once(&self.hub)) {
            let _ = ip(&["netns", "del", n]);
        }
    }
}
