//! Bookkeeping that every vendor needs to turn bad handles into typed errors.
//!
//! Vendor runtimes crash, or worse, on a stream handle that was destroyed or a pointer they never
//! allocated. Adaptors therefore remember what they handed out — handles in a [`HandleSet`],
//! address ranges in a [`RangeMap`] — and check before calling the runtime.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

use crate::error::{AdaptorError, Result};

/// Locks `m`, taking the data even if another thread panicked while holding it.
///
/// For state updated in single steps (one insert, one remove, one assignment) — all the state
/// adaptors and the transports keep behind locks — a panic elsewhere cannot leave it
/// half-updated, so a poisoned lock is still consistent and refusing it would only turn one
/// failure into many.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Hashes handle numbers — integers this process handed out, not input from outside — with
/// one multiply instead of SipHash: a stream or event lookup sits on every small message's
/// path (SipHash showed in the profile of small collectives).
#[derive(Debug, Default, Clone, Copy)]
pub struct HandleHasher(u64);

impl Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: an odd constant near 2^64 / φ spreads consecutive numbers over
        // the high bits (which pick a table's control bytes) as well as the low ones.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by handle numbers, hashed with [`HandleHasher`].
pub type HandleMap<V> = HashMap<u64, V, BuildHasherDefault<HandleHasher>>;

/// A thread-safe set of live handles of one kind (streams, events, …).
#[derive(Debug)]
pub struct HandleSet {
    kind: &'static str,
    live: Mutex<HashSet<u64>>,
}

impl HandleSet {
    /// An empty set; `kind` names the handles in errors (`"stream"`).
    pub fn new(kind: &'static str) -> Self {
        HandleSet {
            kind,
            live: Mutex::default(),
        }
    }

    /// Records a new live handle.
    pub fn insert(&self, h: u64) {
        lock(&self.live).insert(h);
    }

    /// `Ok` if `h` is live, else [`AdaptorError::InvalidHandle`].
    pub fn check(&self, h: u64) -> Result<()> {
        if lock(&self.live).contains(&h) {
            Ok(())
        } else {
            Err(self.invalid(h))
        }
    }

    /// Forgets `h`; [`AdaptorError::InvalidHandle`] if it was not live.
    pub fn remove(&self, h: u64) -> Result<()> {
        if lock(&self.live).remove(&h) {
            Ok(())
        } else {
            Err(self.invalid(h))
        }
    }

    /// Removes and returns every live handle (for teardown).
    pub fn drain(&self) -> Vec<u64> {
        lock(&self.live).drain().collect()
    }

    fn invalid(&self, h: u64) -> AdaptorError {
        AdaptorError::InvalidHandle {
            kind: self.kind,
            value: h,
        }
    }
}

/// Non-overlapping address ranges `[base, base+len)` with a value each, found by any address
/// inside them.
#[derive(Debug)]
pub struct RangeMap<T> {
    ranges: BTreeMap<u64, (usize, T)>,
}

impl<T> Default for RangeMap<T> {
    fn default() -> Self {
        RangeMap {
            ranges: BTreeMap::new(),
        }
    }
}

impl<T> RangeMap<T> {
    /// The range containing `addr`: its base, length and value.
    pub fn find(&self, addr: u64) -> Option<(u64, usize, &T)> {
        let (&base, (len, v)) = self.ranges.range(..=addr).next_back()?;
        (addr - base < *len as u64).then_some((base, *len, v))
    }

    /// The range containing `addr`, with its value mutable.
    pub fn find_mut(&mut self, addr: u64) -> Option<(u64, usize, &mut T)> {
        let (&base, (len, v)) = self.ranges.range_mut(..=addr).next_back()?;
        (addr - base < *len as u64).then_some((base, *len, v))
    }

    /// `Ok` when `[addr, addr+n)` lies inside one range; a typed error naming `op` otherwise.
    pub fn check(&self, op: &'static str, addr: u64, n: usize) -> Result<(u64, &T)> {
        if addr == 0 {
            return Err(AdaptorError::invalid(op, "null device pointer"));
        }
        match self.find(addr) {
            Some((base, len, v)) if (addr - base).checked_add(n as u64) <= Some(len as u64) => {
                Ok((base, v))
            }
            Some((base, len, _)) => Err(AdaptorError::invalid(
                op,
                format!("{n} bytes at {addr:#x} run past the {len}-byte range at {base:#x}"),
            )),
            None => Err(AdaptorError::invalid(
                op,
                format!("{addr:#x} is not memory this adaptor knows"),
            )),
        }
    }

