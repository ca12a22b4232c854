//! A plain single-threaded reference model of index.md, written from the rules with BTreeMaps
//! (no sharing of code with the engine beyond the public input/output types).
#![allow(dead_code)]

use inferencecache_engine::{
    Algorithm, CacheState, CapturedHits, EvictionReason, Index, LookupRequest, PROBE_TENANT,
    RankerConfig, ReplicaStatsInput, Strategy,
};
use std::collections::{BTreeMap, BTreeSet};

pub type Key = (String, String, String, String, Vec<u8>);

#[derive(Clone, Debug, PartialEq)]
pub struct Ent {
    pub tokens: i32,
    pub last: i64,
    pub tier: i32, // stored K6 value: 1..3 or >3 / MAX
    pub access: u32,
    pub generation: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct St {
    pub s: ReplicaStatsInput,
    pub last: i64,
    pub reported: i64,
}

#[derive(Clone, Debug)]
pub struct MRef {
    pub hash: Vec<u8>,
    pub tokens: i32,
    pub blocks: Vec<Vec<u8>>,
    pub counts: Vec<i32>,
    pub tier: i32,
    pub adapter: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MScore {
    pub replica: String,
    pub score: f32,
    pub matched: i32,
    pub prob: f32,
    pub tier: i32,
}

pub struct Model {
    pub now_us: i64,
    pub global_ttl: i64,
    pub ttl: BTreeMap<String, i64>,
    pub lfu: BTreeSet<String>,
    pub ranker: RankerConfig,
    pub hot_thr: u32,
    pub reserved: BTreeSet<String>,
    pub entries: BTreeMap<Key, BTreeMap<String, Ent>>,
    pub stats: BTreeMap<(String, String, String), St>,
    /// Global cap in storage entries (V2); ≤ 0 = unbounded.
    pub cap: i64,
    /// Tenant quotas in distinct keys (V5); absent or negative = unbounded.
    pub quota: BTreeMap<String, i64>,
    /// `tenant_evictions_total{tenant}` (keys).
    pub tenant_evictions: BTreeMap<String, u64>,
    /// `index_evictions_total{lru|lfu, cap}`.
    pub cap_evictions: [u64; 2],
    next_gen: u64,
}

fn ms(us: i64) -> i64 {
    us.div_euclid(1000)
}

pub fn fresh(now: i64, last: i64, ttl: i64) -> f32 {
    if ttl <= 0 {
        return 0.0;
    }
    let age = now - last;
    if age <= 0 {
        1.0
    } else if age >= ttl {
        0.0
    } else {
        (1.0 - age as f64 / ttl as f64) as f32
    }
}

pub fn dp(m: i64, n: i64) -> f64 {
    if n <= 1 || m < 0 {
        1.0
    } else if m >= n {
        0.0
    } else {
        1.0 - m as f64 / n as f64
    }
}

fn wire_tier(t: i32) -> i32 {
    if (1..=3).contains(&t) { t } else { 0 }
}

fn fold(a: i32, b: i32) -> i32 {
    if a == 0 || b == 0 { 0 } else { a.max(b) }
}

impl Model {
    pub fn new(now_us: i64, global_ttl: i64, ranker: RankerConfig, hot_thr: u32) -> Self {
        Self {
            now_us,
            global_ttl,
            ttl: BTreeMap::new(),
            lfu: BTreeSet::new(),
            ranker,
            hot_thr,
            reserved: ["inferencecache.io/probe".to_string()].into(),
            entries: BTreeMap::new(),
            stats: BTreeMap::new(),
            cap: 0,
            quota: BTreeMap::new(),
            tenant_evictions: BTreeMap::new(),
            cap_evictions: [0; 2],
            next_gen: 1,
        }
    }

    pub fn ttl_of(&self, t: &str) -> i64 {
        match self.ttl.get(t) {
            Some(&x) if x > 0 => x,
            _ => self.global_ttl,
        }
    }

