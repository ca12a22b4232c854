//! Writing a checkpoint: partitions are dumped shard by shard, each (partition, shard) encoded
//! on a rayon worker into sections of about [`TARGET_PAYLOAD`] bytes. Work goes in windows of
//! a few shards, so the writer holds only those shards' encodings at once, and each window's
//! sections are written interleaved across its shards (so a restore loading consecutive
//! sections in parallel works on different shard locks).

use super::format::{
    Header, SectionKind, TARGET_PAYLOAD, encode_header, frame_section, put_bytes, put_ivarint,
    put_uvarint, write_end,
};
use super::{FLAG_KEY8, FLAG_LFU, FLAG_TIER};
use crate::{DumpPartition, DumpedEntry, Index, ReplicaId};
use rayon::prelude::*;
use std::io::{self, Write};
use std::time::{Duration, Instant};

/// What a checkpoint holds besides the index.
#[derive(Debug, Clone, Default)]
pub struct WriteOptions<'a> {
    /// Wall-clock start time (ms since the epoch), recorded in the header.
    pub created_ms: i64,
    /// Replication log position the checkpoint covers (0 = none).
    pub stream_seq: u64,
    /// Named opaque blobs (e.g. the server's policy layer).
    pub blobs: Vec<(&'a str, &'a [u8])>,
}

/// What a write produced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteReport {
    /// Entries written.
    pub entries: u64,
    /// Stats records written.
    pub stats: u64,
    /// Partitions written.
    pub partitions: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Time taken.
    pub duration: Duration,
}

/// (partition, shard) work items encoded per window: two per worker keeps both busy while the
/// writer drains the previous window.
fn window() -> usize {
    2 * rayon::current_num_threads().max(1)
}

struct Counting<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(b)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Dumps `index` into `out` (see the module docs). Returns what was written; `out` is flushed
/// but not synced.
pub fn write_checkpoint(
    index: &Index,
    out: impl Write,
    opts: &WriteOptions<'_>,
) -> io::Result<WriteReport> {
    let started = Instant::now();
    let mut w = Counting {
        inner: out,
        bytes: 0,
    };
    let mut report = WriteReport::default();
    let mut sections = 0u64;
    w.write_all(&encode_header(&Header {
        created_ms: opts.created_ms,
        stream_seq: opts.stream_seq,
    }))?;
    let mut buf = Vec::new();
    for (name, bytes) in &opts.blobs {
        let mut p = Vec::with_capacity(name.len() + bytes.len() + 8);
        put_bytes(&mut p, name.as_bytes());
        p.extend_from_slice(bytes);
        buf.clear();
        frame_section(&mut buf, SectionKind::Blob, &p);
        w.write_all(&buf)?;
        sections += 1;
    }
    let parts = index.dump_partitions();
    for p in &parts {
        let mut payload = Vec::new();
        for s in [p.tenant(), p.model(), p.scheme(), p.adapter()] {
            put_bytes(&mut payload, s.as_bytes());
        }
        buf.clear();
        frame_section(&mut buf, SectionKind::Partition, &payload);
        w.write_all(&buf)?;
        sections += 1;
    }
    report.partitions = parts.len() as u64;
    let items: Vec<(usize, usize)> = (0..parts.len())
        .flat_map(|p| (0..DumpPartition::SHARDS).map(move |s| (p, s)))
        .collect();
    for chunk in items.chunks(window()) {
        let encoded: Vec<(Vec<Vec<u8>>, u64)> = chunk
            .par_iter()
            .map(|&(p, s)| encode_shard(&parts[p], p as u64, s))
            .collect();
        for (&(p, s), (_, n)) in chunk.iter().zip(&encoded) {
            if *n > 0 {
                let mut hint = Vec::with_capacity(12);
                put_uvarint(&mut hint, p as u64);
                put_uvarint(&mut hint, s as u64);
                put_uvarint(&mut hint, *n);
                buf.clear();
                frame_section(&mut buf, SectionKind::ShardSize, &hint);
                w.write_all(&buf)?;
                sections += 1;
            }
        }
        // Sections of the window's shards are interleaved, so the restore's parallel window
        // loads several shards at once instead of queueing on one shard's lock.
        let most = encoded.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
        for i in 0..most {
            for (framed, _) in &encoded {
                if let Some(section) = framed.get(i) {
                    w.write_all(section)?;
                    sections += 1;
                }
            }
        }
        report.entries += encoded.iter().map(|(_, n)| n).sum::<u64>();
    }
    let (stats_sections, stats) = encode_stats(index, &mut w)?;
    sections += stats_sections;
    report.stats = stats;
    write_end(&mut w, sections, report.entries)?;
    w.flush()?;
    report.bytes = w.bytes;
    report.duration = started.elapsed();
    Ok(report)
}

/// One replica's entries of a shard, encoded as a group body (count written at framing).
struct Group {
    body: Vec<u8>,
    count: u64,
    prev_ms: i64,
}