    /// Records `[base, base+len)`; refuses overlap with an existing range.
    pub fn insert(&mut self, op: &'static str, base: u64, len: usize, value: T) -> Result<()> {
        let end = base
            .checked_add(len as u64)
            .ok_or_else(|| AdaptorError::invalid(op, format!("range {base:#x}+{len} overflows")))?;
        if let Some((&b, (l, _))) = self.ranges.range(..end).next_back() {
            if b + *l as u64 > base {
                return Err(AdaptorError::invalid(
                    op,
                    format!(
                        "{base:#x}..{end:#x} overlaps the range at {b:#x} (already registered)"
                    ),
                ));
            }
        }
        self.ranges.insert(base, (len, value));
        Ok(())
    }

    /// Removes the range starting exactly at `base` if `accept` agrees with its value.
    pub fn remove_if(
        &mut self,
        op: &'static str,
        base: u64,
        accept: impl FnOnce(&T) -> bool,
    ) -> Result<(usize, T)> {
        match self.ranges.get(&base) {
            Some((_, v)) if accept(v) => Ok(self.ranges.remove(&base).expect("present")),
            Some(_) => Err(AdaptorError::invalid(
                op,
                format!("{base:#x} is a different kind of memory"),
            )),
            None => Err(AdaptorError::InvalidHandle {
                kind: "memory",
                value: base,
            }),
        }
    }

    /// Every range's value, in address order.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.ranges.values().map(|(_, v)| v)
    }

    /// Removes every range (for teardown).
    pub fn drain(&mut self) -> Vec<(u64, usize, T)> {
        std::mem::take(&mut self.ranges)
            .into_iter()
            .map(|(b, (l, v))| (b, l, v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn handle_maps_keep_every_handle_and_spread_consecutive_ones() {
        let mut m: HandleMap<u64> = HandleMap::default();
        for h in 1..=10_000u64 {
            m.insert(h, h * 3);
        }
        assert!((1..=10_000u64).all(|h| m.get(&h) == Some(&(h * 3))));
        assert_eq!(m.remove(&5000), Some(15_000));
        assert!(!m.contains_key(&5000));
        // Consecutive handles land in different high bytes and different low bits.
        let b = BuildHasherDefault::<HandleHasher>::default();
        let hashes: Vec<u64> = (1..=256u64).map(|h| b.hash_one(h)).collect();
        let high: HashSet<u64> = hashes.iter().map(|x| x >> 57).collect();
        let low: HashSet<u64> = hashes.iter().map(|x| x & 255).collect();
        assert!(
            high.len() > 64,
            "top 7 bits of 256 handles: {} values",
            high.len()
        );
        assert_eq!(low.len(), 256, "low byte of 256 handles must differ");
    }

    #[test]
    fn range_map_finds_checks_and_refuses_overlap() {
        let mut m = RangeMap::default();
        m.insert("t", 0x1000, 0x100, 'a').unwrap();
        m.insert("t", 0x1100, 0x10, 'b').unwrap();
        assert_eq!(m.find(0x10ff).map(|r| *r.2), Some('a'));
        assert_eq!(m.find(0x1100).map(|r| *r.2), Some('b'));
        assert!(m.find(0x1110).is_none());
        assert!(m.find(0xfff).is_none());
        assert!(m.check("t", 0x1080, 0x80).is_ok());
        assert!(m.check("t", 0x1080, 0x81).is_err());
        assert!(m.check("t", 0, 1).is_err());
        assert!(m.insert("t", 0x10f0, 0x20, 'c').is_err());
        assert!(m.insert("t", 0xff0, 0x11, 'c').is_err());
        assert!(m.insert("t", u64::MAX - 1, 8, 'c').is_err());
        assert!(m.remove_if("t", 0x1000, |v| *v == 'z').is_err());
        assert_eq!(m.remove_if("t", 0x1000, |v| *v == 'a').unwrap().1, 'a');
        assert!(m.remove_if("t", 0x1000, |_| true).is_err());
    }

    #[test]
    fn handle_set_tracks_liveness() {
        let s = HandleSet::new("stream");
        s.insert(7);
        assert!(s.check(7).is_ok());
        assert!(s.check(8).is_err());
        s.remove(7).unwrap();
        assert!(matches!(
            s.remove(7),
            Err(AdaptorError::InvalidHandle {
                kind: "stream",
                value: 7
            })
        ));
    }
}
