//! `cargo xtask bench --python`: the Python package's per-call latency next to the Rust API's,
//! and the torch backend's next to the package's and gloo's, each pair in one run.
//!
//! Every call is waited for before the next on both sides (`flagcx-perf --blocking`; the
//! package's calls wait by default), ranks started by `flagcx-run` (one CPU each where the
//! machine has no more CPUs than ranks). Rounds alternate between the two programs; a row is
//! the median of the rounds. Verdicts come from the issue's targets (#58): the Python layer
//! adds ≤ 5 µs per call from 8 B to 64 KiB; the torch backend adds ≤ 10 µs over the package's
//! call up to 64 KiB and keeps ≥ 0.9 × its bandwidth from 1 MiB; against gloo it is ≥ 10 ×
//! faster up to 64 KiB and ≥ 1.0 × beyond.

use std::collections::BTreeMap;
use std::process::Command;

use crate::{cargo, root, run, Result};

const ROUNDS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `cmd`, returning the JSON objects it printed one per line.
fn json_rows(cmd: &mut Command) -> Result<Vec<serde_json::Value>> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l.trim()).ok())
        .collect())
}

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v.get(key).and_then(|x| x.as_f64()).unwrap_or(f64::NAN)
}

fn launcher(n: usize) -> Command {
    let mut c = Command::new(root().join("target/release/flagcx-run"));
    c.args(["-n", &n.to_string(), "--no-prefix", "--"])
        .env("FLAGCX_VENDOR", "host");
    c
}

/// The package's perf module (from the wheel installed under `PYTHONPATH`).
fn python() -> [&'static str; 3] {
    ["python3", "-m", "flagcx.perf"]
}

