//! Reading a checkpoint: [`check`] reads and decodes every section without touching an index;
//! [`restore`] checks first, then reads the file again and applies it, decoding and loading a
//! window of sections at a time in parallel (rayon). The window bounds what a restore holds
//! beyond the index it builds to a few section payloads and their decoded entries.

use super::format::{
    Cursor, FormatError, HEADER_LEN, Header, Section, SectionKind, SectionReader, decode_header,
};
use super::{FLAG_KEY8, FLAG_LFU, FLAG_TIER, MAX_KEY, MAX_NAME};
use crate::{Index, LoadEntry, LoadOutcome, ReplicaStatsInput};
use rayon::prelude::*;
use std::io::{Read, Seek, SeekFrom};
use std::time::{Duration, Instant};

/// What a check or a restore found.
#[derive(Debug, Clone, Default)]
pub struct RestoreReport {
    /// The header.
    pub header: Option<Header>,
    /// Entries in the file.
    pub entries: u64,
    /// What loading them did (zero for a check).
    pub outcome: LoadOutcome,
    /// Stats records in the file.
    pub stats: u64,
    /// Stats records loaded (zero for a check; expired ones are skipped).
    pub stats_loaded: u64,
    /// Partitions in the file.
    pub partitions: u64,
    /// Bytes read (one pass).
    pub bytes: u64,
    /// The blobs, by name.
    pub blobs: Vec<(String, Vec<u8>)>,
    /// Time taken.
    pub duration: Duration,
}

struct PartitionNames {
    tenant: String,
    model: String,
    scheme: String,
    adapter: String,
}

/// One decoded group of an Entries section.
struct DecodedGroup<'a> {
    replica: &'a str,
    entries: Vec<LoadEntry<'a>>,
}

fn bad(section: u64) -> impl Fn(&'static str) -> FormatError {
    move |reason| FormatError::BadPayload { section, reason }
}

fn decode_partition(s: &Section) -> Result<PartitionNames, FormatError> {
    let mut c = Cursor::new(&s.payload);
    let e = bad(s.index);
    let names = PartitionNames {
        tenant: c.str(MAX_NAME).map_err(&e)?.to_owned(),
        model: c.str(MAX_NAME).map_err(&e)?.to_owned(),
        scheme: c.str(MAX_NAME).map_err(&e)?.to_owned(),
        adapter: c.str(MAX_NAME).map_err(&e)?.to_owned(),
    };
    if !c.is_empty() {
        return Err(e("bytes after the partition names"));
    }
    Ok(names)
}

/// Decodes an Entries section: its partition number and groups.
fn decode_entries(s: &Section) -> Result<(u64, Vec<DecodedGroup<'_>>), FormatError> {
    let e = bad(s.index);
    let mut c = Cursor::new(&s.payload);
    let part = c.uvarint().map_err(&e)?;
    let mut groups = Vec::new();
    while !c.is_empty() {
        let replica = c.str(MAX_NAME).map_err(&e)?;
        // Every entry takes at least 4 bytes, so a count beyond that is a lie: refuse it before
        // reserving anything for it.
        let count = c
            .bounded(
                (c.remaining() / 4) as u64,
                "entry count exceeds the payload",
            )
            .map_err(&e)?;
        let mut entries = Vec::with_capacity(count as usize);
        let mut prev_ms = 0i64;
        for _ in 0..count {
            let flags = c.byte().map_err(&e)?;
            if flags & !(FLAG_TIER | FLAG_LFU | FLAG_KEY8) != 0 {
                return Err(e("unknown entry flags"));
            }
            let key_len = if flags & FLAG_KEY8 != 0 {
                8
            } else {
                c.bounded(MAX_KEY as u64, "key longer than the format allows")
                    .map_err(&e)? as usize
            };
            let key = c.take(key_len).map_err(&e)?;
            let tokens = c.ivarint().map_err(&e)?;
            let tokens = i32::try_from(tokens).map_err(|_| e("token count out of range"))?;
            let delta = c.ivarint().map_err(&e)?;
            let last_seen_ms = prev_ms.wrapping_add(delta);
            prev_ms = last_seen_ms;
            let lfu_count = if flags & FLAG_LFU != 0 {
                c.uvarint().map_err(&e)?
            } else {
                0
            };
            entries.push(LoadEntry {
                key,
                tokens,
                tier: i32::from(flags & FLAG_TIER),
                last_seen_ms,
                lfu_count,
            });
        }
        groups.push(DecodedGroup { replica, entries });
    }
    Ok((part, groups))
}

