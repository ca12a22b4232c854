//! The sidecar against the engines' own KV-event publishers: vLLM's
//! `vllm/distributed/kv_events.py` and SGLang's `sglang/srt/disaggregation/kv_events.py` +
//! `sglang/srt/mem_cache/events.py`, taken from their published wheels by
//! `tests/engines/prepare.sh` and driven by `tests/engines/engine_host.py`; the real server and
//! sidecar binaries on loopback.
//!
//! After every step of every scenario the index must equal what the engine holds — no false and
//! no stale entry — within 2 s, checked twice: LookupRoute (matched tokens and tier of each
//! prompt the engine holds or held) and the server's `/snapshot` (the replica's entry count).
//! The sidecar's own `/metrics`, read with prometheus_client's parser, must show the gaps,
//! replays and resyncs the scenario causes.
//!
//! The engine files are looked up in `$INFERENCECACHE_ENGINE_SOURCES`, else
//! `~/.cache/inferencecache-ci/engine-sources`. Without them (or without the Python packages)
//! the tests print a notice and pass, unless `CI` is set: then they fail.

mod common;

use common::engines::*;
use common::server_process::{Server, server_binary, start_server};
use inferencecache_proto::v1alpha1 as pb;
use serde_json::json;
use std::path::Path;
use std::time::Duration;

fn chain_a(page: usize) -> (Seg, Seg) {
    let a01 = root("a01", span(1000, 32), page);
    let a23 = child(&a01, "a23", span(1032, 32));
    (a01, a23)
}

async fn happy_path(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "happy", json!({})).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01), store(&a23), store(&b)]).await;
    rig.expect("store", &[want(&a23, 64), want(&b, 32)], 6)
        .await;
    rig.apply(&[remove(&a23)]).await;
    rig.expect("remove", &[want(&a23, 32), want(&b, 32)], 4)
        .await;
    rig.apply(&[Op::Clear]).await;
    rig.expect("clear", &[want(&a23, 0), want(&b, 0)], 0).await;
    let m = rig.metrics().await;
    let resyncs = "inferencecache_sidecar_resyncs_total";
    assert_eq!(m.get(resyncs, &[("reason", "startup")]), 1.0);
    assert_eq!(m.get(resyncs, &[]), 1.0);
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_total", &[]),
        0.0
    );
    let received = "inferencecache_sidecar_batches_received_total";
    assert_eq!(m.get(received, &[("source", "live")]), 3.0);
    let events = "inferencecache_sidecar_events_received_total";
    assert_eq!(m.get(events, &[("type", "AllBlocksCleared")]), 1.0);
    assert!(m.get(events, &[("type", "BlockStored")]) >= 1.0);
    assert_eq!(m.get(events, &[("type", "BlockRemoved")]), 1.0);
    assert!(m.get("inferencecache_sidecar_updates_sent_total", &[]) >= 1.0);
    assert_eq!(
        m.get(
            "inferencecache_sidecar_events_sent_total",
            &[("type", "PREFIX_EVICTED")]
        ),
        2.0
    );
    assert_eq!(m.get("inferencecache_sidecar_send_errors_total", &[]), 0.0);
    assert_eq!(
        m.get("inferencecache_sidecar_decode_failures_total", &[]),
        0.0
    );
    assert!(m.get("inferencecache_sidecar_seconds_since_last_event", &[]) >= 0.0);
    rig.finish().await;
}

async fn sidecar_starts_after_the_engine_published(
    engine: Engine,
    server: &Server,
    sources: &Path,
) {
    let mut rig = Rig::new(engine, server, sources, "late", json!({})).await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01), store(&a23)]).await;
    rig.apply(&[store(&b)]).await;
    rig.apply(&[remove(&a23)]).await;
    rig.start_sidecar().await;
    rig.expect("after replay", &[want(&a23, 32), want(&b, 32)], 4)
        .await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        3.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_resyncs_total",
            &[("reason", "startup")]
        ),
        1.0
    );
    rig.finish().await;
}

async fn sidecar_restarted_while_a_removal_is_published(
    engine: Engine,
    server: &Server,
    sources: &Path,
) {
    let mut rig = Rig::new(engine, server, sources, "restarted", json!({})).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    rig.apply(&[store(&a01), store(&a23)]).await;
    rig.expect("store", &[want(&a23, 64)], 4).await;
    rig.stop_sidecar().await;
    rig.apply(&[remove(&a23)]).await;
    rig.start_sidecar().await;
    rig.expect("removal while down", &[want(&a23, 32)], 2).await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        2.0
    );
    rig.finish().await;
}

async fn one_message_lost(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "lost", json!({})).await;
    rig.proxy(&[1]).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01)]).await; // seq 0
    rig.expect("first", &[want(&a23, 32)], 2).await;
    rig.apply(&[store(&b)]).await; // seq 1: dropped by the proxy
    rig.apply(&[store(&a23)]).await; // seq 2: reveals the gap
    rig.expect("gap filled", &[want(&a23, 64), want(&b, 32)], 6)
        .await;
    let dropped = rig.host.call(json!({"op": "dropped"})).await;
    assert_eq!(dropped["dropped"], json!([1]));
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_filled_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_resyncs_total", &[]),
        1.0,
        "startup only"
    );
    rig.finish().await;
}

