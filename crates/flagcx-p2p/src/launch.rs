//! Starting the ranks of a job on this node: what `flagcx-run` and the examples use.
//!
//! Each rank is a child process with `FLAGCX_RANK`, `FLAGCX_NRANKS`, `FLAGCX_LOCAL_RANK`,
//! `FLAGCX_UNIQUE_ID` (fresh random secret) and `FLAGCX_VENDOR` set. Output lines are prefixed
//! with the rank (unless [`LaunchSpec::prefix`] is off); [`LaunchSpec::passthrough`] ranks
//! write straight to this process's stdout and stderr.
//!
//! Where the launcher's CPUs are no more than the ranks, every rank is bound to a CPU of its
//! own, or to one in turn where they are fewer ([`Bind`], as `mpirun` binds to cores): left
//! to the scheduler, two ranks' spinning threads often start on one core and share it until
//! the load balancer parts them — on 2 cores an 8 B host-vendor round trip then took 2.4–2.7 µs
//! instead of 0.44–0.62, in one to three of five runs at the start of a sweep.
//!
//! No rank outlives the job:
//! - the first rank to fail ends the others: `SIGTERM`, then `SIGKILL` after
//!   [`LaunchSpec::grace`] (a stopped or wedged rank cannot keep the job alive);
//! - [`LaunchSpec::timeout`] bounds the whole job the same way;
//! - `SIGTERM`, `SIGINT` or `SIGHUP` sent to the launching process (Slurm, Kubernetes, a CI
//!   timeout, Ctrl-C) is forwarded to every rank, with the same grace before `SIGKILL`;
//! - every rank is started with `PR_SET_PDEATHSIG = SIGKILL`, so if the launcher itself is
//!   killed outright, the kernel kills its ranks.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::bootstrap::UniqueId;
use crate::error::{CommError, Result};

/// The default time between `SIGTERM` and `SIGKILL` when a job is stopped.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3);

/// What to start.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Number of ranks.
    pub nranks: usize,
    /// Vendor per rank, cycled (`["cuda", "host"]` alternates); empty leaves `FLAGCX_VENDOR`
    /// to the environment.
    pub vendors: Vec<String>,
    /// The program and its arguments.
    pub program: Vec<String>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Give up (and stop every rank) after this long.
    pub timeout: Option<Duration>,
    /// How long ranks get between `SIGTERM` and `SIGKILL` when the job is stopped (a rank
    /// failed, the timeout passed, or the launcher got a signal); [`DEFAULT_GRACE`].
    pub grace: Duration,
    /// Prefix each output line with `[rank] ` (`true`), or pass lines through unchanged.
    pub prefix: bool,
    /// Ranks whose stdout and stderr are this process's own, not captured: what they print
    /// reaches the terminal (or the pipe) unchanged and at once — a table or JSON for `| jq`,
    /// a progress bar that needs a terminal. Empty by default.
    pub passthrough: Vec<usize>,
    /// Whether ranks are bound to CPUs ([`Bind::Auto`] by default).
    pub bind: Bind,
}

/// Overrides [`LaunchSpec::bind`] where that is [`Bind::Auto`] (`auto`, `cpus` or `off`), for
/// the tools that launch their own ranks (`flagcx-perf -N`, the examples).
pub const BIND_ENV: &str = "FLAGCX_BIND";

/// How a launcher places its ranks on the CPUs it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bind {
    /// Where there are no more CPUs than ranks, each rank gets one: its own, or one in turn
    /// where there are fewer ([`bind_plan`]); with more CPUs than ranks, none — the ranks'
    /// helper threads then use the spare ones (12 host ranks on the 16-core H200 host ran a
    /// 12 MiB all-to-all in 4817 µs unbound, 6185 µs bound to 1–2 CPUs each).
    #[default]
    Auto,
    /// Always, as [`bind_plan`] shares them out.
    Cpus,
    /// Never: the ranks inherit the launcher's CPUs.
    Off,
}

impl std::str::FromStr for Bind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Bind::Auto),
            "cpus" | "cores" => Ok(Bind::Cpus),
            "off" | "none" => Ok(Bind::Off),
            other => Err(format!("expected auto, cpus or off, got {other:?}")),
        }
    }
}

