//! vLLM KV-cache groups and its hybrid prefix-cache hit rule.
//!
//! A hybrid model (full attention mixed with sliding-window, chunked-local or Mamba layers)
//! keeps one KV-cache group per layer kind. vLLM 0.33 publishes one `BlockStored` per group
//! (`group_idx`, annotated with `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`) and
//! one `BlockRemoved` per (hash, group); the external block hash is the same in every group.
//!
//! The engine reuses a prompt prefix of `N` tokens (`N` at a block boundary,
//! `kv_cache_coordinator.py::find_longest_cache_hit`) only when **every** group accepts `N`
//! (each group's `find_longest_cache_hit` in `single_type_kv_cache_manager.py` returns the
//! longest length it accepts, and the coordinator iterates to the fixed point, the longest
//! length every group accepts):
//!
//! | Group kind | Accepts `N` when the group holds |
//! |---|---|
//! | full attention (also MLA, sink, and any kind this table does not know) | every block before `N` |
//! | sliding window `W`, block `B` | the `⌈(W−1)/B⌉` blocks before `N` (all of them when `N` is shorter) |
//! | chunked local attention, chunk `C` | the blocks from the chunk start `⌊N/C⌋·C` to `N` (none when `N` is a chunk boundary) |
//! | Mamba | the block ending at `N` (its state at `N`) |
//!
//! The chunk size is not in the events (`--attention-chunk-size`); without it a chunked group
//! is held to the full-attention requirement, which can only under-claim. An unknown kind is
//! also held to it. [`Rule::accepts`] evaluates one group at one candidate end from the group's
//! contiguous held run; [`crate::positional`] walks the page chains with it.

use std::collections::BTreeMap;

/// The reuse rule of one KV-cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Every block before the end (full attention, MLA, sink attention, unknown kinds, and a
    /// chunked group whose chunk size is unknown).
    Full,
    /// The trailing `tokens` before the end (`⌈(W−1)/B⌉·B` for window `W`, block `B`).
    Window { tokens: u64 },
    /// The blocks from the last multiple of `chunk` at or before the end.
    Chunked { chunk: u64 },
    /// Only the block ending at the end.
    State,
}

/// A group kind, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    FullAttention,
    SlidingWindow,
    ChunkedLocalAttention,
    Mamba,
    Other,
}

impl Kind {
    /// Every kind, in metric order.
    pub const ALL: [Kind; 5] = [
        Kind::FullAttention,
        Kind::SlidingWindow,
        Kind::ChunkedLocalAttention,
        Kind::Mamba,
        Kind::Other,
    ];

    /// Label value in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::FullAttention => "full_attention",
            Kind::SlidingWindow => "sliding_window",
            Kind::ChunkedLocalAttention => "chunked_local_attention",
            Kind::Mamba => "mamba",
            Kind::Other => "other",
        }
    }

    /// Classifies vLLM's `kv_cache_spec_kind` (absent = a single full-attention group).
    pub fn from_wire(kind: Option<&str>) -> Kind {
        match kind.map(str::trim) {
            None | Some("") => Kind::FullAttention,
            Some("full_attention" | "mla_attention" | "sink_full_attention") => Kind::FullAttention,
            Some("sliding_window" | "sliding_window_mla") => Kind::SlidingWindow,
            Some("chunked_local_attention") => Kind::ChunkedLocalAttention,
            Some("mamba") => Kind::Mamba,
            Some(_) => Kind::Other,
        }
    }
}

/// What the sidecar knows about one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub kind: Kind,
    pub rule: Rule,
    /// Tokens per block of the group (its events' `block_size`).
    pub block_size: u64,
}

impl Group {
    /// The group described by a `BlockStored` event's annotations.
    ///
    /// `window` is `kv_cache_spec_sliding_window`, `block_size` the event's block size and
    /// `chunk` the configured attention chunk size (0 = unknown). A sliding-window group without
    /// a positive window is held to the full-attention requirement.
    pub fn from_wire(
        kind: Option<&str>,
        window: Option<i64>,
        block_size: i64,
        chunk: u64,
    ) -> Group {
        let kind_of = Kind::from_wire(kind);
        let rule = match kind_of {
            Kind::SlidingWindow => match (window, u64::try_from(block_size)) {
                (Some(w), Ok(b)) if w > 0 && b > 0 => {
                    let w = w.unsigned_abs();
                    // vLLM `_contiguous_blocks_for_hit`: cdiv(window − 1, block_size) blocks.
                    Rule::Window {
                        tokens: (w - 1).div_ceil(b).saturating_mul(b),
                    }
                }
                _ => Rule::Full,
            },
            Kind::ChunkedLocalAttention if chunk > 0 => Rule::Chunked { chunk },
            Kind::Mamba => Rule::State,
            _ => Rule::Full,
        };
        Group {
            kind: kind_of,
            rule,
            block_size: u64::try_from(block_size).unwrap_or(0),
        }
    }
}

