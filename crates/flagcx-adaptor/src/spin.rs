//! How long threads that wait for other threads spin before they sleep.
//!
//! Spinning saves the microseconds of a wake-up but takes a core. It pays only when every
//! spinner of the job can have a core of its own: measured on a 2-core machine, spinning made an
//! 8-byte host round trip 9× slower (28 → 247 µs), while on a 16-core H200 host it made a CUDA
//! IPC one 1.5× faster. Each rank has up to about four waiters that may spin at once (its API
//! thread, its proxy, the workers of host-vendor streams waiting on values), hence the rule below.

use std::time::Duration;

/// The variable that overrides the rule: microseconds, 0 to never spin, at most 10 000.
pub const SPIN_ENV: &str = "FLAGCX_SPIN_US";

/// The spin used when `FLAGCX_SPIN_US` is not set, for `ranks` processes on this machine:
/// 50 µs if the machine has at least 8 cores and 4 per rank, else none.
pub fn default_spin(ranks: usize) -> Duration {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    spin_rule(cores, ranks)
}

fn spin_rule(cores: usize, ranks: usize) -> Duration {
    if cores >= 8 && cores >= 4 * ranks.max(1) {
        Duration::from_micros(50)
    } else {
        Duration::ZERO
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

/// The ranks on this machine as far as a vendor library can tell without a communicator:
/// `FLAGCX_NRANKS` (set by `flagcx-run`), else 1.
pub fn ranks_from_env() -> usize {
    std::env::var("FLAGCX_NRANKS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::spin_rule;
    use std::time::Duration;

    #[test]
    fn spins_only_with_cores_to_spare() {
        assert_eq!(spin_rule(2, 1), Duration::ZERO);
        assert_eq!(spin_rule(4, 1), Duration::ZERO);
        assert_eq!(spin_rule(16, 2), Duration::from_micros(50));
        assert_eq!(spin_rule(16, 4), Duration::from_micros(50));
        assert_eq!(spin_rule(16, 8), Duration::ZERO);
        assert_eq!(spin_rule(128, 8), Duration::from_micros(50));
        assert_eq!(spin_rule(16, 0), Duration::from_micros(50));
    }
}
