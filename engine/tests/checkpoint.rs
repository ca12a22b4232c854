//! Checkpoint round trips and refusals (warm restart): a restored index holds exactly the
//! dumped entries (clocks, tiers, token counts, LFU counts), stats and blobs, answers lookups
//! identically, skips what expired meanwhile, and a damaged file changes nothing.

mod common;

use common::*;
use inferencecache_engine::checkpoint::{files, format::FormatError, read, write};
use inferencecache_engine::*;
use std::io::Cursor;
use std::sync::Arc;

type Row = (String, String, String, String, Vec<u8>, String, DumpedEntry);

/// Every entry of the index, sorted: the exact observable state of the entries.
fn rows(ix: &Index) -> Vec<Row> {
    let mut out = Vec::new();
    for p in ix.dump_partitions() {
        for s in 0..DumpPartition::SHARDS {
            p.for_each_entry(s, |key, _, replica, e| {
                out.push((
                    p.tenant().to_owned(),
                    p.model().to_owned(),
                    p.scheme().to_owned(),
                    p.adapter().to_owned(),
                    key.to_vec(),
                    replica.to_string(),
                    e,
                ));
            });
        }
    }
    out.sort_by(|a, b| {
        (&a.0, &a.1, &a.2, &a.3, &a.4, &a.5).cmp(&(&b.0, &b.1, &b.2, &b.3, &b.4, &b.5))
    });
    out
}

fn h(i: u64) -> Vec<u8> {
    (0xC0FF_EE00_0000_0000u64 + i).to_be_bytes().to_vec()
}

/// Chains, legacy keys of several lengths, tiers, adapters, tenants, stats and LFU credits.
fn populated() -> Env {
    let e = env();
    e.set_lfu("lfu");
    let chain: Vec<Vec<u8>> = (0..40).map(h).collect();
    let refs: Vec<&[u8]> = chain.iter().map(|c| c.as_slice()).collect();
    let counts = [16; 40];
    for (i, r) in ["r0", "r1", "r2"].iter().enumerate() {
        e.clock.advance_us(1_000_000);
        e.chain_with(
            &Put {
                replica: r,
                tier: (i % 3) as i32 + 1,
                ..Put::default()
            },
            &refs[..10 + 10 * i],
            &counts[..10 + 10 * i],
            b"",
            0,
        );
    }
    e.put_with(
        &Put {
            replica: "r1",
            adapter: "sql-lora",
            ..Put::default()
        },
        b"legacy-key-long-form",
        77,
    );
    e.put_with(
        &Put {
            replica: "r9",
            tenant: "other",
            model: "m2",
            ..Put::default()
        },
        b"k",
        3,
    );
    for i in 0..20 {
        e.put_with(
            &Put {
                replica: "lr",
                tenant: "lfu",
                ..Put::default()
            },
            &h(1000 + i),
            16,
        );
    }
    // Credit some LFU entries a varying number of times.
    for i in 0..20u64 {
        for _ in 0..(i % 11) {
            let r = e.ix.lookup_route(&LookupRequest {
                prefix_hash: &h(1000 + i),
                ..LookupRequest::<Vec<u8>>::new("lfu", "m", "vllm")
            });
            e.ix.credit_hits(&r.hits);
        }
    }
    e.stats_with("t", "m", "r0", 0.5, 0.25, 0);
    e.stats_with("lfu", "m", "lr", 0.75, 0.0, 0);
    e
}

fn checkpoint_bytes(ix: &Index, blobs: Vec<(&str, &[u8])>) -> (Vec<u8>, write::WriteReport) {
    let mut buf = Vec::new();
    let rep = write::write_checkpoint(
        ix,
        &mut buf,
        &write::WriteOptions {
            created_ms: 1,
            stream_seq: 99,
            blobs,
        },
    )
    .expect("writing to memory");
    (buf, rep)
}

