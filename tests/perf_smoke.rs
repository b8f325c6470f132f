//! The perf tool must not rot: a tiny sweep of every test with data checking, JSON and a plot.
//! No timing is asserted — only that it runs, moves the right bytes and writes what it promises.

use std::process::Command;

fn perf(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_flagcx-perf"))
        .args(args)
        .env("FLAGCX_VENDOR", "host")
        .env_remove("FLAGCX_RANK")
        .output()
        .expect("run flagcx-perf");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "flagcx-perf {args:?} failed:\n{text}");
    text
}

#[test]
fn every_test_runs_a_checked_tiny_sweep() {
    for (test, ranks) in [("sendrecv", "3"), ("pingpong", "2"), ("pairs", "4")] {
        let t = perf(&[
            "-t", test, "-N", ranks, "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1", "-c",
        ]);
        assert!(t.contains("# wrong bytes in all: 0"), "{test}:\n{t}");
        // 8, 256, 8K sizes, each with a ceiling column.
        assert_eq!(
            t.lines().filter(|l| l.starts_with("[0]  ")).count(),
            3,
            "{test}:\n{t}"
        );
    }
}

#[test]
fn staged_transport_and_json_and_plot() {
    let dir = std::env::temp_dir().join(format!("flagcx-perf-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("sweep.svg");
    let t = perf(&[
        "--transport",
        "staged",
        "-b",
        "1K",
        "-e",
        "1M",
        "-f",
        "32",
        "-n",
        "2",
        "-w",
        "1",
        "-c",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let rows: Vec<&str> = t.lines().filter(|l| l.contains("{\"test\"")).collect();
    assert_eq!(rows.len(), 3, "{t}");
    for r in rows {
        for key in [
            "\"transport\":\"staged\"",
            "\"wrong\":0",
            "\"ceiling_gbs\":",
            "\"busbw_gbs\":",
        ] {
            assert!(r.contains(key), "{key} missing in {r}");
        }
    }
    let plot = std::fs::read_to_string(&svg).expect("plot written");
    assert!(
        plot.starts_with("<svg") && plot.matches("<polyline").count() == 2,
        "{plot}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_are_refused_with_usage() {
    let out = Command::new(env!("CARGO_BIN_EXE_flagcx-perf"))
        .args(["-t", "allreduce"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: flagcx-perf"));
}

/// `--transport staged` holds under a launcher too (the ranks read it, not the launcher).
#[test]
fn staged_transport_is_honoured_under_flagcx_run() {
    let out = Command::new(env!("CARGO_BIN_EXE_flagcx-run"))
        .args(["-n", "2", "--vendor", "host", "--"])
        .arg(env!("CARGO_BIN_EXE_flagcx-perf"))
        .args([
            "--transport",
            "staged",
            "-b",
            "64K",
            "-e",
            "64K",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
        ])
        .env_remove("FLAGCX_RANK")
        .output()
        .expect("run flagcx-run");
    let t = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("| transport staged"),
        "the pair was not staged:\n{t}"
    );
    assert!(t.contains("# wrong bytes in all: 0"), "{t}");
}
