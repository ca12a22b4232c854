//! Hybrid-attention models (issue 47): vLLM 0.33's per-group KV events through the sidecar.
//!
//! vLLM keeps one KV-cache group per layer kind and publishes one `BlockStored` per group
//! (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`) and one `BlockRemoved`
//! per (hash, group). The engine reuses a prefix of `N` tokens only when every group accepts
//! `N` (`kv_cache_coordinator.py::find_longest_cache_hit`): full attention holds every block
//! before `N`, a sliding-window group the `⌈(W−1)/B⌉` blocks before `N`, a chunked-local group
//! the blocks of `N`'s chunk, a Mamba group its state at `N`.
//!
//! The end-to-end scenarios publish through vLLM's own `vllm/distributed/kv_events.py` (driven
//! by `tests/engines/engine_host.py`) to the real sidecar and server binaries, and after every
//! step assert LookupRoute's matched tokens for the stored prompt: the value the engine's rule
//! gives (worked out in each step's comment), and the replica's entry count. The map-level
//! tests check the same rule without processes.

mod common;

use common::engines::*;
use common::server_process::{Server, server_binary, start_server};
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_sidecar::positional::{Removal, ReverseMap};
use inferencecache_sidecar::wire::{BlockStored, Event, decode_batch_lenient, encode};
use rmpv::Value;
use serde_json::{Value as Json, json};
use std::path::Path;

/// Tokens of chain `a`: `blocks` blocks of 16.
fn prompt(blocks: usize) -> Vec<u32> {
    span(1000, (blocks * BS) as u32)
}

fn want_tokens(tokens: Vec<u32>, matched: usize, tier: Option<pb::CacheTier>) -> Want {
    Want {
        tokens,
        adapter: "",
        matched: matched as i32,
        tier: if matched > 0 { tier } else { None },
    }
}

fn t1(blocks: usize, matched: usize) -> Want {
    want_tokens(prompt(blocks), matched, Some(pb::CacheTier::T1))
}

/// A vLLM `BlockStored` of chain `a`, blocks `first..first+n`, in group `group`.
fn stored(first: usize, n: usize, group: u32, kind: &str, window: Option<u32>) -> Json {
    let mut ev = json!({
        "kind": "stored",
        "chain": "a",
        "first": first,
        "tokens": span(1000 + (first * BS) as u32, (n * BS) as u32),
        "block_size": BS,
        "group_idx": group,
        "kv_cache_spec_kind": kind,
    });
    if let Some(w) = window {
        ev["kv_cache_spec_sliding_window"] = json!(w);
    }
    ev
}

/// A vLLM `BlockRemoved` of chain `a`'s `blocks` in group `group`.
fn removed(blocks: &[usize], group: u32) -> Json {
    json!({"kind": "removed", "chain": "a", "blocks": blocks, "group_idx": group})
}

async fn publish(rig: &mut Rig<'_>, events: Vec<Json>) {
    rig.host
        .call(json!({"op": "publish", "events": events}))
        .await;
}

async fn vllm_rig<'a>(server: &'a Server, sources: &'a Path, scenario: &str) -> Rig<'a> {
    Rig::new(Engine::Vllm, server, sources, scenario, json!({})).await
}

