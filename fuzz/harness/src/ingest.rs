//! `cache_state_update` and `cache_event`: protobuf bytes → a producer message → the functions
//! the gRPC service applies it with (server.md §8.2, §8.3), on a freshly seeded state.

use crate::fixture::{self, T0_US};
use inferencecache_engine::{Index, LookupRequest, PROBE_TENANT, event_type};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCache;
use inferencecache_server::grpc::CacheService;
use inferencecache_server::translate;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

/// Most ingested keys checked one by one per input (keeps an execution cheap).
const MAX_CHECKED_KEYS: usize = 64;

/// Decodes `data` as a `CacheStateUpdate`, ingests it into a seeded state and checks the result
/// against K3–K15 and S2.
pub fn cache_state_update(data: &[u8]) {
    let Ok(update) = pb::CacheStateUpdate::decode(data) else {
        return;
    };
    let state = fixture::new_state();
    let index = state.index();
    let before = Totals::of(index);
    translate::ingest(index, &update);
    check_counts(index);
    // §8.2 / K15: the reserved tenant's updates are skipped silently.
    if update.tenant_id == PROBE_TENANT {
        assert_eq!(
            Totals::of(index),
            before,
            "a probe-tenant update changed the index"
        );
        return;
    }
    let (t, m, s, r) = (
        update.tenant_id.as_str(),
        update.model_id.as_str(),
        update.hash_scheme.as_str(),
        update.replica_id.as_str(),
    );
    // A tenant with a quota may lose the update's own keys to V5; the exact checks below are for
    // the unbounded tenants.
    let bounded = state.policies().quota(t).is_some();
    if !bounded {
        if s.is_empty() {
            // K4: an empty scheme indexes nothing.
            assert_eq!(
                Totals::of(index),
                before,
                "an empty-scheme update indexed prefixes"
            );
        }
        let expected = expected_entries(&update);
        for ((adapter, hash), (tokens, tier)) in expected.iter().take(MAX_CHECKED_KEYS) {
            let entry = index
                .entry(t, m, s, adapter, hash, r)
                .unwrap_or_else(|| panic!("ingested key {hash:?} (adapter {adapter:?}) missing"));
            assert_eq!(
                entry.token_count, *tokens,
                "K8/K10/K11 token count of {hash:?}"
            );
            assert_eq!(entry.tier, reported_tier(*tier), "K6 tier of {hash:?}");
            if update.timestamp_us == 0 {
                // L3: an entry written now is fresh, so the exact lookup emits its holder with
                // the stored count.
                let req: LookupRequest<'_> = LookupRequest {
                    adapter_id: adapter,
                    prefix_hash: hash,
                    ..LookupRequest::new(t, m, s)
                };
                let scores = index.lookup(&req);
                let mine = scores
                    .iter()
                    .find(|x| &*x.replica_id == r)
                    .unwrap_or_else(|| panic!("fresh key {hash:?} not found by a lookup"));
                assert_eq!(mine.matched_tokens, *tokens);
            }
        }
    }
    // S2: stats replace the record; NaN and ±Inf become 0.
    if let Some(st) = &update.stats {
        let cs = index.cache_state(t, m);
        let rec = cs
            .replicas
            .iter()
            .find(|x| &*x.replica_id == r)
            .expect("S2: the stats record is listed by CacheState");
        assert_eq!(rec.cache_memory_bytes, st.cache_memory_bytes);
        assert_eq!(
            rec.hit_rate.to_bits(),
            finite_or_zero(st.hit_rate).to_bits()
        );
        assert_eq!(
            rec.pressure.to_bits(),
            finite_or_zero(st.pressure).to_bits()
        );
        assert_eq!(
            (rec.t2_hit_tokens, rec.t2_query_tokens),
            (st.t2_hit_tokens, st.t2_query_tokens)
        );
    }
    // K12: re-sending an identical update creates no keys and no entries.
    if !bounded {
        let once = Totals::of(index);
        translate::ingest(index, &update);
        assert_eq!(
            Totals::of(index),
            once,
            "K12: a re-sent update changed the counts"
        );
        check_counts(index);
    }
}