async fn engine_restart(engine: Engine, server: &Server, sources: &Path, via_proxy: bool) {
    let scenario = if via_proxy {
        "restart-proxied"
    } else {
        "restart"
    };
    let mut rig = Rig::new(engine, server, sources, scenario, json!({})).await;
    if via_proxy {
        // The proxy stays connected: the sidecar sees only the sequence going back to 0.
        rig.proxy(&[]).await;
    }
    rig.start_sidecar().await;
    let (a01, _) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    rig.apply(&[store(&a01)]).await;
    rig.apply(&[store(&b)]).await;
    rig.expect("before", &[want(&a01, 32), want(&b, 32)], 4)
        .await;
    // A new engine process: empty cache, sequence from 0, same block hashes for the same
    // content.
    rig.restart_engine().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = root("c", span(3000, 32), 16);
    let d = root("d", span(4000, 16), 16);
    rig.apply(&[store(&c)]).await;
    rig.apply(&[store(&d)]).await;
    rig.expect(
        "after restart",
        &[want(&a01, 0), want(&b, 0), want(&c, 32), want(&d, 16)],
        3,
    )
    .await;
    let m = rig.metrics().await;
    let resyncs = "inferencecache_sidecar_resyncs_total";
    if via_proxy {
        assert_eq!(m.get(resyncs, &[("reason", "engine_restart")]), 1.0);
    } else {
        assert!(
            m.get(resyncs, &[("reason", "reconnect")])
                + m.get(resyncs, &[("reason", "engine_restart")])
                >= 1.0
        );
    }
    rig.finish().await;
}

async fn replay_buffer_exceeded(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(
        engine,
        server,
        sources,
        "exceeded",
        json!({"buffer_steps": 3}),
    )
    .await;
    rig.proxy(&[1, 2, 3, 4]).await;
    rig.start_sidecar().await;
    let (a01, a23) = chain_a(16);
    let b = root("b", span(2000, 32), 16);
    let c = root("c", span(3000, 32), 16);
    let d = root("d", span(4000, 16), 16);
    rig.apply(&[store(&a01), store(&a23)]).await; // 0: delivered
    rig.expect("first", &[want(&a23, 64)], 4).await;
    // Chain e starts before the buffer window and continues inside it.
    let e01 = root("e01", span(10_000, 32), 16);
    let e23 = child(&e01, "e23", span(10_032, 32));
    rig.apply(&[store(&b), store(&e01)]).await; // 1: dropped, aged out of the buffer
    rig.apply(&[remove(&a23), remove(&a01)]).await; // 2: dropped, aged out
    rig.apply(&[remove(&b)]).await; // 3: dropped, still buffered
    rig.apply(&[store(&c), store(&e23)]).await; // 4: dropped, still buffered
    rig.apply(&[store(&d)]).await; // 5: delivered, reveals the gap
    // The engine holds c, d and e01+e23. After the resync the sidecar knows c and d; e23's
    // parent is older than the buffer, so chain e is a miss — and e23's tokens alone must not
    // match as if they started a prompt.
    let e23_alone = Want {
        tokens: e23.own.clone(),
        adapter: "",
        matched: 0,
        tier: None,
    };
    rig.expect(
        "after resync",
        &[
            want(&a23, 0),
            want(&b, 0),
            want(&c, 32),
            want(&d, 16),
            want(&e23, 0),
            e23_alone,
        ],
        3,
    )
    .await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_sequence_gaps_filled_total", &[]),
        0.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_resyncs_total",
            &[("reason", "gap_unfillable")]
        ),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_replayed_batches_total", &[]),
        3.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_duplicate_batches_total", &[]),
        1.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_skipped_blocks_total",
            &[("reason", "unknown_parent")]
        ),
        2.0
    );
    rig.finish().await;
}

async fn media_copies(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "media", json!({})).await;
    rig.start_sidecar().await;
    let (a01, _) = chain_a(16);
    let x = root("x", span(5000, 16), 16);
    let tiered = |seg: &Seg, tier| Want {
        tier: Some(tier),
        ..want(seg, seg.full.len())
    };
    rig.apply(&[store(&a01)]).await;
    rig.apply(&[Op::Store(a01.clone(), Medium::Cpu, json!({}))])
        .await;
    rig.apply(&[Op::Store(x.clone(), Medium::Disk, json!({}))])
        .await;
    rig.expect(
        "GPU and CPU copies",
        &[
            tiered(&a01, pb::CacheTier::T1),
            tiered(&x, pb::CacheTier::T3),
        ],
        3,
    )
    .await;
    rig.apply(&[remove(&a01)]).await;
    rig.expect("GPU copy removed", &[tiered(&a01, pb::CacheTier::T2)], 3)
        .await;
    rig.apply(&[Op::Remove(a01.clone(), Medium::Cpu)]).await;
    rig.expect("CPU copy removed", &[want(&a01, 0)], 1).await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_unknown_medium_total", &[]),
        0.0
    );
    rig.finish().await;
}

