//! Reporter batching, ordering, L2 mode and LoRA (spec `sidecar.md` §6–§7) against an
//! in-process recording gRPC server: SC04–SC08.

mod common;

use common::{Call, Mode, sink_to, start_fake_server, temp_dir};
use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
use inferencecache_proto::v1alpha1::{CacheTier, cache_event};
use inferencecache_sidecar::client::TokenSource;
use inferencecache_sidecar::lora::AdapterMap;
use inferencecache_sidecar::reporter::{Identity, Reporter, ReporterConfig};
use inferencecache_sidecar::wire::{BlockStored, Event, EventBatch};
use std::time::Duration;

fn ident() -> Identity {
    Identity {
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
    }
}

fn eh(i: u64) -> Vec<u8> {
    (0xE000 + i).to_be_bytes().to_vec()
}

const BS: usize = 4;

fn tokens() -> Vec<u32> {
    (100..100 + 8 * BS as u32).collect()
}

/// BlockStored for global blocks `first..first+count` of [`tokens`].
fn store(first: usize, count: usize, lora: Option<i64>) -> Event {
    let t = tokens();
    Event::BlockStored(BlockStored {
        block_hashes: (first..first + count).map(|i| eh(i as u64)).collect(),
        parent_block_hash: (first > 0).then(|| eh(first as u64 - 1)),
        token_ids: t[first * BS..(first + count) * BS].to_vec(),
        block_size: BS as i64,
        lora_id: lora,
        ..BlockStored::default()
    })
}

/// BlockStored for global block `i` of [`tokens`] as a chain root (no parent).
fn root_store(i: usize, lora: Option<i64>) -> Event {
    let Event::BlockStored(mut ev) = store(i, 1, lora) else {
        unreachable!()
    };
    ev.parent_block_hash = None;
    Event::BlockStored(ev)
}

fn remove(blocks: &[u64]) -> Event {
    Event::BlockRemoved {
        block_hashes: blocks.iter().map(|b| eh(*b)).collect(),
        medium: None,
        group_idx: None,
        locality: None,
        ownership: None,
    }
}

/// Reporter defaults with this file's block size.
fn config() -> ReporterConfig {
    let mut cfg = ReporterConfig::new(ident());
    cfg.block_size = BS;
    cfg
}

fn batch(ts: f64, events: Vec<Event>) -> EventBatch {
    EventBatch {
        ts,
        events,
        data_parallel_rank: None,
    }
}

fn wire(i: usize) -> Vec<u8> {
    to_wire(prefix_hashes(&tokens(), BS)[i]).to_vec()
}

fn kinds(calls: &[Call]) -> Vec<String> {
    calls
        .iter()
        .map(|c| match c {
            Call::Report(u) => format!("report[{}]", u.prefixes.len()),
            Call::Publish(e) => match cache_event::Type::try_from(e.r#type).unwrap() {
                cache_event::Type::PrefixEvicted => "evicted".into(),
                cache_event::Type::AllCleared => "cleared".into(),
                other => format!("{other:?}"),
            },
        })
        .collect()
}

#[tokio::test]
async fn sc04_store_is_sent_before_its_eviction() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut r = Reporter::new(config(), sink_to(addr, None));
    // Store and remove within one window: no tick in between.
    r.handle_batch(&batch(2.0, vec![store(0, 2, None)])).await;
    assert_eq!(r.pending_len(), 2);
    r.handle_batch(&batch(3.0, vec![remove(&[1])])).await;
    let calls = rec.calls();
    assert_eq!(kinds(&calls), vec!["report[2]", "evicted"]);
    let u = &rec.updates()[0];
    assert_eq!(u.replica_id, "r0");
    assert_eq!(u.model_id, "m");
    assert_eq!(u.tenant_id, "t");
    assert_eq!(u.hash_scheme, "vllm");
    assert_eq!(u.timestamp_us, 2_000_000);
    assert_eq!(u.adapter_id, "");
    assert!(u.stats.is_none());
    assert_eq!(u.prefixes[0].prefix_hash, wire(0));
    assert_eq!(u.prefixes[1].prefix_hash, wire(1));
    assert_eq!(u.prefixes[1].token_count, 2 * BS as i32);
    assert_eq!(u.prefixes[0].tier, CacheTier::T1 as i32);
    assert!(u.prefixes[0].block_hashes.is_empty());
    let ev = &rec.events()[0];
    assert_eq!(ev.prefix_hash, wire(1));
    assert_eq!(ev.timestamp_us, 3_000_000);
    assert_eq!(ev.replica_id, "r0");
    assert_eq!(ev.adapter_id, "");
    assert_eq!(r.pending_len(), 0);
}

