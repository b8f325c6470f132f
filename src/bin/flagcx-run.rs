//! `flagcx-run`: start the ranks of a job on this node (`flagcx-run --help`).
//!
//! Exit status: 0 when every rank succeeded; the first failing rank's own exit code (or
//! 128 + its signal); 124 on `--timeout`; 128 + the signal the launcher received; 2 for bad
//! arguments.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory as _, FromArgMatches as _, Parser};
use flagcx::p2p::launch::{launch, LaunchSpec};

/// Starts N ranks of PROGRAM on this node and stops them together.
///
/// Each rank gets FLAGCX_RANK, FLAGCX_NRANKS, FLAGCX_LOCAL_RANK (0..N) and FLAGCX_UNIQUE_ID (a
/// fresh random job id with its secret), and FLAGCX_VENDOR where --vendor is given; the rest
/// of the environment is inherited. Programs started by torchrun (RANK, WORLD_SIZE,
/// LOCAL_RANK) or Open MPI (OMPI_COMM_WORLD_*) find their rank the same way without this
/// launcher, but then need FLAGCX_UNIQUE_ID or a unique id from the application.
///
/// Each output line of a rank is prefixed with the rank in brackets (stdout to stdout, stderr to stderr)
/// unless --no-prefix. No rank outlives the job: the first rank that fails, the timeout, or
/// SIGTERM/SIGINT/SIGHUP to this launcher sends SIGTERM to every rank and SIGKILL after the
/// grace period; if the launcher itself is killed, the kernel kills its ranks
/// (PR_SET_PDEATHSIG).
#[derive(Parser, Debug)]
#[command(name = "flagcx-run", after_help = AFTER_HELP)]
struct Args {
    /// Number of ranks.
    #[arg(short = 'n', long = "nranks", value_parser = clap::value_parser!(u64).range(1..),
          required_unless_present_any = ["completions", "print_id"], default_value_t = 1,
          hide_default_value = true)]
    nranks: u64,
    /// Vendor of each rank, cycled over ranks (host, cuda, hip, opencl; "cuda,host"
    /// alternates); sets FLAGCX_VENDOR. Without it the ranks inherit FLAGCX_VENDOR or detect.
    #[arg(long = "vendor", visible_alias = "vendors", value_delimiter = ',',
          value_parser = vendor_arg)]
    vendors: Vec<String>,
    /// Stop every rank after this many seconds (exit status 124).
    #[arg(long, value_name = "SECS", value_parser = seconds)]
    timeout: Option<Duration>,
    /// Seconds between SIGTERM and SIGKILL when the job is stopped.
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = seconds)]
    grace: Duration,
    /// Pass the ranks' output through unchanged (for machine-readable output).
    #[arg(long)]
    no_prefix: bool,
    /// Bind each rank to its own share of this launcher's CPUs (one CPU in turn where there
    /// are fewer CPUs than ranks): auto (where there are no more CPUs than ranks), cpus
    /// (always), off.
    /// FLAGCX_BIND says the same for launchers without this flag.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = bind_arg)]
    bind: flagcx::p2p::launch::Bind,
    /// The program each rank runs, and its arguments.
    #[arg(
        required_unless_present_any = ["completions", "print_id"],
        last = true,
        value_name = "PROGRAM"
    )]
    program: Vec<String>,
    /// Print a fresh job id (for FLAGCX_UNIQUE_ID; append @host:port of rank 0's host for a
    /// job over several hosts, whose ranks another launcher starts) and exit.
    #[arg(long)]
    print_id: bool,
    /// Print a completion script for SHELL (bash, zsh, fish, elvish, powershell) and exit.
    #[arg(long, value_name = "SHELL", hide_short_help = true)]
    completions: Option<clap_complete::Shell>,
}

const AFTER_HELP: &str = "Exit status: 0 when every rank succeeded; the first failing rank's \
own code (or 128 + its signal); 124 after --timeout; 128 + the signal the launcher received; \
2 for bad arguments.

Example:
  flagcx-run -n 2 --vendors cuda,host -- target/release/examples/pingpong 16";

fn seconds(v: &str) -> Result<Duration, String> {
    let secs: f64 = v
        .parse()
        .map_err(|_| format!("expected seconds, got {v:?}"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("expected seconds >= 0, got {v:?}"))
}

fn bind_arg(v: &str) -> Result<flagcx::p2p::launch::Bind, String> {
    v.parse()
}

fn vendor_arg(v: &str) -> Result<String, String> {
    let v = v.trim();
    v.parse::<flagcx::Vendor>().map_err(|e| e.to_string())?;
    Ok(v.to_string())
}

fn main() -> ExitCode {
    flagcx::init_logging();
    let version: &'static str = Box::leak(flagcx::version_line().into_boxed_str());
    let m = Args::command().version(version).get_matches();
    let a = Args::from_arg_matches(&m).unwrap_or_else(|e| e.exit());
    if let Some(shell) = a.completions {
        clap_complete::generate(
            shell,
            &mut Args::command(),
            "flagcx-run",
            &mut std::io::stdout(),
        );
        return ExitCode::SUCCESS;
    }
    if a.print_id {
        return match flagcx::p2p::UniqueId::random() {
            Ok(id) => {
                println!("{id}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("flagcx-run: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let spec = LaunchSpec {
        vendors: a.vendors,
        timeout: a.timeout,
        grace: a.grace,
        prefix: !a.no_prefix,
        bind: a.bind,
        ..LaunchSpec::new(a.nranks as usize, a.program)
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