#[test]
fn a_restored_index_holds_exactly_what_was_dumped() {
    let e = populated();
    let before = rows(&e.ix);
    assert!(
        before.iter().any(|r| r.6.lfu_count > 0),
        "LFU counts are part of the test"
    );
    let (bytes, written) = checkpoint_bytes(&e.ix, vec![("policy", b"{\"a\":1}")]);
    assert_eq!(written.entries as usize, before.len());
    assert_eq!(written.bytes as usize, bytes.len());

    let e2 = env();
    e2.set_lfu("lfu");
    e2.clock.set_us(e.now());
    let report = read::restore(&e2.ix, Cursor::new(&bytes)).expect("a valid checkpoint");
    assert_eq!(report.outcome.loaded as usize, before.len());
    assert_eq!(report.header.unwrap().stream_seq, 99);
    assert_eq!(
        report.blobs,
        vec![("policy".to_owned(), b"{\"a\":1}".to_vec())]
    );
    assert_eq!(
        rows(&e2.ix),
        before,
        "entries, clocks, tiers, tokens and LFU counts"
    );

    for (t, m) in [("t", "m"), ("lfu", "m"), ("other", "m2")] {
        assert_eq!(
            e2.ix.cache_state(t, m),
            e.ix.cache_state(t, m),
            "G1 of {t}/{m}"
        );
    }
    assert_eq!(e2.ix.snapshot(), e.ix.snapshot(), "G2 snapshot");
    assert_eq!(e2.ix.storage_entries(), e.ix.storage_entries());
    assert_eq!(e2.ix.total_keys(), e.ix.total_keys());
    // Lookups answer identically (ranked replicas, scores, matched tokens, tiers).
    let chain: Vec<Vec<u8>> = (0..45).map(h).collect();
    for n in [1, 5, 10, 15, 20, 30, 40, 45] {
        let counts = vec![16; n];
        let req = LookupRequest {
            block_hashes: &chain[..n],
            block_token_counts: &counts,
            ..LookupRequest::new("t", "m", "vllm")
        };
        let (a, b) = (e.ix.lookup_route(&req), e2.ix.lookup_route(&req));
        assert_eq!(a.strategy, b.strategy, "chain of {n}");
        assert_eq!(a.scores, b.scores, "chain of {n}");
        assert!(!a.scores.is_empty() || n == 0);
    }
}

#[test]
fn entries_that_expired_during_the_downtime_are_not_restored() {
    let e = env();
    e.put("old", b"a", 1);
    e.clock.advance_us(30 * MIN_US);
    e.put("new", b"b", 1);
    let (bytes, _) = checkpoint_bytes(&e.ix, vec![]);
    let e2 = env();
    // 40 minutes of downtime: "old" is 70 min old (TTL 1 h), "new" 40 min.
    e2.clock.set_us(e.now() + 40 * MIN_US);
    let report = read::restore(&e2.ix, Cursor::new(&bytes)).unwrap();
    assert_eq!((report.outcome.loaded, report.outcome.expired), (1, 1));
    assert!(e2.ix.entry("t", "m", "vllm", "", b"a", "old").is_none());
    let kept = e2
        .ix
        .entry("t", "m", "vllm", "", b"b", "new")
        .expect("restored");
    assert_eq!(
        kept.last_seen_us,
        e.now(),
        "the clock kept running from the original last_seen"
    );
}

#[test]
fn a_restore_stops_at_the_global_cap() {
    let e = env();
    for i in 0..50 {
        e.put("r", &h(i), 16);
    }
    let (bytes, _) = checkpoint_bytes(&e.ix, vec![]);
    let e2 = env_with(IndexConfig {
        max_entries: 20,
        ..cfg_1h()
    });
    e2.clock.set_us(e.now());
    let report = read::restore(&e2.ix, Cursor::new(&bytes)).unwrap();
    assert_eq!((report.outcome.loaded, report.outcome.dropped), (20, 30));
    assert_eq!(e2.ix.storage_entries(), 20);
}

#[test]
fn every_truncation_and_flipped_byte_is_refused_and_changes_nothing() {
    let e = populated();
    let (bytes, _) = checkpoint_bytes(&e.ix, vec![("policy", b"x")]);
    let fresh = env();
    // Every cut (a stride keeps the test fast; boundaries of the first sections are all hit).
    for cut in (0..bytes.len())
        .step_by(7)
        .chain([bytes.len() - 1, 39, 40, 41])
    {
        let err = read::restore(&fresh.ix, Cursor::new(&bytes[..cut])).unwrap_err();
        assert!(
            matches!(err, FormatError::Truncated { .. } | FormatError::Empty),
            "cut at {cut}: {err}"
        );
    }
    for i in (0..bytes.len()).step_by(5) {
        let mut bad = bytes.clone();
        bad[i] ^= 0x01;
        assert!(
            read::restore(&fresh.ix, Cursor::new(&bad)).is_err(),
            "flip at {i}"
        );
    }
    assert_eq!(
        fresh.ix.storage_entries(),
        0,
        "a refused checkpoint loads nothing"
    );
    assert!(fresh.ix.dump_partitions().is_empty());
}

