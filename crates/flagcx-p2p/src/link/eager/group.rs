//! A group's eager moves: what the posting thread keeps between groups.

use flagcx_adaptor::{DevicePtr, StreamHandle};

use crate::error::Result;
use crate::op::{Dir, Op};

/// One message of a group that the posting thread may move itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Move {
    pub peer: usize,
    pub dir: Dir,
    pub ptr: DevicePtr,
    pub bytes: usize,
    pub stream: StreamHandle,
    /// Its stream was idle when it was posted (no start event, no wait behind an operation):
    /// only such a message may move before `group_end` returns.
    pub unordered: bool,
}

impl Move {
    pub(crate) fn of(op: &Op, stream: StreamHandle) -> Self {
        Move {
            peer: op.peer,
            dir: op.dir,
            ptr: op.ptr,
            bytes: op.bytes,
            stream,
            unordered: op.start.is_none() && op.after == 0,
        }
    }
}

/// What [`Comm::eager_moves`](crate::comm::Comm::eager_moves) works on and keeps track of during one group, reused between
/// groups.
#[derive(Default)]
pub(crate) struct GroupScratch {
    /// The group's messages (the caller fills it).
    pub(crate) moves: Vec<Move>,
    /// Per message: its result, where this thread moved it.
    pub(crate) done: Vec<Option<Result<usize>>>,
    /// Streams seen, and whether each was idle.
    pub(crate) idle: Vec<(u64, bool)>,
    /// Pairs and directions with a message left to the proxy.
    pub(crate) handed: PeerDirs,
    /// Per peer, whether this sweep already looked at its next receive.
    pub(crate) busy: Vec<bool>,
    /// Indices of the group's receives that may come eagerly.
    pub(crate) receives: Vec<usize>,
}

impl GroupScratch {
    /// Records that `stream` is idle, as the caller just found it: [`Comm::eager_moves`](crate::comm::Comm::eager_moves)
    /// then does not ask the vendor again.
    pub(crate) fn known_idle(&mut self, stream: StreamHandle) {
        self.idle.push((stream.0, true));
    }

    /// Empty, sized for `nranks`.
    pub(crate) fn reset(&mut self, nranks: usize) {
        self.moves.clear();
        self.done.clear();
        self.idle.clear();
        self.receives.clear();
        self.handed.0.clear();
        self.handed.0.resize(2 * nranks, false);
        self.busy.clear();
        self.busy.resize(nranks, false);
    }
}

/// A set of (peer, direction) pairs of one group: a flag per pair.
#[derive(Default)]
pub(crate) struct PeerDirs(Vec<bool>);

impl PeerDirs {
    /// Adds `(peer, dir)`; whether it was new.
    pub(crate) fn insert(&mut self, (peer, dir): (usize, usize)) -> bool {
        !std::mem::replace(&mut self.0[2 * peer + dir], true)
    }

    pub(crate) fn contains(&self, (peer, dir): (usize, usize)) -> bool {
        self.0[2 * peer + dir]
    }
}
