//! Lookups (L1–L10), ranking (R1–R9) and LFU crediting (V3, V4, D4): a `LookupRoute` walks
//! the partition (see `walk.rs`), scores each replica's run, ranks them (R5: score desc, then
//! replica id asc) and classifies a miss (O3). In an LFU namespace a PREFIX_MATCH captures its
//! hits; they are credited only once the answer is delivered, and only to the entry they saw
//! (generation-checked, L9).

use super::Index;
use super::records::{ModelRec, Partition, ScopeRec, ScopeReplica, StatsRecord, TenantRec};
use super::walk::MatchScratch;
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::config::Algorithm;
use crate::directory::hash_strs;
use crate::rank::{
    distinguishing_power, freshness, prefix_score, pressure_factor, recency, slo_c,
    tenant_hot_score,
};
use crate::raw::holder::{key_parts, tier_wire};
use crate::raw::lfu::Credited;
use crate::sync::Ordering;
use crate::types::*;
use crossbeam_epoch::{self as epoch, Guard};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Weak};

/// A replica's chain-path score before ranking (see `Index::prefix_scores`).
#[derive(Clone, Copy)]
pub(super) struct Ranked {
    score: f32,
    matched: i32,
    fresh: f32,
    tier: u8,
    /// Order label of the replica's id (`ScopeReplica::label`; TENANT_HOT: its position in
    /// id order): the tie-break of R4 and R5, with `name` deciding equal labels.
    rank: u64,
    /// The replica's id, borrowed from its scope slot or stats record under the lookup's
    /// guard (see `BorrowedId`): only the returned scores count their ids.
    name: crate::replica_id::BorrowedId,
}

/// One captured LFU hit (L9): identifies one storage entry by key, replica and generation.
#[derive(Clone)]
pub(super) struct Hit {
    pub(super) replica: ReplicaId,
    pub(super) rep: u32,
    pub(super) key: KeyBytesOwned,
    pub(super) generation: u32,
}

#[derive(Clone)]
pub(super) enum KeyBytesOwned {
    Short([u8; 8]),
    Long(Box<[u8]>),
}

impl KeyBytesOwned {
    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            KeyBytesOwned::Short(a) => a,
            KeyBytesOwned::Long(b) => b,
        }
    }
}

/// Hits captured by a PREFIX_MATCH lookup in an LFU namespace, not yet credited (L9, V4).
#[derive(Clone, Default)]
pub struct CapturedHits {
    pub(super) part: Option<Arc<Partition>>,
    pub(super) hits: Vec<Hit>,
}

impl std::fmt::Debug for CapturedHits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedHits")
            .field("len", &self.hits.len())
            .finish()
    }
}

impl CapturedHits {
    /// Number of captured entries.
    pub fn len(&self) -> usize {
        self.hits.len()
    }
    /// No captured entry.
    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }
    /// Captured entries of one replica.
    pub fn count_for(&self, replica: &str) -> usize {
        self.hits.iter().filter(|h| &*h.replica == replica).count()
    }
    /// Drops every hit.
    pub fn clear(&mut self) {
        self.hits.clear();
        self.part = None;
    }
    /// Keeps only the hits of replicas for which `keep` returns true.
    pub fn retain_replicas(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.hits.retain(|h| keep(&h.replica));
    }
}

/// A LookupRoute result (O1).
#[derive(Debug, Clone, Default)]
pub struct RouteResult {
    /// Result kind.
    pub strategy: Strategy,
    /// Ranked replicas, best first.
    pub scores: Vec<ScoredReplica>,
    /// LFU hits to credit if the answer is delivered.
    pub hits: CapturedHits,
}

impl RouteResult {
    /// Prunes scores and hits together (H10): keeps replicas for which `keep` is true.
    pub fn retain_replicas(&mut self, mut keep: impl FnMut(&ScoredReplica) -> bool) {
        self.scores.retain(&mut keep);
        let scores = &self.scores;
        self.hits
            .retain_replicas(|r| scores.iter().any(|s| &*s.replica_id == r));
    }
}