#[test]
fn a_directory_keeps_the_previous_checkpoint_and_falls_back_to_it() {
    let dir = std::env::temp_dir().join(format!("ic-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let e = env();
    e.put("r", b"first", 1);
    files::write_to_dir(&e.ix, &dir, &write::WriteOptions::default()).unwrap();
    e.put("r", b"second", 1);
    files::write_to_dir(&e.ix, &dir, &write::WriteOptions::default()).unwrap();
    assert!(dir.join(files::CURRENT).exists() && dir.join(files::PREVIOUS).exists());
    assert!(!dir.join(files::TEMPORARY).exists());

    let restored = env();
    let r = files::restore_newest(&restored.ix, &dir);
    assert!(r.refused.is_empty());
    assert_eq!(restored.ix.storage_entries(), 2, "current holds both keys");

    // Corrupt current: the previous one (one key) is restored and current's reason reported.
    let cur = dir.join(files::CURRENT);
    let mut b = std::fs::read(&cur).unwrap();
    let n = b.len();
    b.truncate(n - 3);
    std::fs::write(&cur, &b).unwrap();
    let fallback = env();
    let r = files::restore_newest(&fallback.ix, &dir);
    assert_eq!(r.refused.len(), 1);
    assert!(matches!(r.refused[0].reason, FormatError::Truncated { .. }));
    assert_eq!(fallback.ix.storage_entries(), 1);
    assert!(
        fallback
            .ix
            .entry("t", "m", "vllm", "", b"first", "r")
            .is_some()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reserved_tenants_are_never_checkpointed() {
    let e = env_with(IndexConfig {
        reserved_tenants: vec![PROBE_TENANT.into()],
        ..cfg_1h()
    });
    e.put_with(
        &Put {
            tenant: PROBE_TENANT,
            replica: "probe",
            ..Put::default()
        },
        b"p",
        1,
    );
    e.put("r", b"k", 1);
    let (bytes, w) = checkpoint_bytes(&e.ix, vec![]);
    assert_eq!(w.entries, 1);
    let e2 = env_with(IndexConfig {
        reserved_tenants: vec![PROBE_TENANT.into()],
        ..cfg_1h()
    });
    e2.clock.set_us(e.now());
    read::restore(&e2.ix, Cursor::new(&bytes)).unwrap();
    assert_eq!(e2.ix.reserved_storage_entries(), 0);
    assert_eq!(e2.ix.storage_entries(), 1);
}

#[test]
fn a_checkpoint_taken_during_ingest_and_removals_holds_only_held_entries() {
    // Keys 0..2000 are stable; a writer thread stores and evicts keys 10_000.. meanwhile. The
    // checkpoint must hold every stable entry exactly, and nothing the writer never stored.
    let e = env();
    for i in 0..2000 {
        e.put("stable", &h(i), 16);
    }
    let ix = e.ix.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (ix, stop) = (ix.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = h(10_000 + n % 5_000);
                let refs = [PrefixRef {
                    prefix_hash: key.as_slice(),
                    token_count: 16,
                    block_hashes: &[] as &[Vec<u8>],
                    block_token_counts: &[],
                    tier: 1,
                    adapter_id: "",
                }];
                ix.ingest(CacheStateUpdate {
                    replica_id: "churn",
                    model_id: "m",
                    tenant_id: "t",
                    hash_scheme: "vllm",
                    timestamp_us: 0,
                    prefixes: refs.iter().copied(),
                    stats: None,
                    adapter_id: "",
                });
                if n.is_multiple_of(3) {
                    ix.evict_prefixes("t", "m", "churn", "", &[key.as_slice()], 0);
                }
                n += 1;
            }
        })
    };
    let mut checkpoints = Vec::new();
    for _ in 0..8 {
        checkpoints.push(checkpoint_bytes(&ix, vec![]).0);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    for bytes in checkpoints {
        let e2 = env();
        e2.clock.set_us(e.now());
        read::restore(&e2.ix, Cursor::new(&bytes)).unwrap();
        let rows = rows(&e2.ix);
        let stable: Vec<_> = rows.iter().filter(|r| r.5 == "stable").collect();
        assert_eq!(
            stable.len(),
            2000,
            "every entry untouched during the dump is in it"
        );
        for r in &rows {
            let k = u64::from_be_bytes(r.4.clone().try_into().unwrap()) - 0xC0FF_EE00_0000_0000;
            match r.5.as_str() {
                "stable" => assert!(k < 2000),
                "churn" => assert!((10_000..15_000).contains(&k), "never stored: {k}"),
                other => panic!("unknown replica {other}"),
            }
        }
        assert_eq!(
            e2.ix.storage_entries() as usize,
            rows.len(),
            "counters agree"
        );
    }
}
