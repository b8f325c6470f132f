//! Where a device's proxy threads should run: the CPUs of the device's NUMA node, read from
//! sysfs (`/sys/bus/pci/devices/<bus id>/numa_node`, then
//! `/sys/devices/system/node/node<N>/cpulist`), limited to the CPUs this process may use.
//! A proxy that polls memory the device writes, and issues the device's copies, belongs next
//! to it: on a two-socket host the other socket adds a cross-link hop to every poll.

use std::path::Path;

/// Parses a kernel CPU list (`0-3,8,10-11`); `None` if malformed.
pub(crate) fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// The CPUs of the NUMA node of the PCI device `bus_id` (e.g. `0000:3b:00.0`), as sysfs under
/// `sysfs` describes them; `None` when the node is unknown (`-1`, no file, a bad bus id).
pub(crate) fn node_cpus(sysfs: &Path, bus_id: &str) -> Option<Vec<usize>> {
    let bus = bus_id.trim().to_ascii_lowercase();
    if bus.is_empty() || bus.contains('/') || bus.contains("..") {
        return None;
    }
    let node: i64 =
        std::fs::read_to_string(sysfs.join("bus/pci/devices").join(&bus).join("numa_node"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
    if node < 0 {
        return None;
    }
    let list = std::fs::read_to_string(
        sysfs
            .join("devices/system/node")
            .join(format!("node{node}"))
            .join("cpulist"),
    )
    .ok()?;
    parse_cpulist(&list).filter(|c| !c.is_empty())
}

/// The CPUs of the device's node that this process may run on; `None` if there is no such
/// CPU (binding would then leave the process's own limits).
pub(crate) fn device_cpus(sysfs: &Path, bus_id: &str) -> Option<Vec<usize>> {
    let node = node_cpus(sysfs, bus_id)?;
    let allowed = allowed_cpus()?;
    let both: Vec<usize> = node.into_iter().filter(|c| allowed.contains(c)).collect();
    (!both.is_empty()).then_some(both)
}

/// [`device_cpus`] of the adaptor's device, from the live sysfs (`None` for devices with no
/// PCI identity, such as the host vendor's).
pub(crate) fn adaptor_cpus<A: flagcx_adaptor::DeviceAdaptor>(a: &A) -> Option<Vec<usize>> {
    let bus = a.properties(a.device()).ok()?.pci_bus_id?;
    device_cpus(Path::new("/sys"), &bus)
}

/// The CPUs the calling thread may run on.
pub(crate) fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the call fills it for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return None;
    }
    // SAFETY: reading bits of an initialized set, below its capacity.
    Some(
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect(),
    )
}

/// A CPU set holding `cpus` (those beyond the set's capacity left out).
pub(crate) fn cpu_set(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: `c` is below the set's capacity.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

/// Restricts the calling thread to `cpus`; whether it worked.
pub(crate) fn bind_current_thread(cpus: &[usize]) -> bool {
    let set = cpu_set(cpus);
    // SAFETY: a valid set of the size passed; 0 is the calling thread.
    let ok =
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } == 0;
    if ok {
        tracing::debug!(?cpus, "proxy thread bound to its device's NUMA node");
    }
    ok
}

/// Says at `info` which CPUs this rank's threads (the caller, the proxy, the vendor's workers)
/// share and how its waiters behave there: under `mpirun --bind-to core` or Slurm's
/// `--cpu-bind=cores` a rank gets one CPU, and a waiter that spun there would keep the very
/// thread it waits for off that CPU, so waiters yield between polls below 8 CPUs
/// (`flagcx_adaptor::spin::relax`).
pub(crate) fn log_cpus(rank: usize, nranks: usize) {
    let own = std::thread::available_parallelism().map_or(1, |n| n.get());
    let job = flagcx_adaptor::spin::cores_from_env();
    let yields = job < 8;
    tracing::info!(
        rank,
        cpus = own,
        job_cpus = job,
        "rank {rank} of {nranks}: {own} CPU(s) in its affinity mask, {job} for the job: waiting \
         threads {}",
        if yields {
            "yield between polls (fewer than 8 CPUs), so the thread waited for gets the CPU"
        } else {
            "spin with CPU pauses"
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(node: &str, cpulist: Option<&str>) -> tempdir::Dir {
        let d = tempdir::Dir::new();
        let dev = d.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), node).unwrap();
        if let Some(l) = cpulist {
            let n = d.path().join("devices/system/node/node1");
            std::fs::create_dir_all(&n).unwrap();
            std::fs::write(n.join("cpulist"), l).unwrap();
        }
        d
    }

    /// A throwaway directory (std only).
    mod tempdir {
        pub struct Dir(std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "flagcx-numa-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
            pub fn path(&self) -> &std::path::Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn cpulists_parse_like_the_kernel_writes_them() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a-b"), None);
        assert_eq!(parse_cpulist("0-99999999"), None);
    }

    #[test]
    fn a_device_on_node_1_gets_node_1s_cpus() {
        let d = fixture("1\n", Some("16-31,48-63\n"));
        let cpus = node_cpus(d.path(), "0000:3B:00.0").unwrap();
        assert_eq!(cpus.len(), 32);
        assert_eq!((cpus[0], cpus[16]), (16, 48));
    }

    #[test]
    fn unknown_nodes_and_odd_bus_ids_bind_nothing() {
        let d = fixture("-1\n", None);
        assert_eq!(node_cpus(d.path(), "0000:3b:00.0"), None);
        let d = fixture("1\n", None);
        assert_eq!(node_cpus(d.path(), "0000:3b:00.0"), None, "no cpulist");
        assert_eq!(node_cpus(d.path(), "../../etc"), None);
        assert_eq!(node_cpus(d.path(), "0000:00:01.0"), None, "no such device");
        let d = fixture("1", Some("garbage"));
        assert_eq!(node_cpus(d.path(), "0000:3b:00.0"), None);
    }

    #[test]
    fn binding_stays_inside_the_allowed_cpus() {
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        let list = allowed
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let d = fixture("1", Some(&format!("{list},100000")));
        assert_eq!(device_cpus(d.path(), "0000:3b:00.0"), Some(allowed.clone()));
        let d = fixture("1", Some("100000"));
        assert_eq!(
            device_cpus(d.path(), "0000:3b:00.0"),
            None,
            "no allowed CPU on the node"
        );
        // Binding a thread to what it may already use succeeds and changes nothing.
        std::thread::spawn(move || {
            assert!(bind_current_thread(&allowed));
            assert_eq!(allowed_cpus().unwrap(), allowed);
        })
        .join()
        .unwrap();
    }
}
