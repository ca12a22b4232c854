//! Identity lifecycle (issue 28): records that hold nothing are reclaimed by the sweep, memory
//! and record counts return to the empty baseline, a long-lived scope takes new pods forever
//! (its replica slots are recycled), lookups with unknown ids create nothing, and reclamation
//! racing ingest never loses a live entry or a counter.

mod common;

use common::*;
use inferencecache_engine::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const TTL_MS: i64 = 30_000;

fn env_ttl() -> Env {
    env_with(IndexConfig {
        global_ttl_ms: TTL_MS,
        max_entries: 0,
        ..IndexConfig::default()
    })
}

fn put_in(e: &Env, tenant: &str, model: &str, replica: &str, key: &[u8]) -> IngestOutcome {
    e.put_with(
        &Put {
            tenant,
            model,
            replica,
            ..Put::default()
        },
        key,
        16,
    )
}

fn exact_in(e: &Env, tenant: &str, model: &str, key: &[u8]) -> RouteResult {
    e.route(&LookupRequest::<Vec<u8>> {
        prefix_hash: key,
        ..LookupRequest::new(tenant, model, "vllm")
    })
}

/// Churned tenants, models and pods leave nothing once their entries and stats expire: one
/// sweep after the TTL returns entry counts, record counts and `memory_bytes` to the empty
/// baseline, and the tenants' ids are then unknown again (O1 diagnostics, nothing created).
#[test]
fn churned_records_return_to_the_empty_baseline() {
    let e = env_ttl();
    assert_eq!(e.ix.record_counts(), RecordCounts::default());
    let baseline = e.ix.memory_bytes();
    for round in 0..3 {
        for t in 0..500 {
            let tenant = format!("tenant-{round}-{t}");
            for m in 0..2 {
                let model = format!("model-{m}");
                for r in 0..2 {
                    let replica = format!("pod-{round}-{t}-{r}");
                    put_in(&e, &tenant, &model, &replica, &(t as u64).to_be_bytes());
                    e.stats_with(&tenant, &model, &replica, 0.5, 0.1, 0);
                }
            }
        }
        let live = e.ix.record_counts();
        assert_eq!(live.tenants, 500);
        assert_eq!(live.models, 1000);
        assert_eq!(live.scopes, 1000);
        assert_eq!(live.partitions, 1000);
        assert_eq!(live.gauges, 2);
        assert_eq!(live.scope_replicas, 2000);
        assert_eq!(e.ix.storage_entries(), 2000);
        assert!(e.ix.memory_bytes() > baseline);
        // Within the TTL nothing is reclaimed, even with the sweep running.
        let out = e.ix.sweep_now();
        assert_eq!(out.records_reclaimed, 0);
        assert_eq!(e.ix.record_counts(), live);
        e.clock.set_us(e.now() + (TTL_MS + 1) * 1000);
        let out = e.ix.sweep_now();
        assert_eq!(out.entries_removed, 2000);
        assert_eq!(out.stats_removed, 2000);
        // 1,000 partitions + 1,000 scopes + 1,000 pairs + 2 gauges + 500 tenants.
        assert_eq!(out.records_reclaimed, 3502, "round {round}");
        assert_eq!(e.ix.record_counts(), RecordCounts::default());
        assert_eq!(e.ix.storage_entries(), 0);
        assert_eq!(e.ix.total_keys(), 0);
        assert_eq!(e.ix.memory_bytes(), baseline, "round {round}");
        assert!(
            e.ix.entry_counts_by_model().is_empty(),
            "gauges go with their models"
        );
        assert!(e.ix.snapshot().replicas.is_empty());
    }
    // The last round's ids are unknown again, and asking creates nothing.
    let key = 7u64.to_be_bytes();
    assert_eq!(
        exact_in(&e, "tenant-2-7", "model-0", &key).strategy,
        Strategy::None,
        "an empty index answers NO_HINT"
    );
    put_in(&e, "other", "m", "r", b"k");
    assert_eq!(
        exact_in(&e, "tenant-2-7", "model-0", &key).strategy,
        Strategy::UnknownTenant
    );
    assert_eq!(
        exact_in(&e, "other", "model-0", &key).strategy,
        Strategy::UnknownModel
    );
    assert_eq!(
        e.route(&LookupRequest::<Vec<u8>> {
            prefix_hash: &key,
            ..LookupRequest::new("other", "m", "sglang")
        })
        .strategy,
        Strategy::UnknownHashScheme
    );
    assert_eq!(
        e.ix.cache_state("tenant-2-7", "model-0"),
        CacheState::default()
    );
    assert_eq!(
        e.ix.serving_count("tenant-2-7", "model-0", "vllm", "pod-2-7-0"),
        0
    );
    let c = e.ix.record_counts();
    assert_eq!(
        (c.tenants, c.models, c.partitions),
        (1, 1, 1),
        "lookups created nothing"
    );
}

/// A record is kept while anything in it is live: an entry keeps its partition (and the
/// pair, scope and tenant above it), a stats record alone keeps its (tenant, model) pair.
#[test]
fn records_holding_an_entry_or_stats_are_kept() {
    let e = env_ttl();
    put_in(&e, "t1", "m", "r", b"old");
    e.stats_with("t2", "m", "r", 0.5, 0.1, 0);
    e.clock.set_us(e.now() + 20_000_000);
    put_in(&e, "t1", "m", "r", b"new");
    e.stats_with("t2", "m", "r", 0.5, 0.1, 0);
    e.clock.set_us(e.now() + 15_000_000);
    let out = e.ix.sweep_now();
    assert_eq!(out.entries_removed, 1, "only the 35 s old entry");
    assert_eq!(out.records_reclaimed, 0);
    let c = e.ix.record_counts();
    assert_eq!((c.tenants, c.models, c.partitions, c.scopes), (2, 2, 1, 1));
    assert_eq!(
        ids(&exact_in(&e, "t1", "m", b"new").scores),
        ["r"],
        "the live entry is answered"
    );
    e.clock.set_us(e.now() + 30_000_000);
    let out = e.ix.sweep_now();
    assert_eq!(
        out.records_reclaimed,
        1 + 1 + 2 + 1 + 2,
        "partition, scope, pairs, gauge, tenants"
    );
    assert_eq!(e.ix.record_counts(), RecordCounts::default());
}

