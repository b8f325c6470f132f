//! The perf tool must not rot: a tiny sweep of every test with data checking, JSON and a plot.
//! No timing is asserted — only that it runs, moves the right bytes and writes what it promises.

use std::process::Command;

fn perf(args: &[&str]) -> String {
    perf_env(args, &[])
}

/// flagcx-perf with `args` and the extra environment `env`; its output, having succeeded.
fn perf_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let (ok, text) = perf_run(args, env);
    assert!(ok, "flagcx-perf {args:?} failed:\n{text}");
    text
}

/// flagcx-perf with `args` and the extra environment `env` on the host vendor: whether it
/// succeeded, and its stdout then stderr.
fn perf_run(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_flagcx-perf"))
        .args(args)
        .env("FLAGCX_VENDOR", "host")
        .env_remove("FLAGCX_RANK")
        .envs(env.iter().copied())
        .output()
        .expect("run flagcx-perf");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Table rows: rank 0's lines that start with a size.
fn rows(t: &str) -> usize {
    t.lines()
        .filter(|l| l.starts_with("  ") && l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .count()
}

#[test]
fn every_test_runs_a_checked_tiny_sweep() {
    for (test, ranks) in [("sendrecv", "3"), ("pingpong", "2"), ("pairs", "4")] {
        let t = perf(&[
            "-t", test, "-N", ranks, "-b", "8", "-e", "64K", "-f", "32", "-n", "3", "-w", "1", "-c",
        ]);
        assert!(t.contains("# wrong bytes in all: 0"), "{test}:\n{t}");
        // 8, 256, 8K sizes, each with a ceiling column.
        assert_eq!(rows(&t), 3, "{test}:\n{t}");
    }
}

/// `--json`: stdout is one JSON object per size and nothing else, so `| jq` works; the plot
/// is an SVG document with one line per measured series.
#[test]
fn staged_transport_and_json_and_plot() {
    let dir = std::env::temp_dir().join(format!("flagcx-perf-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("sweep.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_flagcx-perf"))
        .args([
            "--transport",
            "staged",
            "-b",
            "1K",
            "-e",
            "1M",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
            "--json",
            "--plot",
        ])
        .arg(&svg)
        .env("FLAGCX_VENDOR", "host")
        .env_remove("FLAGCX_RANK")
        .output()
        .expect("run flagcx-perf");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    // 1K, 8K, 64K, 512K.
    assert_eq!(rows.len(), 4, "{stdout}");
    for (r, bytes) in rows.iter().zip([1024, 8192, 65536, 524288]) {
        assert_eq!(r["bytes"], bytes, "{r}");
        assert_eq!(r["transport"], "staged", "{r}");
        assert_eq!(r["wrong"], 0, "{r}");
        assert_eq!(r["test"], "sendrecv", "{r}");
        for key in [
            "time_us",
            "algbw_gbs",
            "busbw_gbs",
            "ceiling_us",
            "ceiling_gbs",
            "ratio",
        ] {
            assert!(r[key].as_f64().is_some_and(|v| v >= 0.0), "{key} in {r}");
        }
    }
    let text = std::fs::read_to_string(&svg).expect("plot written");
    let doc = roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    // A series is a polyline through every measured size; legend samples have two points.
    let series = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .filter(|n| {
            n.attribute("points")
                .is_some_and(|p| p.split_whitespace().count() == 4)
        })
        .count();
    assert_eq!(series, 2, "bus bandwidth and ceiling");
    let labels: String = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .collect::<Vec<_>>()
        .join("|");
    for want in [
        "message size (bytes)",
        "bandwidth (GB/s)",
        "flagcx-rs bus bandwidth",
        "ceiling",
    ] {
        assert!(
            labels.contains(want),
            "{want:?} not among the plot's labels: {labels}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--json-file` writes the rows and keeps the table on stdout.
#[test]
fn json_file_keeps_the_table() {
    let dir = std::env::temp_dir().join(format!("flagcx-perf-jsonfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.json");
    let t = perf(&[
        "-t",
        "pingpong",
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "2",
        "-w",
        "1",
        "-c",
        "--json-file",
        file.to_str().unwrap(),
    ]);
    // 8, 64, 512, 4K.
    assert_eq!(rows(&t), 4, "{t}");
    let json = std::fs::read_to_string(&file).expect("rows written");
    let parsed: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    assert_eq!(parsed.len(), 4, "{json}");
    assert_eq!(parsed[3]["bytes"], 4096);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn run(bin: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin).args(args).output().expect("run")
}

#[test]
fn help_names_every_option_and_version_names_the_vendors() {
    for (bin, options) in [
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &[
                "--test",
                "--minbytes",
                "--maxbytes",
                "--stepfactor",
                "--iters",
                "--warmup_iters",
                "--check",
                "--nranks",
                "--vendor",
                "--transport",
                "--json",
                "--json-file",
                "--in-place",
                "--plot",
                "--version",
                "[default: 64M]",
                "FLAGCX_VENDOR",
            ][..],
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-run"),
            &[
                "--nranks",
                "--vendor",
                "--timeout",
                "--grace",
                "--no-prefix",
                "--version",
                "[default: 3]",
                "FLAGCX_RANK",
                "FLAGCX_UNIQUE_ID",
                "torchrun",
                "PR_SET_PDEATHSIG",
            ][..],
        ),
    ] {
        let out = run(bin, &["--help"]);
        let help = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{bin} --help");
        for o in options {
            assert!(
                help.contains(o),
                "{bin} --help does not mention {o}:\n{help}"
            );
        }
        let v = run(bin, &["--version"]);
        let v = String::from_utf8_lossy(&v.stdout);
        assert!(
            v.contains(env!("CARGO_PKG_VERSION")) && v.contains("vendors: "),
            "{v}"
        );
        assert!(v.contains("host"), "{v}");
    }
}

#[test]
fn bad_arguments_exit_2_naming_the_option() {
    for (bin, args, named) in [
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &["-t", "alltoallw"][..],
            "--test",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &["-b", "4Q"][..],
            "--minbytes",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &["-t", "broadcast", "-N", "2", "-r", "2"][..],
            "--root",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &["--vendor", "nvidia"][..],
            "--vendor",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &["--bogus"][..],
            "--bogus",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-perf"),
            &["-t", "alltoall", "--in-place"][..],
            "--in-place",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-run"),
            &["-n", "0", "--", "true"][..],
            "--nranks",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-run"),
            &["-n", "2", "--grace", "soon", "--", "true"][..],
            "--grace",
        ),
        (
            env!("CARGO_BIN_EXE_flagcx-run"),
            &["-n", "2"][..],
            "PROGRAM",
        ),
    ] {
        let out = run(bin, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bin} {args:?}: {err}");
        assert!(
            err.contains(named),
            "{bin} {args:?} does not name {named}: {err}"
        );
    }
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

/// The reductions of the perf tool, 3 ranks, out of place and in place, with a 16-bit type
/// and an average: every element checked bit for bit against the reference.
#[test]
fn reduction_tests_run_checked() {
    for test in ["allreduce", "reducescatter", "reduce"] {
        for place in [None, Some("--in-place")] {
            let mut args = vec![
                "-t", test, "-N", "3", "-r", "1", "-d", "bfloat16", "-o", "avg", "-b", "3K", "-e",
                "3M", "-f", "32", "-n", "2", "-w", "1", "-c",
            ];
            args.extend(place);
            let t = perf(&args);
            assert!(
                t.contains("# wrong bytes in all: 0"),
                "{test} {place:?}:\n{t}"
            );
            assert_eq!(rows(&t), 3, "{test} {place:?}:\n{t}");
        }
    }
    // The JSON rows carry the slowest rank's own combining time, a positive number of µs.
    let j = perf(&[
        "-t",
        "allreduce",
        "-N",
        "2",
        "-b",
        "64K",
        "-e",
        "64K",
        "-n",
        "2",
        "-w",
        "1",
        "--json",
    ]);
    let row: serde_json::Value = serde_json::from_str(j.lines().next().unwrap_or("")).expect(&j);
    assert!(
        row["reduce_us"].as_f64().is_some_and(|us| us > 0.0),
        "{row}"
    );
}

/// Every collective test of the perf tool, 3 ranks, every byte checked.
#[test]
fn collective_tests_run_checked() {
    for test in [
        "broadcast",
        "gather",
        "scatter",
        "allgather",
        "alltoall",
        "alltoallv",
    ] {
        let t = perf(&[
            "-t", test, "-N", "3", "-b", "3K", "-e", "3M", "-f", "32", "-n", "2", "-w", "1", "-c",
        ]);
        assert!(t.contains("# wrong bytes in all: 0"), "{test}:\n{t}");
        // 3K, 96K, 3M.
        assert_eq!(rows(&t), 3, "{test}:\n{t}");
    }
    // In place (each rank's input inside its receive buffer; a scatter's root keeps its block
    // in its send buffer), checked the same way.
    for test in ["broadcast", "gather", "scatter", "allgather"] {
        let t = perf(&[
            "-t",
            test,
            "-N",
            "3",
            "-b",
            "3K",
            "-e",
            "3M",
            "-f",
            "32",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
            "--in-place",
        ]);
        assert!(
            t.contains(&format!("# flagcx-perf {test} (in place)")),
            "{t}"
        );
        assert!(
            t.contains("# wrong bytes in all: 0"),
            "{test} in place:\n{t}"
        );
        assert_eq!(rows(&t), 3, "{test} in place:\n{t}");
    }
    // Rooted at the last rank (`-r`), out of place and in place: the root's bytes are checked
    // everywhere, and a gather's or scatter's root keeps its block at its own offset.
    for test in ["broadcast", "gather", "scatter"] {
        for place in [None, Some("--in-place")] {
            let mut args = vec![
                "-t", test, "-N", "3", "-r", "2", "-b", "3K", "-e", "96K", "-f", "32", "-n", "2",
                "-w", "1", "-c",
            ];
            args.extend(place);
            let t = perf(&args);
            assert!(
                t.contains("# wrong bytes in all: 0"),
                "{test} -r 2 {place:?}:\n{t}"
            );
            assert_eq!(rows(&t), 2, "{test} -r 2 {place:?}:\n{t}");
        }
    }
}

/// `--completions SHELL` prints a script naming the tool's options.
#[test]
fn completion_scripts_name_the_options() {
    for (bin, option) in [
        (env!("CARGO_BIN_EXE_flagcx-perf"), "--minbytes"),
        (env!("CARGO_BIN_EXE_flagcx-run"), "--grace"),
    ] {
        for shell in ["bash", "zsh", "fish"] {
            let out = run(bin, &["--completions", shell]);
            let script = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{bin} --completions {shell}");
            assert!(
                script.contains(option.trim_start_matches('-')),
                "{bin} {shell}:\n{script}"
            );
        }
    }
}

/// `--blocking` (each iteration waited for) and the default (every iteration enqueued, one
/// wait at the end) move the same checked bytes, on two ranks and on three (where enqueued
/// groups once stalled: `enqueued_groups_3_ranks` in tests/p2p.rs).
#[test]
fn enqueued_and_blocking_timing_both_check_out() {
    let two = ["-t", "sendrecv", "-N", "2"];
    let three = ["-t", "pairs", "-N", "3"];
    for (job, extra) in [(two, &[][..]), (two, &["--blocking"][..]), (three, &[][..])] {
        let mut args = job.to_vec();
        args.extend_from_slice(&[
            "-b", "8", "-e", "1M", "-f", "64", "-n", "5", "-w", "1", "-c",
        ]);
        args.extend_from_slice(extra);
        let t = perf(&args);
        assert!(t.contains("# wrong bytes in all: 0"), "{extra:?}:\n{t}");
        // 8, 512, 32K.
        assert_eq!(rows(&t), 3, "{extra:?}:\n{t}");
    }
}

/// `--vs-nccl` where NCCL cannot run (host ranks): the header says why, every row carries
/// `n/a` in the three NCCL columns, and the JSON rows carry them as null.
#[test]
fn vs_nccl_says_why_not_where_nccl_cannot_run() {
    let args = [
        "-t",
        "sendrecv",
        "-N",
        "2",
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "3",
        "--vs-nccl",
    ];
    let t = perf(&args);
    assert!(
        t.contains("# vs NCCL: n/a: NCCL runs CUDA ranks only"),
        "{t}"
    );
    let header = t.lines().find(|l| l.contains("time_us")).expect("header");
    assert!(header.ends_with("nccl_us   nccl_gbs  vs_nccl"), "{header}");
    let data: Vec<&str> = t
        .lines()
        .filter(|l| l.starts_with("  ") && l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert_eq!(data.len(), 4, "{t}"); // 8, 64, 512, 4096
    for row in data {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[cols.len() - 3..], ["n/a", "n/a", "n/a"], "{row}");
    }
    let mut json = args.to_vec();
    json.push("--json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flagcx-perf"))
        .args(&json)
        .env("FLAGCX_VENDOR", "host")
        .env_remove("FLAGCX_RANK")
        .output()
        .expect("run flagcx-perf");
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("one JSON object per line");
        for k in ["nccl_us", "nccl_gbs", "vs_nccl"] {
            assert!(v[k].is_null(), "{k} in {line}");
        }
    }
    // Without the flag the fields are absent.
    let plain = perf(&[
        "-t", "sendrecv", "-N", "2", "-b", "8", "-e", "8", "-n", "2", "--json",
    ]);
    assert!(!plain.contains("nccl"), "{plain}");
}

/// An IPC pair's header says where its ranks are; on two devices (host ranks on two host
/// devices, as on two GPUs) the ceiling is a copy into the peer's buffer, mapped through IPC
/// by every rank of a ring at once, and the checked sweep still finds every byte.
#[test]
fn ipc_pairs_name_their_placement_and_measure_against_the_peer() {
    let args = [
        "-t", "sendrecv", "-N", "3", "-b", "8", "-e", "1M", "-f", "256", "-n", "3", "-w", "1", "-c",
    ];
    let two = perf_env(&args, &[]);
    assert!(two.contains("(two devices; each sender copies)"), "{two}");
    assert!(two.contains("# wrong bytes in all: 0"), "{two}");
    assert_eq!(rows(&two), 3, "{two}");
    let one = perf_env(&args, &[("FLAGCX_HOST_DEVICES", "1")]);
    assert!(
        one.contains("(one device; rank 0 copies both ways)"),
        "{one}"
    );
    assert!(one.contains("# wrong bytes in all: 0"), "{one}");
}

/// Where the streams share one work queue (the host vendor's `FLAGCX_HOST_QUEUES=1`, as
/// `CUDA_DEVICE_MAX_CONNECTIONS=1`), the pairs copy late by default: the header says so, and the
/// sweep (through proxy hand-overs on the other path: `FLAGCX_P2P_IPC_CALLER=off`) finishes
/// with every byte right. With late copies off, and for staged pairs, the posts wait for what
/// the proxy copies (where a stream join stalled it, until the operation timeout): the header
/// says so and every size finishes with every byte right. Nothing is said with a worker per
/// stream, and no header warns any more.
#[test]
fn the_header_notes_where_streams_share_one_queue() {
    let args = [
        "-t", "sendrecv", "-b", "8", "-e", "256K", "-f", "32", "-n", "3", "-w", "1", "-c",
    ];
    let warning = "# warning: this process's streams share one work queue";
    let note = "# note: this process's streams share one work queue";
    let late = "late copies: the second to post copies";
    let queue = [
        ("FLAGCX_HOST_QUEUES", "1"),
        ("FLAGCX_TIMEOUT_MS", "5000"),
        ("FLAGCX_P2P_IPC_CALLER", "off"),
    ];
    let (ok, text) = perf_run(&args, &queue);
    assert!(ok, "{text}");
    assert!(text.contains(note) && text.contains(late), "{text}");
    assert!(!text.contains(warning), "{text}");
    assert!(text.contains("# wrong bytes in all: 0"), "{text}");
    assert_eq!(rows(&text), 4, "{text}");
    let off = [
        ("FLAGCX_HOST_QUEUES", "1"),
        ("FLAGCX_TIMEOUT_MS", "5000"),
        ("FLAGCX_P2P_LATE_COPY", "off"),
        ("FLAGCX_P2P_IPC_CALLER", "off"),
    ];
    let off_args = [
        "-t", "sendrecv", "-b", "8", "-e", "64", "-f", "8", "-n", "3", "-w", "1", "-c",
    ];
    // Without late copies (IPC pairs through the proxy, and staged pairs) the posts wait for
    // what the proxy copies instead of a stream join: where that stalled, every size finishes.
    let waits = "posts of operations the proxy copies return once those finished";
    let staged = [
        ("FLAGCX_HOST_QUEUES", "1"),
        ("FLAGCX_TIMEOUT_MS", "5000"),
        ("FLAGCX_P2P_DISABLE", "1"),
    ];
    for env in [&off[..], &staged[..]] {
        let (ok, shared) = perf_run(&args, env);
        assert!(ok, "{shared}");
        assert!(shared.contains(waits), "{shared}");
        assert!(
            !shared.contains(warning) && !shared.contains(late),
            "{shared}"
        );
        assert!(shared.contains("# wrong bytes in all: 0"), "{shared}");
        assert_eq!(rows(&shared), 4, "{shared}");
    }
    let own = perf_env(&off_args, &[("FLAGCX_HOST_QUEUES", "0")]);
    assert!(!own.contains(warning) && !own.contains(note), "{own}");
    assert!(!own.contains(late), "{own}");
}

/// The GPU bundle's verdict table (`xtask/assets/targets.py`) reads what flagcx-perf writes:
/// fed real rows of a host-vendor run under the names `targets.sh` gives them, it must print a
/// number for the targets those rows cover and "NO DATA" for the rest, not fail on a renamed
/// field. Skipped (and reported) where there is no `python3`.
#[test]
fn the_bundles_verdict_table_reads_flagcx_perf_rows() {
    let py = Command::new("python3").arg("--version").output();
    if !py.is_ok_and(|o| o.status.success()) {
        flagcx_adaptor::conformance::report_skip_reason(
            "perf_smoke",
            "host",
            "python3 not found: the GPU bundle's targets.py was not checked",
        );
        return;
    }
    let dir = std::env::temp_dir().join(format!("flagcx-targets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str| dir.join(format!("{name}.json")).display().to_string();
    for (name, args) in [
        (
            "staged-pingpong",
            &[
                "-t",
                "pingpong",
                "--transport",
                "staged",
                "-b",
                "64M",
                "-e",
                "64M",
            ][..],
        ),
        (
            "mixed-cuda-host-sendrecv",
            &["-t", "sendrecv", "-b", "1M", "-e", "4M", "-f", "4"],
        ),
        (
            "mixed-cuda-host-broadcast",
            &["-t", "broadcast", "-b", "1M", "-e", "4M", "-f", "4"],
        ),
        (
            "bcast-root1-pull",
            &["-t", "broadcast", "-r", "1", "-b", "16M", "-e", "16M"],
        ),
    ] {
        let mut a = args.to_vec();
        let f = file(name);
        a.extend(["-n", "2", "-w", "1", "-c", "--json-file", &f]);
        perf(&a);
    }
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/xtask/assets/targets.py"
        ))
        .arg(&dir)
        .output()
        .expect("run targets.py");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |what: &str| {
        text.lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no line for {what}:\n{text}"))
            .to_string()
    };
    assert!(
        text.contains("wrong bytes over every flagcx-perf row: 0"),
        "{text}"
    );
    for covered in [
        "staged CUDA<->CUDA / pinned copy",
        "cuda-host broadcast busbw / the pair's sendrecv",
    ] {
        let l = line(covered);
        assert!(
            (l.ends_with("met") || l.ends_with("MISSED")) && !l.contains("NO DATA"),
            "{l}"
        );
    }
    for missing in [
        "allgather busbw / NCCL's",
        "alltoall busbw / NCCL's, 8 B-2 MiB, FLAGCX_P2P_STREAM=on",
        "4 MiB puts / host-issued copies into the peer",
        "trigger pick-up",
        "CUDA<->OpenCL 8 B",
    ] {
        assert!(line(missing).ends_with("NO DATA"), "{text}");
    }
    // The broadcast diagnosis prints the rows it has, by size.
    assert!(
        line("broadcast 16 MiB, GB/s: root 1 pulled ").len() > 35,
        "{text}"
    );
}