#[tokio::test]
async fn sc04_store_remove_clear_gives_two_evictions_and_one_all_cleared() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut r = Reporter::new(config(), sink_to(addr, None));
    r.handle_batch(&batch(
        0.0,
        vec![
            store(0, 3, None),
            remove(&[1, 2, 77]),
            Event::AllBlocksCleared,
        ],
    ))
    .await;
    r.flush().await;
    assert_eq!(
        kinds(&rec.calls()),
        vec!["report[3]", "evicted", "evicted", "cleared"]
    );
    let cleared = rec.events().pop().unwrap();
    assert_eq!(cleared.replica_id, "r0");
    assert_eq!(cleared.tenant_id, "t");
    assert!(r.reverse_map().is_empty());
    // ts 0 → server now.
    assert_eq!(rec.updates()[0].timestamp_us, 0);
}

#[tokio::test]
async fn sc05_l2_mode_rereports_as_t2_with_the_removal_timestamp() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = config();
    cfg.l2_mode = true;
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    r.handle_batch(&batch(10.0, vec![store(0, 1, None)])).await;
    r.handle_batch(&batch(20.0, vec![remove(&[0])])).await;
    assert!(
        r.reverse_map().is_empty(),
        "reverse map empty after store + remove"
    );
    // A later store (other block) must not refresh the T2 update's timestamp.
    r.handle_batch(&batch(30.0, vec![store(0, 1, None)])).await;
    r.flush().await;
    let ups = rec.updates();
    let tiers: Vec<i32> = ups
        .iter()
        .flat_map(|u| u.prefixes.iter().map(|p| p.tier))
        .collect();
    assert_eq!(
        tiers,
        vec![
            CacheTier::T1 as i32,
            CacheTier::T2 as i32,
            CacheTier::T1 as i32
        ]
    );
    assert_eq!(ups[1].timestamp_us, 20_000_000);
    assert_eq!(ups[1].prefixes[0].prefix_hash, wire(0));
    assert_eq!(ups[1].prefixes[0].token_count, BS as i32);
    assert_eq!(ups[2].timestamp_us, 30_000_000);
    assert!(rec.events().is_empty(), "no PREFIX_EVICTED in L2 mode");
    // Removing unknown blocks sends nothing.
    r.handle_batch(&batch(40.0, vec![remove(&[5])])).await;
    assert_eq!(rec.calls().len(), 3);
}

#[tokio::test]
async fn sc05_l2_store_then_remove_in_one_window_orders_t1_before_t2() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = config();
    cfg.l2_mode = true;
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    r.handle_batch(&batch(5.0, vec![store(0, 2, None), remove(&[0, 1])]))
        .await;
    let ups = rec.updates();
    assert_eq!(ups.len(), 2);
    assert!(
        ups[0]
            .prefixes
            .iter()
            .all(|p| p.tier == CacheTier::T1 as i32)
    );
    assert!(
        ups[1]
            .prefixes
            .iter()
            .all(|p| p.tier == CacheTier::T2 as i32)
    );
}

