//! How long threads that wait for other threads spin before they sleep, and how they spin.
//!
//! Spinning saves the microseconds of a wake-up (25–30 µs per hand-over on the 2-core
//! development machine, `FLAGCX_PROFILE`) but takes a core. A pure CPU-pause spin starved the
//! very threads being waited for where cores are few (2-core machine: a 512 KiB host round
//! trip rose from 792 to 1014 µs), so below 8 cores a spinner yields between polls
//! ([`relax`]). Measured on the 2-core machine, host-vendor ping-pong, same run: without
//! spinning 225 µs at 8 B, 792 µs at 512 KiB; spinning 50 µs with yields 1.1 µs and 118 µs
//! (Open MPI: 0.31 and 528 µs); 4 ranks' all-to-all at 16 MiB 6544 → 5574 µs (Open MPI 6617).
//! On a 16-core H200 host spinning made a CUDA IPC round trip 1.5× faster. Hence: spin 50 µs
//! by default everywhere.

use std::time::Duration;

/// The variable that overrides the rule: microseconds, 0 to never spin, at most 10 000.
pub const SPIN_ENV: &str = "FLAGCX_SPIN_US";

/// The spin used when `FLAGCX_SPIN_US` is not set, for `ranks` processes on this machine:
/// 50 µs, whatever the core count (below 8 cores spinners yield between polls: [`relax`]).
pub fn default_spin(ranks: usize) -> Duration {
    spin_rule(cores_from_env(), ranks)
}

fn spin_rule(_cores: usize, _ranks: usize) -> Duration {
    Duration::from_micros(50)
}

/// What a spinning thread does between two polls: a CPU pause where the machine has cores to
/// spare, else a yield — on a few-core machine the thread that would make the progress being
/// waited for (a peer's posting thread, this rank's proxy, a host-vendor stream worker) may be
/// waiting for this very core.
pub fn relax() {
    static FEW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let few = *FEW.get_or_init(|| cores_from_env() < 8);
    if few {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// What a thread waiting for a store by another process does between two polls, where none
/// of its own process's threads has to run for that store to come (an eager message's slot):
/// a CPU pause, with a yield every [`peer_yield_every`] polls where cores are few. `polls`
/// counts the caller's polls so far.
///
/// [`relax`] yields after every poll below 8 cores, for waits on this process's own proxy or
/// stream workers; here a yield is only a courtesy to other work, and each one (a system
/// call of ~0.1–0.3 µs) delays seeing the store.
pub fn relax_on_peer(polls: u32) {
    static EVERY: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let every = *EVERY.get_or_init(|| peer_yield_every(cores_from_env(), ranks_from_env()));
    if every != 0 && polls % every == every - 1 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Every how many polls [`relax_on_peer`] yields (0: never) for `ranks` processes on `cores`
/// cores: never from 8 cores; every 256th poll (a few µs of polling) with no more ranks than
/// cores, so this rank's own proxy and stream threads, which share its core where ranks are
/// bound, still get a turn; every poll with more ranks than cores, where a waiter's pauses
/// would keep other ranks' threads off the cores they need.
///
/// Measured on the 2-core machine (host ranks, same sitting): an 8 B round trip took 0.65–0.92
/// µs yielding after every poll and 0.34–0.46 µs yielding every 16th (Open MPI 0.20–0.25); four
/// ranks' all-to-all at 1 MiB took 160–190 µs yielding every poll and 215–290 µs every 16th.
/// Later, five alternating rounds of 20 000 round trips (medians, 8 B / 128 B / 2 KiB): every
/// 16th poll 0.41 / 0.48 / 0.88 µs, every 256th 0.39 / 0.44 / 0.73, never 0.37 / 0.43 / 0.73,
/// Open MPI 0.27 / 0.36 / 0.74 — each yield with nothing else to run is a system call during
/// which the peer's store waits to be seen.
pub fn peer_yield_every(cores: usize, ranks: usize) -> u32 {
    if cores >= 8 {
        0
    } else if ranks > cores {
        1
    } else {
        256
    }
}

/// Parses a `FLAGCX_SPIN_US` value; `Err` says what is wrong with it.
pub fn parse_spin(v: &str) -> std::result::Result<Duration, String> {
    match v.trim().parse::<u64>() {
        Ok(us) if us <= 10_000 => Ok(Duration::from_micros(us)),
        Ok(_) => Err("must be at most 10000 (10 ms)".into()),
        Err(_) => Err("expected a whole number of microseconds".into()),
    }
}

/// `FLAGCX_SPIN_US` parsed: `None` when unset, `Some(Err(reason))` when malformed.
pub fn spin_from_env() -> Option<std::result::Result<Duration, String>> {
    let v = std::env::var(SPIN_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())?;
    Some(parse_spin(&v))
}

/// Set by a launcher that binds its ranks to CPUs (`flagcx_p2p::launch`): how many CPUs the
/// whole job runs on. A bound rank's own CPU count (its affinity) says nothing of how many
/// ranks share a core, which is what the rules here and the host vendor's weigh.
pub const JOB_CPUS_ENV: &str = "FLAGCX_JOB_CPUS";

/// The CPUs the job's ranks share: `FLAGCX_JOB_CPUS` where a launcher bound the ranks, else
/// what this process may run on.
pub fn cores_from_env() -> usize {
    std::env::var(JOB_CPUS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The ranks on this machine as far as a vendor library can tell without a communicator:
/// `FLAGCX_NRANKS` (set by `flagcx-run`), else the launcher's count of ranks on this node
/// (torchrun's `LOCAL_WORLD_SIZE`, Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, Slurm's
/// `SLURM_NTASKS_PER_NODE` where it is one number), else 1.
pub fn ranks_from_env() -> usize {
    ranks_from(|n| std::env::var(n).ok())
}

/// [`ranks_from_env`] over any variable lookup.
pub fn ranks_from(var: impl Fn(&str) -> Option<String>) -> usize {
    [
        "FLAGCX_NRANKS",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|n| var(n)?.trim().parse::<usize>().ok().filter(|&r| r > 0))
    .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::{peer_yield_every, ranks_from, spin_rule};
    use std::time::Duration;

    #[test]
    fn ranks_come_from_flagcx_run_else_the_launchers_local_count() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(ranks_from(env(&[])), 1);
        assert_eq!(ranks_from(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "2")])), 2);
        assert_eq!(ranks_from(env(&[("LOCAL_WORLD_SIZE", "8")])), 8);
        assert_eq!(
            ranks_from(env(&[
                ("FLAGCX_NRANKS", "3"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
            ])),
            3
        );
        // Slurm's "2(x3)" (two tasks on each of three nodes) is not one number: not used.
        assert_eq!(ranks_from(env(&[("SLURM_NTASKS_PER_NODE", "2(x3)")])), 1);
    }

    #[test]
    fn spins_50_us_on_any_machine() {
        for (cores, ranks) in [(2, 1), (2, 4), (4, 8), (16, 2), (16, 8), (128, 8), (16, 0)] {
            assert_eq!(
                spin_rule(cores, ranks),
                Duration::from_micros(50),
                "{cores} {ranks}"
            );
        }
    }

    #[test]
    fn waiters_on_a_peer_yield_only_where_cores_are_short() {
        assert_eq!(peer_yield_every(16, 2), 0);
        assert_eq!(peer_yield_every(8, 64), 0);
        assert_eq!(peer_yield_every(2, 2), 256);
        assert_eq!(peer_yield_every(4, 1), 256);
        assert_eq!(peer_yield_every(2, 4), 1);
    }
}