impl Rule {
    /// Whether a group with this rule accepts a prefix ending at `end` tokens, given that it
    /// holds the block ending there (`holds_last`), holds every block from the chain start
    /// (`holds_all`, read only by [`Rule::Full`]: the map keeps it exact for full-attention
    /// groups alone), and holds a contiguous run of `run` tokens ending there (read up to
    /// [`Rule::reach`] tokens back).
    pub fn accepts(self, end: u64, holds_last: bool, holds_all: bool, run: u64) -> bool {
        if end == 0 {
            return true;
        }
        match self {
            Rule::Full => holds_all,
            Rule::Window { tokens } => run >= tokens.min(end),
            Rule::Chunked { chunk } => run >= end - end / chunk * chunk,
            Rule::State => holds_last,
        }
    }

    /// How many tokens before an end this rule may look at (`None` = back to the start).
    pub fn reach(self) -> Option<u64> {
        match self {
            Rule::Full => None,
            Rule::Window { tokens } => Some(tokens),
            Rule::Chunked { chunk } => Some(chunk),
            Rule::State => Some(0),
        }
    }
}

/// The groups learned from one replica's store events, by `group_idx`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Groups {
    groups: BTreeMap<u32, Group>,
}

impl Groups {
    /// Records what a store event says about its group; true when that changed the rule set
    /// (a new group, or a group whose kind or window changed).
    pub fn learn(&mut self, index: u32, group: Group) -> bool {
        self.groups.insert(index, group) != Some(group)
    }

    /// The known group `index`.
    pub fn get(&self, index: u32) -> Option<Group> {
        self.groups.get(&index).copied()
    }