#[tokio::test]
async fn sc06_store_then_clear_reports_nothing_and_publishes_all_cleared() {
    for l2 in [false, true] {
        let (rec, addr) = start_fake_server(Mode::Ok).await;
        let mut cfg = config();
        cfg.l2_mode = l2;
        let mut r = Reporter::new(cfg, sink_to(addr, None));
        r.handle_batch(&batch(
            7.0,
            vec![store(0, 2, None), Event::AllBlocksCleared],
        ))
        .await;
        r.flush().await;
        assert_eq!(kinds(&rec.calls()), vec!["cleared"], "l2={l2}");
        assert_eq!(rec.events()[0].timestamp_us, 7_000_000);
        assert!(r.reverse_map().is_empty());
    }
}

#[tokio::test]
async fn sc07_lora_mapping_partitions_and_fails_closed() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = config();
    cfg.adapters = AdapterMap::parse("1=sql-lora").unwrap();
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    r.handle_batch(&batch(
        1.0,
        vec![
            store(0, 1, Some(1)),
            store(1, 1, Some(2)), // unmapped → dropped
            store(2, 1, Some(2)), // same id again (WARN once)
            store(3, 1, None),    // its parent was dropped: an orphan, skipped
            root_store(4, None),
        ],
    ))
    .await;
    r.flush().await;
    let ups = rec.updates();
    assert_eq!(ups.len(), 1);
    assert_eq!(ups[0].adapter_id, "", "update-level adapter is empty");
    let adapters: Vec<&str> = ups[0]
        .prefixes
        .iter()
        .map(|p| p.adapter_id.as_str())
        .collect();
    assert_eq!(adapters, vec!["sql-lora", ""]);
    assert_eq!(r.counters().dropped_unmapped_lora, 2);
    assert_eq!(
        r.reverse_map().len(),
        2,
        "the orphan under a dropped block is not indexed"
    );
    // Removing the lora-1 block evicts only under sql-lora; the dropped blocks are unknown.
    r.handle_batch(&batch(2.0, vec![remove(&[0, 1, 2])])).await;
    let evs = rec.events();
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].adapter_id, "sql-lora");
    assert_eq!(evs[0].prefix_hash, wire(0));
}

#[tokio::test]
async fn sc08_failing_server_keeps_the_outbox_in_order_and_delivers_it_when_it_answers() {
    let (rec, addr) = start_fake_server(Mode::Fail).await;
    let mut cfg = config();
    cfg.window = Duration::from_millis(20);
    cfg.retry_min = Duration::from_millis(20);
    cfg.retry_max = Duration::from_millis(100);
    let telemetry = std::sync::Arc::clone(&cfg.telemetry);
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let task = tokio::spawn(Reporter::new(cfg, sink_to(addr, None)).run(rx));
    tx.send(batch(1.0, vec![store(0, 2, None)]).into())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    tx.send(batch(2.0, vec![remove(&[0]), Event::AllBlocksCleared]).into())
        .await
        .unwrap();
    tx.send(batch(3.0, vec![store(0, 1, None)]).into())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let failed_attempts = rec.calls().len();
    assert!(
        failed_attempts >= 2,
        "the server saw retries: {failed_attempts}"
    );
    assert!(
        telemetry
            .link
            .send_retries
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    // The clear superseded the store and its removals: the outbox holds the clear and the
    // store after it, in that order, and delivers exactly those once the server answers. This
    // fake server offers no digest, so the failed deliveries cannot be proven: a reconcile
    // (the clear and the full block set: the one block) follows.
    rec.set_mode(Mode::Ok);
    drop(tx);
    let r = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("reporter drains")
        .unwrap();
    let calls = rec.calls();
    assert_eq!(
        kinds(&calls[failed_attempts..]),
        ["cleared", "report[1]", "cleared", "report[1]"],
        "{:?}",
        kinds(&calls)
    );
    let c = r.counters();
    assert!(c.updates_failed >= 2, "{c:?}");
    assert_eq!((c.updates_sent, c.events_sent), (2, 2), "{c:?}");
    assert_eq!(c.reconciles, 1, "{c:?}");
    assert_eq!(
        telemetry
            .link
            .reconciles(inferencecache_sidecar::link::ReconcileReason::Unproven),
        1
    );
    assert_eq!(r.outbox_len(), 0);
}

#[tokio::test]
async fn window_tick_flushes_and_close_final_flushes() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = config();
    cfg.window = Duration::from_millis(50);
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let task = tokio::spawn(Reporter::new(cfg, sink_to(addr, None)).run(rx));
    tx.send(batch(1.0, vec![store(0, 1, None)]).into())
        .await
        .unwrap();
    tx.send(batch(1.5, vec![store(1, 1, None)]).into())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while rec.updates().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ups = rec.updates();
    assert_eq!(ups.len(), 1, "both stores batched into one window");
    assert_eq!(ups[0].prefixes.len(), 2);
    assert_eq!(ups[0].timestamp_us, 1_500_000, "latest batch ts wins");
    // Pending at close is flushed.
    tx.send(batch(0.0, vec![store(2, 1, None)]).into())
        .await
        .unwrap();
    drop(tx);
    task.await.unwrap();
    let ups = rec.updates();
    assert_eq!(ups.len(), 2);
    assert_eq!(ups[1].timestamp_us, 0);
}

