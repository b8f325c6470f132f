//! What a late-copy pair's rank named to its peer, so that it never names a new allocation the
//! peer cannot map.
//!
//! On a late pair the copy is made by the rank that posts a message second, through its
//! mapping of the other rank's buffer, and it opens that mapping while the other rank's stream
//! already waits for the copy (`transport::late`). A process that freed an allocation its peer
//! still maps may get the same addresses back for its next one, and CUDA refuses to map that
//! new allocation in the peer while the old mapping is open (`CUDA_ERROR_ALREADY_MAPPED`).
//! Closing the old mapping there waits for every stream of the peer's device, and those
//! streams may wait for this rank's words, which wait for the very copy being refused: on an
//! H100 every rank of a 4-rank job stopped inside `cuIpcCloseMemHandle`.
//!
//! So the exporter decides, before it names a buffer: it remembers each allocation it named to
//! the peer (its span and handle). A new allocation overlapping one of those under another
//! handle means the old one was freed (two live allocations never overlap), and the peer may
//! still map it. Then:
//! - the message goes through a stand-in (`crate::standin`: this rank's own allocation, kept
//!   for the communicator's life, one device-to-device copy more), which the peer can map;
//! - the freed allocation is published in the pair's freed ring ([`Channel::publish_freed`]),
//!   where the peer's engine marks its mapping stale, closes it once nothing is in flight (when
//!   closing cannot wait for a stream that waits for a peer) and says so
//!   ([`Counter::Unmapped`]);
//! - from then on the new allocation is named as it is.
//!
//! [`Channel::publish_freed`]: crate::channel::Channel::publish_freed
//! [`Counter::Unmapped`]: crate::channel::Counter::Unmapped

use flagcx_adaptor::IpcMemHandle;

use crate::channel::{Span, FREED_RING};

/// Allocations remembered per peer; past it the oldest live one is forgotten (the peer's own
/// cache keeps at most `ipccache::IPC_CACHE_MAX` mappings at rest, far fewer).
pub(crate) const NAMED_MAX: usize = 1024;

/// One allocation this rank named to the peer.
#[derive(Debug, Clone, Copy)]
struct Rec {
    span: Span,
    handle: [u8; IpcMemHandle::WIRE_LEN],
    /// The runtime's identifier of the allocation, where it has one: should the runtime give a
    /// new allocation at a freed one's addresses the very same handle bytes (not seen on CUDA
    /// so far, nor ruled out), only this tells them apart (a peer still mapping the old one
    /// would copy through that mapping).
    id: Option<u64>,
    /// The record of the freed ring that says it was freed, once published.
    freed: Option<u64>,
}

/// The allocations this rank named to one peer (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Named {
    recs: Vec<Rec>,
    /// Records published in the freed ring.
    published: u64,
}