/// The entries one update must leave behind, keyed by (resolved adapter, hash): the last write
/// of each key wins (K8, K9, K11), with its token count and wire tier.
fn expected_entries(update: &pb::CacheStateUpdate) -> BTreeMap<(String, Vec<u8>), (i32, i32)> {
    let mut out = BTreeMap::new();
    if update.hash_scheme.is_empty() {
        return out; // K4
    }
    for r in &update.prefixes {
        // K5: the ref's adapter, else the update's.
        let adapter = if r.adapter_id.is_empty() {
            update.adapter_id.clone()
        } else {
            r.adapter_id.clone()
        };
        let chain = !r.block_hashes.is_empty() || !r.block_token_counts.is_empty();
        if chain {
            // K7: a malformed chain drops whole, its prefix_hash included.
            if r.block_hashes.len() != r.block_token_counts.len()
                || r.block_hashes.iter().any(|h| h.is_empty())
            {
                continue;
            }
            // K8: cumulative i32 counts.
            let mut sum = 0i32;
            for (h, c) in r.block_hashes.iter().zip(&r.block_token_counts) {
                sum = sum.wrapping_add(*c);
                out.insert((adapter.clone(), h.clone()), (sum, r.tier));
            }
        }
        // K9 (co-set key after the blocks) and K10 (legacy form; D8: never an empty key).
        if !r.prefix_hash.is_empty() {
            out.insert((adapter, r.prefix_hash.clone()), (r.token_count, r.tier));
        }
    }
    out
}

/// K6: wire tier as the index reports it back (0 is stored as T1; negative and > 3 report
/// UNSPECIFIED).
fn reported_tier(wire: i32) -> i32 {
    match wire {
        0 => 1,
        1..=3 => wire,
        _ => 0,
    }
}

fn finite_or_zero(x: f32) -> f32 {
    if x.is_finite() { x } else { 0.0 }
}

/// Decodes `data` as a `CacheEvent`, publishes it through the service's `PublishEvent` on a
/// seeded state and checks every seeded key's holders against E1–E7.
pub fn cache_event(data: &[u8]) {
    let Ok(event) = pb::CacheEvent::decode(data) else {
        return;
    };
    let state = fixture::new_state();
    let index = state.index().clone();
    let keys = seeded_keys();
    let before = holders_view(&index, &keys);
    let stats_before = index.stats_clocks(&event.tenant_id, &event.model_id, &event.replica_id);
    let service = CacheService::new(state);
    let ack = fixture::runtime()
        .block_on(service.publish_event(tonic::Request::new(event.clone())))
        .unwrap_or_else(|status| panic!("PublishEvent returned a gRPC error: {status:?}"))
        .into_inner();
    // §8.3 / contract §4.2: always accepted, empty reason code.
    assert!(ack.accepted && ack.reason_code.is_empty(), "Ack {ack:?}");
    check_counts(&index);

    let mut want = before.clone();
    let applies = event.tenant_id != PROBE_TENANT;
    let (t, m, r) = (
        event.tenant_id.as_str(),
        event.model_id.as_str(),
        event.replica_id.as_str(),
    );
    match event.r#type {
        // E3: every scheme, the named adapter only if one is set; D8: an empty hash matches
        // nothing.
        event_type::PREFIX_EVICTED if applies && !event.prefix_hash.is_empty() => {
            for (k, holders) in want.iter_mut() {
                if k.0 == t
                    && k.1 == m
                    && k.4 == event.prefix_hash
                    && (event.adapter_id.is_empty() || k.3 == event.adapter_id)
                {
                    holders.remove(r);
                }
            }
        }
        // E4: the replica leaves every key of (tenant, model); its stats record goes too.
        event_type::ALL_CLEARED if applies => {
            for (k, holders) in want.iter_mut() {
                if k.0 == t && k.1 == m {
                    holders.remove(r);
                }
            }
            assert_eq!(
                index.stats_clocks(t, m, r),
                None,
                "E4: stats survived ALL_CLEARED"
            );
            assert!(
                index
                    .cache_state(t, m)
                    .replicas
                    .iter()
                    .all(|x| &*x.replica_id != r)
            );
        }
        // E2: liveness moves forward only, payload freshness never; no record is created.
        event_type::REPLICA_UPDATED if applies => {
            let after = index.stats_clocks(t, m, r);
            match (stats_before, after) {
                (None, None) => {}
                (Some((live0, rep0)), Some((live1, rep1))) => {
                    assert_eq!(rep1, rep0, "E2 moved stats_reported");
                    assert!(live1 >= live0, "E2/D7 moved last_seen backwards");
                    if event.timestamp_us == 0 {
                        assert_eq!(live1, live0.max(T0_US), "E1: 0 means now");
                    }
                }
                other => panic!("E2 created or dropped a stats record: {other:?}"),
            }
        }
        // E5, E6, the reserved tenant: nothing changes.
        _ => {}
    }
    let after = holders_view(&index, &keys);
    assert_eq!(after, want, "holders after {event:?}");
    // Only seeded keys exist, so the global counters follow from the view.
    let entries: usize = after.values().map(BTreeSet::len).sum();
    let live_keys = after.values().filter(|h| !h.is_empty()).count();
    assert_eq!(index.storage_entries(), entries as i64);
    assert_eq!(index.total_keys(), live_keys as i64);
}