#[tokio::test]
async fn pending_limit_forces_an_immediate_flush() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = config();
    cfg.flush_threshold = 3;
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    r.handle_batch(&batch(1.0, vec![store(0, 2, None)])).await;
    assert!(rec.calls().is_empty());
    r.handle_batch(&batch(1.0, vec![store(2, 2, None)])).await;
    assert_eq!(kinds(&rec.calls()), vec!["report[4]"]);
    assert_eq!(r.pending_len(), 0);
}

#[tokio::test]
async fn default_pending_limit_is_4096() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = config();
    cfg.block_size = 1;
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    let bs = 1usize;
    let n = 4096usize;
    let ev = Event::BlockStored(BlockStored {
        block_hashes: (0..n as u64).map(|i| i.to_be_bytes().to_vec()).collect(),
        parent_block_hash: None,
        token_ids: (0..n as u32).collect(),
        block_size: bs as i64,
        ..BlockStored::default()
    });
    r.handle_batch(&batch(1.0, vec![ev])).await;
    assert_eq!(rec.updates().len(), 1);
    assert_eq!(rec.updates()[0].prefixes.len(), 4096);
}

#[tokio::test]
async fn missing_token_ids_produce_no_entries() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut r = Reporter::new(config(), sink_to(addr, None));
    let Event::BlockStored(mut st) = store(0, 2, None) else {
        unreachable!()
    };
    st.token_ids.clear();
    r.handle_batch(&batch(1.0, vec![Event::BlockStored(st)]))
        .await;
    r.flush().await;
    assert!(rec.calls().is_empty());
    assert_eq!(r.counters().no_index_entries, 1);
}

