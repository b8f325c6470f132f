//! Starting the ranks of a job on this node: what `flagcx-run` and the examples use.
//!
//! Each rank is a child process with `FLAGCX_RANK`, `FLAGCX_NRANKS`, `FLAGCX_LOCAL_RANK`,
//! `FLAGCX_UNIQUE_ID` (fresh random secret) and `FLAGCX_VENDOR` set. Output lines are prefixed
//! with the rank. The first rank to fail stops the others, and the launch reports it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::bootstrap::UniqueId;
use crate::error::{CommError, Result};

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
}

impl LaunchOutcome {
    /// True when every rank exited with status 0.
    pub fn success(&self) -> bool {
        self.first_failure.is_none() && !self.timed_out
    }
}

fn pump(
    rank: usize,
    src: impl std::io::Read + Send + 'static,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).lines() {
            let Ok(line) = line else { break };
            if to_stderr {
                let _ = writeln!(std::io::stderr().lock(), "[{rank}] {line}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[{rank}] {line}");
            }
        }
    })
}

fn stop(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        // SAFETY: sending a signal to our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(2);
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

/// Starts the ranks, forwards their output, and waits for all of them.
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
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    for rank in 0..spec.nranks {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("FLAGCX_RANK", rank.to_string())
            .env("FLAGCX_NRANKS", spec.nranks.to_string())
            .env("FLAGCX_LOCAL_RANK", rank.to_string())
            .env("FLAGCX_UNIQUE_ID", id.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !spec.vendors.is_empty() {
            cmd.env("FLAGCX_VENDOR", &spec.vendors[rank % spec.vendors.len()]);
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        match cmd.spawn() {
            Ok(mut c) => {
                pumps.push(pump(rank, c.stdout.take().expect("piped"), false));
                pumps.push(pump(rank, c.stderr.take().expect("piped"), true));
                children.push(Some(c));
            }
            Err(e) => {
                stop(&mut children);
                return Err(CommError::io("start rank", e));
            }
        }
    }
    let start = Instant::now();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; spec.nranks];
    let mut first_failure = None;
    let mut timed_out = false;
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
        if spec.timeout.is_some_and(|t| start.elapsed() > t) {
            timed_out = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if first_failure.is_some() || timed_out {
        for (rank, c) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                *c = None;
            }
        }
        stop(&mut children);
    }
    for p in pumps {
        let _ = p.join();
    }
    Ok(LaunchOutcome {
        statuses,
        first_failure,
        timed_out,
    })
}