type Key = (String, String, String, String, Vec<u8>);

/// Every key the fixture's seed updates create (before quota trimming).
fn seeded_keys() -> Vec<Key> {
    let mut keys = BTreeSet::new();
    for u in fixture::seed_updates() {
        for e in expected_entries(&u).into_keys() {
            keys.insert((
                u.tenant_id.clone(),
                u.model_id.clone(),
                u.hash_scheme.clone(),
                e.0,
                e.1,
            ));
        }
    }
    keys.into_iter().collect()
}

fn holders_view(index: &Index, keys: &[Key]) -> BTreeMap<Key, BTreeSet<String>> {
    keys.iter()
        .map(|k| {
            let holders = index
                .holders(&k.0, &k.1, &k.2, &k.3, &k.4)
                .iter()
                .map(|h| h.to_string())
                .collect();
            (k.clone(), holders)
        })
        .collect()
}

/// Counters whose change an update or event is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Totals {
    keys: i64,
    entries: i64,
    reserved: i64,
}

impl Totals {
    fn of(index: &Index) -> Self {
        Self {
            keys: index.total_keys(),
            entries: index.storage_entries(),
            reserved: index.reserved_storage_entries(),
        }
    }
}

/// The aggregates agree with each other (G2, V7) when no reserved data exists.
fn check_counts(index: &Index) {
    assert_eq!(
        index.reserved_storage_entries(),
        0,
        "K15: reserved entries stored"
    );
    let keys = index.total_keys();
    let entries = index.storage_entries();
    assert!(entries >= keys, "{entries} storage entries for {keys} keys");
    let gauge: i64 = index.entry_counts_by_model().iter().map(|x| x.1).sum();
    assert_eq!(gauge, keys, "V7: per-model gauge vs distinct keys");
    let snap = index.snapshot();
    assert_eq!(snap.total_prefixes, keys, "G2: totalPrefixes");
    let by_tenant: i64 = snap.tenants.iter().map(|t| t.index_entries).sum();
    assert_eq!(by_tenant, keys, "G2: Σ indexEntries");
    let by_replica: i64 = snap.replicas.iter().map(|r| r.prefix_count).sum();
    assert_eq!(by_replica, entries, "G2: Σ prefixCount");
}
