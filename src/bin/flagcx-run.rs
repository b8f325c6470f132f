//! `flagcx-run`: start the ranks of a job on this node.
//!
//! ```text
//! flagcx-run -n N [--vendor V | --vendors A,B,…] [--timeout SECS] [--grace SECS]
//!            [--no-prefix] -- PROGRAM [ARGS…]
//! ```
//!
//! Each rank gets `FLAGCX_RANK`, `FLAGCX_NRANKS`, `FLAGCX_LOCAL_RANK`, `FLAGCX_UNIQUE_ID` and
//! (with `--vendor`/`--vendors`, cycled over ranks) `FLAGCX_VENDOR`. Output lines are prefixed
//! with `[rank]`. No rank outlives the job: the first rank that fails, the timeout, or a
//! `SIGTERM`/`SIGINT`/`SIGHUP` to the launcher stops the others (`SIGTERM`, then `SIGKILL`
//! after the grace period), and ranks die with the launcher if it is killed outright.
//!
//! Exit status: 0 when every rank succeeded; the first failing rank's own exit code (or
//! 128 + its signal); 124 on `--timeout`; 128 + the signal the launcher received; 2 for bad
//! arguments.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;

use flagcx::p2p::launch::{launch, LaunchSpec, DEFAULT_GRACE};

const USAGE: &str = "usage: flagcx-run -n N [--vendor V | --vendors A,B,...] [--timeout SECS] \
[--grace SECS] [--no-prefix] -- PROGRAM [ARGS...]";

fn seconds(name: &str, v: String) -> Result<Duration, String> {
    let secs: f64 = v
        .parse()
        .map_err(|_| format!("{name} needs seconds, got {v:?}"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{name} needs seconds >= 0, got {v:?}"))
}

fn parse(args: &[String]) -> Result<LaunchSpec, String> {
    let mut spec = LaunchSpec::new(0, Vec::new());
    spec.grace = DEFAULT_GRACE;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "-n" | "--nranks" => {
                let v = value("-n")?;
                spec.nranks = v
                    .parse()
                    .map_err(|_| format!("-n needs a positive integer, got {v:?}"))?
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
            "--timeout" => spec.timeout = Some(seconds("--timeout", value("--timeout")?)?),
            "--grace" => spec.grace = seconds("--grace", value("--grace")?)?,
            "--no-prefix" => spec.prefix = false,
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
    let grace = spec.grace.as_secs_f64();
    match launch(&spec) {
        Ok(out) if out.success() => ExitCode::SUCCESS,
        Ok(out) => {
            if let Some(sig) = out.signal {
                eprintln!(
                    "flagcx-run: got signal {sig}; forwarded it to every rank (SIGKILL after {grace} s)"
                );
                return ExitCode::from(128u8.saturating_add(sig as u8));
            }
            if out.timed_out {
                eprintln!("flagcx-run: timed out; stopped every rank");
                return ExitCode::from(124);
            }
            let r = out.first_failure.unwrap_or(0);
            let st = out.statuses.get(r).copied().flatten();
            eprintln!(
                "flagcx-run: rank {r} failed first ({}); stopped the others (SIGTERM, SIGKILL after {grace} s)",
                st.map_or("stopped".into(), |s| s.to_string())
            );
            let code = match st {
                Some(s) => s
                    .code()
                    .or_else(|| s.signal().map(|g| 128 + g))
                    .unwrap_or(1),
                None => 1,
            };
            ExitCode::from(u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("flagcx-run: {e}");
            ExitCode::FAILURE
        }
    }
}