#[tokio::test]
async fn producer_token_is_sent_and_reloaded() {
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let dir = temp_dir("token");
    let path = dir.join("producer.token");
    std::fs::write(&path, "# producer token\n\n  s3cret  \nsecond\n").unwrap();
    let token = TokenSource::new(&path).unwrap();
    let mut r = Reporter::new(config(), sink_to(addr, Some(token)));
    r.handle_batch(&batch(1.0, vec![store(0, 1, None), remove(&[0])]))
        .await;
    std::fs::write(&path, "rotated-token-value\n").unwrap();
    r.handle_batch(&batch(1.0, vec![store(0, 1, None)])).await;
    r.flush().await;
    let auth = rec.auth.lock().unwrap().clone();
    assert_eq!(
        auth,
        vec![
            Some("Bearer s3cret".to_string()),
            Some("Bearer s3cret".to_string()),
            Some("Bearer rotated-token-value".to_string())
        ]
    );
    assert!(TokenSource::new(dir.join("missing")).is_err());
    std::fs::write(dir.join("empty"), "# nothing\n").unwrap();
    assert!(TokenSource::new(dir.join("empty")).is_err());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_overflowing_outbox_is_a_gap_closed_by_a_reconcile() {
    let (rec, addr) = start_fake_server(Mode::Fail).await;
    let mut cfg = config();
    cfg.window = Duration::from_millis(20);
    cfg.retry_min = Duration::from_millis(20);
    cfg.retry_max = Duration::from_millis(50);
    // Two blocks fit; the third store's update overflows.
    cfg.outbox_max_entries = 2;
    let telemetry = std::sync::Arc::clone(&cfg.telemetry);
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let task = tokio::spawn(Reporter::new(cfg, sink_to(addr, None)).run(rx));
    for i in 0..4 {
        tx.send(batch(1.0 + i as f64, vec![store(i, 1, None)]).into())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&telemetry.link.outbox_overflows), 1);
    // Owed a reconcile, the reporter queues nothing more: the reverse map holds it all.
    assert_eq!(load(&telemetry.link.outbox_messages), 0);
    let failed_attempts = rec.calls().len();
    rec.set_mode(Mode::Ok);
    drop(tx);
    let r = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("reporter drains")
        .unwrap();
    // The reconcile: clear the replica, then its full block set (4 blocks) in one update.
    // (A failed attempt may land between the count and the mode switch: it is a clear too.)
    let calls = kinds(&rec.calls());
    let after = &calls[failed_attempts..];
    assert!(after.len() >= 2, "{calls:?}");
    assert_eq!(
        after[after.len() - 2..],
        ["cleared", "report[4]"],
        "{calls:?}"
    );
    assert!(
        after[..after.len() - 2].iter().all(|k| k == "cleared"),
        "{calls:?}"
    );
    let mut sent: Vec<Vec<u8>> = rec
        .updates()
        .last()
        .unwrap()
        .prefixes
        .iter()
        .map(|p| p.prefix_hash.clone())
        .collect();
    sent.sort();
    let mut want: Vec<Vec<u8>> = (0..4).map(wire).collect();
    want.sort();
    assert_eq!(sent, want);
    assert_eq!(
        telemetry
            .link
            .reconciles(inferencecache_sidecar::link::ReconcileReason::OutboxOverflow),
        1
    );
    assert_eq!(r.counters().reconciles, 1);
}

#[tokio::test]
async fn a_server_gone_fails_over_to_the_next_and_keeps_the_order() {
    let (down, down_addr) = start_fake_server(Mode::Fail).await;
    let (up, up_addr) = start_fake_server(Mode::Ok).await;
    let channel = |addr: std::net::SocketAddr| {
        inferencecache_sidecar::client::build_channel(&addr.to_string(), &Default::default())
            .unwrap()
    };
    let sink = inferencecache_sidecar::client::GrpcSink::with_servers(
        vec![
            ("down".into(), channel(down_addr)),
            ("up".into(), channel(up_addr)),
        ],
        None,
    );
    assert_eq!(sink.servers(), 2);
    let mut cfg = config();
    cfg.retry_min = Duration::from_millis(10);
    cfg.retry_max = Duration::from_millis(20);
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let task = tokio::spawn(Reporter::new(cfg, sink).run(rx));
    tx.send(batch(1.0, vec![store(0, 2, None)]).into())
        .await
        .unwrap();
    tx.send(batch(2.0, vec![remove(&[1])]).into())
        .await
        .unwrap();
    drop(tx);
    let r = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("reporter drains")
        .unwrap();
    assert_eq!(
        down.calls().len(),
        1,
        "one attempt on the server that is gone"
    );
    // The failed store first, then the removal, then (the fake offers no digest, so the
    // failed attempt cannot be proven) the reconcile: the one block left.
    assert_eq!(
        kinds(&up.calls()),
        ["report[2]", "evicted", "cleared", "report[1]"]
    );
    assert_eq!(r.outbox_len(), 0);
}
