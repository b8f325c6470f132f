//! `cargo xtask bench --net`: the network transport next to UCX's own `ucx_perftest`, over the
//! same two "hosts" (network namespaces joined by a bridge, `UCX_TLS=tcp`) in the same run.
//!
//! Both sides are ping-pongs of one message at a time: flagcx-perf's `pingpong` (its time is a
//! round trip; one way is half) against `ucx_perftest -t tag_lat` (one way), and for
//! bandwidth our one-way rate against `-t tag_bw`, which streams a window of messages — a
//! harder peer than the same pattern. Both tools run each size the same number of iterations
//! and each host's process bound to a CPU of its own ([`pinned`]).

use std::process::{Command, Stdio};

use crate::{cargo, root, run, Result};

#[path = "../../tests/common/netns.rs"]
mod netns;

/// Sizes of the sweep: 8 B to 16 MiB, ×8.
const SIZES: [u64; 8] = [8, 64, 512, 4096, 32768, 262144, 2097152, 16777216];

/// The machine's CPUs.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `program` run inside host `i`, bound to CPU `i` (modulo the CPUs) — ours and UCX's alike,
/// as `mpirun` and our launcher bind ranks where CPUs are few. Unbound, two spinning processes
/// of a 2-CPU machine often shared one CPU for part of a run, which moved small-message times
/// by 30% between runs of either tool.
fn pinned(h: &netns::Hosts, i: usize, program: &std::path::Path) -> Command {
    let mut c = h.command(i, std::path::Path::new("taskset"));
    c.args(["-c", &(i % cpus()).to_string()]).arg(program);
    c
}

/// One `ucx_perftest` measurement between host 1 (server) and host 0 (client): the `Final:`
/// line's average one-way latency (µs) and overall bandwidth (GB/s).
fn perftest(h: &netns::Hosts, test: &str, size: u64, port: u16) -> Result<(f64, f64)> {
    let exe = std::path::Path::new("ucx_perftest");
    let mut server = pinned(h, 1, exe);
    server
        .args(["-p", &port.to_string()])
        .env("UCX_TLS", "tcp")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut server = server.spawn().map_err(|e| format!("ucx_perftest: {e}"))?;
    std::thread::sleep(std::time::Duration::from_millis(300));
    let iters = iterations(size).to_string();
    let out = pinned(h, 0, exe)
        .args([&h.addr(1), "-p", &port.to_string(), "-t", test, "-s"])
        .arg(size.to_string())
        .args(["-n", &iters])
        .env("UCX_TLS", "tcp")
        .output()
        .map_err(|e| format!("ucx_perftest: {e}"))?;
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let f: Vec<f64> = text
        .lines()
        .find(|l| l.starts_with("Final:"))
        .ok_or_else(|| format!("ucx_perftest {test} {size}: no Final line\n{text}"))?
        .split_whitespace()
        .skip(1)
        .filter_map(|c| c.parse().ok())
        .collect();
    if f.len() < 6 {
        return Err(format!(
            "ucx_perftest {test} {size}: odd Final line\n{text}"
        ));
    }
    // UCX prints MB/s of 2^20 bytes.
    Ok((f[2], f[5] * 1048576.0 / 1e9))
}

/// Rounds of the comparison.
const ROUNDS: usize = 5;

fn median(v: Option<&Vec<f64>>) -> Option<f64> {
    let mut v = v?.clone();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// Iterations per size, as `perftest` runs them: many below 1 MiB, where one round trip is
/// microseconds and a short run is mostly noise, few above.
fn iterations(size: u64) -> u64 {
    if size >= 1 << 20 {
        100
    } else {
        5000
    }
}

/// One flagcx-perf pingpong sweep between the two hosts: one-way µs per size. Two jobs, so
/// each size runs as many iterations as `perftest` gives it ([`iterations`]).
fn flagcx_round(h: &netns::Hosts, perf: &std::path::Path, port: u16) -> Result<Vec<(u64, f64)>> {
    let small: Vec<u64> = SIZES.iter().copied().filter(|&s| s < 1 << 20).collect();
    let large: Vec<u64> = SIZES.iter().copied().filter(|&s| s >= 1 << 20).collect();
    let mut out = flagcx_sweep(h, perf, port, &small)?;
    out.extend(flagcx_sweep(h, perf, port + 20, &large)?);
    Ok(out)
}

/// A pingpong job over `sizes` (consecutive entries of [`SIZES`], all with one iteration
/// count).
fn flagcx_sweep(
    h: &netns::Hosts,
    perf: &std::path::Path,
    port: u16,
    sizes: &[u64],
) -> Result<Vec<(u64, f64)>> {
    let (Some(&b), Some(&e)) = (sizes.first(), sizes.last()) else {
        return Ok(Vec::new());
    };
    let n = iterations(b);
    let id = job_id(h, port)?;
    let mut ranks = Vec::new();
    for rank in 0..2 {
        let mut c = pinned(h, rank, perf);
        c.args(["-t", "pingpong", "-f", "8", "-c", "--json"])
            .args(["-b", &b.to_string(), "-e", &e.to_string()])
            .args(["-n", &n.to_string(), "-w", &(n / 10).to_string()])
            .env("FLAGCX_RANK", rank.to_string())
            .env("FLAGCX_NRANKS", "2")
            .env("FLAGCX_UNIQUE_ID", &id)
            .env("FLAGCX_VENDOR", "host")
            .env("FLAGCX_JOB_CPUS", cpus().to_string())
            .env("UCX_TLS", "tcp")
            .stdout(Stdio::piped());
        ranks.push(c.spawn().map_err(|e| format!("flagcx-perf: {e}"))?);
    }
    let mut outs = Vec::new();
    for c in ranks {
        let o = c.wait_with_output().map_err(|e| e.to_string())?;
        if !o.status.success() {
            return Err(format!("a flagcx-perf rank failed ({})", o.status));
        }
        outs.push(String::from_utf8_lossy(&o.stdout).into_owned());
    }
    Ok(outs[0]
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["bytes"].as_u64()?, v["time_us"].as_f64()? / 2.0)))
        .collect())
}