/// Caller-owned buffer for the allocation-free [`Index::lookup_route_into`].
#[derive(Default)]
pub struct RouteBuffer {
    /// Result kind of the last call.
    pub strategy: Strategy,
    /// Ranked replicas of the last call.
    pub scores: Vec<ScoredReplica>,
    /// Captured hits (LFU only; allocates in proportion to the run).
    pub hits: CapturedHits,
    scratch: MatchScratch,
    memo: Option<PartitionMemo>,
}

/// The partition a buffer's last lookup resolved. The next lookup of the same names in the
/// same index takes it without hashing the names and probing the directory, as long as the
/// partition is not retired: a live partition is the one the directory names for its names,
/// and one the sweep retired meanwhile is empty, which is what a lookup that resolved it just
/// before the retirement reads too. The memo is weak: it never keeps a partition, or what the
/// partition owns, alive (only its allocation's header, until the buffer resolves another).
struct PartitionMemo {
    index: u64,
    part: Weak<Partition>,
}

impl RouteBuffer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }
    /// Moves the contents out as a [`RouteResult`].
    pub fn take(&mut self) -> RouteResult {
        RouteResult {
            strategy: self.strategy,
            scores: std::mem::take(&mut self.scores),
            hits: std::mem::take(&mut self.hits),
        }
    }
}

pub(super) fn own_key(k: &[u8]) -> KeyBytesOwned {
    match <[u8; 8]>::try_from(k) {
        Ok(a) => KeyBytesOwned::Short(a),
        Err(_) => KeyBytesOwned::Long(k.into()),
    }
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
fn emit_ranked(ranked: &mut [Ranked], out: &mut Vec<ScoredReplica>) {
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
struct Pressure<'g> {
    stats: &'g [StatsRecord],
    weight: f32,
    now_ms: i64,
    ttl_ms: i64,
}

impl Pressure<'_> {
    /// A replica's pressure counts only while its report is fresh (R2); no report is 0.
    #[inline]
    fn factor(&self, replica: &ScopeReplica) -> f32 {
        let pressure = match ModelRec::stats_in(self.stats, replica) {
            Some(s) if freshness(self.now_ms, s.reported_ms, self.ttl_ms) > 0.0 => s.pressure,
            _ => 0.0,
        };
        pressure_factor(self.weight, pressure)
    }

    /// The factor every replica gets when the model has no stats records (no replica reported
    /// any): one value for the whole lookup.
    #[inline]
    fn uniform(&self) -> Option<f32> {
        self.stats
            .is_empty()
            .then(|| pressure_factor(self.weight, 0.0))
    }
}