/// Waits for two more anti-entropy comparisons and asserts none of them found a difference:
/// the claimed set the sidecar would reconcile with (its digest) equals what the server holds.
async fn digests_agree(rig: &mut Rig<'_>) {
    let checks = "inferencecache_sidecar_digest_checks_total";
    let mismatches = "inferencecache_sidecar_digest_mismatches_total";
    let before = rig.metrics().await.get(checks, &[]);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let m = rig.metrics().await;
        if m.get(checks, &[]) >= before + 2.0 {
            assert_eq!(
                m.get(mismatches, &[]),
                0.0,
                "the sidecar's claimed set and the server differ"
            );
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no anti-entropy comparison ran"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Full attention + a 32-token sliding window: the example.
async fn sliding_window_32(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "swa32").await;
    rig.sidecar_args = vec!["--anti-entropy-interval".into(), "300ms".into()];
    rig.start_sidecar().await;
    publish(
        &mut rig,
        vec![
            stored(0, 4, 0, "full_attention", None),
            stored(0, 4, 1, "sliding_window", Some(32)),
        ],
    )
    .await;
    // Both groups hold blocks 0–3: 64 tokens.
    rig.expect("both groups store 0-3", &[t1(4, 64), t1(2, 32)], 4)
        .await;
    publish(&mut rig, vec![removed(&[0, 1], 1)]).await;
    // The window group keeps 2–3, the two blocks (⌈31/16⌉) before 64: still 64.
    rig.expect("window frees 0-1", &[t1(4, 64)], 4).await;
    digests_agree(&mut rig).await;
    publish(&mut rig, vec![removed(&[3], 1)]).await;
    // Window group holds only block 2: N=64 misses block 3, N=48 misses block 1, N≤32 miss
    // 0–1 → the engine reuses nothing, and the claim must go.
    rig.expect("window frees 3: the claim shrinks", &[t1(4, 0)], 0)
        .await;
    publish(&mut rig, vec![stored(3, 1, 1, "sliding_window", Some(32))]).await;
    rig.expect("window re-stores 3", &[t1(4, 64)], 4).await;
    digests_agree(&mut rig).await;
    publish(&mut rig, vec![removed(&[1], 0)]).await;
    // Full attention loses block 1: N ≥ 32 fails; N=16 needs the window's block 0 (gone).
    rig.expect("full attention frees 1", &[t1(4, 0)], 0).await;
    let m = rig.metrics().await;
    let kind = |k| [("kind", k)];
    assert_eq!(
        m.get(
            "inferencecache_sidecar_group_blocks_stored_total",
            &kind("sliding_window")
        ),
        5.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_group_blocks_stored_total",
            &kind("full_attention")
        ),
        4.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_group_blocks_removed_total",
            &kind("sliding_window")
        ),
        3.0
    );
    // Blocks 0 and 1 of the window group went while the prefix stayed reusable.
    assert_eq!(
        m.get(
            "inferencecache_sidecar_group_removals_kept_reusable_total",
            &kind("sliding_window")
        ),
        2.0
    );
    assert_eq!(
        m.get(
            "inferencecache_sidecar_group_removals_kept_reusable_total",
            &kind("full_attention")
        ),
        0.0
    );
    rig.finish().await;
}

/// Full attention + a 128-token sliding window over ten blocks.
async fn sliding_window_128(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "swa128").await;
    rig.start_sidecar().await;
    publish(
        &mut rig,
        vec![
            stored(0, 10, 0, "full_attention", None),
            stored(0, 10, 1, "sliding_window", Some(128)),
        ],
    )
    .await;
    rig.expect("both groups store 0-9", &[t1(10, 160)], 10)
        .await;
    publish(&mut rig, vec![removed(&[9], 1)]).await;
    // N=160 misses block 9; N=144 needs the 8 blocks (⌈127/16⌉) 1–8: held → 144.
    rig.expect("window frees 9: the claim shrinks", &[t1(10, 144)], 9)
        .await;
    publish(&mut rig, vec![removed(&[0], 1)]).await;
    // N=144 still has 1–8.
    rig.expect("window frees 0", &[t1(10, 144)], 9).await;
    publish(&mut rig, vec![removed(&[1], 1)]).await;
    // N=144 has only 2–8 (112 tokens); every shorter N misses block 1 or 0 → nothing.
    rig.expect("window frees 1", &[t1(10, 0)], 0).await;
    rig.finish().await;
}

/// Full attention + chunked local attention, chunk 32 (`--attention-chunk-size 32`).
async fn chunked_local(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "chunked").await;
    rig.sidecar_args = vec!["--attention-chunk-size".into(), "32".into()];
    rig.start_sidecar().await;
    publish(
        &mut rig,
        vec![
            stored(0, 5, 0, "full_attention", None),
            stored(0, 5, 1, "chunked_local_attention", None),
        ],
    )
    .await;
    rig.expect("both groups store 0-4", &[t1(5, 80)], 5).await;
    publish(&mut rig, vec![removed(&[0, 1], 1)]).await;
    // N=80: its chunk starts at 64, so only block 4 is needed: still 80.
    rig.expect("chunked frees 0-1", &[t1(5, 80)], 5).await;
    publish(&mut rig, vec![removed(&[4], 1)]).await;
    // N=80 misses block 4; N=64 is a chunk boundary and needs no chunked block → 64.
    rig.expect("chunked frees 4: the claim shrinks", &[t1(5, 64)], 4)
        .await;
    publish(&mut rig, vec![removed(&[2], 1)]).await;
    // N=64 still needs nothing of the chunked group; N=48 would need block 2.
    rig.expect("chunked frees 2", &[t1(5, 64)], 4).await;
    rig.finish().await;
}