async fn pages_other_than_the_block_size(engine: Engine, server: &Server, sources: &Path) {
    // SGLang's default page_size = 1; vLLM with 32-token blocks.
    let (page, first_len) = match engine {
        Engine::Sglang => (1, 40),
        Engine::Vllm => (32, 32),
    };
    let mut rig = Rig::new(engine, server, sources, "pages", json!({"page_size": page})).await;
    rig.start_sidecar().await;
    let p = root("p", span(6000, first_len), page);
    let q = child(&p, "q", span(6000 + first_len, 64 - first_len));
    rig.apply(&[store(&p)]).await;
    rig.apply(&[store(&q)]).await;
    rig.expect(
        "stored",
        &[want(&q, 64), want(&p, first_len as usize / BS * BS)],
        4,
    )
    .await;
    rig.apply(&[remove(&q)]).await;
    rig.expect("second run removed", &[want(&q, 32)], 2).await;
    rig.finish().await;
}

async fn extra_keys(engine: Engine, server: &Server, sources: &Path) {
    let mut rig = Rig::new(engine, server, sources, "extra", json!({})).await;
    rig.start_sidecar().await;
    let plain = root("plain", span(7000, 32), 16);
    let keyed = root("keyed", span(8000, 64), 16);
    match engine {
        Engine::Vllm => {
            let lora = root("lora", span(9000, 32), 16);
            rig.apply(&[
                store(&plain),
                // An image in block 1: its hash (and every later block's) depends on it.
                Op::Store(
                    keyed.clone(),
                    Medium::Gpu,
                    json!({"extra_keys": [null, [["img-sha", 0]], null, null]}),
                ),
                // LoRA name only: a token-only block of adapter "sql-lora" (id 7 unmapped).
                Op::Store(
                    lora.clone(),
                    Medium::Gpu,
                    json!({"lora_id": 7, "lora_name": "sql-lora",
                           "extra_keys": [["sql-lora"], ["sql-lora"]]}),
                ),
            ])
            .await;
            let base_lora = want(&lora, 0);
            let adapter_lora = Want {
                adapter: "sql-lora",
                ..want(&lora, 32)
            };
            rig.expect(
                "extra keys",
                &[want(&plain, 32), want(&keyed, 16), base_lora, adapter_lora],
                5,
            )
            .await;
        }
        Engine::Sglang => {
            rig.apply(&[
                store(&plain),
                Op::Store(keyed.clone(), Medium::Gpu, json!({"cache_salt": "salt-1"})),
            ])
            .await;
            rig.expect("cache salt", &[want(&plain, 32), want(&keyed, 0)], 2)
                .await;
        }
    }
    let m = rig.metrics().await;
    assert_eq!(
        m.get(
            "inferencecache_sidecar_skipped_blocks_total",
            &[("reason", "extra_keys")]
        ),
        match engine {
            Engine::Vllm => 3.0,
            Engine::Sglang => 4.0,
        }
    );
    rig.finish().await;
}

async fn all_scenarios(engine: Engine) {
    let Some(sources) = engine_sources() else {
        return;
    };
    let Some(bin) = server_binary() else { return };
    let dir = common::temp_dir(&format!("engines-server-{}", engine.name()));
    let server = start_server(&bin, BS, &[], &dir.join("server.log"))
        .await
        .expect("server starts");
    // Report every match, however short: the default policy prunes matches under 64 tokens
    // (H10) and the scenarios check 16-token granularity.
    let mut host = Host::spawn(&sources).await;
    let policy = json!({"version": 7, "policies": [{
        "namespace": TENANT, "minimumMatchedTokens": 0, "routingFloorScore": 0,
        "affinityRouting": false,
    }]});
    host.call(json!({
        "op": "post",
        "url": format!("http://127.0.0.1:{}/policy", server.snapshot),
        "body": policy.to_string(),
    }))
    .await;
    host.call(json!({"op": "stop"})).await;
    happy_path(engine, &server, &sources).await;
    sidecar_starts_after_the_engine_published(engine, &server, &sources).await;
    sidecar_restarted_while_a_removal_is_published(engine, &server, &sources).await;
    one_message_lost(engine, &server, &sources).await;
    engine_restart(engine, &server, &sources, false).await;
    engine_restart(engine, &server, &sources, true).await;
    replay_buffer_exceeded(engine, &server, &sources).await;
    media_copies(engine, &server, &sources).await;
    pages_other_than_the_block_size(engine, &server, &sources).await;
    extra_keys(engine, &server, &sources).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_publisher_keeps_the_index_exact() {
    all_scenarios(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_publisher_keeps_the_index_exact() {
    all_scenarios(Engine::Sglang).await;
}