impl Named {
    /// Whether the allocation at `span` with `handle` (and the runtime's identifier `id`, where
    /// it has one) may be named to the peer now (else the message takes a stand-in).
    /// `unmapped` is the peer's [`Counter::Unmapped`]; `publish` puts record `n` in the freed
    /// ring, which has room for every record from `unmapped` to `unmapped + FREED_RING`. A span
    /// of unknown length is always named (nothing to compare).
    ///
    /// [`Counter::Unmapped`]: crate::channel::Counter::Unmapped
    pub(crate) fn name(
        &mut self,
        span: Span,
        handle: &IpcMemHandle,
        id: Option<u64>,
        unmapped: u64,
        mut publish: impl FnMut(u64, Span),
    ) -> bool {
        // Allocations the peer no longer maps are forgotten.
        self.recs
            .retain(|r| r.freed.map_or(true, |n| n >= unmapped));
        let key = handle.to_wire();
        if self
            .recs
            .iter()
            .any(|r| r.freed.is_none() && r.handle == key && r.id == id)
        {
            return true;
        }
        let mut clear = true;
        for r in self.recs.iter_mut().filter(|r| r.span.overlaps(&span)) {
            clear = false;
            if r.freed.is_none() && self.published < unmapped + FREED_RING {
                publish(self.published, r.span);
                r.freed = Some(self.published);
                self.published += 1;
            }
        }
        if clear {
            if self.recs.len() >= NAMED_MAX {
                if let Some(i) = self.recs.iter().position(|r| r.freed.is_none()) {
                    self.recs.remove(i);
                }
            }
            self.recs.push(Rec {
                span,
                handle: key,
                id,
                freed: None,
            });
        }
        clear
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flagcx_adaptor::Vendor;

    fn handle(n: u8) -> IpcMemHandle {
        let mut bytes = [0u8; flagcx_adaptor::IPC_HANDLE_BYTES];
        bytes[0] = n;
        IpcMemHandle {
            vendor: Vendor::Cuda,
            bytes,
        }
    }

    fn span(base: u64, len: u64) -> Span {
        Span { base, len }
    }

    /// A new allocation at a freed one's addresses goes through stand-ins, and its record is
    /// published once, until the peer says it unmapped it; then it is named, and stays so.
    #[test]
    fn a_new_allocation_over_a_freed_one_waits_for_the_peer_to_unmap_it() {
        let mut n = Named::default();
        let mut ring = Vec::new();
        let (old, new, beside) = (
            span(0x10000, 0x4000),
            span(0x12000, 0x100),
            span(0x20000, 0x100),
        );
        assert!(n.name(old, &handle(1), None, 0, |i, s| ring.push((i, s))));
        assert!(
            n.name(old, &handle(1), None, 0, |i, s| ring.push((i, s))),
            "named again"
        );
        assert!(n.name(beside, &handle(2), None, 0, |i, s| ring.push((i, s))));
        assert!(ring.is_empty(), "nothing freed yet");
        // `old` was freed and `new` lies inside its addresses.
        assert!(!n.name(new, &handle(3), None, 0, |i, s| ring.push((i, s))));
        assert_eq!(ring, vec![(0, old)], "the freed allocation, published once");
        assert!(!n.name(new, &handle(3), None, 0, |i, s| ring.push((i, s))));
        assert_eq!(ring.len(), 1, "not published again");
        assert!(n.name(beside, &handle(2), None, 0, |_, _| panic!(
            "nothing to publish"
        )));
        // The peer acted on record 0: `new` is named from now on.
        assert!(n.name(new, &handle(3), None, 1, |_, _| panic!(
            "nothing to publish"
        )));
        assert!(n.name(new, &handle(3), None, 1, |_, _| panic!(
            "nothing to publish"
        )));
    }

    /// The ring never runs ahead of the peer by more than its records: a freed allocation
    /// waits for room (its messages keep taking stand-ins), then is published.
    #[test]
    fn the_freed_ring_waits_for_room() {
        let mut n = Named::default();
        let mut ring = Vec::new();
        let at = |i: u64| span(0x100000 * (i + 1), 0x1000);
        for i in 0..=FREED_RING {
            assert!(n.name(at(i), &handle(i as u8), None, 0, |_, _| unreachable!()));
        }
        for i in 0..=FREED_RING {
            let reused = span(at(i).base, 0x10);
            assert!(!n.name(reused, &handle(100 + i as u8), None, 0, |k, s| ring
                .push((k, s))));
        }
        assert_eq!(ring.len() as u64, FREED_RING, "the ring is full");
        let last = span(at(FREED_RING).base, 0x10);
        // The peer acted on the first record: one more fits.
        assert!(
            !n.name(last, &handle(100 + FREED_RING as u8), None, 1, |k, s| ring
                .push((k, s)))
        );
        assert_eq!(ring.last(), Some(&(FREED_RING, at(FREED_RING))));
    }

    /// A new allocation with the very handle bytes of a freed one (CUDA gives those at the
    /// same addresses) is told apart by the runtime's identifier: it waits like any other.
    #[test]
    fn the_same_handle_with_a_new_identifier_is_a_new_allocation() {
        let mut n = Named::default();
        let mut ring = Vec::new();
        let at = span(0x40000, 0x1000);
        assert!(n.name(at, &handle(7), Some(1), 0, |_, _| unreachable!()));
        assert!(
            n.name(at, &handle(7), Some(1), 0, |_, _| unreachable!()),
            "the same one"
        );
        assert!(!n.name(at, &handle(7), Some(2), 0, |k, s| ring.push((k, s))));
        assert_eq!(ring, vec![(0, at)], "the old one is published as freed");
        assert!(
            n.name(at, &handle(7), Some(2), 1, |_, _| unreachable!()),
            "once unmapped"
        );
    }

    /// Spans of unknown length never block a name.
    #[test]
    fn unknown_spans_are_named() {
        let mut n = Named::default();
        assert!(n.name(span(0, 0), &handle(1), None, 0, |_, _| unreachable!()));
        assert!(n.name(span(0, 0), &handle(2), None, 0, |_, _| unreachable!()));
    }
}
