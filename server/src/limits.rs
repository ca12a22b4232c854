//! Limits that keep one misbehaving client from growing the server's memory or monopolising
//! ingest (`docs/robustness.md`).
//!
//! The spec fixes two of them (`server.md` §5: 4 MiB request messages; §7: `MaxLookupTokens`,
//! `MaxPromptTextBytes`). It is silent on how long a chain, a hash or an identifier may be, how
//! many prefixes one update may carry and how fast one producer may write; the index's global
//! cap (`--max-entries`) counts storage entries, not bytes, so without these a single update
//! could store a 4 MiB "hash" per entry. Each limit is a flag and a `[limits]` key, with a
//! default far above what an engine sidecar sends.
//!
//! Enforcement lives here, in the server layer; the engine keeps applying its own K-rules
//! (K7 malformed chains, D8 empty hashes) to whatever passes. Producer RPCs never turn a limit
//! into an error (contract §5: `Ack` is always `accepted: true`): the part of an update over a
//! limit is left out, counted in `inferencecache_limit_exceeded_total{limit}`, and everything
//! already stored stays. A lookup over a limit fails open (`NO_HINT`), never a gRPC error.

use crate::translate;
use governor::{Quota, RateLimiter};
use inferencecache_engine::{CacheStateUpdate, PrefixRef};
use inferencecache_proto::v1alpha1 as pb;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

/// Default `--max-chain-length`: blocks per chain. 2^16 blocks of 16 tokens are 2^20 tokens,
/// the spec's `MaxLookupTokens`, and beyond any model's context window.
pub const DEFAULT_MAX_CHAIN_LENGTH: u64 = 1 << 16;
/// Default `--max-hash-bytes`. Engine block hashes are 8 (vLLM, SGLang, our fingerprint) to 32
/// bytes (SHA-256); 256 leaves room for any encoding of those.
pub const DEFAULT_MAX_HASH_BYTES: u64 = 256;
/// Default `--max-id-bytes` for tenant, model, hash scheme, adapter and replica ids.
pub const DEFAULT_MAX_ID_BYTES: u64 = 1024;
/// Default `--max-prefixes-per-update`. The sidecar flushes far smaller batches.
pub const DEFAULT_MAX_PREFIXES_PER_UPDATE: u64 = 1 << 16;
/// Default `--max-message-bytes`: the spec's 4 MiB (`server.md` §5).
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 4 * 1024 * 1024;
/// Default `--producer-max-blocks-per-sec` per producer connection: above the reference
/// index's whole ingest rate (~1.64 M blocks/s) and 100× what one engine replica produces.
pub const DEFAULT_PRODUCER_MAX_BLOCKS_PER_SEC: u64 = 2_000_000;

/// The configured limits; `0` turns a limit off (except the message size, which is required).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_chain_length: u64,
    pub max_hash_bytes: u64,
    pub max_id_bytes: u64,
    pub max_prefixes_per_update: u64,
    pub max_message_bytes: u64,
    pub producer_max_blocks_per_sec: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_chain_length: DEFAULT_MAX_CHAIN_LENGTH,
            max_hash_bytes: DEFAULT_MAX_HASH_BYTES,
            max_id_bytes: DEFAULT_MAX_ID_BYTES,
            max_prefixes_per_update: DEFAULT_MAX_PREFIXES_PER_UPDATE,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            producer_max_blocks_per_sec: DEFAULT_PRODUCER_MAX_BLOCKS_PER_SEC,
        }
    }
}

/// `0` = no limit.
fn cap(limit: u64) -> usize {
    if limit == 0 {
        usize::MAX
    } else {
        usize::try_from(limit).unwrap_or(usize::MAX)
    }
}

impl Limits {
    /// The message limit handed to tonic's decoder.
    pub fn message_bytes(&self) -> usize {
        cap(self.max_message_bytes)
    }

    /// Whether a lookup's wire chain is longer than the chain limit (the lookup fails open).
    pub fn lookup_chain_too_long(&self, blocks: usize) -> bool {
        blocks > cap(self.max_chain_length)
    }
}

