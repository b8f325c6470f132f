//! Rank 0's progress through the sweep on stderr.

use std::io::IsTerminal as _;
use std::time::Instant;

/// Rank 0's progress through the sweep on stderr: a bar where stderr is a terminal, else a
/// plain line at most every 10 s (CI logs stay readable), and one at the end.
pub(crate) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    total: usize,
    done: usize,
    t0: Instant,
    last_line: Instant,
}

impl Progress {
    pub(crate) fn new(total: usize) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(total as u64);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} sizes, now {msg}",
            ) {
                b.set_style(style.progress_chars("=> "));
            }
            b
        });
        let now = Instant::now();
        Progress {
            bar,
            total,
            done: 0,
            t0: now,
            last_line: now,
        }
    }

    /// A new size begins (the previous one is done).
    pub(crate) fn start(&mut self, size: usize) {
        if let Some(b) = &self.bar {
            b.set_position(self.done as u64);
            b.set_message(format!("{size} B"));
        } else if self.done > 0 && self.last_line.elapsed().as_secs() >= 10 {
            eprintln!(
                "progress: {}/{} sizes, now {size} B, {:.0} s",
                self.done,
                self.total,
                self.t0.elapsed().as_secs_f64()
            );
            self.last_line = Instant::now();
        }
        self.done += 1;
    }

    /// Runs `f` (which prints a row) with the bar hidden, so rows and bar do not mix.
    pub(crate) fn suspend(&self, f: impl FnOnce()) {
        match &self.bar {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    pub(crate) fn finish(self) {
        match self.bar {
            Some(b) => b.finish_and_clear(),
            None if self.total > 0 => eprintln!(
                "progress: {}/{} sizes in {:.1} s",
                self.total,
                self.total,
                self.t0.elapsed().as_secs_f64()
            ),
            None => {}
        }
    }
}
