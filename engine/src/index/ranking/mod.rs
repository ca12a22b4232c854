//! Ranking (index.md §4: R1–R9, L6): what turns a lookup's matches into an ordered answer.
//! `formulas` holds the pure arithmetic in the order the spec states it (freshness, R4's
//! distinguishing power, R2's pressure factor, R3's SLO constant, R1's and R7's scores); this
//! file holds a replica's score before ranking ([`Ranked`]), R4 over a chain's replicas, R5's
//! order (a sorting network for small answers) and R2's per-lookup pressure.
//!
//! The lookup walk uses this room one way: `route` drives `walk` (the match) and then this
//! room; nothing here names the route or the walk.

pub mod formulas;

use super::Index;
use super::records::{ModelRec, Partition, ScopeReplica, StatsRecord};
use crate::raw::holder::tier_wire;
use crate::types::ScoredReplica;
use crossbeam_epoch::Guard;
use formulas::{distinguishing_power, freshness, pressure_factor};

/// A replica's chain-path score before ranking (see `Index::prefix_scores`).
#[derive(Clone, Copy)]
pub(in crate::index) struct Ranked {
    pub(in crate::index) score: f32,
    pub(in crate::index) matched: i32,
    pub(in crate::index) fresh: f32,
    pub(in crate::index) tier: u8,
    /// Order label of the replica's id (`ScopeReplica::label`; TENANT_HOT: its position in
    /// id order): the tie-break of R4 and R5, with `name` deciding equal labels.
    pub(in crate::index) rank: u64,
    /// The replica's id, borrowed from its scope slot or stats record under the lookup's
    /// guard (see `BorrowedId`): only the returned scores count their ids.
    pub(in crate::index) name: crate::replica_id::BorrowedId,
}

/// Replica id order of two ranked entries: their labels, then (equal labels) the ids.
#[inline]
fn by_id(a: &Ranked, b: &Ranked) -> std::cmp::Ordering {
    a.rank
        .cmp(&b.rank)
        // SAFETY: ranked entries are compared within the lookup that borrowed their ids.
        .then_with(|| unsafe { a.name.as_str().cmp(b.name.as_str()) })
}

/// R5's order of two ranked entries: score desc, then replica id asc.
#[inline]
fn r5_order(a: &Ranked, b: &Ranked) -> std::cmp::Ordering {
    b.score
        .partial_cmp(&a.score)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(by_id(a, b))
}

/// Answers of at most this many replicas are ordered by [`network_order`].
const SMALL_ANSWER: usize = 8;

/// Defines [`NETWORK`] (tests) and [`sort8`] from one list of compare-exchanges.
macro_rules! sorting_network {
    ($(($i:literal, $j:literal)),* $(,)?) => {
        /// A sorting network for 8 keys (19 compare-exchanges in 6 layers).
        #[cfg(test)]
        const NETWORK: &[(usize, usize)] = &[$(($i, $j)),*];

        /// Sorts 8 keys by the network's compare-exchanges, written out: constant indices let
        /// the keys live in registers, where a loop over the list kept them in memory and paid
        /// a bounds check and a store-to-load round trip per exchange.
        #[inline(always)]
        fn sort8(keys: &mut [u64; SMALL_ANSWER]) {
            $(
                let (a, b) = (keys[$i], keys[$j]);
                keys[$i] = a.min(b);
                keys[$j] = a.max(b);
            )*
        }
    };
}

sorting_network![
    (0, 2),
    (1, 3),
    (4, 6),
    (5, 7),
    (0, 4),
    (1, 5),
    (2, 6),
    (3, 7),
    (0, 1),
    (2, 3),
    (4, 5),
    (6, 7),
    (2, 4),
    (3, 5),
    (1, 4),
    (3, 6),
    (1, 2),
    (3, 4),
    (5, 6),
];

/// R5's order of a few entries: a sorting network of branch-free compare-exchanges on one
/// 64-bit key per entry (the score's bits, descending, then the entry's position), then, within
/// each run of equal scores, an insertion sort by id (labels, then the ids for equal labels);
/// returns the entries' positions in R5 order. Scores are never negative, and the bits of
/// non-negative floats order as the floats do. `None` when the keys cannot decide: more than
/// [`SMALL_ANSWER`] entries, or a negative or NaN score.
fn network_order(v: &[Ranked]) -> Option<[u8; SMALL_ANSWER]> {
    if v.len() > SMALL_ANSWER {
        return None;
    }
    // Unused places hold the largest key, which sorts after every entry's.
    let mut keys = [u64::MAX; SMALL_ANSWER];
    for (position, (key, r)) in keys.iter_mut().zip(v).enumerate() {
        if r.score.is_nan() || r.score.is_sign_negative() {
            return None;
        }
        *key = u64::from(u32::MAX - r.score.to_bits()) << 32 | position as u64;
    }
    sort8(&mut keys);
    let mut order = keys.map(|k| k as u8);
    // Swaps stay within a run of equal scores, so `keys` still tells the runs apart.
    for i in 1..v.len() {
        let mut j = i;
        while j > 0
            && keys[j - 1] >> 32 == keys[i] >> 32
            && by_id(&v[usize::from(order[j])], &v[usize::from(order[j - 1])]).is_lt()
        {
            order.swap(j, j - 1);
            j -= 1;
        }
    }
    Some(order)
}

