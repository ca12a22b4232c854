//! Lookups (L1–L10), ranking (R1–R9) and LFU crediting (V3, V4, D4): a `LookupRoute` walks
//! the partition (see `walk.rs`), scores each replica's run, ranks them (R5: score desc, then
//! replica id asc) and classifies a miss (O3). In an LFU namespace a PREFIX_MATCH captures its
//! hits; they are credited only once the answer is delivered, and only to the entry they saw
//! (generation-checked, L9).

use super::Index;
use super::crediting::{CapturedHits, Hit};
use super::ranking::formulas::{
    distinguishing_power, freshness, prefix_score, pressure_factor, recency, slo_c,
    tenant_hot_score,
};
use super::ranking::{Ranked, apply_distinguishing_power, emit_ranked};
use super::records::{ModelRec, Partition, ScopeRec, TenantRec};
use super::walk::MatchScratch;
use crate::ReplicaId;
use crate::clock::us_to_ms;
use crate::config::Algorithm;
use crate::directory::hash_strs;
use crate::raw::key::key_parts;
use crate::raw::key::own_key;
use crate::sync::Ordering;
use crate::types::*;
use crossbeam_epoch::{self as epoch, Guard};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Weak};

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

impl Index {
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
    use crate::index::testing::{NOW, Policy, single};
    use crate::sync::AtomicBool;

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