    fn upsert(&mut self, key: Key, replica: &str, tokens: i32, ts: i64, tier: i32) {
        let holders = self.entries.entry(key).or_default();
        match holders.get_mut(replica) {
            Some(e) => {
                e.tokens = tokens;
                e.tier = tier;
                e.last = e.last.max(ts);
            }
            None => {
                holders.insert(
                    replica.to_string(),
                    Ent {
                        tokens,
                        last: ts,
                        tier,
                        access: 0,
                        generation: self.next_gen,
                    },
                );
                self.next_gen += 1;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn ingest(
        &mut self,
        replica: &str,
        t: &str,
        m: &str,
        s: &str,
        adapter: &str,
        ts_us: i64,
        refs: &[MRef],
        stats: Option<ReplicaStatsInput>,
    ) {
        let ts = ms(if ts_us == 0 { self.now_us } else { ts_us });
        if !s.is_empty() {
            for r in refs {
                let a = if !r.adapter.is_empty() {
                    r.adapter.clone()
                } else {
                    adapter.to_string()
                };
                let tier = match r.tier {
                    0 => 1,
                    x if x < 0 => i32::MAX,
                    x => x,
                };
                let key = |h: &[u8]| {
                    (
                        t.to_string(),
                        m.to_string(),
                        s.to_string(),
                        a.clone(),
                        h.to_vec(),
                    )
                };
                if !r.blocks.is_empty() || !r.counts.is_empty() {
                    if r.blocks.len() != r.counts.len() || r.blocks.iter().any(|b| b.is_empty()) {
                        continue;
                    }
                    let mut sum = 0i32;
                    for (b, c) in r.blocks.iter().zip(&r.counts) {
                        sum = sum.wrapping_add(*c);
                        self.upsert(key(b), replica, sum, ts, tier);
                    }
                    if !r.hash.is_empty() {
                        self.upsert(key(&r.hash), replica, r.tokens, ts, tier);
                    }
                } else if !r.hash.is_empty() {
                    self.upsert(key(&r.hash), replica, r.tokens, ts, tier);
                }
            }
        }
        if let Some(st) = stats {
            let clean = |x: f32| if x.is_finite() { x } else { 0.0 };
            let k = (t.to_string(), m.to_string(), replica.to_string());
            let (last, rep) = match self.stats.get(&k) {
                Some(o) => (o.last.max(ts), o.reported.max(ts)),
                None => (ts, ts),
            };
            let mut s2 = st;
            s2.hit_rate = clean(st.hit_rate);
            s2.pressure = clean(st.pressure);
            self.stats.insert(
                k,
                St {
                    s: s2,
                    last,
                    reported: rep,
                },
            );
        }
        self.enforce_quota(t);
        self.enforce_cap();
    }

    /// V5 for the ingesting tenant, exact ideal order: whole keys by (max last_seen, model,
    /// scheme, adapter, hash).
    fn enforce_quota(&mut self, t: &str) {
        let Some(&b) = self.quota.get(t) else {
            return;
        };
        if b < 0 {
            return;
        }
        let mut keys: Vec<(i64, Key)> = self
            .entries
            .iter()
            .filter(|(k, _)| k.0 == t)
            .map(|(k, h)| (h.values().map(|e| e.last).max().unwrap(), k.clone()))
            .collect();
        if keys.len() as i64 <= b {
            return;
        }
        keys.sort_by(|a, b| {
            (a.0, &a.1.1, &a.1.2, &a.1.3, &a.1.4).cmp(&(b.0, &b.1.1, &b.1.2, &b.1.3, &b.1.4))
        });
        let n = keys.len() - b as usize;
        for (_, k) in keys.into_iter().take(n) {
            self.entries.remove(&k);
            *self.tenant_evictions.entry(t.to_string()).or_default() += 1;
        }
    }

    /// V2, exact ideal order over non-reserved storage entries.
    fn enforce_cap(&mut self) {
        if self.cap <= 0 {
            return;
        }
        type Ideal = (u64, i64, Key, String);
        let mut all: Vec<Ideal> = Vec::new();
        for (k, h) in &self.entries {
            if self.reserved.contains(&k.0) {
                continue;
            }
            let lfu = self.lfu.contains(&k.0);
            for (r, e) in h {
                let eff = if lfu { e.access as u64 } else { 0 };
                all.push((eff, e.last, k.clone(), r.clone()));
            }
        }
        if all.len() as i64 <= self.cap {
            return;
        }
        all.sort();
        let n = all.len() - self.cap as usize;
        for (_, _, k, r) in all.into_iter().take(n) {
            let lfu = self.lfu.contains(&k.0);
            self.cap_evictions[lfu as usize] += 1;
            self.remove_entry(&k, &r);
        }
    }

    fn remove_entry(&mut self, key: &Key, replica: &str) -> bool {
        let Some(h) = self.entries.get_mut(key) else {
            return false;
        };
        let r = h.remove(replica).is_some();
        if h.is_empty() {
            self.entries.remove(key);
        }
        r
    }

    pub fn evict(&mut self, t: &str, m: &str, replica: &str, hash: &[u8], adapter: &str) -> usize {
        if hash.is_empty() {
            return 0;
        }
        let keys: Vec<Key> = self
            .entries
            .keys()
            .filter(|k| {
                k.0 == t && k.1 == m && k.4 == hash && (adapter.is_empty() || k.3 == adapter)
            })
            .cloned()
            .collect();
        keys.iter()
            .filter(|k| self.remove_entry(k, replica))
            .count()
    }

    pub fn clear(&mut self, t: &str, m: &str, replica: &str) {
        let keys: Vec<Key> = self
            .entries
            .keys()
            .filter(|k| k.0 == t && k.1 == m)
            .cloned()
            .collect();
        for k in keys {
            self.remove_entry(&k, replica);
        }
        self.stats
            .remove(&(t.to_string(), m.to_string(), replica.to_string()));
    }

    pub fn replica_updated(&mut self, t: &str, m: &str, replica: &str, ts_us: i64) {
        let ts = ms(if ts_us == 0 { self.now_us } else { ts_us });
        if let Some(s) = self
            .stats
            .get_mut(&(t.to_string(), m.to_string(), replica.to_string()))
        {
            s.last = s.last.max(ts);
        }
    }

    pub fn sweep(&mut self) -> usize {
        let now = ms(self.now_us);
        let mut removed = 0;
        let keys: Vec<Key> = self.entries.keys().cloned().collect();
        for k in keys {
            let ttl = self.ttl_of(&k.0);
            let reps: Vec<String> = self.entries[&k]
                .iter()
                .filter(|(_, e)| now - e.last >= ttl)
                .map(|(r, _)| r.clone())
                .collect();
            for r in reps {
                self.remove_entry(&k, &r);
                removed += 1;
            }
        }
        let stale: Vec<_> = self
            .stats
            .iter()
            .filter(|(k, s)| now - s.last >= self.ttl_of(&k.0))
            .map(|(k, _)| k.clone())
            .collect();
        for k in stale {
            self.stats.remove(&k);
        }
        removed
    }

    /// serving[(t, m, s)] as replica → count.
    pub fn serving(&self, t: &str, m: &str, s: &str) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        for (k, h) in &self.entries {
            if k.0 == t && k.1 == m && k.2 == s {
                for r in h.keys() {
                    *out.entry(r.clone()).or_insert(0) += 1;
                }
            }
        }
        out
    }

    fn pf_for(&self, t: &str, m: &str, r: &str, now: i64, ttl: i64) -> f32 {
        let p = match self
            .stats
            .get(&(t.to_string(), m.to_string(), r.to_string()))
        {
            Some(s) if fresh(now, s.reported, ttl) > 0.0 => s.pressure(),
            _ => 0.0,
        };
        (1.0 - self.ranker.pressure_weight * p).clamp(0.0, 1.0)
    }

    fn slo_c(&self, ttft: i32) -> f32 {
        let r = &self.ranker;
        if r.slo_tight_ttft_ms <= 0
            || r.slo_tight_bias <= 0.0
            || ttft <= 0
            || ttft >= r.slo_tight_ttft_ms
        {
            0.0
        } else {
            r.slo_tight_bias
        }
    }

    /// LookupRoute: strategy, scores, captured hits (key, replica, generation).
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        t: &str,
        m: &str,
        s: &str,
        a: &str,
        hash: &[u8],
        blocks: &[Vec<u8>],
        counts: &[i32],
        ttft: i32,
    ) -> (Strategy, Vec<MScore>, Vec<(Key, String, u64)>) {
        if t.is_empty() || m.is_empty() || s.is_empty() {
            return (Strategy::None, vec![], vec![]);
        }
        let chain = !blocks.is_empty() || !counts.is_empty();
        if chain && blocks.len() != counts.len() {
            return (Strategy::None, vec![], vec![]);
        }
        let now = ms(self.now_us);
        let ttl = self.ttl_of(t);
        let capture = self.lfu.contains(t);
        let c = self.slo_c(ttft);
        let n = self.serving(t, m, s).len() as i64;
        let key = |h: &[u8]| {
            (
                t.to_string(),
                m.to_string(),
                s.to_string(),
                a.to_string(),
                h.to_vec(),
            )
        };
        let mut scores = Vec::new();
        let mut hits = Vec::new();
        if chain {
            // L4, literally.
            struct R {
                rep: String,
                matched: i32,
                oldest: i64,
                tier: i32,
                blocks: usize,
                open: bool,
            }
            let mut runs: Vec<R> = Vec::new();
            if let Some(h0) = self.entries.get(&key(&blocks[0])) {
                for (r, e) in h0 {
                    if fresh(now, e.last, ttl) > 0.0 {
                        runs.push(R {
                            rep: r.clone(),
                            matched: counts[0],
                            oldest: e.last,
                            tier: e.tier,
                            blocks: 1,
                            open: true,
                        });
                    }
                }
            }
            for i in 1..blocks.len() {
                if !runs.iter().any(|r| r.open) {
                    break;
                }
                let h = self.entries.get(&key(&blocks[i]));
                for r in runs.iter_mut().filter(|r| r.open) {
                    match h.and_then(|h| h.get(&r.rep)) {
                        Some(e) if fresh(now, e.last, ttl) > 0.0 => {
                            r.matched = r.matched.wrapping_add(counts[i]);
                            r.oldest = r.oldest.min(e.last);
                            r.tier = fold(r.tier, e.tier);
                            r.blocks += 1;
                        }
                        _ => r.open = false,
                    }
                }
            }
            for r in runs {
                if r.matched <= 0 {
                    continue;
                }
                let f = fresh(now, r.oldest, ttl);
                if f <= 0.0 {
                    continue;
                }
                let pf = self.pf_for(t, m, &r.rep, now, ttl);
                scores.push(MScore {
                    replica: r.rep.clone(),
                    score: ((r.matched as f32 * f) * pf) * (1.0 + f * c),
                    matched: r.matched,
                    prob: f,
                    tier: wire_tier(r.tier),
                });
                if capture {
                    for b in &blocks[..r.blocks] {
                        let k = key(b);
                        let g = self.entries[&k][&r.rep].generation;
                        hits.push((k, r.rep.clone(), g));
                    }
                }
            }
            if n > 1 && !scores.is_empty() {
                scores.sort_by(|x, y| y.matched.cmp(&x.matched).then(x.replica.cmp(&y.replica)));
                let mut i = 0;
                while i < scores.len() {
                    let mut j = i;
                    while j < scores.len() && scores[j].matched == scores[i].matched {
                        j += 1;
                    }
                    let d = dp(j as i64, n);
                    if d != 1.0 {
                        for x in &mut scores[i..j] {
                            x.score *= d as f32;
                        }
                    }
                    i = j;
                }
            }
        } else if !hash.is_empty()
            && let Some(h) = self.entries.get(&key(hash))
        {
            for (r, e) in h {
                let f = fresh(now, e.last, ttl);
                if f <= 0.0 {
                    continue;
                }
                let pf = self.pf_for(t, m, r, now, ttl);
                scores.push(MScore {
                    replica: r.clone(),
                    score: ((e.tokens as f32 * f) * pf) * (1.0 + f * c),
                    matched: e.tokens,
                    prob: f,
                    tier: wire_tier(e.tier),
                });
                if capture && e.tokens > 0 {
                    hits.push((key(hash), r.clone(), e.generation));
                }
            }
            let d = dp(scores.len() as i64, n);
            if d != 1.0 {
                for x in &mut scores {
                    x.score *= d as f32;
                }
            }
        }
        let sort = |v: &mut Vec<MScore>| {
            v.sort_by(|x, y| {
                y.score
                    .partial_cmp(&x.score)
                    .unwrap()
                    .then(x.replica.cmp(&y.replica))
            })
        };
        if !scores.is_empty() {
            sort(&mut scores);
            return (Strategy::PrefixMatch, scores, hits);
        }
        if !chain && self.ranker.tenant_hot_max_age_ms > 0 {
            let serving = self.serving(t, m, s);
            let mut th = Vec::new();
            for ((st, sm, r), rec) in &self.stats {
                if st != t || sm != m {
                    continue;
                }
                let age = now - rec.reported;
                let max = self.ranker.tenant_hot_max_age_ms;
                if age >= max
                    || rec.s.hit_rate < self.ranker.tenant_hot_min_hit_rate
                    || serving.get(r).copied().unwrap_or(0) <= 0
                {
                    continue;
                }
                let recency = if age <= 0 {
                    1.0
                } else {
                    1.0 - ((age * 1_000_000) as f32) / ((max * 1_000_000) as f32)
                };
                let pf = (1.0 - self.ranker.pressure_weight * rec.s.pressure).clamp(0.0, 1.0);
                th.push(MScore {
                    replica: r.clone(),
                    score: ((rec.s.hit_rate * recency) * pf) * (1.0 + recency * c),
                    matched: 0,
                    prob: rec.s.hit_rate,
                    tier: 0,
                });
            }
            if !th.is_empty() {
                sort(&mut th);
                return (Strategy::TenantHot, th, vec![]);
            }
        }
        (self.classify(t, m, s), vec![], vec![])
    }

    pub fn classify(&self, t: &str, m: &str, s: &str) -> Strategy {
        if self.entries.is_empty() {
            Strategy::None
        } else if !self.entries.keys().any(|k| k.0 == t) {
            Strategy::UnknownTenant
        } else if !self.entries.keys().any(|k| k.0 == t && k.1 == m) {
            Strategy::UnknownModel
        } else if self.serving(t, m, s).is_empty() {
            Strategy::UnknownHashScheme
        } else {
            Strategy::None
        }
    }

    pub fn credit(&mut self, hits: &[(Key, String, u64)]) {
        for (k, r, g) in hits {
            if let Some(e) = self.entries.get_mut(k).and_then(|h| h.get_mut(r))
                && e.generation == *g
            {
                e.access = e.access.saturating_add(1);
            }
        }
    }

    /// (total distinct keys, hot keys) of (t, m).
    pub fn cache_counts(&self, t: &str, m: &str) -> (i64, i64) {
        let mut total = 0;
        let mut hot = 0;
        for (k, h) in &self.entries {
            if k.0 == t && k.1 == m {
                total += 1;
                if h.values().map(|e| e.access as u64).sum::<u64>() >= self.hot_thr as u64 {
                    hot += 1;
                }
            }
        }
        (total, hot)
    }

    /// Snapshot rows: (tenant, replica) → (prefix_count, last_event_ms, stats: Option<(hit, last_ms)>);
    /// tenants: tenant → (index_entries, mean hit, reported).
    #[allow(clippy::type_complexity)]
    pub fn snapshot(
        &self,
    ) -> (
        Vec<(String, String, i64, i64, Option<(f32, i64)>)>,
        Vec<(String, i64, f64, bool)>,
        i64,
        i64,
    ) {
        let mut rows: BTreeMap<(String, String), (i64, i64, Option<(f32, i64, String)>)> =
            BTreeMap::new();
        for (k, h) in &self.entries {
            if self.reserved.contains(&k.0) {
                continue;
            }
            for (r, e) in h {
                let row = rows
                    .entry((k.0.clone(), r.clone()))
                    .or_insert((0, i64::MIN, None));
                row.0 += 1;
                row.1 = row.1.max(e.last);
            }
        }
        for ((t, m, r), s) in &self.stats {
            if self.reserved.contains(t) {
                continue;
            }
            let row = rows
                .entry((t.clone(), r.clone()))
                .or_insert((0, i64::MIN, None));
            let better = match &row.2 {
                None => true,
                Some((_, last, cm)) => s.last > *last || (s.last == *last && m < cm),
            };
            if better {
                row.2 = Some((s.s.hit_rate, s.last, m.clone()));
            }
        }
        let rows_out: Vec<_> = rows
            .iter()
            .map(|((t, r), (c, le, s))| {
                (
                    t.clone(),
                    r.clone(),
                    *c,
                    if *le == i64::MIN { 0 } else { *le * 1000 },
                    s.as_ref().map(|(h, l, _)| (*h, *l * 1000)),
                )
            })
            .collect();
        let mut tenants: BTreeMap<String, (i64, f64, usize)> = BTreeMap::new();
        let mut hot = 0;
        for (k, h) in &self.entries {
            if self.reserved.contains(&k.0) {
                continue;
            }
            tenants.entry(k.0.clone()).or_default().0 += 1;
            if h.values().map(|e| e.access as u64).sum::<u64>() >= self.hot_thr as u64 {
                hot += 1;
            }
        }
        for (t, _, _, _, s) in &rows_out {
            if let Some((h, _)) = s {
                let e = tenants.entry(t.clone()).or_default();
                e.1 += *h as f64;
                e.2 += 1;
            }
        }
        let total = tenants.values().map(|v| v.0).sum();
        let tenants_out = tenants
            .into_iter()
            .map(|(t, (k, s, n))| (t, k, if n > 0 { s / n as f64 } else { 0.0 }, n > 0))
            .collect();
        (rows_out, tenants_out, total, hot)
    }
}

trait Pressure {
    fn pressure(&self) -> f32;
}
impl Pressure for St {
    fn pressure(&self) -> f32 {
        self.s.pressure
    }
}

/// Captured hits of one lookup, engine side and model side, for a later credit (L9).
pub type Hits = (CapturedHits, Vec<(Key, String, u64)>);

/// Fails with `what` and both values when they differ. A `Result` rather than a panic so the
/// proptest oracle can shrink on it and the fuzz harness can add the operation to the message.
fn same<T: PartialEq + std::fmt::Debug>(got: T, want: T, what: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: engine {got:?} != model {want:?}"))
    }
}

/// The request of a lookup operation of the T90 oracle and the `engine_ops` fuzz target: a key and
/// an optional chain in one (tenant, model, scheme, adapter) partition. Neither sets a prefix
/// token count or a TBT budget, as the index reads neither (R3).
pub fn lookup_request<'a>(
    (tenant_id, model_id, hash_scheme, adapter_id): (&'a str, &'a str, &'a str, &'a str),
    prefix_hash: &'a [u8],
    block_hashes: &'a [Vec<u8>],
    block_token_counts: &'a [i32],
    ttft_ms: i32,
) -> LookupRequest<'a, Vec<u8>> {
    LookupRequest {
        tenant_id,
        model_id,
        hash_scheme,
        adapter_id,
        prefix_hash,
        prefix_token_count: 0,
        block_hashes,
        block_token_counts,
        ttft_ms,
        tbt_ms: 0,
    }
}

