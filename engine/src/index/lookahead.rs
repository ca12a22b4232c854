//! Latency hiding for writers: the staged prefetch a chain ingest or a batch removal issues
//! ahead of its single-key probes (hints only; every write probes again under its shard lock).

use super::walk::PREFETCH;
use crate::raw::table::{Candidate, KeyTable, Probe};
use crossbeam_epoch::Guard;

/// Writers' look-ahead (see [`Lookahead`]): candidates are read this many keys ahead...
const CANDIDATE_AHEAD: usize = 4;
/// ... and their run keys prefetched this many keys ahead.
const KEY_AHEAD: usize = 2;

/// Latency hiding for a writer's sequence of single-key probes (chain ingest, batch removal):
/// each key's probe reads up to four dependent lines (summary, home group, node, and the key
/// in its chain run for a run node), so they are fetched in stages ahead of the write: the home
/// group [`PREFETCH`] keys ahead, the candidate node (the group is read, the node prefetched)
/// [`CANDIDATE_AHEAD`] keys ahead, its run key [`KEY_AHEAD`] keys ahead. (Prefetching the summary
/// word too made no difference at W1M's size and cost ~3% on a cached index.) Hints only:
/// every write probes again under its shard lock. Sequences of at most [`KEY_AHEAD`] keys
/// (single-key events) skip it.
pub(super) struct Lookahead {
    ring: [Candidate; 8],
}

impl Lookahead {
    /// Issues the stages of the first keys of a sequence of `n` (`probe(k)` is key `k`'s).
    #[inline]
    pub(super) fn start<'k>(
        t: &KeyTable,
        n: usize,
        probe: impl Fn(usize) -> Probe<'k>,
        guard: &Guard,
    ) -> Self {
        let mut ring = [Candidate::Probe; 8];
        if n <= KEY_AHEAD {
            // Nothing to overlap: the stages would only read ahead what the writes read next.
            return Self { ring };
        }
        for k in 0..n.min(PREFETCH) {
            t.prefetch_home(probe(k), guard);
        }
        for (k, c) in ring.iter_mut().enumerate().take(n.min(CANDIDATE_AHEAD)) {
            *c = t.candidate(probe(k), guard);
        }
        for &c in ring.iter().take(n.min(KEY_AHEAD)) {
            KeyTable::prefetch_key(c);
        }
        Self { ring }
    }

    /// Advances the stages before key `k` is written.
    #[inline]
    pub(super) fn step<'k>(
        &mut self,
        t: &KeyTable,
        k: usize,
        n: usize,
        probe: impl Fn(usize) -> Probe<'k>,
        guard: &Guard,
    ) {
        if k + PREFETCH < n {
            t.prefetch_home(probe(k + PREFETCH), guard);
        }
        if k + CANDIDATE_AHEAD < n {
            self.ring[(k + CANDIDATE_AHEAD) & 7] = t.candidate(probe(k + CANDIDATE_AHEAD), guard);
        }
        if k + KEY_AHEAD < n {
            KeyTable::prefetch_key(self.ring[(k + KEY_AHEAD) & 7]);
        }
    }
}
