//! InferenceCache under the Mooncake replay ([`crate::mooncake`]): the W1M partition and
//! configuration of [`crate::ours`] (cap unbounded, fixed clock), workers as replicas `w0`,
//! `w1`, …; a `Stored` event is one chain-form ingest of the new blocks (token counts
//! continuing from the parent's position, K8), a `Removed` event one `evict_prefixes` (E3), a
//! lookup the allocation-free core match on the request's rolling hashes (as integers,
//! `Index::match_digests_into`).

use inferencecache_engine::fingerprint::to_wire;
use inferencecache_engine::{
    CacheStateUpdate, Index, MatchScratch, PartitionHandle, PrefixRef, tier,
};

use crate::mooncake::{Pair, Reader, TRACE_BLOCK_TOKENS, Writer};
use crate::ours::{ADAPTER, MODEL, SCHEME, T0_US, TENANT};

/// Replica names of `workers` workers.
#[must_use]
pub fn replica_names(workers: u32) -> Vec<String> {
    (0..workers).map(|w| format!("w{w}")).collect()
}

/// The worker number of a replica name made by [`replica_names`].
#[inline]
fn worker_of(name: &str) -> Option<u32> {
    name.strip_prefix('w')?.parse().ok()
}

/// The event side.
pub struct OursWriter<'a> {
    index: &'a Index,
    names: Vec<String>,
    keys: Vec<[u8; 8]>,
    counts: Vec<i32>,
}

impl<'a> OursWriter<'a> {
    /// A writer for `workers` workers.
    #[must_use]
    pub fn new(index: &'a Index, workers: u32) -> Self {
        Self {
            index,
            names: replica_names(workers),
            keys: Vec::new(),
            counts: Vec::new(),
        }
    }
}

impl Writer for OursWriter<'_> {
    fn store(&mut self, worker: u32, position: u32, _: Option<u64>, _: &[u64], seq: &[u64]) {
        let Some(replica) = self.names.get(worker as usize) else {
            return;
        };
        self.keys.clear();
        self.keys.extend(seq.iter().map(|h| to_wire(*h)));
        self.counts.clear();
        self.counts.resize(seq.len(), TRACE_BLOCK_TOKENS);
        if let Some(first) = self.counts.first_mut() {
            // K8: counts are cumulative within the ref; the first block carries its prefix.
            *first = (position as i32 + 1) * TRACE_BLOCK_TOKENS;
        }
        let r = PrefixRef {
            prefix_hash: &[],
            token_count: 0,
            block_hashes: &self.keys[..],
            block_token_counts: &self.counts[..],
            tier: tier::T1,
            adapter_id: ADAPTER,
        };
        self.index.ingest(CacheStateUpdate {
            replica_id: replica,
            model_id: MODEL,
            tenant_id: TENANT,
            hash_scheme: SCHEME,
            timestamp_us: T0_US,
            prefixes: std::iter::once(r),
            stats: None,
            adapter_id: ADAPTER,
        });
    }

    fn remove(&mut self, worker: u32, seq: &[u64]) {
        let Some(replica) = self.names.get(worker as usize) else {
            return;
        };
        self.keys.clear();
        self.keys.extend(seq.iter().map(|h| to_wire(*h)));
        self.index
            .evict_prefixes(TENANT, MODEL, replica, ADAPTER, &self.keys, T0_US);
    }

    fn flush(&mut self) {}
}

/// The lookup side.
pub struct OursReader<'a> {
    index: &'a Index,
    part: Option<PartitionHandle<'a>>,
    scratch: MatchScratch,
    counts: Vec<i32>,
    /// Worker number by scope-local replica index, with the replica name's address it was
    /// read from (a name is parsed once, not per match; an index the sweep gave to another
    /// replica has another name and is parsed again).
    workers: Vec<(usize, u32)>,
}

impl<'a> OursReader<'a> {
    /// A reader of `index`.
    #[must_use]
    pub fn new(index: &'a Index) -> Self {
        Self {
            index,
            part: None,
            scratch: MatchScratch::default(),
            counts: Vec::new(),
            workers: Vec::new(),
        }
    }
}

/// The worker number of a match, through the reader's memo by replica index.
#[inline]
fn memo_worker(workers: &mut Vec<(usize, u32)>, replica_index: u32, name: &str) -> Option<u32> {
    let at = replica_index as usize;
    let address = name.as_ptr() as usize;
    if let Some(&(seen, worker)) = workers.get(at)
        && seen == address
    {
        return Some(worker);
    }
    let worker = worker_of(name)?;
    if workers.len() <= at {
        workers.resize(at + 1, (0, 0));
    }
    workers[at] = (address, worker);
    Some(worker)
}

