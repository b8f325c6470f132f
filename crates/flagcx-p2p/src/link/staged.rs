//! The staging ring's cursors and chunk sizes; the pump that moves chunks is
//! [`crate::transport::staged`]'s.

use std::collections::VecDeque;

use flagcx_adaptor::EventHandle;

/// The chunk size of a `total`-byte staged message over slots of `slot` bytes cut into `split`
/// chunks: about `1/split` of the message (so mid-size messages still pipeline their two
/// copies), in 64 KiB steps, at most a slot (so large messages pay the per-chunk cost of events
/// and hand-offs rarely). Both sides derive it from the same total and the channel's geometry,
/// so their chunk boundaries agree.
pub(crate) fn chunk_len(total: usize, slot: usize, split: usize) -> usize {
    const STEP: usize = 64 << 10;
    total
        .div_ceil(split.max(1))
        .next_multiple_of(STEP)
        .max(STEP)
        .min(slot)
}

/// One direction's position in a pair's ring: chunks issued, chunks whose copy completed (and
/// were published to the peer: `Tail` for sends, `Head` for receives), and the events of the
/// copies in flight, oldest first.
#[derive(Default)]
pub(crate) struct Cursor {
    pub(crate) issued: u64,
    pub(crate) done: u64,
    pub(crate) chunks: VecDeque<EventHandle>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_a_split_of_the_message_within_bounds() {
        let (k, m) = (1 << 10, 1 << 20);
        let slot = 4 * m;
        assert_eq!(chunk_len(8, slot, 8), 64 * k, "small messages: one chunk");
        assert_eq!(chunk_len(2 * m, slot, 8), 256 * k);
        assert_eq!(
            chunk_len(2 * m + 1, slot, 8),
            320 * k,
            "rounded up to 64 KiB"
        );
        assert_eq!(chunk_len(16 * m, slot, 8), 2 * m);
        assert_eq!(chunk_len(1 << 30, slot, 8), slot, "at most a slot");
        // Slots smaller than the 64 KiB step (a tiny FLAGCX_P2P_CHUNKSIZE) still bound it.
        assert_eq!(chunk_len(1 << 30, 4096, 8), 4096);
        for total in [1, 100, 65_537, 3 * m + 5, 1 << 31] {
            for split in [1, 2, 8, 64] {
                let c = chunk_len(total, slot, split);
                assert!(c > 0 && c <= slot && c % (64 * k) == 0);
                assert!(
                    total.div_ceil(c) <= split || c == slot,
                    "{total}/{split}: {c}"
                );
            }
        }
        assert_eq!(chunk_len(8 * m, slot, 2), 4 * m, "a split of 2: halves");
        assert_eq!(
            chunk_len(8 * m, slot, 1),
            slot,
            "one chunk, bounded by the slot"
        );
    }
}