/// Pods renamed at every rollout: a scope sees more than 2^20 distinct replica ids over its
/// life (the most a holder can name at once) and keeps taking new ones, because the sweep
/// recycles the slots of pods that hold nothing. After every rollout each live pod answers for
/// its own keys (a recycled slot never lends an old pod's entry to a new one), and the scope
/// names only the live pods.
#[test]
fn a_scope_takes_new_pods_forever() {
    let e = env_ttl();
    // Keeps the scope (and its partition) alive across rollouts.
    put_in(&e, "t", "m", "anchor", b"anchor");
    const PODS: u64 = 65_536;
    let rollouts: u64 = std::env::var("IDENTITY_ROLLOUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(17); // 17 × 65,536 = 1,114,112 > 2^20 ids
    let mut dropped = 0;
    for round in 0..rollouts {
        e.clock.set_us(e.now() + 1_000);
        for p in 0..PODS {
            let out = put_in(
                &e,
                "t",
                "m",
                &format!("pod-{round}-{p}"),
                &(round << 32 | p).to_be_bytes(),
            );
            dropped += out.refs_dropped;
        }
        // The anchor and this rollout's pods are live; earlier pods are gone.
        assert_eq!(e.ix.record_counts().scope_replicas as u64, PODS + 1);
        for p in [0, 1, PODS / 2, PODS - 1] {
            let key = (round << 32 | p).to_be_bytes();
            assert_eq!(
                ids(&e.exact(&key).scores),
                [format!("pod-{round}-{p}")],
                "rollout {round}"
            );
        }
        assert_eq!(
            e.ix.serving_count("t", "m", "vllm", &format!("pod-{round}-0")),
            1
        );
        // The rollout's pods leave: their entries expire, the sweep removes them and frees
        // their slots. The anchor is refreshed so that it stays.
        e.clock.set_us(e.now() + (TTL_MS + 1) * 1000);
        put_in(&e, "t", "m", "anchor", b"anchor");
        let out = e.ix.sweep_now();
        assert_eq!(out.entries_removed, PODS, "rollout {round}");
        assert_eq!(out.replica_slots_reclaimed, PODS, "rollout {round}");
        assert_eq!(out.records_reclaimed, 0, "the anchor keeps the scope");
        assert_eq!(e.ix.storage_entries(), 1);
        assert_eq!(
            e.ix.serving_count("t", "m", "vllm", &format!("pod-{round}-0")),
            0
        );
    }
    assert_eq!(dropped, 0, "no pod was refused");
    assert_eq!(ids(&e.exact(b"anchor").scores), ["anchor"]);
}

/// Writers keep re-creating entries in partitions that a sweeper keeps reclaiming as soon as
/// they are empty: every writer's own live entry is answered right after its ingest, nothing
/// is lost, and once everything is removed the index is back to zero records and bytes.
#[test]
fn reclamation_racing_ingest_never_loses_a_live_entry() {
    let e = env_ttl();
    let ix = e.ix.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let sweeper = {
        let ix = ix.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut reclaimed = 0;
            while !stop.load(Ordering::Relaxed) {
                let out = ix.sweep_now();
                reclaimed += out.records_reclaimed + out.replica_slots_reclaimed;
            }
            reclaimed
        })
    };
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let ix = ix.clone();
            std::thread::spawn(move || {
                let none: &[Vec<u8>] = &[];
                for i in 0..4_000u64 {
                    // Shared tenants and models, so the writers also race each other's
                    // partitions being reclaimed under them.
                    let tenant = format!("t{}", i % 4);
                    let replica = format!("w{w}-{}", i % 7);
                    let key = (w << 40 | i).to_be_bytes();
                    ix.ingest(CacheStateUpdate {
                        replica_id: &replica,
                        model_id: "m",
                        tenant_id: &tenant,
                        hash_scheme: "vllm",
                        timestamp_us: 0,
                        prefixes: std::iter::once(PrefixRef {
                            prefix_hash: &key[..],
                            token_count: 16,
                            block_hashes: none,
                            block_token_counts: &[],
                            tier: 1,
                            adapter_id: "",
                        }),
                        stats: None,
                        adapter_id: "",
                    });
                    let r = ix.lookup_route(&LookupRequest::<Vec<u8>> {
                        prefix_hash: &key,
                        ..LookupRequest::new(&tenant, "m", "vllm")
                    });
                    assert_eq!(ids(&r.scores), [replica.as_str()], "writer {w}, op {i}");
                    ix.apply_event(CacheEventInput {
                        event_type: event_type::PREFIX_EVICTED,
                        replica_id: &replica,
                        model_id: "m",
                        tenant_id: &tenant,
                        prefix_hash: &key,
                        timestamp_us: 0,
                        adapter_id: "",
                    });
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    stop.store(true, Ordering::Relaxed);
    let reclaimed = sweeper.join().expect("sweeper");
    assert!(
        reclaimed > 0,
        "the sweeper reclaimed records while the writers ran"
    );
    assert_eq!(ix.storage_entries(), 0);
    assert_eq!(ix.total_keys(), 0);
    ix.sweep_now();
    assert_eq!(ix.record_counts(), RecordCounts::default());
    assert_eq!(ix.memory_bytes(), 0);
}