struct DecodedStats<'a> {
    tenant: &'a str,
    model: &'a str,
    records: Vec<(&'a str, ReplicaStatsInput, i64, i64)>,
}

fn decode_stats(s: &Section) -> Result<DecodedStats<'_>, FormatError> {
    let e = bad(s.index);
    let mut c = Cursor::new(&s.payload);
    let tenant = c.str(MAX_NAME).map_err(&e)?;
    let model = c.str(MAX_NAME).map_err(&e)?;
    let count = c
        .bounded(
            (c.remaining() / 8) as u64,
            "record count exceeds the payload",
        )
        .map_err(&e)?;
    let mut records = Vec::with_capacity(count as usize);
    let f32_of = |c: &mut Cursor<'_>| -> Result<f32, &'static str> {
        let b = c.take(4)?;
        Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    for _ in 0..count {
        let replica = c.str(MAX_NAME).map_err(&e)?;
        let stats = ReplicaStatsInput {
            cache_memory_bytes: c.ivarint().map_err(&e)?,
            hit_rate: f32_of(&mut c).map_err(&e)?,
            pressure: f32_of(&mut c).map_err(&e)?,
            t2_hit_tokens: c.ivarint().map_err(&e)?,
            t2_query_tokens: c.ivarint().map_err(&e)?,
        };
        let last_seen = c.ivarint().map_err(&e)?;
        let reported = c.ivarint().map_err(&e)?;
        records.push((replica, stats, last_seen, reported));
    }
    if !c.is_empty() {
        return Err(e("bytes after the stats records"));
    }
    Ok(DecodedStats {
        tenant,
        model,
        records,
    })
}

/// A ShardSize hint: `(partition, shard, entries)`.
fn decode_shard_size(s: &Section) -> Result<(u64, u64, u64), FormatError> {
    let e = bad(s.index);
    let mut c = Cursor::new(&s.payload);
    let hint = (
        c.uvarint().map_err(&e)?,
        c.uvarint().map_err(&e)?,
        c.uvarint().map_err(&e)?,
    );
    if !c.is_empty() {
        return Err(e("bytes after the shard size"));
    }
    Ok(hint)
}

fn decode_blob(s: &Section) -> Result<(String, Vec<u8>), FormatError> {
    let e = bad(s.index);
    let mut c = Cursor::new(&s.payload);
    let name = c.str(MAX_NAME).map_err(&e)?.to_owned();
    let rest = c.take(c.remaining()).map_err(&e)?;
    Ok((name, rest.to_vec()))
}

fn read_header(r: &mut impl Read) -> Result<Header, FormatError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    decode_header(&h[..got])
}

/// Reads and decodes the whole checkpoint without applying it.
pub fn check(mut r: impl Read) -> Result<RestoreReport, FormatError> {
    let started = Instant::now();
    let mut report = RestoreReport {
        header: Some(read_header(&mut r)?),
        ..Default::default()
    };
    let mut reader = SectionReader::new(r);
    let mut bytes = super::format::HEADER_LEN as u64;
    while let Some(s) = reader.next_section()? {
        bytes += s.payload.len() as u64 + 16;
        match s.kind {
            SectionKind::Partition => {
                decode_partition(&s)?;
                report.partitions += 1;
            }
            SectionKind::Entries => {
                let (part, groups) = decode_entries(&s)?;
                if part >= report.partitions {
                    return Err(bad(s.index)(
                        "entries name a partition not defined before them",
                    ));
                }
                let n: u64 = groups.iter().map(|g| g.entries.len() as u64).sum();
                reader.count_entries(n);
                report.entries += n;
            }
            SectionKind::Stats => report.stats += decode_stats(&s)?.records.len() as u64,
            SectionKind::Blob => report.blobs.push(decode_blob(&s)?),
            SectionKind::ShardSize => {
                let (part, _, _) = decode_shard_size(&s)?;
                if part >= report.partitions {
                    return Err(bad(s.index)(
                        "a shard size names a partition not defined before it",
                    ));
                }
            }
            SectionKind::End => {}
        }
    }
    report.bytes = bytes + 16;
    report.duration = started.elapsed();
    Ok(report)
}

/// Sections decoded and loaded per parallel window.
const WINDOW: usize = 16;