/// Which limit an input exceeded (the `limit` label of `inferencecache_limit_exceeded_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    /// An ingested chain was cut to its first `max_chain_length` blocks.
    ChainLength,
    /// A prefix ref with a hash (block or `prefix_hash`) over `max_hash_bytes` was left out.
    HashBytes,
    /// An update with an identifier over `max_id_bytes` was left out whole (a ref's own
    /// `adapter_id` leaves out only that ref).
    IdBytes,
    /// Prefix refs past the first `max_prefixes_per_update` of an update were left out.
    PrefixesPerUpdate,
    /// A lookup's wire chain was longer than `max_chain_length`: fail-open `NO_HINT`.
    LookupChainLength,
}

impl Exceeded {
    pub const ALL: [Exceeded; 5] = [
        Exceeded::ChainLength,
        Exceeded::HashBytes,
        Exceeded::IdBytes,
        Exceeded::PrefixesPerUpdate,
        Exceeded::LookupChainLength,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Exceeded::ChainLength => "chain_length",
            Exceeded::HashBytes => "hash_bytes",
            Exceeded::IdBytes => "id_bytes",
            Exceeded::PrefixesPerUpdate => "prefixes_per_update",
            Exceeded::LookupChainLength => "lookup_chain_length",
        }
    }
}

/// Counters of inputs cut by a limit, one slot per [`Exceeded`] (refs for ingest, calls for
/// lookups), plus producer messages delayed by the rate limit.
#[derive(Debug, Default)]
pub struct LimitCounters {
    exceeded: [AtomicU64; Exceeded::ALL.len()],
    throttled: AtomicU64,
}