impl Reader for OursReader<'_> {
    fn lookup(&mut self, _: &[u64], seq: &[u64], out: &mut Vec<(u32, u32)>) {
        if self.part.is_none() {
            // Created by the first ingest; a handle, once resolved, stays valid.
            self.part = self.index.partition(TENANT, MODEL, SCHEME, ADAPTER);
        }
        let Some(part) = self.part else {
            return;
        };
        if self.counts.len() < seq.len() {
            self.counts.resize(seq.len(), TRACE_BLOCK_TOKENS);
        }
        // The trace's hashes are the keys' big-endian values (`to_wire`): no conversion.
        let workers = &mut self.workers;
        self.index.match_digests_into(
            part,
            seq,
            &self.counts[..seq.len()],
            T0_US,
            &mut self.scratch,
            |m| {
                if let Some(w) = memo_worker(workers, m.replica_index, m.replica_id) {
                    out.push((w, m.blocks));
                }
            },
        );
    }
}

/// Both sides in one object, for one thread and for [`crate::mooncake::verify`].
pub type OursSingle<'a> = Pair<OursWriter<'a>, OursReader<'a>>;

impl<'a> OursSingle<'a> {
    /// Both sides of `index`.
    #[must_use]
    pub fn new(index: &'a Index, workers: u32) -> Self {
        Pair(OursWriter::new(index, workers), OursReader::new(index))
    }
}

/// InferenceCache as a [`crate::mooncake_bench::Subject`] (both thread counts).
pub struct OursSubject {
    /// Simulated workers.
    pub workers: u32,
}

fn check_empty(index: &Index, name: &str) -> Result<(), String> {
    let left = index.storage_entries();
    if left == 0 {
        Ok(())
    } else {
        Err(format!("{name}: {left} entries left after the drain"))
    }
}

impl crate::mooncake_bench::Subject for OursSubject {
    fn name(&self) -> String {
        "inferencecache".into()
    }
    fn supports(&self, threads: usize) -> bool {
        threads == 1 || threads == 2
    }
    fn synchronous(&self) -> bool {
        true
    }
    fn verify(&self, sim: &crate::mooncake::Simulation) -> Result<usize, String> {
        let index = crate::ours::new_index();
        let n = crate::mooncake::verify(sim, &mut OursSingle::new(&index, self.workers))?;
        check_empty(&index, "inferencecache")?;
        Ok(n)
    }
    fn run(
        &self,
        sim: &crate::mooncake::Simulation,
        threads: usize,
        pace: crate::mooncake::Pace,
    ) -> Result<crate::mooncake::RunStats, String> {
        let index = crate::ours::new_index();
        let stats = if threads == 1 {
            crate::mooncake::replay_single(sim, &mut OursSingle::new(&index, self.workers), pace)
        } else {
            crate::mooncake::replay_dual(
                sim,
                || OursWriter::new(&index, self.workers),
                || OursReader::new(&index),
                pace,
            )
        };
        check_empty(&index, "inferencecache")?;
        Ok(stats)
    }
}

/// The reference model ([`crate::mooncake::Reference`]) as a subject: the exactness yardstick
/// when no peer is built (one thread only).
pub struct ReferenceSubject {
    /// Simulated workers.
    pub workers: u32,
}

impl crate::mooncake_bench::Subject for ReferenceSubject {
    fn name(&self) -> String {
        "reference model".into()
    }
    fn supports(&self, threads: usize) -> bool {
        threads == 1
    }
    fn synchronous(&self) -> bool {
        true
    }
    fn verify(&self, sim: &crate::mooncake::Simulation) -> Result<usize, String> {
        crate::mooncake::verify(sim, &mut crate::mooncake::Reference::new(self.workers))
    }
    fn run(
        &self,
        sim: &crate::mooncake::Simulation,
        _: usize,
        pace: crate::mooncake::Pace,
    ) -> Result<crate::mooncake::RunStats, String> {
        let mut reference = crate::mooncake::Reference::new(self.workers);
        let stats = crate::mooncake::replay_single(sim, &mut reference, pace);
        if reference.is_empty() {
            Ok(stats)
        } else {
            Err(format!("reference model: {} blocks left", reference.len()))
        }
    }
}