/// Runs `req` through `LookupRoute` of the engine and the model and compares the answers:
/// strategy, bit-equal scores, probabilities and tiers in order (R1–R7), the captured hits per
/// replica of `replicas` (L9), and the bare lookup as the prefix part of LookupRoute. Shared by
/// the T90 oracle and the `engine_ops` fuzz target so both judge the engine by the same rules.
pub fn check_lookup(
    ix: &Index,
    md: &Model,
    req: &LookupRequest<'_, Vec<u8>>,
    replicas: &[&str],
) -> Result<Hits, String> {
    let got = ix.lookup_route(req);
    let (want_strategy, want_scores, want_hits) = md.route(
        req.tenant_id,
        req.model_id,
        req.hash_scheme,
        req.adapter_id,
        req.prefix_hash,
        req.block_hashes,
        req.block_token_counts,
        req.ttft_ms,
    );
    same(got.strategy, want_strategy, "strategy")?;
    // Compared as bits: NaN scores must match too, and no rounding slack is allowed.
    let g: Vec<(String, u32, i32, u32, i32)> = got
        .scores
        .iter()
        .map(|x| {
            (
                x.replica_id.to_string(),
                x.score.to_bits(),
                x.matched_tokens,
                x.estimated_cache_hit_prob.to_bits(),
                x.tier,
            )
        })
        .collect();
    let w: Vec<(String, u32, i32, u32, i32)> = want_scores
        .iter()
        .map(|x| {
            (
                x.replica.clone(),
                x.score.to_bits(),
                x.matched,
                x.prob.to_bits(),
                x.tier,
            )
        })
        .collect();
    same(g, w, "scores")?;
    same(got.hits.len(), want_hits.len(), "hits")?;
    for rep in replicas {
        same(
            got.hits.count_for(rep),
            want_hits.iter().filter(|h| h.1 == *rep).count(),
            &format!("hits of {rep}"),
        )?;
    }
    if got.strategy == Strategy::PrefixMatch {
        same(ix.lookup(req), got.scores, "bare lookup vs LookupRoute")?;
    }
    Ok((got.hits, want_hits))
}