/// The benchmark; writes the tables to `target/xtask/pybench.md` and prints them.
pub fn bench_python(record: Option<&str>) -> Result {
    let mut data: Vec<serde_json::Value> = Vec::new();
    run(
        "building flagcx-perf and flagcx-run",
        cargo().args([
            "build",
            "--release",
            "-p",
            "flagcx",
            "--bin",
            "flagcx-perf",
            "--bin",
            "flagcx-run",
        ]),
    )?;
    let site = root().join("target/xtask/python-release");
    crate::build_wheel(true, &root().join("target/wheels-release"), &site)?;
    let perf = root().join("target/release/flagcx-perf");
    let mut md = String::new();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    md.push_str(&format!(
        "Host-vendor ranks on this machine ({cpus} CPUs), median of {ROUNDS} rounds, \
         `cargo xtask bench --python`.\n\n"
    ));

    // 1. The Python layer over the Rust API.
    md.push_str(
        "| test | bytes | Rust API µs | Python µs | added µs | numpy (staged) µs | ≤ 5 µs |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for test in ["allreduce", "sendrecv"] {
        let mut rust: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        let mut py: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        let mut numpy: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for round in 0..ROUNDS {
            eprintln!("xtask: {test}: round {}/{ROUNDS}", round + 1);
            let mut c = launcher(2);
            c.arg(&perf).args([
                "-t",
                test,
                "--blocking",
                "-b",
                "8",
                "-e",
                "65536",
                "-f",
                "8",
                "-n",
                "2000",
                "-w",
                "200",
                "--json",
            ]);
            for r in json_rows(&mut c)? {
                rust.entry(num(&r, "bytes") as u64)
                    .or_default()
                    .push(num(&r, "time_us"));
            }
            let mut c = launcher(2);
            c.args(python())
                .args([
                    "-t", test, "-b", "8", "-e", "65536", "-f", "8", "-i", "2000", "-w", "200",
                    "-r", "1", "--json",
                ])
                .env("PYTHONPATH", &site);
            for r in json_rows(&mut c)? {
                let b = num(&r, "bytes") as u64;
                py.entry(b).or_default().push(num(&r, "flagcx_us"));
                numpy.entry(b).or_default().push(num(&r, "numpy_us"));
            }
        }
        for (b, r) in rust {
            let (pys, nps) = (
                py.remove(&b).unwrap_or_default(),
                numpy.remove(&b).unwrap_or_default(),
            );
            data.push(serde_json::json!({
                "group": "python", "test": format!("python {test}"), "ranks": 2, "bytes": b,
                "ours_us": pys, "rust_us": r, "numpy_us": nps,
            }));
            let (r, p) = (median(r), median(pys));
            let np = median(nps);
            let added = p - r;
            md.push_str(&format!(
                "| {test} | {b} | {r:.2} | {p:.2} | {added:+.2} | {np:.2} | {} |\n",
                if added <= 5.0 { "met" } else { "missed" }
            ));
        }
    }

    // 2. torch.distributed over flagcx, next to the package and to gloo; first what torch
    // itself costs to reach any Python backend (the floor under the added-latency target).
    let mut floor = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let mut c = Command::new("python3");
        c.args(python()[1..].iter())
            .args(["--floor", "--json", "-r", "3"])
            .env("PYTHONPATH", &site);
        c.env_remove("FLAGCX_RANK");
        for r in json_rows(&mut c)? {
            floor.0.push(num(&r, "noop_us"));
            floor.1.push(num(&r, "flagcx_us"));
        }
    }
    let floor_rounds = floor.clone();
    md.push_str(&format!(
        "\nOne-rank `dist.all_reduce` of 8 bytes in one process (`flagcx-py-perf --floor`): a \
         no-op Python backend {:.2} µs (torch's floor for any Python backend), flagcx {:.2} µs.\n",
        median(floor.0),
        median(floor.1)
    ));
    md.push_str(
        "\n| test | ranks | bytes | package µs | torch+flagcx µs | added µs | gloo µs | \
         gloo ÷ ours | verdict |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for ranks in [2usize, 4] {
        for test in ["allreduce", "allgather", "broadcast"] {
            let mut rows: BTreeMap<u64, Vec<serde_json::Value>> = BTreeMap::new();
            for round in 0..ROUNDS.min(3) {
                eprintln!("xtask: torch {test} on {ranks} ranks: round {}", round + 1);
                let mut c = launcher(ranks);
                c.args(python())
                    .args([
                        "-t", test, "--torch", "-b", "8", "-e", "16777216", "-f", "8", "-i", "100",
                        "-w", "10", "-r", "3", "--json",
                    ])
                    .env("PYTHONPATH", &site);
                for r in json_rows(&mut c)? {
                    rows.entry(num(&r, "bytes") as u64).or_default().push(r);
                }
            }
            for (b, rs) in rows {
                let all = |k: &str| rs.iter().map(|r| num(r, k)).collect::<Vec<f64>>();
                data.push(serde_json::json!({
                    "group": "torch", "test": format!("torch {test}"), "ranks": ranks, "bytes": b,
                    "ours_us": all("torch_us"), "package_us": all("flagcx_us"),
                    "gloo_us": all("gloo_us"),
                }));
                let m = |k: &str| median(all(k));
                let (pkg, tor, gloo) = (m("flagcx_us"), m("torch_us"), m("gloo_us"));
                let added = tor - pkg;
                let vs_gloo = gloo / tor;
                let verdict = if b <= 65536 {
                    match (added <= 10.0, vs_gloo >= 10.0) {
                        (true, true) => "met",
                        (false, true) => "missed (added)",
                        (true, false) => "missed (gloo)",
                        (false, false) => "missed (both)",
                    }
                } else if b >= 1 << 20 {
                    match (pkg / tor >= 0.9, vs_gloo >= 1.0) {
                        (true, true) => "met",
                        (false, _) => "missed (< 0.9 × package)",
                        (_, false) => "missed (gloo)",
                    }
                } else {
                    "—"
                };
                md.push_str(&format!(
                    "| {test} | {ranks} | {b} | {pkg:.1} | {tor:.1} | {added:+.1} | {gloo:.1} | \
                     {vs_gloo:.1} | {verdict} |\n"
                ));
            }
        }
    }
    if let Some(name) = record {
        data.push(serde_json::json!({
            "group": "floor", "test": "torch floor", "ranks": 1, "bytes": 8,
            "ours_us": floor_rounds.1, "noop_us": floor_rounds.0,
        }));
        let meta = [
            (
                "labels",
                serde_json::json!({"rust": "Rust API", "package": "package", "gloo": "gloo",
                                   "noop": "no-op backend"}),
            ),
            (
                "references",
                serde_json::json!({
                    "rust": "flagcx-perf --blocking, the same ranks and sizes, alternating rounds",
                    "package": "the package's own call in the same process (flagcx-py-perf --torch)",
                    "gloo": "torch's gloo group of the same ranks in the same process",
                    "noop": "torch.distributed over a Python backend that does nothing: torch's own cost",
                }),
            ),
        ];
        crate::perfpage::record(name, "cargo xtask bench --python", &meta, data)?;
    }
    let out = root().join("target/xtask/pybench.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("{md}\n(written to {})", out.display());
    Ok(())
}