fn encode_entry(g: &mut Group, key: &[u8], e: &DumpedEntry) {
    let mut flags = (e.tier as u8) & FLAG_TIER;
    if e.lfu_count > 0 {
        flags |= FLAG_LFU;
    }
    if key.len() == 8 {
        flags |= FLAG_KEY8;
    }
    g.body.push(flags);
    if key.len() != 8 {
        put_uvarint(&mut g.body, key.len() as u64);
    }
    g.body.extend_from_slice(key);
    put_ivarint(&mut g.body, i64::from(e.tokens));
    put_ivarint(&mut g.body, e.last_seen_ms.wrapping_sub(g.prev_ms));
    g.prev_ms = e.last_seen_ms;
    if e.lfu_count > 0 {
        put_uvarint(&mut g.body, e.lfu_count);
    }
    g.count += 1;
}

/// Encodes one (partition, shard) into framed Entries sections: `(sections, entries)`.
fn encode_shard(part: &DumpPartition, part_no: u64, shard: usize) -> (Vec<Vec<u8>>, u64) {
    // By the replica's dense slot number in the scope.
    let mut groups: Vec<Option<(ReplicaId, Group)>> = Vec::new();
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut entries = 0u64;
    let frame = |out: &mut Vec<Vec<u8>>, payload: &[u8]| {
        let mut framed = Vec::with_capacity(payload.len() + 16);
        frame_section(&mut framed, SectionKind::Entries, payload);
        out.push(framed);
    };
    let flush = |out: &mut Vec<Vec<u8>>, replica: &str, g: &mut Group| {
        let mut payload = Vec::with_capacity(g.body.len() + replica.len() + 16);
        put_uvarint(&mut payload, part_no);
        put_bytes(&mut payload, replica.as_bytes());
        put_uvarint(&mut payload, g.count);
        payload.extend_from_slice(&g.body);
        frame(out, &payload);
        g.body.clear();
        g.count = 0;
        g.prev_ms = 0;
    };
    part.for_each_entry(shard, |key, slot, replica, e| {
        if key.len() > super::MAX_KEY {
            return;
        }
        let slot = slot as usize;
        if groups.len() <= slot {
            groups.resize_with(slot + 1, || None);
        }
        let (_, g) = groups[slot].get_or_insert_with(|| {
            (
                replica.clone(),
                Group {
                    body: Vec::new(),
                    count: 0,
                    prev_ms: 0,
                },
            )
        });
        encode_entry(g, key, &e);
        entries += 1;
        if g.body.len() >= TARGET_PAYLOAD {
            flush(&mut out, &replica, g);
        }
    });
    // Small remainders share sections: groups are packed until a section reaches the target.
    let mut rest: Vec<(ReplicaId, Group)> = groups
        .into_iter()
        .flatten()
        .filter(|(_, g)| g.count > 0)
        .collect();
    rest.sort_by(|(a, _), (b, _)| a.cmp(b));
    let mut payload = Vec::new();
    for (replica, g) in rest {
        if payload.is_empty() {
            put_uvarint(&mut payload, part_no);
        }
        put_bytes(&mut payload, replica.as_bytes());
        put_uvarint(&mut payload, g.count);
        payload.extend_from_slice(&g.body);
        if payload.len() >= TARGET_PAYLOAD {
            frame(&mut out, &payload);
            payload.clear();
        }
    }
    if !payload.is_empty() {
        frame(&mut out, &payload);
    }
    (out, entries)
}

fn encode_stats(index: &Index, w: &mut impl Write) -> io::Result<(u64, u64)> {
    let mut all = index.dump_stats();
    all.sort_by(|a, b| {
        (&*a.tenant, &*a.model, &*a.replica).cmp(&(&*b.tenant, &*b.model, &*b.replica))
    });
    let mut sections = 0;
    let mut buf = Vec::new();
    let mut start = 0;
    while start < all.len() {
        let (t, m) = (all[start].tenant.clone(), all[start].model.clone());
        let mut end = start;
        while end < all.len() && all[end].tenant == t && all[end].model == m {
            end += 1;
        }
        // A (tenant, model) with very many replicas is split so no payload outgrows the target.
        for chunk in all[start..end].chunks(2048) {
            let mut p = Vec::new();
            put_bytes(&mut p, t.as_bytes());
            put_bytes(&mut p, m.as_bytes());
            put_uvarint(&mut p, chunk.len() as u64);
            for s in chunk {
                put_bytes(&mut p, s.replica.as_bytes());
                put_ivarint(&mut p, s.stats.cache_memory_bytes);
                p.extend_from_slice(&s.stats.hit_rate.to_le_bytes());
                p.extend_from_slice(&s.stats.pressure.to_le_bytes());
                put_ivarint(&mut p, s.stats.t2_hit_tokens);
                put_ivarint(&mut p, s.stats.t2_query_tokens);
                put_ivarint(&mut p, s.last_seen_ms);
                put_ivarint(&mut p, s.reported_ms);
            }
            buf.clear();
            frame_section(&mut buf, SectionKind::Stats, &p);
            w.write_all(&buf)?;
            sections += 1;
        }
        start = end;
    }
    Ok((sections, all.len() as u64))
}