impl LimitCounters {
    pub fn add(&self, which: Exceeded, n: u64) {
        if n > 0 {
            self.exceeded[which as usize].fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn get(&self, which: Exceeded) -> u64 {
        self.exceeded[which as usize].load(Ordering::Relaxed)
    }

    /// Producer messages (or events) that had to wait for the rate limit.
    pub fn throttled(&self) -> u64 {
        self.throttled.load(Ordering::Relaxed)
    }

    fn add_throttled(&self) {
        self.throttled.fetch_add(1, Ordering::Relaxed);
    }
}

/// What [`admit`] decided for one prefix ref.
enum RefVerdict {
    Keep { blocks: usize },
    Drop(Exceeded),
}

fn judge_ref(p: &pb::PrefixEntry, limits: &Limits) -> RefVerdict {
    let max_hash = cap(limits.max_hash_bytes);
    if p.adapter_id.len() > cap(limits.max_id_bytes) {
        return RefVerdict::Drop(Exceeded::IdBytes);
    }
    let blocks = p.block_hashes.len().min(cap(limits.max_chain_length));
    // A chain is checked only over the blocks that will be kept; an over-long hash anywhere in
    // them leaves the whole ref out, as K7 does for an empty block hash (a shortened hash would
    // be a different key, and a gap would break the chain).
    if p.prefix_hash.len() > max_hash || p.block_hashes[..blocks].iter().any(|h| h.len() > max_hash)
    {
        return RefVerdict::Drop(Exceeded::HashBytes);
    }
    RefVerdict::Keep { blocks }
}

/// Identifier fields of an update that grow index structures (partitions, interned replicas).
fn ids_too_long(u: &pb::CacheStateUpdate, limits: &Limits) -> bool {
    let max = cap(limits.max_id_bytes);
    [
        &u.tenant_id,
        &u.model_id,
        &u.hash_scheme,
        &u.adapter_id,
        &u.replica_id,
    ]
    .iter()
    .any(|s| s.len() > max)
}

/// The part of `update` within the limits, as the engine's borrowed form, plus the number of
/// key upserts it can cause (the producer rate limit's cost). `None` when the whole update is
/// left out (an over-long identifier). Counts every cut in `counters`.
///
/// Chains are cut, not dropped: the first blocks are the prefix every lookup matches first, and
/// their cumulative token counts (K8) do not depend on later blocks. A chain-form ref with
/// mismatched arrays is passed on unchanged so the engine drops it per K7.
pub fn admit<'u>(
    update: &'u pb::CacheStateUpdate,
    limits: &Limits,
    counters: &LimitCounters,
) -> Option<(
    CacheStateUpdate<'u, impl Iterator<Item = PrefixRef<'u, Vec<u8>>> + 'u>,
    u64,
)> {
    if ids_too_long(update, limits) {
        counters.add(Exceeded::IdBytes, 1);
        return None;
    }
    let max_refs = cap(limits.max_prefixes_per_update);
    let max_chain = cap(limits.max_chain_length);
    let kept = update.prefixes.len().min(max_refs);
    counters.add(
        Exceeded::PrefixesPerUpdate,
        (update.prefixes.len() - kept) as u64,
    );
    // One pass to count and judge, so the rate limiter can be charged before the update is
    // applied; the engine's iterator repeats the (cheap, allocation-free) judgement.
    let mut cost: u64 = 0;
    for p in &update.prefixes[..kept] {
        match judge_ref(p, limits) {
            RefVerdict::Drop(which) => counters.add(which, 1),
            RefVerdict::Keep { blocks } => {
                let well_formed = p.block_hashes.len() == p.block_token_counts.len();
                if well_formed && p.block_hashes.len() > max_chain {
                    counters.add(Exceeded::ChainLength, 1);
                }
                cost += blocks as u64 + u64::from(!p.prefix_hash.is_empty());
            }
        }
    }
    let limits = *limits;
    let prefixes = update.prefixes[..kept].iter().filter_map(move |p| {
        let RefVerdict::Keep { blocks } = judge_ref(p, &limits) else {
            return None;
        };
        // K7 needs the original lengths to see a malformed chain; only well-formed chains
        // are cut.
        let well_formed = p.block_hashes.len() == p.block_token_counts.len();
        let (hashes, counts) = if well_formed {
            (&p.block_hashes[..blocks], &p.block_token_counts[..blocks])
        } else {
            (&p.block_hashes[..], &p.block_token_counts[..])
        };
        Some(translate::prefix_ref(p, hashes, counts))
    });
    Some((translate::update_with(update, prefixes), cost))
}

type Keyed = governor::DefaultKeyedRateLimiter<Option<SocketAddr>>;

/// Per-producer write budget: a token bucket per client connection (peer address; connections
/// without a known peer share one bucket), charged one
/// token per key upsert (chain block or `prefix_hash`) and at least one per message or event.
/// Over budget the handler waits before applying (and so before reading the next message):
/// backpressure through HTTP/2 flow control, never a dropped update, since a producer RPC must
/// not fail for its content (contract §5). Waits are counted.
pub struct ProducerLimiter {
    limiter: Option<Keyed>,
    burst: u32,
    calls: AtomicU64,
}

/// Forget idle connections' buckets every this many charges (keeps the map at the number of
/// recently active producers).
const RETAIN_EVERY: u64 = 4096;

impl ProducerLimiter {
    /// `per_sec == 0` disables the limit. The bucket holds one second of budget.
    pub fn new(per_sec: u64) -> Self {
        let rate = NonZeroU32::new(u32::try_from(per_sec).unwrap_or(u32::MAX));
        Self {
            limiter: rate.map(|r| RateLimiter::keyed(Quota::per_second(r))),
            burst: rate.map_or(0, NonZeroU32::get),
            calls: AtomicU64::new(0),
        }
    }