/// The CPUs each of `nranks` ranks is bound to, out of the launcher's `allowed` ones (in
/// order); `None`: no binding (by `bind`, or no CPU to give). With at least one CPU per rank,
/// rank `i` gets `allowed[i·c/n .. (i+1)·c/n]`: contiguous, so a rank's CPUs share caches.
/// With fewer (oversubscribed), rank `i` gets `allowed[i mod c]`: ranks take turns on their
/// core instead of piling onto one while another idles — four host ranks on 2 cores ran a
/// 1 MiB all-to-all in 228–248 µs bound against 252–276 µs unbound (three alternating runs).
pub fn bind_plan(bind: Bind, allowed: &[usize], nranks: usize) -> Option<Vec<Vec<usize>>> {
    let c = allowed.len();
    let wanted = match bind {
        Bind::Off => false,
        Bind::Cpus => true,
        Bind::Auto => c <= nranks,
    };
    if !wanted || nranks == 0 || c == 0 {
        return None;
    }
    Some(
        (0..nranks)
            .map(|i| {
                if c >= nranks {
                    allowed[i * c / nranks..(i + 1) * c / nranks].to_vec()
                } else {
                    vec![allowed[i % c]]
                }
            })
            .collect(),
    )
}

impl LaunchSpec {
    /// A spec for `nranks` ranks of `program`, with the defaults: no vendor list, no extra
    /// environment, no timeout, [`DEFAULT_GRACE`], prefixed output.
    pub fn new(nranks: usize, program: Vec<String>) -> Self {
        LaunchSpec {
            nranks,
            vendors: Vec::new(),
            program,
            env: Vec::new(),
            timeout: None,
            grace: DEFAULT_GRACE,
            prefix: true,
            passthrough: Vec::new(),
            bind: Bind::Auto,
        }
    }
}

/// How a launch ended.
#[derive(Debug)]
pub struct LaunchOutcome {
    /// Each rank's exit status (`None` if it was stopped by the launcher).
    pub statuses: Vec<Option<ExitStatus>>,
    /// The first rank that failed, if any.
    pub first_failure: Option<usize>,
    /// Whether the timeout stopped the job.
    pub timed_out: bool,
    /// The signal (`SIGTERM`, `SIGINT`, `SIGHUP`) the launching process received, which
    /// stopped the job.
    pub signal: Option<i32>,
}

impl LaunchOutcome {
    /// True when every rank exited with status 0.
    pub fn success(&self) -> bool {
        self.first_failure.is_none() && !self.timed_out && self.signal.is_none()
    }
}

/// The last of `SIGTERM`/`SIGINT`/`SIGHUP` the launching process received (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Async-signal-safe: one atomic store.
    RECEIVED.store(sig, Ordering::SeqCst);
}

const FORWARDED: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Catches the forwarded signals for the launch's lifetime; restores what was there on drop.
struct SignalGuard {
    old: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalGuard {
    fn install() -> Result<Self> {
        RECEIVED.store(0, Ordering::SeqCst);
        let mut old = Vec::new();
        for sig in FORWARDED {
            // SAFETY: plain-old-data structs, zero-initialised then filled; `on_signal` only
            // stores to an atomic, which is async-signal-safe.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                sa.sa_flags = libc::SA_RESTART;
                let mut prev: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &sa, &mut prev) != 0 {
                    return Err(CommError::io("sigaction", std::io::Error::last_os_error()));
                }
                old.push((sig, prev));
            }
        }
        Ok(SignalGuard { old })
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, prev) in &self.old {
            // SAFETY: restoring the action `sigaction` returned for this signal.
            unsafe { libc::sigaction(*sig, prev, std::ptr::null_mut()) };
        }
    }
}

fn pump(
    rank: usize,
    src: impl std::io::Read + Send + 'static,
    to_stderr: bool,
    prefix: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).lines() {
            let Ok(line) = line else { break };
            let tag = if prefix {
                format!("[{rank}] ")
            } else {
                String::new()
            };
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "{tag}{line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "{tag}{line}");
            }
        }
    })
}

