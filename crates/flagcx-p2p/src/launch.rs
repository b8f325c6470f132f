//! Starting the ranks of a job on this node: what `flagcx-run` and the examples use.
//!
//! Each rank is a child process with `FLAGCX_RANK`, `FLAGCX_NRANKS`, `FLAGCX_LOCAL_RANK`,
//! `FLAGCX_UNIQUE_ID` (fresh random secret) and `FLAGCX_VENDOR` set. Output lines are prefixed
//! with the rank (unless [`LaunchSpec::prefix`] is off); [`LaunchSpec::passthrough`] ranks
//! write straight to this process's stdout and stderr.
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
    for rank in 0..spec.nranks {
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
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        // SAFETY: runs in the child between fork and exec, calling only async-signal-safe
        // functions (prctl, getppid, _exit) and touching no memory of the parent's.
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