    /// Waits until the producer at `peer` may apply `cost` upserts.
    pub async fn acquire(&self, peer: Option<SocketAddr>, cost: u64, counters: &LimitCounters) {
        let Some(limiter) = &self.limiter else {
            return;
        };
        if self
            .calls
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(RETAIN_EVERY)
        {
            limiter.retain_recent();
        }
        // A message larger than the whole bucket is charged the whole bucket: it waits for a
        // full second of budget instead of being refused.
        let n = u32::try_from(cost.max(1))
            .unwrap_or(u32::MAX)
            .min(self.burst);
        let Some(n) = NonZeroU32::new(n) else {
            return;
        };
        match limiter.check_key_n(&peer, n) {
            Ok(Ok(())) => {}
            _ => {
                counters.add_throttled();
                let _ = limiter.until_key_n_ready(&peer, n).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: usize, hash_len: usize) -> pb::PrefixEntry {
        pb::PrefixEntry {
            block_hashes: (0..n).map(|i| vec![i as u8; hash_len]).collect(),
            block_token_counts: vec![16; n],
            ..Default::default()
        }
    }

    fn legacy(hash_len: usize) -> pb::PrefixEntry {
        pb::PrefixEntry {
            prefix_hash: vec![7; hash_len],
            token_count: 16,
            ..Default::default()
        }
    }

    fn update(prefixes: Vec<pb::PrefixEntry>) -> pb::CacheStateUpdate {
        pb::CacheStateUpdate {
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "vllm".into(),
            prefixes,
            ..Default::default()
        }
    }

    fn small() -> Limits {
        Limits {
            max_chain_length: 4,
            max_hash_bytes: 8,
            max_id_bytes: 16,
            max_prefixes_per_update: 3,
            ..Limits::default()
        }
    }

    #[test]
    fn chains_are_cut_and_bad_refs_left_out() {
        let counters = LimitCounters::default();
        let mut long = chain(10, 8);
        long.prefix_hash = vec![1; 8];
        let u = update(vec![long, legacy(9), chain(2, 9), legacy(8), legacy(8)]);
        let (admitted, cost) = admit(&u, &small(), &counters).unwrap();
        let refs: Vec<_> = admitted.prefixes.collect();
        // The fourth and fifth refs are past the per-update limit; the second and third carry
        // a 9-byte hash.
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].block_hashes.len(), 4);
        assert_eq!(refs[0].block_token_counts, &[16; 4]);
        assert_eq!(refs[0].prefix_hash, &[1; 8]);
        assert_eq!(cost, 5, "four blocks and the co-set key");
        assert_eq!(counters.get(Exceeded::ChainLength), 1);
        assert_eq!(counters.get(Exceeded::HashBytes), 2);
        assert_eq!(counters.get(Exceeded::PrefixesPerUpdate), 2);
    }

    #[test]
    fn malformed_chains_reach_the_engine_unchanged() {
        let counters = LimitCounters::default();
        let mut bad = chain(10, 8);
        bad.block_token_counts.pop();
        let u = update(vec![bad]);
        let (admitted, _) = admit(&u, &small(), &counters).unwrap();
        let refs: Vec<_> = admitted.prefixes.collect();
        assert_eq!(refs[0].block_hashes.len(), 10);
        assert_eq!(refs[0].block_token_counts.len(), 9);
        assert_eq!(counters.get(Exceeded::ChainLength), 0);
    }

    #[test]
    fn long_identifiers_leave_the_update_out() {
        let counters = LimitCounters::default();
        let mut u = update(vec![legacy(8)]);
        u.tenant_id = "x".repeat(17);
        assert!(admit(&u, &small(), &counters).is_none());
        assert_eq!(counters.get(Exceeded::IdBytes), 1);
        let mut u = update(vec![legacy(8), legacy(8)]);
        u.prefixes[0].adapter_id = "a".repeat(17);
        let (admitted, _) = admit(&u, &small(), &counters).unwrap();
        assert_eq!(admitted.prefixes.count(), 1);
        assert_eq!(counters.get(Exceeded::IdBytes), 2);
    }

    #[test]
    fn zero_turns_limits_off() {
        let off = Limits {
            max_chain_length: 0,
            max_hash_bytes: 0,
            max_id_bytes: 0,
            max_prefixes_per_update: 0,
            ..Limits::default()
        };
        let counters = LimitCounters::default();
        let u = update(vec![chain(100, 300), legacy(5000)]);
        let (admitted, cost) = admit(&u, &off, &counters).unwrap();
        assert_eq!(admitted.prefixes.count(), 2);
        assert_eq!(cost, 101);
        assert!(!off.lookup_chain_too_long(usize::MAX));
        for which in Exceeded::ALL {
            assert_eq!(counters.get(which), 0);
        }
    }
}