/// Sends `sig` to every rank still running, waits up to `grace` for them to exit, then
/// kills the rest (`SIGKILL` works on stopped processes too) and reaps every one.
fn stop(children: &mut [Option<Child>], sig: libc::c_int, grace: Duration) {
    for c in children.iter_mut().flatten() {
        if matches!(c.try_wait(), Ok(None)) {
            // SAFETY: sending a signal to our own child's pid, which we have not reaped.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline
        && children
            .iter_mut()
            .flatten()
            .any(|c| matches!(c.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut().flatten() {
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// Starts the ranks, forwards their output, and waits for all of them (see the module docs
/// for how a job is stopped). While it runs, `SIGTERM`, `SIGINT` and `SIGHUP` to this process
/// are caught and forwarded to the ranks; the previous handlers come back when it returns.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchOutcome> {
    if spec.nranks == 0 {
        return Err(CommError::InvalidArgument(
            "a job needs at least one rank".into(),
        ));
    }
    let Some((exe, args)) = spec.program.split_first() else {
        return Err(CommError::InvalidArgument("no program to run".into()));
    };
    let id = UniqueId::random()?;
    let _signals = SignalGuard::install()?;
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    let bind = match (spec.bind, std::env::var(BIND_ENV)) {
        (Bind::Auto, Ok(v)) => v
            .parse()
            .map_err(|e| CommError::InvalidArgument(format!("{BIND_ENV}: {e}")))?,
        (b, _) => b,
    };
    // Read before any rank starts: the launcher's own CPUs, which it shares out.
    let allowed = crate::numa::allowed_cpus().unwrap_or_default();
    let plan = bind_plan(bind, &allowed, spec.nranks);
    for rank in 0..spec.nranks {
        let cpus = plan.as_ref().map(|p| crate::numa::cpu_set(&p[rank]));
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("FLAGCX_RANK", rank.to_string())
            .env("FLAGCX_NRANKS", spec.nranks.to_string())
            .env("FLAGCX_LOCAL_RANK", rank.to_string())
            .env("FLAGCX_UNIQUE_ID", id.to_string());
        if !spec.passthrough.contains(&rank) {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        if !spec.vendors.is_empty() {
            cmd.env("FLAGCX_VENDOR", &spec.vendors[rank % spec.vendors.len()]);
        }
        if plan.is_some() {
            // A bound rank sees its own share; the few-core rules want the job's.
            cmd.env(
                flagcx_adaptor::spin::JOB_CPUS_ENV,
                allowed.len().to_string(),
            );
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        // SAFETY: runs in the child between fork and exec, calling only async-signal-safe
        // functions (prctl, getppid, sched_setaffinity — a plain system call — and _exit),
        // reading only the CPU set built before the fork.
        unsafe {
            cmd.pre_exec(move || {
                // Die with the launcher, however it dies.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before the prctl: then no signal will come.
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                // A failed binding is no reason to fail the rank: it runs where it may.
                if let Some(set) = &cpus {
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set);
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(mut c) => {
                if let Some(out) = c.stdout.take() {
                    pumps.push(pump(rank, out, false, spec.prefix));
                }
                if let Some(err) = c.stderr.take() {
                    pumps.push(pump(rank, err, true, spec.prefix));
                }
                children.push(Some(c));
            }
            Err(e) => {
                stop(&mut children, libc::SIGTERM, spec.grace);
                return Err(CommError::io("start rank", e));
            }
        }
    }
    let start = Instant::now();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; spec.nranks];
    let mut first_failure = None;
    let mut timed_out = false;
    let mut signal = None;
    while statuses.iter().any(|s| s.is_none()) {
        for (rank, c) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            if let Some(child) = c.as_mut() {
                if let Ok(Some(st)) = child.try_wait() {
                    statuses[rank] = Some(st);
                    if !st.success() && first_failure.is_none() {
                        first_failure = Some(rank);
                    }
                }
            }
        }
        if first_failure.is_some() {
            break;
        }
        let sig = RECEIVED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            signal = Some(sig);
            break;
        }
        if spec.timeout.is_some_and(|t| start.elapsed() > t) {
            timed_out = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if first_failure.is_some() || timed_out || signal.is_some() {
        for (rank, c) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                *c = None;
            }
        }
        stop(&mut children, signal.unwrap_or(libc::SIGTERM), spec.grace);
    }
    // Every rank is reaped; its pipes close unless a process it started still holds them,
    // which must not keep the launcher waiting.
    let deadline = Instant::now() + Duration::from_secs(1);
    while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    for p in pumps.into_iter().filter(|p| p.is_finished()) {
        let _ = p.join();
    }
    Ok(LaunchOutcome {
        statuses,
        first_failure,
        timed_out,
        signal,
    })
}

#[cfg(test)]
mod tests {
    use super::{bind_plan, launch, Bind, LaunchSpec};
    use crate::numa::{allowed_cpus, parse_cpulist};

    #[test]
    fn ranks_are_bound_only_where_cpus_are_no_more_than_ranks() {
        let two = [0, 1];
        assert_eq!(bind_plan(Bind::Auto, &two, 2), Some(vec![vec![0], vec![1]]));
        // Oversubscribed: one CPU each, in turn; roomy: left to the scheduler.
        assert_eq!(
            bind_plan(Bind::Auto, &two, 5),
            Some(vec![vec![0], vec![1], vec![0], vec![1], vec![0]])
        );
        assert_eq!(bind_plan(Bind::Auto, &two, 1), None);
        let sixteen: Vec<usize> = (0..16).collect();
        assert_eq!(bind_plan(Bind::Auto, &sixteen, 8), None);
        assert_eq!(bind_plan(Bind::Auto, &sixteen, 12), None);
        assert_eq!(
            bind_plan(Bind::Auto, &sixteen, 16).map(|p| p[15].clone()),
            Some(vec![15])
        );
        // Shares are contiguous and cover every CPU, in the launcher's own order.
        let odd = [2, 3, 5, 7, 11];
        assert_eq!(bind_plan(Bind::Auto, &odd, 3), None);
        assert_eq!(
            bind_plan(Bind::Cpus, &odd, 3),
            Some(vec![vec![2], vec![3, 5], vec![7, 11]])
        );
        assert_eq!(
            bind_plan(Bind::Cpus, &sixteen, 2),
            Some(vec![(0..8).collect(), (8..16).collect()])
        );
        assert_eq!(
            bind_plan(Bind::Cpus, &two, 3),
            Some(vec![vec![0], vec![1], vec![0]])
        );
        assert_eq!(bind_plan(Bind::Off, &two, 2), None);
        assert_eq!(bind_plan(Bind::Cpus, &[], 1), None);
    }

    #[test]
    fn bind_values_parse_strictly() {
        assert_eq!("auto".parse::<Bind>(), Ok(Bind::Auto));
        assert_eq!(" cpus".parse::<Bind>(), Ok(Bind::Cpus));
        assert_eq!("cores".parse::<Bind>(), Ok(Bind::Cpus));
        assert_eq!("off".parse::<Bind>(), Ok(Bind::Off));
        assert!("yes".parse::<Bind>().is_err());
    }

    /// Each launched rank runs on the share the plan gave it (read back from the kernel).
    #[test]
    fn launched_ranks_run_on_their_share() {
        let allowed = allowed_cpus().expect("this process's CPUs");
        // More ranks than CPUs where the machine is small, to see both kinds of share.
        let n = (allowed.len() + 1).min(4);
        let plan = bind_plan(Bind::Cpus, &allowed, n).expect("a CPU to share out");
        let dir = std::env::temp_dir().join(format!("flagcx-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "(grep Cpus_allowed_list /proc/self/status; echo \"$FLAGCX_JOB_CPUS\") > {}/$FLAGCX_RANK",
            dir.display()
        );
        let spec = LaunchSpec {
            bind: Bind::Cpus,
            ..LaunchSpec::new(n, vec!["sh".into(), "-c".into(), script])
        };
        assert!(launch(&spec).expect("the job runs").success());
        for (rank, cpus) in plan.iter().enumerate() {
            let text = std::fs::read_to_string(dir.join(rank.to_string())).unwrap();
            let (line, job_cpus) = text.split_once('\n').unwrap();
            // The few-core rules read the job's CPUs, not the rank's share.
            assert_eq!(job_cpus.trim(), allowed.len().to_string(), "rank {rank}");
            let list = line.split(':').nth(1).unwrap().trim().to_string();
            let got = parse_cpulist(&list).expect("the kernel's CPU list");
            assert_eq!(&got, cpus, "rank {rank} runs on {list}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