/// R4 on `ranked`: each score times the distinguishing power of the number of replicas that
/// matched at least its chain length, out of the scope's `n` serving replicas.
fn apply_distinguishing_power(ranked: &mut [Ranked], n: i64) {
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
    fn pressure<'g>(
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

    /// R1–R5 over the runs a chain walk left in `buf.scratch`: each replica's prefix score,
    /// R4's distinguishing power, R5's order; with `capture`, the LFU hits of its run.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rank_chain<H: AsRef<[u8]>>(
        &self,
        part: &Partition,
        req: &LookupRequest<'_, H>,
        now_ms: i64,
        ttl: i64,
        capture: bool,
        buf: &mut RouteBuffer,
        guard: &Guard,
    ) {
        let c = slo_c(&self.cfg.ranker, req.ttft_ms);
        let n = part.scope.serving_n.load(Ordering::Relaxed);
        let pressure = self.pressure(part, now_ms, ttl, guard);
        let uniform_pf = pressure.uniform();
        let ranked = &mut buf.scratch.ranked;
        ranked.clear();
        for r in buf.scratch.runs.iter() {
            if r.matched <= 0 {
                continue;
            }
            let f = freshness(now_ms, r.oldest, ttl);
            if f <= 0.0 {
                continue;
            }
            // SAFETY: under the guard of the walk that left the run.
            let Some(rr) = (unsafe { r.replica(guard) }) else {
                continue;
            };
            let pf = uniform_pf.unwrap_or_else(|| pressure.factor(rr));
            ranked.push(Ranked {
                score: prefix_score(r.matched, f, pf, c),
                matched: r.matched,
                fresh: f,
                tier: r.tier,
                rank: rr.label,
                name: rr.name.borrow_id(),
            });
            if capture {
                // The replica's entries over its matched blocks, stretch by stretch.
                for s in buf.scratch.stretches.iter().filter(|s| s.rep == r.rep) {
                    for key in &req.block_hashes[s.from as usize..s.to.min(r.blocks) as usize] {
                        buf.hits.hits.push(Hit {
                            replica: rr.name.clone(),
                            rep: r.rep,
                            key: own_key(key.as_ref()),
                            generation: s.generation,
                        });
                    }
                }
            }
        }
        buf.scratch.stretches.clear();
        apply_distinguishing_power(ranked, n);
        emit_ranked(ranked, &mut buf.scores);
    }

    /// Prefix scores (exact or chain path) into `buf.scores`, capturing LFU hits if `capture`.
    #[allow(clippy::too_many_arguments)]
    fn prefix_scores<H: AsRef<[u8]>>(
        &self,
        part: &Partition,
        req: &LookupRequest<'_, H>,
        chain: bool,
        now_ms: i64,
        ttl: i64,
        capture: bool,
        buf: &mut RouteBuffer,
        guard: &Guard,
    ) {
        let c = slo_c(&self.cfg.ranker, req.ttft_ms);
        let n = part.scope.serving_n.load(Ordering::Relaxed);
        if chain {
            Self::walk_chain(
                part,
                req.block_hashes,
                req.block_token_counts,
                now_ms,
                || ttl,
                guard,
                &mut buf.scratch,
                capture,
            );
            if buf.scratch.runs.is_empty() {
                return;
            }
            self.rank_chain(part, req, now_ms, ttl, capture, buf, guard);
        } else {
            if req.prefix_hash.is_empty() {
                return;
            }
            let (digest, long) = key_parts(req.prefix_hash);
            let reps = part.scope.replicas.load(guard);
            let pressure = self.pressure(part, now_ms, ttl, guard);
            let ranked = &mut buf.scratch.ranked;
            ranked.clear();
            let hits = &mut buf.hits.hits;
            let found = part.store.for_each_holder_keyed(digest, long, guard, |h| {
                let f = freshness(now_ms, h.last_seen_ms(), ttl);
                if f <= 0.0 {
                    return;
                }
                let Some(rr) = reps.get(h.rep() as usize) else {
                    return;
                };
                let pf = pressure.factor(rr);
                ranked.push(Ranked {
                    score: prefix_score(h.tokens(), f, pf, c),
                    matched: h.tokens(),
                    fresh: f,
                    tier: h.tier(),
                    rank: rr.label,
                    name: rr.name.borrow_id(),
                });
                if capture && h.tokens() > 0 {
                    hits.push(Hit {
                        replica: rr.name.clone(),
                        rep: h.rep(),
                        key: own_key(req.prefix_hash),
                        generation: h.generation(),
                    });
                }
            });
            if !found {
                return;
            }
            let dp = distinguishing_power(ranked.len() as i64, n);
            if dp != 1.0 {
                for s in ranked.iter_mut() {
                    s.score *= dp as f32;
                }
            }
            emit_ranked(ranked, &mut buf.scores);
        }
    }

    /// Bare lookup (L1–L10): prefix scores only, never credits, no fallbacks.
    pub fn lookup<H: AsRef<[u8]>>(&self, req: &LookupRequest<'_, H>) -> Vec<ScoredReplica> {
        let mut buf = RouteBuffer::default();
        if req.hash_scheme.is_empty() {
            return Vec::new();
        }
        let chain = !req.block_hashes.is_empty() || !req.block_token_counts.is_empty();
        if chain && req.block_hashes.len() != req.block_token_counts.len() {
            return Vec::new();
        }
        let guard = epoch::pin();
        let Some(part) = self.part_ref(
            req.tenant_id,
            req.model_id,
            req.hash_scheme,
            req.adapter_id,
            &guard,
        ) else {
            return Vec::new();
        };
        let now_ms = us_to_ms(self.clock.now_us());
        let ttl = self.ttl_for(req.tenant_id);
        self.prefix_scores(part, req, chain, now_ms, ttl, false, &mut buf, &guard);
        buf.scores
    }

    /// LookupRoute at the index level (O1): prefix match, TENANT_HOT, classifier.
    ///
    /// Runs in a per-thread [`RouteBuffer`] (its walk scratch is reused across calls) and
    /// allocates only the result's score vector, at its exact size.
    pub fn lookup_route<H: AsRef<[u8]>>(&self, req: &LookupRequest<'_, H>) -> RouteResult {
        crate::sync::thread_local! {
            static BUF: std::cell::RefCell<RouteBuffer> =
                std::cell::RefCell::new(RouteBuffer::default());
        }
        let reused = BUF.with(|b| {
            // A re-entrant call (a sink or resolver calling back) takes the fresh path.
            let mut buf = b.try_borrow_mut().ok()?;
            // The buffer's score vector is always handed out (it is empty here), so the
            // ranking allocates the result's at its exact size and nothing is copied.
            self.lookup_route_into(req, &mut buf);
            Some(RouteResult {
                strategy: buf.strategy,
                scores: std::mem::take(&mut buf.scores),
                hits: std::mem::take(&mut buf.hits),
            })
        });
        if let Some(r) = reused {
            return r;
        }
        let mut buf = RouteBuffer::default();
        self.lookup_route_into(req, &mut buf);
        buf.take()
    }

    /// [`Index::lookup_route`] into a caller buffer: allocation-free in LRU namespaces once the
    /// buffer has grown (T93); returns the strategy (also stored in `buf.strategy`).
    pub fn lookup_route_into<H: AsRef<[u8]>>(
        &self,
        req: &LookupRequest<'_, H>,
        buf: &mut RouteBuffer,
    ) -> Strategy {
        buf.scores.clear();
        buf.hits.clear();
        let s = self.route_inner(req, buf);
        if s != Strategy::PrefixMatch {
            buf.hits.clear();
        }
        buf.strategy = s;
        s
    }

    fn route_inner<H: AsRef<[u8]>>(
        &self,
        req: &LookupRequest<'_, H>,
        buf: &mut RouteBuffer,
    ) -> Strategy {
        let (t, m, s) = (req.tenant_id, req.model_id, req.hash_scheme);
        if t.is_empty() || m.is_empty() || s.is_empty() {
            return Strategy::None;
        }
        let chain = !req.block_hashes.is_empty() || !req.block_token_counts.is_empty();
        if chain && req.block_hashes.len() != req.block_token_counts.len() {
            return Strategy::None;
        }
        let guard = epoch::pin();
        // The partition: the buffer's memo when it still is the one, else the directory's.
        let a = req.adapter_id;
        let remembered = buf
            .memo
            .as_ref()
            .filter(|memo| memo.index == self.id)
            .and_then(|memo| memo.part.upgrade());
        let part = match remembered {
            Some(p) if p.is_named(t, m, s, a) && !p.life.is_dead() => Some(p),
            _ => {
                let found = self
                    .parts
                    .get_arc(hash_strs(&[t, m, s, a]), &|p: &Partition| {
                        p.is_named(t, m, s, a)
                    });
                buf.memo = found.as_ref().map(|p| PartitionMemo {
                    index: self.id,
                    part: Arc::downgrade(p),
                });
                found
            }
        };
        self.route_in(req, chain, part.as_ref(), buf, &guard)
    }

    /// [`Index::route_inner`] once the request is checked and its partition (if it exists)
    /// resolved.
    fn route_in<H: AsRef<[u8]>>(
        &self,
        req: &LookupRequest<'_, H>,
        chain: bool,
        part_arc: Option<&Arc<Partition>>,
        buf: &mut RouteBuffer,
        guard: &Guard,
    ) -> Strategy {
        let (t, m, s) = (req.tenant_id, req.model_id, req.hash_scheme);
        let now_ms = us_to_ms(self.clock.now_us());
        let ttl = self.ttl_for(t);
        let part = part_arc.map(|p| &**p);
        if let Some(part) = part {
            let capture = self.resolvers.algorithm(t) == Algorithm::Lfu;
            self.prefix_scores(part, req, chain, now_ms, ttl, capture, buf, guard);
            if !buf.scores.is_empty() {
                if capture && !buf.hits.hits.is_empty() {
                    buf.hits.part = part_arc.cloned();
                }
                return Strategy::PrefixMatch;
            }
        }
        if !chain
            && self.tenant_hot(
                req,
                part,
                now_ms,
                &mut buf.scratch.ranked,
                &mut buf.scores,
                guard,
            )
        {
            return Strategy::TenantHot;
        }
        match part {
            // The partition names the same directory records the lookups by name would find
            // (a live partition's parents are live: the sweep reclaims a parent only once its
            // children are gone): no string hashing on the common miss.
            Some(p) => {
                self.classify_with(|| Some(&*p.tenant), || Some(&*p.model), || Some(&*p.scope))
            }
            None => self.classify_in(t, m, s, guard),
        }
    }

    /// O2: TENANT_HOT candidates into `out`; true if any.
    /// `part` is the request's partition when it exists: its (tenant, model) and scope records
    /// are the ones the lookups by name would find (a live partition's parents are live).
    fn tenant_hot<H: AsRef<[u8]>>(
        &self,
        req: &LookupRequest<'_, H>,
        part: Option<&Partition>,
        now_ms: i64,
        ranked: &mut Vec<Ranked>,
        out: &mut Vec<ScoredReplica>,
        guard: &Guard,
    ) -> bool {
        let rc = &self.cfg.ranker;
        if rc.tenant_hot_max_age_ms <= 0 || req.hash_scheme.is_empty() {
            return false;
        }
        let records = match part {
            Some(p) => Some((&*p.model, &*p.scope)),
            None => self
                .model_ref(req.tenant_id, req.model_id, guard)
                .zip(self.scope_ref(req.tenant_id, req.model_id, req.hash_scheme, guard)),
        };
        let Some((model, scope)) = records else {
            return false;
        };
        let c = slo_c(rc, req.ttft_ms);
        let stats = model.stats.load(guard);
        ranked.clear();
        for (i, st) in stats.iter().enumerate() {
            let age = now_ms - st.reported_ms;
            if age >= rc.tenant_hot_max_age_ms || st.hit_rate < rc.tenant_hot_min_hit_rate {
                continue;
            }
            if scope
                .find(&st.replica, guard)
                .is_none_or(|r| r.serving.load(Ordering::Relaxed) <= 0)
            {
                continue;
            }
            let rec = recency(age, rc.tenant_hot_max_age_ms);
            let pf = pressure_factor(rc.pressure_weight, st.pressure);
            // Stats records are kept sorted by replica id, so a record's position is its id's
            // rank among them: R5's tie-break without comparing ids.
            ranked.push(Ranked {
                score: tenant_hot_score(st.hit_rate, rec, pf, c),
                matched: 0,
                fresh: st.hit_rate,
                tier: 0,
                rank: i as u64,
                name: st.replica.borrow_id(),
            });
        }
        emit_ranked(ranked, out);
        !out.is_empty()
    }

    /// O3 miss classifier (O(1) counter reads).
    pub fn classify(&self, tenant: &str, model: &str, scheme: &str) -> Strategy {
        self.classify_in(tenant, model, scheme, &epoch::pin())
    }

    fn classify_in(&self, tenant: &str, model: &str, scheme: &str, guard: &Guard) -> Strategy {
        self.classify_with(
            || self.tenant_ref(tenant, guard),
            || self.model_ref(tenant, model, guard),
            || self.scope_ref(tenant, model, scheme, guard),
        )
    }

    /// The classifier over directory records, each looked up only when the previous test
    /// passed.
    fn classify_with<'a>(
        &'a self,
        tenant: impl FnOnce() -> Option<&'a TenantRec>,
        model: impl FnOnce() -> Option<&'a ModelRec>,
        scope: impl FnOnce() -> Option<&'a ScopeRec>,
    ) -> Strategy {
        if self.total_keys.load(Ordering::Relaxed) <= 0 {
            return Strategy::None;
        }
        match tenant() {
            Some(t) if t.keys.load(Ordering::Relaxed) > 0 => {}
            _ => return Strategy::UnknownTenant,
        }
        match model() {
            Some(m) if m.keys.load(Ordering::Relaxed) > 0 => {}
            _ => return Strategy::UnknownModel,
        }
        match scope() {
            Some(s) if s.serving_n.load(Ordering::Relaxed) > 0 => Strategy::None,
            _ => Strategy::UnknownHashScheme,
        }
    }

    /// O4 affinity pick: SHA-256(seed) modulo the sorted serving replicas of the scope.
    pub fn affinity_hint(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        seed: &[u8],
    ) -> Option<ReplicaId> {
        if seed.is_empty() || scheme.is_empty() {
            return None;
        }
        let guard = epoch::pin();
        let scope = self.scope_ref(tenant, model, scheme, &guard)?;
        let mut cands = scope.serving_ids();
        if cands.is_empty() {
            return None;
        }
        cands.sort_unstable();
        let d = Sha256::digest(seed);
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        let idx = (u64::from_be_bytes(b) % cands.len() as u64) as usize;
        Some(cands.swap_remove(idx))
    }

    // ----------------------------------------------------------------------------------------
    // LFU crediting (V3, V4, D4)

    /// Credits captured hits (lock-free). Hits whose entry was removed (or replaced by a new
    /// entry with the same key and replica) are ignored (L9, T92).
    pub fn credit_hits(&self, hits: &CapturedHits) {
        let Some(part) = hits.part.as_deref() else {
            return;
        };
        let guard = epoch::pin();
        for hit in hits.hits.iter() {
            self.credit_one(part, hit.key.as_bytes(), hit.rep, hit.generation, &guard);
        }
    }

    /// One LFU credit of the entry `(key, rep)` if it is still the `generation` credited.
    pub(crate) fn credit_one(
        &self,
        part: &Partition,
        key: &[u8],
        rep: u32,
        generation: u32,
        guard: &Guard,
    ) {
        let (digest, long) = key_parts(key);
        let live =
            |h: Option<crate::raw::holder::Holder>| h.is_some_and(|h| h.generation() == generation);
        if !live(part.store.entry(digest, long, rep, guard)) {
            return;
        }
        // Lock-free once the entry has an LFU cell; the first credit creates it under the
        // partition's writer lock after re-validating the entry there (removals kill cells
        // under the same lock, so a cell is never created for a removed entry).
        let cell = match part.lfu.cell(digest, rep, generation, guard) {
            Some(c) => c,
            None => {
                let created = part.store.with_entry_locked(digest, long, rep, guard, |h| {
                    live(h).then(|| part.lfu.cell_or_create(key, rep, generation, guard))
                });
                match created {
                    Some(c) => c,
                    None => return,
                }
            }
        };
        // Counts above the threshold go to per-core stripes under contention and leave the
        // key sum alone: it only needs min(count, threshold) per cell to decide "hot" (D4).
        let lanes = self.stripe_lanes;
        if cell.credit(self.hot_threshold(), lanes, &part.lfu) == Credited::BelowThreshold {
            self.add_key_access(&part.model, cell.ksum(), 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::{DefaultResolvers, IndexConfig};
    use crate::index::testing::NOW;

    /// The replicas a route names, in order.
    fn routed(ix: &Index, keys: &[[u8; 8]], buf: &mut RouteBuffer) -> Vec<String> {
        let counts = vec![16; keys.len()];
        let req = LookupRequest {
            block_hashes: keys,
            block_token_counts: &counts,
            ..LookupRequest::new("t", "m", "s")
        };
        ix.lookup_route_into(&req, buf);
        buf.scores
            .iter()
            .map(|s| s.replica_id.to_string())
            .collect()
    }

    /// A buffer's partition memo never outlives its partition's place in the directory: once
    /// the sweep reclaims the partition and an ingest creates its successor, the next route
    /// through the same buffer finds the successor's entries, not the retired partition; and
    /// one buffer serving two indexes answers each from its own.
    #[test]
    fn a_route_buffer_follows_its_partition_through_reclaim() {
        use crate::index::testing::{chain, index_at_now};
        let keys = [[1u8; 8], [2u8; 8]];
        let ix = index_at_now();
        let mut buf = RouteBuffer::new();
        chain(&ix, "a", &keys);
        assert_eq!(routed(&ix, &keys, &mut buf), ["a"]);
        ix.evict_prefixes("t", "m", "a", "", &keys, NOW);
        assert!(
            routed(&ix, &keys, &mut buf).is_empty(),
            "the memo's partition is empty"
        );
        assert!(
            ix.sweep_now().records_reclaimed > 0,
            "the partition was reclaimed"
        );
        chain(&ix, "b", &keys);
        assert_eq!(
            routed(&ix, &keys, &mut buf),
            ["b"],
            "the successor partition"
        );
        let other = index_at_now();
        chain(&other, "c", &keys);
        assert_eq!(routed(&other, &keys, &mut buf), ["c"]);
        assert_eq!(routed(&ix, &keys, &mut buf), ["b"]);
        // Through `lookup_route`'s own (thread-local) buffer too.
        let lookup = |ix: &Index| {
            let counts = [16; 2];
            let req = LookupRequest {
                block_hashes: &keys[..],
                block_token_counts: &counts,
                ..LookupRequest::new("t", "m", "s")
            };
            let r = ix.lookup_route(&req);
            r.scores
                .iter()
                .map(|s| s.replica_id.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(lookup(&ix), ["b"]);
        assert_eq!(lookup(&other), ["c"]);
        ix.evict_prefixes("t", "m", "b", "", &keys, NOW);
        ix.sweep_now();
        chain(&ix, "d", &keys);
        assert_eq!(lookup(&ix), ["d"]);
    }

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

    /// O3 on a partition that exists but was emptied: the route classifies its miss from the
    /// partition's own directory records, with the same answers as the lookups by name.
    #[test]
    fn o3_classifies_misses_in_an_emptied_known_partition() {
        let ix = Index::new(
            IndexConfig::default(),
            Arc::new(DefaultResolvers),
            Arc::new(ManualClock::new(NOW)),
        );
        let put = |t: &str, m: &str, s: &str, key: [u8; 8]| {
            ix.ingest(CacheStateUpdate {
                replica_id: "r",
                model_id: m,
                tenant_id: t,
                hash_scheme: s,
                timestamp_us: NOW,
                adapter_id: "",
                stats: None,
                prefixes: std::iter::once(PrefixRef {
                    prefix_hash: b"",
                    token_count: 0,
                    block_hashes: &[key],
                    block_token_counts: &[16],
                    tier: 0,
                    adapter_id: "",
                }),
            });
        };
        let route = |t: &str, m: &str, s: &str| {
            let hashes = [[0xEE; 8]];
            ix.lookup_route(&LookupRequest {
                block_hashes: &hashes[..],
                block_token_counts: &[16],
                ..LookupRequest::new(t, m, s)
            })
            .strategy
        };
        let k = |i: u8| [i; 8];
        put("a", "m", "s", k(1));
        put("b", "m", "s", k(2));
        put("b", "m2", "s", k(3));
        put("c", "m", "s2", k(4));
        put("c", "m", "s", k(5));
        assert_eq!(route("a", "m", "s"), Strategy::None, "O3.5: novel prefix");
        // Tenant a has no key left; b's (b, m) and c's (c, m, s) neither, but each still has
        // keys one level up.
        ix.evict_prefixes("a", "m", "r", "", &[k(1)], 0);
        ix.evict_prefixes("b", "m", "r", "", &[k(2)], 0);
        ix.evict_prefixes("c", "m", "r", "", &[k(5)], 0);
        for (t, m, s, want) in [
            ("a", "m", "s", Strategy::UnknownTenant),
            ("b", "m", "s", Strategy::UnknownModel),
            ("c", "m", "s", Strategy::UnknownHashScheme),
            ("c", "m", "s2", Strategy::None),
        ] {
            assert!(ix.partition(t, m, s, "").is_some(), "{t}/{m}/{s} exists");
            assert_eq!(route(t, m, s), want, "{t}/{m}/{s}");
            assert_eq!(ix.classify(t, m, s), want, "{t}/{m}/{s} by name");
        }
    }
}

#[cfg(test)]
mod lfu_race_tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::config::IndexConfig;
    use crate::sync::AtomicBool;

    use crate::index::testing::{NOW, Policy, single};

    /// Credits racing with evictions and re-creations: once everything quiesces, the hot-key
    /// counter equals the number of keys whose live holders' access counts sum to ≥ threshold.
    #[test]
    fn credits_racing_removals_keep_hot_exact() {
        let cfg = IndexConfig {
            hot_access_threshold: 3,
            ..IndexConfig::default()
        };
        let ix = Arc::new(Index::new(
            cfg,
            Arc::new(Policy {
                algorithm: Algorithm::Lfu,
                quota: None,
            }),
            Arc::new(ManualClock::new(NOW)),
        ));
        let keys: Vec<Vec<u8>> = (0..16u32)
            .map(|i| format!("key-{i}").into_bytes())
            .collect();
        let reps = ["a", "b", "c"];
        for k in &keys {
            for r in reps {
                single(&ix, r, k);
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..3 {
            let (ix, keys, stop) = (ix.clone(), keys.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let k = &keys[i % keys.len()];
                    i += 7;
                    let req = LookupRequest::<&[u8]> {
                        prefix_hash: k,
                        ..LookupRequest::new("t", "m", "s")
                    };
                    let r = ix.lookup_route(&req);
                    ix.credit_hits(&r.hits);
                }
            }));
        }
        {
            let (ix, keys) = (ix.clone(), keys.clone());
            hs.push(std::thread::spawn(move || {
                for round in 0..300 {
                    let k = &keys[round % keys.len()];
                    let r = reps[round % 3];
                    ix.apply_event(CacheEventInput {
                        event_type: event_type::PREFIX_EVICTED,
                        replica_id: r,
                        model_id: "m",
                        tenant_id: "t",
                        prefix_hash: k,
                        timestamp_us: NOW,
                        adapter_id: "",
                    });
                    if round % 2 == 0 {
                        single(&ix, r, k);
                    }
                }
            }));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        let mut want = 0;
        for k in &keys {
            let sum: u64 = reps
                .iter()
                .filter_map(|r| ix.entry("t", "m", "s", "", k, r))
                .map(|e| e.access_count as u64)
                .sum();
            if sum >= 3 {
                want += 1;
            }
        }
        assert_eq!(ix.cache_state("t", "m").hot_prefixes, want);
        assert!(want > 0);
    }
}
