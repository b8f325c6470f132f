//! `flagcx-run`: start the ranks of a job on this node.
//!
//! ```text
//! flagcx-run -n N [--vendor V | --vendors A,B,…] [--timeout SECS] -- PROGRAM [ARGS…]
//! ```
//!
//! Each rank gets `FLAGCX_RANK`, `FLAGCX_NRANKS`, `FLAGCX_LOCAL_RANK`, `FLAGCX_UNIQUE_ID` and
//! (with `--vendor`/`--vendors`, cycled over ranks) `FLAGCX_VENDOR`. Output lines are prefixed
//! with `[rank]`. The first rank that fails stops the others; the exit status is then non-zero.

use std::process::ExitCode;
use std::time::Duration;

use flagcx::p2p::launch::{launch, LaunchSpec};

const USAGE: &str =
    "usage: flagcx-run -n N [--vendor V | --vendors A,B,...] [--timeout SECS] -- PROGRAM [ARGS...]";

fn parse(args: &[String]) -> Result<LaunchSpec, String> {
    let mut spec = LaunchSpec {
        nranks: 0,
        vendors: Vec::new(),
        program: Vec::new(),
        env: Vec::new(),
        timeout: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "-n" | "--nranks" => {
                spec.nranks = value("-n")?
                    .parse()
                    .map_err(|_| "-n needs a positive integer".to_string())?
            }
            "--vendor" | "--vendors" => {
                spec.vendors = value(a)?
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                for v in &spec.vendors {
                    v.parse::<flagcx::Vendor>().map_err(|e| e.to_string())?;
                }
            }
            "--timeout" => {
                let secs: f64 = value("--timeout")?
                    .parse()
                    .map_err(|_| "--timeout needs seconds".to_string())?;
                spec.timeout = Some(Duration::from_secs_f64(secs));
            }
            "--" => {
                spec.program = it.cloned().collect();
                break;
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if spec.nranks == 0 {
        return Err(format!("-n is required\n{USAGE}"));
    }
    if spec.program.is_empty() {
        return Err(format!("no program after --\n{USAGE}"));
    }
    Ok(spec)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let spec = match parse(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("flagcx-run: {e}");
            return ExitCode::from(2);
        }
    };
    match launch(&spec) {
        Ok(out) if out.success() => ExitCode::SUCCESS,
        Ok(out) => {
            if out.timed_out {
                eprintln!("flagcx-run: timed out; stopped every rank");
                return ExitCode::from(124);
            }
            let r = out.first_failure.unwrap_or(0);
            eprintln!(
                "flagcx-run: rank {r} failed ({}); stopped the others",
                out.statuses[r].map_or("stopped".into(), |s| s.to_string())
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("flagcx-run: {e}");
            ExitCode::FAILURE
        }
    }
}