/// Appends `ranked`'s scores to `out` in R5 order (sorting `ranked` itself only when the
/// network cannot order it).
pub(in crate::index) fn emit_ranked(ranked: &mut [Ranked], out: &mut Vec<ScoredReplica>) {
    let scored = |s: &Ranked| ScoredReplica {
        // SAFETY: emitted within the lookup that borrowed the id (its guard still pinned).
        replica_id: unsafe { s.name.to_owned() },
        score: s.score,
        matched_tokens: s.matched,
        estimated_cache_hit_prob: s.fresh,
        tier: tier_wire(s.tier),
    };
    if out.capacity() == 0 {
        // A result's own vector (`lookup_route`): allocated once, at its exact size.
        *out = Vec::with_capacity(ranked.len());
    } else {
        out.reserve_exact(ranked.len());
    }
    match network_order(ranked) {
        Some(order) => out.extend(
            order[..ranked.len()]
                .iter()
                .map(|&position| scored(&ranked[usize::from(position)])),
        ),
        None => {
            ranked.sort_unstable_by(r5_order);
            out.extend(ranked.iter().map(scored));
        }
    }
}

/// R2's pressure factors of one lookup, over the model's stats records loaded once.
pub(in crate::index) struct Pressure<'g> {
    stats: &'g [StatsRecord],
    weight: f32,
    now_ms: i64,
    ttl_ms: i64,
}

impl Pressure<'_> {
    /// A replica's pressure counts only while its report is fresh (R2); no report is 0.
    #[inline]
    pub(in crate::index) fn factor(&self, replica: &ScopeReplica) -> f32 {
        let pressure = match ModelRec::stats_in(self.stats, replica) {
            Some(s) if freshness(self.now_ms, s.reported_ms, self.ttl_ms) > 0.0 => s.pressure,
            _ => 0.0,
        };
        pressure_factor(self.weight, pressure)
    }

    /// The factor every replica gets when the model has no stats records (no replica reported
    /// any): one value for the whole lookup.
    #[inline]
    pub(in crate::index) fn uniform(&self) -> Option<f32> {
        self.stats
            .is_empty()
            .then(|| pressure_factor(self.weight, 0.0))
    }
}

/// R4 on `ranked`: each score times the distinguishing power of the number of replicas that
/// matched at least its chain length, out of the scope's `n` serving replicas.
pub(in crate::index) fn apply_distinguishing_power(ranked: &mut [Ranked], n: i64) {
    if n <= 1 || ranked.is_empty() {
        return;
    }
    // A few replicas (the common answer) count pairwise; many sort by length first (each
    // group's count is then its end), as a pairwise count would be quadratic.
    const PAIRWISE: usize = 16;
    if ranked.len() <= PAIRWISE {
        // Over a flat array of the lengths, in fixed-length loops the compiler vectorizes;
        // unused places hold i32::MIN, below every length that matched (lengths are > 0).
        let mut matched = [i32::MIN; PAIRWISE];
        for (m, r) in matched.iter_mut().zip(ranked.iter()) {
            *m = r.matched;
        }
        for (i, s) in ranked.iter_mut().enumerate() {
            let at_least = matched.iter().filter(|&&m| m >= matched[i]).count();
            let dp = distinguishing_power(at_least as i64, n);
            if dp != 1.0 {
                s.score *= dp as f32;
            }
        }
        return;
    }
    ranked.sort_unstable_by_key(|r| std::cmp::Reverse(r.matched));
    let mut i = 0;
    while i < ranked.len() {
        let mut j = i;
        while j < ranked.len() && ranked[j].matched == ranked[i].matched {
            j += 1;
        }
        let dp = distinguishing_power(j as i64, n);
        if dp != 1.0 {
            for s in &mut ranked[i..j] {
                s.score *= dp as f32;
            }
        }
        i = j;
    }
}

