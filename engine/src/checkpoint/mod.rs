//! Checkpoints: the whole index (entries with their clocks, tiers, token counts and LFU counts,
//! replica stats) plus opaque blobs of the embedding server, in one versioned, checksummed
//! file, written while lookups and ingest go on and loaded back at startup.
//!
//! - [`format`](mod@format): the byte format (framing, checksums, varints). Stable across builds of one
//!   [`format::VERSION`].
//! - [`write`](mod@write): dumps an [`Index`](crate::Index) into any `Write`, encoding shards in parallel
//!   (rayon).
//! - [`read`]: checks a whole checkpoint first, then loads it (so a torn or corrupt file
//!   changes nothing), decoding and applying sections in parallel, a bounded window at a time.
//! - [`files`]: the on-disk rotation in a state directory (temporary file, fsync, rename,
//!   directory fsync, the previous checkpoint kept until the new one is complete).
//!
//! # Payloads
//!
//! ```text
//! Partition := tenant str | model str | scheme str | adapter str        (numbered in file order)
//! Entries   := partition uvarint | group*
//! group     := replica str | count uvarint | entry*count
//! entry     := flags u8 | [key_len uvarint] | key | tokens ivarint | Δlast_seen ivarint
//!              | [lfu uvarint]
//!              flags: bits 0–1 wire tier, bit 2 an LFU count follows, bit 3 the key is
//!              8 bytes (no length); Δlast_seen is against the group's previous entry (0 first)
//! Stats     := tenant str | model str | count uvarint | record*count
//! record    := replica str | cache_memory_bytes ivarint | hit_rate f32 LE | pressure f32 LE
//!              | t2_hit_tokens ivarint | t2_query_tokens ivarint | last_seen ivarint
//!              | reported ivarint
//! Blob      := name str | bytes
//! ShardSize := partition uvarint | shard uvarint | entries uvarint
//!              (written before the sections of that (partition, shard); the restore presizes
//!              the shard's table with it, bounded by the file's checked entry count)
//! ```
//!
//! An 8-byte key with a delta of 0 and a small token count costs 12–14 bytes; the header and
//! framing are a few bytes per 256 KiB section.

pub mod files;
pub mod format;
pub mod read;
pub mod write;

/// Largest tenant, model, scheme, adapter or replica name a checkpoint carries (bytes).
pub const MAX_NAME: usize = 64 << 10;
/// Largest key a checkpoint carries (bytes).
pub const MAX_KEY: usize = 64 << 10;

const FLAG_TIER: u8 = 0b11;
const FLAG_LFU: u8 = 0b100;
const FLAG_KEY8: u8 = 0b1000;