/// A random job id with the root at host 0.
fn job_id(h: &netns::Hosts, port: u16) -> Result<String> {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .map_err(|e| format!("/dev/urandom: {e}"))?;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "fx1-{}-{}@{}:{port}",
        &hex[..32],
        &hex[32..],
        h.addr(0)
    ))
}

pub(crate) fn bench_net() -> Result {
    if Command::new("ucx_perftest").arg("-h").output().is_err() {
        return Err("--net needs ucx_perftest: sudo apt-get install ucx-utils".into());
    }
    if Command::new("taskset").arg("-V").output().is_err() {
        return Err("--net needs taskset: sudo apt-get install util-linux".into());
    }
    run(
        "building flagcx-perf",
        cargo().args(["build", "--release", "-p", "flagcx", "--bin", "flagcx-perf"]),
    )?;
    let h = netns::Hosts::new(2)?;
    let perf = root().join("target/release/flagcx-perf");
    let port = 21_000 + (std::process::id() % 20_000) as u16;
    // Rounds alternate us and UCX, so a slow stretch of a small machine hits both; each
    // number is the median of its rounds.
    let mut ours: std::collections::HashMap<u64, Vec<f64>> = Default::default();
    let mut lat: std::collections::HashMap<u64, Vec<f64>> = Default::default();
    let mut bw: std::collections::HashMap<u64, Vec<f64>> = Default::default();
    for round in 0..ROUNDS {
        let base = port + 40 * round as u16;
        eprintln!(
            "xtask: round {}: flagcx-perf pingpong between two namespaces (UCX_TLS=tcp)",
            round + 1
        );
        for (size, us) in flagcx_round(&h, &perf, base)? {
            ours.entry(size).or_default().push(us);
        }
        eprintln!(
            "xtask: round {}: ucx_perftest tag_lat and tag_bw, same namespaces",
            round + 1
        );
        for (i, &size) in SIZES.iter().enumerate() {
            let (l, _) = perftest(&h, "tag_lat", size, base + 1 + 2 * i as u16)?;
            let (_, b) = perftest(&h, "tag_bw", size, base + 2 + 2 * i as u16)?;
            lat.entry(size).or_default().push(l);
            bw.entry(size).or_default().push(b);
        }
    }
    println!(
        "# same run, two network namespaces, UCX_TLS=tcp, each host's process on a CPU of its \
         own, median of {ROUNDS} alternating rounds; one-way times (flagcx: half a round trip)"
    );
    println!(
        "{:>10} {:>11} {:>11} {:>9} {:>11} {:>11} {:>9}",
        "bytes", "flagcx_us", "ucx_lat_us", "lat_x", "flagcx_GBs", "ucx_bw_GBs", "bw_ratio"
    );
    for size in SIZES {
        let (Some(us), Some(l), Some(b)) = (
            median(ours.get(&size)),
            median(lat.get(&size)),
            median(bw.get(&size)),
        ) else {
            continue;
        };
        let gbs = size as f64 / us / 1e3;
        println!(
            "{size:>10} {us:>11.2} {l:>11.2} {:>9.2} {gbs:>11.3} {b:>11.3} {:>9.2}",
            us / l,
            gbs / b
        );
    }
    println!("# lat_x: our one-way time ÷ tag_lat's (target ≤ 1.2); bw_ratio: ours ÷ tag_bw's (target ≥ 0.9 from 1 MiB)");
    Ok(())
}