/// Full attention + a Mamba group that, as vLLM's align mode does, keeps only some states:
/// its event names those blocks while its token ids cover the whole prefix.
async fn mamba(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "mamba").await;
    rig.start_sidecar().await;
    let mut state_at_3 = stored(0, 4, 1, "mamba", None);
    state_at_3["blocks"] = json!([3]);
    // The Mamba event first: its block is not known yet and waits for the full-attention one.
    publish(
        &mut rig,
        vec![state_at_3, stored(0, 4, 0, "full_attention", None)],
    )
    .await;
    // Mamba's state at 64 and full attention 0–3: 64 (no state at 16, 32, 48).
    rig.expect("state at 64", &[t1(4, 64)], 4).await;
    publish(&mut rig, vec![removed(&[3], 1)]).await;
    rig.expect("state at 64 freed", &[t1(4, 0)], 0).await;
    let mut state_at_1 = stored(0, 2, 1, "mamba", None);
    state_at_1["blocks"] = json!([1]);
    publish(&mut rig, vec![state_at_1]).await;
    // The state at 32: 32 reusable out of the 64 full attention holds.
    rig.expect("state at 32", &[t1(4, 32)], 2).await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get(
            "inferencecache_sidecar_group_blocks_stored_total",
            &[("kind", "mamba")]
        ),
        2.0
    );
    rig.finish().await;
}

/// Lookahead hashing (16 tokens): a block's hash covers the next block's tokens, so the engine
/// reuses a block only for a prompt that carries them.
async fn lookahead(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "lookahead").await;
    rig.start_sidecar().await;
    let with_lookahead = |first: usize, n: usize| {
        let mut ev = stored(first, n, 0, "full_attention", None);
        let lists: Vec<Vec<u32>> = (first..first + n)
            .map(|b| span(1000 + ((b + 1) * BS) as u32, BS as u32))
            .collect();
        ev["lookahead_token_ids"] = json!(lists);
        ev
    };
    publish(&mut rig, vec![with_lookahead(0, 4)]).await;
    // A 64-token prompt: vLLM hashes block i only when 16 tokens follow it → blocks 0–2: 48.
    rig.expect("blocks 0-3 stored", &[t1(4, 48)], 3).await;
    publish(&mut rig, vec![with_lookahead(4, 1)]).await;
    // Block 4 carries block 3's lookahead: the 80-token prompt reuses 64. (The 64-token
    // prompt is now credited 64 while the engine reuses 48 of it: a lookup that stops inside a
    // claimed block's lookahead is the documented margin of the deferred claim.)
    rig.expect("block 4 stored", &[t1(5, 64)], 4).await;
    publish(&mut rig, vec![removed(&[4], 0)]).await;
    rig.expect("block 4 removed", &[t1(5, 48)], 3).await;
    rig.finish().await;
}

/// `locality: REMOTE` copies are T3, tracked apart from the local copy of the same medium.
async fn remote_copies(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "remote").await;
    rig.start_sidecar().await;
    let mut remote = stored(0, 2, 0, "full_attention", None);
    remote["medium"] = json!("CPU");
    remote["locality"] = json!("REMOTE");
    remote["ownership"] = json!("shared-pool");
    publish(
        &mut rig,
        vec![stored(0, 2, 0, "full_attention", None), remote],
    )
    .await;
    rig.expect("GPU and remote copies", &[t1(2, 32)], 2).await;
    let mut local_cpu = stored(0, 2, 0, "full_attention", None);
    local_cpu["medium"] = json!("CPU");
    publish(&mut rig, vec![local_cpu]).await;
    publish(&mut rig, vec![removed(&[0, 1], 0)]).await;
    // GPU copy gone (the removal names GPU): the local CPU copy remains → T2.
    rig.expect(
        "GPU copy removed",
        &[want_tokens(prompt(2), 32, Some(pb::CacheTier::T2))],
        2,
    )
    .await;
    let mut cpu_gone = removed(&[0, 1], 0);
    cpu_gone["medium"] = json!("CPU");
    publish(&mut rig, vec![cpu_gone]).await;
    // Only the remote pool's copy is left: T3, not this replica's own host memory.
    rig.expect(
        "local CPU copy removed",
        &[want_tokens(prompt(2), 32, Some(pb::CacheTier::T3))],
        2,
    )
    .await;
    let mut remote_gone = removed(&[0, 1], 0);
    remote_gone["medium"] = json!("CPU");
    remote_gone["locality"] = json!("REMOTE");
    remote_gone["ownership"] = json!("shared-pool");
    publish(&mut rig, vec![remote_gone]).await;
    rig.expect("remote copy removed", &[t1(2, 0)], 0).await;
    rig.finish().await;
}