impl Index {
    /// R2's pressure factors of one lookup in `part`.
    pub(in crate::index) fn pressure<'g>(
        &self,
        part: &Partition,
        now_ms: i64,
        ttl_ms: i64,
        guard: &'g Guard,
    ) -> Pressure<'g> {
        Pressure {
            stats: part.model.stats.load(guard),
            weight: self.cfg.ranker.pressure_weight,
            now_ms,
            ttl_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReplicaId;

    /// The sorting network sorts every input of 0s and 1s (so, by the 0-1 principle, every
    /// input).
    #[test]
    fn network_sorts_every_zero_one_input() {
        assert_eq!(NETWORK.len(), 19);
        for bits in 0u32..1 << SMALL_ANSWER {
            let mut v: [u64; SMALL_ANSWER] = std::array::from_fn(|i| u64::from(bits >> i & 1));
            sort8(&mut v);
            assert!(
                v.windows(2).all(|w| w[0] <= w[1]),
                "input {bits:08b}: {v:?}"
            );
        }
    }

    /// R5 by the network agrees with the comparator sort, ties of scores and of labels
    /// included (it gives up on NaN), and the emitted scores follow it, beyond the network's
    /// size too.
    #[test]
    fn r5_by_network_matches_the_comparator() {
        let ids: Vec<ReplicaId> = (0..20)
            .map(|i| ReplicaId::intern(&format!("r5-{i:02}")))
            .collect();
        let mut seed = 11u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        let mut decided = 0;
        for round in 0..4000 {
            let len = 1 + (next() as usize % (SMALL_ANSWER + 4));
            let v: Vec<Ranked> = (0..len)
                .map(|i| {
                    let score = match next() % 4 {
                        0 => 0.0,
                        1 => (next() % 3) as f32 * 16.0,
                        2 if round % 50 == 0 => f32::NAN,
                        _ => (next() % 1000) as f32 / 7.0,
                    };
                    // Labels follow the ids' order; every few rounds two of them tie.
                    let rank = if round % 3 == 0 {
                        (i / 2) as u64
                    } else {
                        i as u64
                    };
                    Ranked {
                        score,
                        matched: 1,
                        fresh: 1.0,
                        tier: 0,
                        rank,
                        name: ids[i].borrow_id(),
                    }
                })
                .collect();
            let mut want = v.clone();
            want.sort_by(r5_order);
            if let Some(order) = network_order(&v) {
                decided += 1;
                let got: Vec<Ranked> = order[..len].iter().map(|&p| v[usize::from(p)]).collect();
                let names = |x: &[Ranked]| -> Vec<usize> {
                    x.iter()
                        .map(|r| {
                            ids.iter()
                                .position(|id| id.borrow_id() == r.name)
                                .unwrap_or(99)
                        })
                        .collect()
                };
                assert_eq!(names(&got), names(&want), "round {round}");
            }
            // What a lookup returns: the network's order, or the comparator's beyond it.
            let mut out = Vec::new();
            emit_ranked(&mut v.clone(), &mut out);
            let emitted: Vec<&str> = out.iter().map(|s| &*s.replica_id).collect();
            // SAFETY: the ids are interned above and live for the whole test.
            let wanted: Vec<&str> = want.iter().map(|r| unsafe { r.name.as_str() }).collect();
            if want.iter().all(|r| !r.score.is_nan()) {
                assert_eq!(emitted, wanted, "round {round}: emitted order");
            }
        }
        assert!(decided > 2300, "the network decided only {decided} of 4000");
    }

    /// R4 on the chain path: a replica's score is multiplied by dp(m, n), m = the replicas that
    /// matched at least as many tokens; the pairwise count (few replicas) and the sorted
    /// groups (many) agree with that definition for every size.
    #[test]
    fn r4_counts_replicas_matching_at_least_as_much() {
        let id = ReplicaId::intern("r4-test");
        let mut seed = 7u64;
        for len in 1..=40usize {
            for n in [1i64, 2, len as i64, len as i64 + 3, 64] {
                let mut ranked: Vec<Ranked> = (0..len)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        Ranked {
                            score: 1.0,
                            matched: (seed >> 60) as i32 * 16,
                            fresh: 1.0,
                            tier: 0,
                            rank: 0,
                            name: id.borrow_id(),
                        }
                    })
                    .collect();
                let matched: Vec<i32> = ranked.iter().map(|r| r.matched).collect();
                apply_distinguishing_power(&mut ranked, n);
                for r in &ranked {
                    let m = matched.iter().filter(|&&x| x >= r.matched).count() as i64;
                    let want = (1.0f64 * distinguishing_power(m, n)) as f32;
                    assert_eq!(r.score, want, "len {len}, n {n}, matched {}", r.matched);
                }
            }
        }
    }
}