/// Checks the checkpoint read from `r`, then rewinds and loads it into `index`. A checkpoint
/// that fails the check changes nothing. (If the second pass reads different bytes than the
/// first — the file was modified in place during the restore — it stops at the first bad
/// section with that section's error, and what it loaded before stays loaded: every loaded
/// entry is one the checkpoint holds.)
pub fn restore<R: Read + Seek>(index: &Index, mut r: R) -> Result<RestoreReport, FormatError> {
    let started = Instant::now();
    let checked = check(&mut r)?;
    r.seek(SeekFrom::Start(0))?;
    let header = read_header(&mut r)?;
    let mut reader =
        SectionReader::without_entry_check(std::io::BufReader::with_capacity(1 << 20, r));
    let mut report = RestoreReport {
        header: Some(header),
        blobs: checked.blobs,
        bytes: checked.bytes,
        ..Default::default()
    };
    let mut parts: Vec<PartitionNames> = Vec::new();
    let mut window: Vec<Section> = Vec::with_capacity(WINDOW);
    let apply_window = |window: &mut Vec<Section>,
                        parts: &[PartitionNames],
                        report: &mut RestoreReport|
     -> Result<(), FormatError> {
        let decoded: Vec<(u64, Vec<DecodedGroup<'_>>, u64)> = window
            .par_iter()
            .map(|s| decode_entries(s).map(|(part, groups)| (part, groups, s.index)))
            .collect::<Result<_, _>>()?;
        // Each load checks the global cap against the stored entries plus its own pending
        // ones, so sections loaded at once could pass it together: a window that might reach
        // the cap is loaded one section at a time (exactly at the cap), others in parallel.
        let in_window: u64 = decoded
            .iter()
            .flat_map(|(_, groups, _)| groups.iter())
            .map(|g| g.entries.len() as u64)
            .sum();
        let cap = index.config().max_entries;
        let fits = cap <= 0 || index.storage_entries().saturating_add(in_window as i64) <= cap;
        let load = |(part, groups, section): &(u64, Vec<DecodedGroup<'_>>, u64)| {
            let names = parts
                .get(*part as usize)
                .ok_or_else(|| bad(*section)("entries name an undefined partition"))?;
            let mut outcome = LoadOutcome::default();
            let mut n = 0;
            let target =
                index.load_target(&names.tenant, &names.model, &names.scheme, &names.adapter);
            for g in groups {
                n += g.entries.len() as u64;
                match &target {
                    Some(t) => outcome.add(&index.load_entries(t, g.replica, &g.entries)),
                    None => outcome.dropped += g.entries.len() as u64,
                }
            }
            Ok((n, outcome))
        };
        let results: Vec<Result<(u64, LoadOutcome), FormatError>> = if fits {
            decoded.par_iter().map(load).collect()
        } else {
            decoded.iter().map(load).collect()
        };
        window.clear();
        for r in results {
            let (n, o) = r?;
            report.entries += n;
            report.outcome.add(&o);
        }
        Ok(())
    };
    while let Some(s) = reader.next_section()? {
        match s.kind {
            SectionKind::Partition => {
                apply_window(&mut window, &parts, &mut report)?;
                parts.push(decode_partition(&s)?);
                report.partitions += 1;
            }
            SectionKind::Entries => {
                window.push(s);
                if window.len() == WINDOW {
                    apply_window(&mut window, &parts, &mut report)?;
                }
            }
            SectionKind::Stats => {
                let d = decode_stats(&s)?;
                for (replica, stats, last, reported) in &d.records {
                    report.stats += 1;
                    if index.load_stats(d.tenant, d.model, replica, stats, *last, *reported) {
                        report.stats_loaded += 1;
                    }
                }
            }
            SectionKind::ShardSize => {
                apply_window(&mut window, &parts, &mut report)?;
                let (part, shard, entries) = decode_shard_size(&s)?;
                let names = parts
                    .get(part as usize)
                    .ok_or_else(|| bad(s.index)("a shard size names an undefined partition"))?;
                // A hint never sizes a table beyond what the checked file really holds.
                let keys = entries.min(checked.entries) as usize;
                if let (Ok(shard), Some(target)) = (
                    usize::try_from(shard),
                    index.load_target(&names.tenant, &names.model, &names.scheme, &names.adapter),
                ) {
                    index.reserve_shard(&target, shard, keys);
                }
            }
            SectionKind::Blob | SectionKind::End => {}
        }
    }
    apply_window(&mut window, &parts, &mut report)?;
    report.duration = started.elapsed();
    Ok(report)
}