/// One malformed event in a batch is dropped and counted; the rest of the batch applies.
async fn malformed_event(server: &Server, sources: &Path) {
    let mut rig = vllm_rig(server, sources, "malformed").await;
    rig.start_sidecar().await;
    let good_b = json!({
        "kind": "stored", "chain": "b", "tokens": span(2000, 32), "block_size": BS,
        "group_idx": 0, "kv_cache_spec_kind": "full_attention",
    });
    let mut bad = stored(0, 2, 0, "full_attention", None);
    bad["override"] = json!({"block_size": -16});
    publish(
        &mut rig,
        vec![
            stored(0, 4, 0, "full_attention", None),
            bad,
            good_b,
            removed(&[3], 0),
        ],
    )
    .await;
    let b = want_tokens(span(2000, 32), 32, Some(pb::CacheTier::T1));
    rig.expect("the other events applied", &[t1(4, 48), b], 5)
        .await;
    let m = rig.metrics().await;
    assert_eq!(
        m.get("inferencecache_sidecar_malformed_events_total", &[]),
        1.0
    );
    assert_eq!(
        m.get("inferencecache_sidecar_decode_failures_total", &[]),
        0.0
    );
    rig.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_hybrid_groups_keep_the_index_to_what_the_engine_reuses() {
    let Some(sources) = engine_sources() else {
        return;
    };
    let Some(bin) = server_binary() else { return };
    let dir = common::temp_dir("hybrid-server");
    let server = start_server(&bin, BS, &[], &dir.join("server.log"))
        .await
        .expect("server starts");
    // Report every match, however short (the default policy prunes matches under 64 tokens).
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
    sliding_window_32(&server, &sources).await;
    sliding_window_128(&server, &sources).await;
    chunked_local(&server, &sources).await;
    mamba(&server, &sources).await;
    lookahead(&server, &sources).await;
    remote_copies(&server, &sources).await;
    malformed_event(&server, &sources).await;
    let _ = std::fs::remove_dir_all(dir);
}

// --- the map alone -------------------------------------------------------------------------

fn engine_hash(block: usize) -> Vec<u8> {
    (0xA000u64 + block as u64).to_be_bytes().to_vec()
}

fn map_store(
    first: usize,
    blocks: &[usize],
    group: u32,
    kind: &str,
    window: Option<i64>,
) -> BlockStored {
    let n = blocks.len();
    BlockStored {
        block_hashes: blocks.iter().map(|&b| engine_hash(b)).collect(),
        parent_block_hash: (first > 0).then(|| engine_hash(first - 1)),
        token_ids: span(1000 + (first * BS) as u32, (n * BS) as u32),
        block_size: BS as i64,
        group_idx: Some(group),
        kv_cache_spec_kind: Some(kind.into()),
        kv_cache_spec_sliding_window: window,
        ..BlockStored::default()
    }
}

fn remove_group(map: &mut ReverseMap, blocks: &[usize], group: u32) -> (Vec<i32>, usize) {
    let hashes: Vec<Vec<u8>> = blocks.iter().map(|&b| engine_hash(b)).collect();
    let removal = Removal {
        group: Some(group),
        ..Removal::default()
    };
    let out = map.remove_copies(&hashes, removal, true);
    (
        out.evicted.iter().map(|e| e.token_count).collect(),
        out.group_copies.iter().filter(|(_, kept)| *kept).count(),
    )
}

#[test]
fn a_removal_in_one_group_keeps_what_the_others_keep_reusable() {
    let mut map = ReverseMap::new(BS);
    let fa = map.store(&map_store(0, &[0, 1, 2, 3], 0, "full_attention", None), "");
    assert_eq!(
        fa.entries.iter().map(|e| e.token_count).collect::<Vec<_>>(),
        [16, 32, 48, 64]
    );
    // Learning the window group with the same blocks changes no claim.
    let sw = map.store(
        &map_store(0, &[0, 1, 2, 3], 1, "sliding_window", Some(32)),
        "",
    );
    assert!(sw.entries.is_empty() && sw.evicted.is_empty());
    // The window group frees 0–1: nothing evicted, both removals kept reusable.
    assert_eq!(remove_group(&mut map, &[0, 1], 1), (vec![], 2));
    // It frees 3: every claim goes.
    let (mut evicted, kept) = remove_group(&mut map, &[3], 1);
    evicted.sort_unstable();
    assert_eq!((evicted, kept), (vec![16, 32, 48, 64], 0));
    // Full attention frees everything: the pages are forgotten once no group holds them.
    remove_group(&mut map, &[0, 1, 2, 3], 0);
    remove_group(&mut map, &[2], 1);
    assert!(map.is_empty(), "{} pages left", map.len());
}

#[test]
fn a_stricter_group_learned_later_withdraws_claims() {
    let mut map = ReverseMap::new(BS);
    map.store(&map_store(0, &[0, 1, 2, 3], 0, "full_attention", None), "");
    // The window group's event leaves the null blocks 0–1 out: only 2–3 are named.
    let mut sw = map_store(0, &[2, 3], 1, "sliding_window", Some(32));
    sw.token_ids = span(1000, 64);
    let out = map.store(&sw, "");
    // 64 stays (2–3 before it); 16, 32 and 48 are no longer reusable ends, but they lie on
    // the path to 64, which the index's leading-run lookup needs.
    assert!(out.evicted.is_empty(), "{:?}", out.evicted);
    // A Mamba group that holds no state yet: nothing is reusable any more.
    let mamba = BlockStored {
        block_hashes: vec![],
        ..map_store(0, &[], 2, "mamba", None)
    };
    let out = map.store(&mamba, "");
    assert_eq!(out.evicted.len(), 4);
}

#[test]
fn unknown_fields_are_ignored_and_one_bad_event_is_dropped() {
    let stored = |extra: Vec<(&str, Value)>| {
        let mut kv = vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(1u64)]),
            ),
            (Value::from("parent_block_hash"), Value::Nil),
            (
                Value::from("token_ids"),
                Value::Array((0..16).map(Value::from).collect()),
            ),
            (Value::from("block_size"), Value::from(16)),
            (Value::from("lora_id"), Value::Nil),
            (Value::from("medium"), Value::from("GPU")),
            (Value::from("lora_name"), Value::Nil),
        ];
        kv.extend(extra.into_iter().map(|(k, v)| (Value::from(k), v)));
        Value::Map(kv)
    };
    let good = stored(vec![
        ("group_idx", Value::from(1)),
        ("kv_cache_spec_kind", Value::from("sliding_window")),
        ("kv_cache_spec_sliding_window", Value::from(4096)),
        ("locality", Value::from("REMOTE")),
        ("ownership", Value::from("lmcache")),
        ("session_id", Value::from("s-1")),
        (
            "lookahead_token_ids",
            Value::Array(vec![Value::Array(vec![Value::from(7), Value::from(8)])]),
        ),
        ("a_field_from_a_later_vllm", Value::from(true)),
    ]);
    let bad = stored(vec![("group_idx", Value::from(-1))]);
    let bad_lookahead = stored(vec![(
        "lookahead_token_ids",
        Value::Array(vec![Value::Nil, Value::Nil]),
    )]);
    let payload = encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![good, bad, bad_lookahead]),
    ]));
    let decoded = decode_batch_lenient(&payload).expect("the envelope is well formed");
    assert_eq!(decoded.dropped.len(), 2, "{:?}", decoded.dropped);
    assert_eq!(decoded.batch.events.len(), 1);
    let Event::BlockStored(st) = &decoded.batch.events[0] else {
        panic!("not a store")
    };
    assert_eq!(st.group_idx, Some(1));
    assert_eq!(st.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    assert_eq!(st.kv_cache_spec_sliding_window, Some(4096));
    assert_eq!(st.locality.as_deref(), Some("REMOTE"));
    assert_eq!(st.ownership.as_deref(), Some("lmcache"));
    assert_eq!(st.session_id.as_deref(), Some("s-1"));
    assert_eq!(st.lookahead_tokens, Some(vec![2]));
    // The strict decoder still rejects the batch.
    assert!(inferencecache_sidecar::wire::decode_batch(&payload).is_err());
}