    /// Every known group, by index.
    pub fn iter(&self) -> impl Iterator<Item = (u32, Group)> + '_ {
        self.groups.iter().map(|(&i, &g)| (i, g))
    }

    /// True when some known group has blocks smaller than `block_size` tokens.
    pub fn has_finer_than(&self, block_size: u64) -> bool {
        self.groups.values().any(|g| g.block_size < block_size)
    }

    /// Number of known groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True when no group is known.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Forgets every group.
    pub fn clear(&mut self) {
        self.groups.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's rule, evaluated by brute force over a list of held blocks (block size `b`), for
    /// one group: the longest `N ≤ max` the group accepts.
    fn longest(rule: Rule, held: &[bool], b: u64) -> u64 {
        let accepts = |n: usize| {
            let end = n as u64 * b;
            let holds_all = held[..n].iter().all(|&h| h);
            let holds_last = n > 0 && held[n - 1];
            let run = held[..n].iter().rev().take_while(|&&h| h).count() as u64 * b;
            rule.accepts(end, holds_last, holds_all, run)
        };
        (0..=held.len()).rev().find(|&n| accepts(n)).unwrap_or(0) as u64 * b
    }

    #[test]
    fn kinds_and_windows_from_the_wire() {
        let sw32 = Group::from_wire(Some("sliding_window"), Some(32), 16, 0);
        assert_eq!(sw32.kind, Kind::SlidingWindow);
        // cdiv(31, 16) = 2 blocks.
        assert_eq!(sw32.rule, Rule::Window { tokens: 32 });
        let sw128 = Group::from_wire(Some("sliding_window"), Some(128), 16, 0);
        // cdiv(127, 16) = 8 blocks.
        assert_eq!(sw128.rule, Rule::Window { tokens: 128 });
        let sw33 = Group::from_wire(Some("sliding_window"), Some(33), 16, 0);
        assert_eq!(sw33.rule, Rule::Window { tokens: 32 });
        let sw34 = Group::from_wire(Some("sliding_window"), Some(34), 16, 0);
        assert_eq!(sw34.rule, Rule::Window { tokens: 48 });
        // No window: held to full attention.
        assert_eq!(
            Group::from_wire(Some("sliding_window"), None, 16, 0).rule,
            Rule::Full
        );
        assert_eq!(
            Group::from_wire(Some("chunked_local_attention"), None, 16, 64).rule,
            Rule::Chunked { chunk: 64 }
        );
        assert_eq!(
            Group::from_wire(Some("chunked_local_attention"), None, 16, 0).rule,
            Rule::Full
        );
        assert_eq!(
            Group::from_wire(Some("mamba"), None, 16, 0).rule,
            Rule::State
        );
        let other = Group::from_wire(Some("cross_attention"), None, 16, 0);
        assert_eq!((other.kind, other.rule), (Kind::Other, Rule::Full));
        assert_eq!(
            Group::from_wire(None, None, 16, 0).kind,
            Kind::FullAttention
        );
        assert_eq!(
            Group::from_wire(Some("mla_attention"), None, 16, 0).kind,
            Kind::FullAttention
        );
    }

    #[test]
    fn sliding_window_needs_the_window_before_the_end() {
        let w = Rule::Window { tokens: 32 };
        // The example: blocks 0–1 gone, 2–3 held → 64 tokens reusable.
        assert_eq!(longest(w, &[false, false, true, true], 16), 64);
        // Block 3 gone: the run before 48 tokens (blocks 1–2) misses block 1 → nothing.
        assert_eq!(longest(w, &[false, false, true, false], 16), 0);
        // Block 2 gone: blocks 0–1 give 32.
        assert_eq!(longest(w, &[true, true, false, true], 16), 32);
        // A short prefix needs only what it has: block 0 alone gives 16.
        assert_eq!(longest(w, &[true, false, false, false], 16), 16);
        // Window 128 (8 blocks): 10 blocks, 0–1 gone → 160; 0–2 gone → 0 (needs 2..9).
        let w128 = Rule::Window { tokens: 128 };
        let mut held = [true; 10];
        held[0] = false;
        held[1] = false;
        assert_eq!(longest(w128, &held, 16), 160);
        held[2] = false;
        assert_eq!(longest(w128, &held, 16), 0);
    }

    #[test]
    fn chunked_local_needs_the_current_chunk() {
        let c = Rule::Chunked { chunk: 32 };
        // Blocks 0–1 gone: 64 (a chunk boundary) needs nothing, 48 needs block 2.
        assert_eq!(longest(c, &[false, false, true, true], 16), 64);
        // Block 3 gone too: 64 is a chunk boundary, still nothing needed.
        assert_eq!(longest(c, &[false, false, true, false], 16), 64);
        // Five blocks, block 4 gone: 80 needs block 4 → 64.
        assert_eq!(longest(c, &[true, true, true, true, false], 16), 64);
        // Block 2 gone of three: 48 needs block 2 (its chunk starts at 32).
        assert_eq!(longest(c, &[true, true, false], 16), 32);
        // Three blocks, block 2 gone: 48 needs block 2 → 32 (a chunk boundary).
        assert_eq!(longest(c, &[false, false, false], 16), 32);
        // One block, gone: 16 needs block 0.
        assert_eq!(longest(c, &[false], 16), 0);
    }

    #[test]
    fn mamba_needs_only_its_state_at_the_end() {
        assert_eq!(longest(Rule::State, &[false, false, false, true], 16), 64);
        assert_eq!(longest(Rule::State, &[false, true, false, false], 16), 32);
        assert_eq!(longest(Rule::State, &[false, false, false, false], 16), 0);
    }

    #[test]
    fn full_attention_needs_everything() {
        assert_eq!(longest(Rule::Full, &[true, true, false, true], 16), 32);
        assert_eq!(longest(Rule::Full, &[false, true, true, true], 16), 0);
    }

    #[test]
    fn learning_reports_changes_only() {
        let mut g = Groups::default();
        let fa = Group::from_wire(Some("full_attention"), None, 16, 0);
        let sw = Group::from_wire(Some("sliding_window"), Some(32), 16, 0);
        assert!(g.learn(0, fa));
        assert!(!g.learn(0, fa));
        assert!(g.learn(1, sw));
        assert!(g.learn(1, fa));
        assert_eq!(g.len(), 2);
    }
}