/// The engine's observable state equals the model's: counters, holders, entries, per-(tenant,
/// model) counts and serving counts over the given domain, quota and cap evictions, and the
/// entry gauge. The oracle adds its snapshot and stats checks on top.
pub fn check_state(
    ix: &Index,
    md: &Model,
    tenants: &[&str],
    models: &[&str],
    schemes: &[&str],
    replicas: &[&str],
) -> Result<(), String> {
    same(ix.total_keys(), md.entries.len() as i64, "keys")?;
    let entries: usize = md.entries.values().map(|h| h.len()).sum();
    same(
        (ix.storage_entries() + ix.reserved_storage_entries()) as usize,
        entries,
        "storage entries",
    )?;
    for (k, holders) in &md.entries {
        let got: Vec<String> = ix
            .holders(&k.0, &k.1, &k.2, &k.3, &k.4)
            .iter()
            .map(|s| s.to_string())
            .collect();
        let want: Vec<String> = holders.keys().cloned().collect();
        same(got, want, &format!("holders of {k:?}"))?;
        for (r, e) in holders {
            let v = ix
                .entry(&k.0, &k.1, &k.2, &k.3, &k.4, r)
                .ok_or_else(|| format!("entry {k:?}/{r} missing"))?;
            // The wire carries only tiers 1–3; other stored values read back as 0.
            let wire_tier = if (1..=3).contains(&e.tier) { e.tier } else { 0 };
            same(
                (v.token_count, v.last_seen_us, v.tier, v.access_count),
                (e.tokens, e.last * 1000, wire_tier, e.access),
                &format!("entry {k:?}/{r}"),
            )?;
        }
    }
    for t in tenants {
        for m in models {
            let cs = ix.cache_state(t, m);
            if *t == PROBE_TENANT {
                same(cs, CacheState::default(), "CacheState of the probe tenant")?;
                continue;
            }
            same(
                (cs.total_prefixes, cs.hot_prefixes),
                md.cache_counts(t, m),
                &format!("CacheState({t}, {m})"),
            )?;
            for s in schemes {
                for r in replicas {
                    same(
                        ix.serving_count(t, m, s, r),
                        md.serving(t, m, s).get(*r).copied().unwrap_or(0),
                        &format!("serving[{t}, {m}, {s}][{r}]"),
                    )?;
                }
            }
        }
    }
    let te: Vec<(String, u64)> = ix
        .tenant_evictions()
        .iter()
        .map(|(t, n)| (t.to_string(), *n))
        .collect();
    let want_te: Vec<(String, u64)> = md
        .tenant_evictions
        .iter()
        .map(|(t, n)| (t.clone(), *n))
        .collect();
    same(te, want_te, "quota evictions")?;
    same(
        [
            ix.evictions(Algorithm::Lru, EvictionReason::Cap),
            ix.evictions(Algorithm::Lfu, EvictionReason::Cap),
        ],
        md.cap_evictions,
        "cap evictions",
    )?;
    let gauge: i64 = ix.entry_counts_by_model().iter().map(|x| x.1).sum();
    same(
        gauge,
        md.entries.keys().filter(|k| k.0 != PROBE_TENANT).count() as i64,
        "gauge",
    )
}