#[test]
fn a_group_whose_parent_is_not_stored_yet_waits_for_it() {
    let mut map = ReverseMap::new(BS);
    let counts = |entries: &[inferencecache_sidecar::positional::Entry]| {
        let mut c: Vec<i32> = entries.iter().map(|e| e.token_count).collect();
        c.sort_unstable();
        c
    };
    map.store(&map_store(0, &[0, 1], 0, "full_attention", None), "");
    map.store(&map_store(0, &[0, 1], 1, "sliding_window", Some(32)), "");
    // The window group's block 3 (parent 2) comes before anyone stored block 2: parked.
    let early = map.store(&map_store(3, &[3], 1, "sliding_window", Some(32)), "");
    assert_eq!(early.orphan_pages, 1);
    // Full attention stores 2–3: block 3 takes the parked window copy, but 64 still needs the
    // window's block 2 and 48 needs it too; 32 stays the claim.
    let out = map.store(&map_store(2, &[2, 3], 0, "full_attention", None), "");
    assert!(out.entries.is_empty(), "{:?}", counts(&out.entries));
    // The window group stores block 2: 64 becomes reusable (without the parked copy of 3 it
    // would not).
    let out = map.store(&map_store(2, &[2], 1, "sliding_window", Some(32)), "");
    assert_eq!(counts(&out.entries), [48, 64]);
}

