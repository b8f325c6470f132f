//! `FLAGCX_PROFILE=1`: where the proxy's operations spend their time, printed at teardown.

use std::time::Instant;

use crate::op::Dir;

/// Prints why small messages of eager pairs went to the proxy ([`crate::op::Declined`]).
pub(crate) fn report_declined(rank: usize, declined: &[std::sync::atomic::AtomicU64; 4]) {
    let n = |i: usize| declined[i].load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "flagcx profile rank {rank}: small messages of eager pairs handed to the proxy: {} with \
         the caller's stream busy, {} with the pair busy, {} receives waited out, {} found a \
         message of the proxy's protocol",
        n(0),
        n(1),
        n(2),
        n(3)
    );
}

/// Where operations spend their time, per direction (`FLAGCX_PROFILE=1` prints it at teardown).
#[derive(Default)]
pub(crate) struct Profile {
    /// Per direction: count, post→admit, admit→matched, matched→done (seconds).
    dirs: [(u64, f64, f64, f64); 2],
    /// IPC handles opened (cache misses).
    pub(crate) ipc_opens: u64,
    /// IPC mappings closed while running (cache trims), and the seconds that took.
    pub(crate) ipc_closes: u64,
    pub(crate) ipc_close_secs: f64,
}

impl Profile {
    pub(crate) fn add(
        &mut self,
        dir: Dir,
        posted: Instant,
        admitted: Instant,
        matched: Option<Instant>,
    ) {
        let now = Instant::now();
        let m = matched.unwrap_or(now);
        let d = &mut self.dirs[dir as usize];
        d.0 += 1;
        d.1 += admitted.duration_since(posted).as_secs_f64();
        d.2 += m.duration_since(admitted).as_secs_f64();
        d.3 += now.duration_since(m).as_secs_f64();
    }

    pub(crate) fn report(&self, rank: usize) {
        eprintln!(
            "flagcx profile rank {rank}: {} IPC handle opens, {} closed while running ({:.1} ms)",
            self.ipc_opens,
            self.ipc_closes,
            self.ipc_close_secs * 1e3
        );
        for (dir, (n, a, b, c)) in ["send", "recv"].iter().zip(self.dirs) {
            if n == 0 {
                continue;
            }
            let us = |x: f64| x / n as f64 * 1e6;
            let (match_what, rest_what) = if *dir == "send" {
                ("waiting for the receive descriptor", "copy and answer")
            } else {
                (
                    "waiting for the caller's stream, then announcing",
                    "waiting for the sender",
                )
            };
            eprintln!(
                "flagcx profile rank {rank}: {n} {dir}s, mean µs: post→proxy {:.1}, {match_what} {:.1}, {rest_what} {:.1}",
                us(a),
                us(b),
                us(c)
            );
        }
    }
}