#[tokio::test]
async fn claims_withdrawn_by_a_later_group_leave_the_pending_buffer_and_the_server() {
    use common::{Call, Mode, sink_to, start_fake_server};
    use inferencecache_sidecar::reporter::{Identity, Reporter, ReporterConfig};
    use inferencecache_sidecar::wire::EventBatch;
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = ReporterConfig::new(Identity {
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
    });
    cfg.block_size = BS;
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    let batch = |events| EventBatch {
        ts: 2.0,
        events,
        data_parallel_rank: None,
    };
    // Full attention stores 0–3 (pending), then a Mamba group appears holding only its state
    // at 32: 48 and 64 are withdrawn before anything was sent, 16 and 32 stay.
    let mut mamba = map_store(0, &[1], 1, "mamba", None);
    mamba.token_ids = span(1000, 32);
    r.handle_batch(&batch(vec![
        Event::BlockStored(map_store(0, &[0, 1, 2, 3], 0, "full_attention", None)),
        Event::BlockStored(mamba),
    ]))
    .await;
    assert_eq!(r.pending_len(), 2);
    r.flush().await;
    let updates = rec.updates();
    let counts: Vec<i32> = updates[0].prefixes.iter().map(|p| p.token_count).collect();
    assert_eq!(counts, [16, 32]);
    // The withdrawals still reach the server (the blocks may be there from an earlier flush).
    let evicted = rec
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::Publish(_)))
        .count();
    assert_eq!(evicted, 2);
    // The Mamba state at 32 goes: nothing is reusable.
    r.handle_batch(&batch(vec![Event::BlockRemoved {
        block_hashes: vec![engine_hash(1)],
        medium: None,
        group_idx: Some(1),
        locality: None,
        ownership: None,
    }]))
    .await;
    assert_eq!(rec.events().len(), 4);
}

/// A long conversation under a 128-token window: the window group frees every block behind
/// it, one removal at a time, as vLLM does while a request runs; the whole prefix stays
/// claimed (and each step touches only the pages within the window of the freed block).
#[test]
fn a_long_conversation_keeps_its_claim_while_the_window_slides() {
    let mut map = ReverseMap::new(BS);
    let n = 2000;
    let blocks: Vec<usize> = (0..n).collect();
    let mut fa = map_store(0, &blocks, 0, "full_attention", None);
    fa.token_ids = span(0, (n * BS) as u32);
    assert_eq!(map.store(&fa, "").entries.len(), n);
    let mut sw = map_store(0, &blocks, 1, "sliding_window", Some(128));
    sw.token_ids = span(0, (n * BS) as u32);
    let out = map.store(&sw, "");
    assert!(out.entries.is_empty() && out.evicted.is_empty());
    for b in 0..n - 8 {
        assert_eq!(remove_group(&mut map, &[b], 1), (vec![], 1), "block {b}");
    }
    // The window's last block goes: N = n·16 misses it, every shorter N misses block n−9.
    let (evicted, kept) = remove_group(&mut map, &[n - 1], 1);
    assert_eq!((evicted.len(), kept), (n, 0));
}

#[tokio::test]
async fn l2_mode_rereports_a_shrunk_claim_as_t2() {
    use common::{Mode, sink_to, start_fake_server};
    use inferencecache_proto::v1alpha1::CacheTier;
    use inferencecache_sidecar::reporter::{Identity, Reporter, ReporterConfig};
    use inferencecache_sidecar::wire::EventBatch;
    let (rec, addr) = start_fake_server(Mode::Ok).await;
    let mut cfg = ReporterConfig::new(Identity {
        replica_id: "r0".into(),
        model_id: "m".into(),
        tenant_id: "t".into(),
        hash_scheme: "vllm".into(),
    });
    cfg.block_size = BS;
    cfg.l2_mode = true;
    let mut r = Reporter::new(cfg, sink_to(addr, None));
    let batch = |ts, events| EventBatch {
        ts,
        events,
        data_parallel_rank: None,
    };
    r.handle_batch(&batch(
        2.0,
        vec![
            Event::BlockStored(map_store(0, &[0, 1, 2, 3], 0, "full_attention", None)),
            Event::BlockStored(map_store(0, &[0, 1, 2, 3], 1, "sliding_window", Some(32))),
        ],
    ))
    .await;
    r.flush().await;
    let removal = |blocks: &[usize]| Event::BlockRemoved {
        block_hashes: blocks.iter().map(|&b| engine_hash(b)).collect(),
        medium: None,
        group_idx: Some(1),
        locality: None,
        ownership: None,
    };
    // Blocks 0–1 leave the window group: the claim stands, nothing is sent.
    r.handle_batch(&batch(3.0, vec![removal(&[0, 1])])).await;
    assert_eq!(rec.updates().len(), 1);
    // Block 3 leaves it: the four blocks are re-reported at T2 with the removal's time.
    r.handle_batch(&batch(4.0, vec![removal(&[3])])).await;
    let updates = rec.updates();
    assert_eq!(updates.len(), 2);
    let t2 = &updates[1];
    assert_eq!(t2.timestamp_us, 4_000_000);
    assert_eq!(t2.prefixes.len(), 4);
    assert!(t2.prefixes.iter().all(|p| p.tier == CacheTier::T2 as i32));
    assert!(rec.events().is_empty(), "no PREFIX_EVICTED in L2 mode");
}

/// A Mamba group with 64-token blocks over 16-token full attention: its block hash is the
/// full-attention hash at the same boundary, and its copy lands on the 16-token page ending
/// there, even when its event comes first.
#[test]
fn a_coarser_group_attaches_to_the_finer_pages() {
    let mut map = ReverseMap::new(BS);
    map.store(&map_store(0, &[0, 1, 2, 3], 0, "full_attention", None), "");
    let mamba = |blocks: &[usize], tokens: u32| BlockStored {
        block_size: 64,
        token_ids: span(1000, tokens),
        ..map_store(0, blocks, 1, "mamba", None)
    };
    // The Mamba block ending at 64 has the full-attention hash of block 3.
    let out = map.store(&mamba(&[3], 64), "");
    assert_eq!(out.orphan_pages, 0);
    assert_eq!(map.len(), 4, "no 64-token page of its own");
    // Only the prefix ending at 64 is reusable; the path to it is reported.
    assert!(out.evicted.is_empty());
    // A second Mamba block (ending at 128) comes before full attention stores 4–7: parked.
    let out = map.store(&mamba(&[7], 128), "");
    assert_eq!(out.orphan_pages, 1);
    let out = map.store(&map_store(4, &[4, 5, 6, 7], 0, "full_attention", None), "");
    let mut counts: Vec<i32> = out.entries.iter().map(|e| e.token_count).collect();
    counts.sort_unstable();
    assert_eq!(counts, [80, 96, 112, 128]);
    assert_eq!(map.len(), 8);
}
