//! The fleet model behind `ic-loadgen`: Zipf-distributed shared system prompts, multi-turn
//! conversations whose token sequences only grow (so their block chains extend turn by turn),
//! sticky replica assignment, and the ground truth of which replica holds which block.
//!
//! Everything here is synchronous and cheap; the runner keeps one [`Fleet`] behind a mutex and
//! calls into it from the ingest, event and gateway tasks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use inferencecache_engine::fingerprint::{prefix_iter, to_wire};
use inferencecache_proto::v1alpha1::{
    CacheStateUpdate, CacheTier, LookupRouteRequest, PrefixEntry,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Token ids are drawn uniformly below this (a typical vocabulary size).
const VOCAB: u32 = 128_000;

/// The block hashes are already XXH3 outputs, so the set keys pass through unchanged.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type BlockSet = HashSet<u64, BuildHasherDefault<PassThrough>>;

/// How gateways send the prompt of a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputForm {
    /// `block_hashes` + `block_token_counts`, fingerprinted by the gateway (the loadgen).
    Chain,
    /// `token_ids`; the server fingerprints them.
    TokenIds,
}

/// How prompts and conversations are drawn. One type for the workload and the report's echo of
/// it, so the two cannot drift apart.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConversationShape {
    pub system_prompts: usize,
    pub zipf_s: f64,
    /// Mean system prompt length in tokens (lengths are uniform in [mean/2, 3·mean/2]).
    pub system_prompt_tokens: usize,
    /// Conversations alive at any time; a finished one is replaced by a new one.
    pub conversations: usize,
    /// Each conversation lasts a uniform 1..=max_turns turns.
    pub max_turns: u32,
    pub user_tokens: usize,
    pub assistant_tokens: usize,
    /// Probability that a turn stays on the conversation's current replica.
    pub sticky: f64,
    pub block_size: usize,
}

/// Shape of the simulated fleet and workload.
#[derive(Debug, Clone)]
pub struct WorkloadParams {
    pub replicas: usize,
    pub shape: ConversationShape,
    pub seed: u64,
    pub tenant: String,
    pub model: String,
    pub hash_scheme: String,
    pub input: InputForm,
}

/// A prebuilt lookup for the next turn of one conversation.
#[derive(Debug)]
pub struct LookupPlan {
    /// The request to send (cloned per send).
    pub request: LookupRouteRequest,
    /// The prefix hashes of the prompt's full blocks, for the ground-truth check.
    pub chain: Vec<u64>,
}

/// One report a replica sends after serving a turn.
pub struct Turn {
    pub replica: usize,
    pub update: CacheStateUpdate,
    pub blocks: usize,
}

/// Ground-truth verdict on one lookup answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Longest prefix (in blocks) any replica truly holds.
    pub best_blocks: usize,
    /// Blocks of the chain the answer's top replica truly holds (0 without a top replica).
    pub top_blocks: usize,
    /// The top replica truly holds the longest prefix (only meaningful when `best_blocks > 0`).
    pub hit: bool,
    /// The top score's `matched_tokens` equals the true longest prefix in tokens (0 and no
    /// scores count as equal when nobody holds anything).
    pub matched_exact: bool,
    /// Every replica holds the longest prefix (any answer is right; the server's distinguishing
    /// power is 0 there, so its routing floor turns such answers into AFFINITY_HINT).
    pub all_tied: bool,
    /// The top score claims more matched tokens than any replica truly holds (stale index).
    pub overclaim: bool,
}

struct Conversation {
    /// Whole token history plus the pending user message of the next turn (append-only).
    tokens: Vec<u32>,
    /// Prefix hashes of the full blocks of `tokens`.
    hashes: Vec<u64>,
    /// Blocks entirely inside the (shared) system prompt; never evicted by events.
    shared_blocks: usize,
    /// Blocks reported by the last turn (history up to the last assistant reply).
    reported_blocks: usize,
    home: usize,
    turns_left: u32,
    /// Replicas that were sent this conversation's chain.
    touched: Vec<usize>,
    lookup: Arc<LookupPlan>,
}

/// Simulated fleet state and ground truth.
pub struct Fleet {
    p: WorkloadParams,
    rng: SmallRng,
    zipf_cdf: Vec<f64>,
    systems: Vec<(Vec<u32>, Vec<u64>)>,
    convs: Vec<Conversation>,
    held: Vec<BlockSet>,
    evictions: VecDeque<(usize, u64)>,
    replica_ids: Vec<String>,
    replica_index: HashMap<String, usize>,
    dead: Vec<bool>,
}

fn extend_hashes(tokens: &[u32], hashes: &mut Vec<u64>, bs: usize) {
    let start = hashes.len() * bs;
    let parent = hashes.last().copied();
    hashes.extend(prefix_iter(&tokens[start..], bs, parent));
}

fn around(rng: &mut SmallRng, mean: usize) -> usize {
    let lo = (mean / 2).max(1);
    let hi = (mean + mean / 2).max(lo);
    rng.random_range(lo..=hi)
}

fn push_tokens(rng: &mut SmallRng, tokens: &mut Vec<u32>, n: usize) {
    tokens.extend((0..n).map(|_| rng.random_range(0..VOCAB)));
}

/// Replica id of replica `i` (`replica-000`, …).
pub fn replica_name(i: usize) -> String {
    format!("replica-{i:03}")
}

impl Fleet {
    /// Builds the system prompts and the initial conversations (nothing is reported yet).
    pub fn new(p: WorkloadParams) -> Self {
        assert!(p.replicas > 0, "at least one replica");
        assert!(p.shape.block_size > 0, "block size must be positive");
        let mut rng = SmallRng::seed_from_u64(p.seed);
        let prompts = p.shape.system_prompts.max(1);
        let mut cdf = Vec::with_capacity(prompts);
        let mut acc = 0.0;
        for k in 1..=prompts {
            acc += 1.0 / (k as f64).powf(p.shape.zipf_s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        let systems = (0..prompts)
            .map(|_| {
                let n = around(&mut rng, p.shape.system_prompt_tokens);
                let mut tokens = Vec::with_capacity(n);
                push_tokens(&mut rng, &mut tokens, n);
                let mut hashes = Vec::new();
                extend_hashes(&tokens, &mut hashes, p.shape.block_size);
                (tokens, hashes)
            })
            .collect();
        let replica_ids: Vec<String> = (0..p.replicas).map(replica_name).collect();
        let replica_index = replica_ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.clone(), i))
            .collect();
        let mut fleet = Fleet {
            held: (0..p.replicas).map(|_| BlockSet::default()).collect(),
            dead: vec![false; p.replicas],
            p,
            rng,
            zipf_cdf: cdf,
            systems,
            convs: Vec::new(),
            evictions: VecDeque::new(),
            replica_ids,
            replica_index,
        };
        for _ in 0..fleet.p.shape.conversations.max(1) {
            let c = fleet.new_conversation();
            fleet.convs.push(c);
        }
        fleet
    }

    /// Replica ids, index = replica number.
    pub fn replica_ids(&self) -> &[String] {
        &self.replica_ids
    }

    fn zipf(&mut self) -> usize {
        let u: f64 = self.rng.random();
        self.zipf_cdf
            .partition_point(|&c| c <= u)
            .min(self.zipf_cdf.len() - 1)
    }

    fn new_conversation(&mut self) -> Conversation {
        let s = self.zipf();
        let (sys_tokens, sys_hashes) = &self.systems[s];
        let mut tokens = Vec::with_capacity(sys_tokens.len() + 4 * self.p.shape.user_tokens);
        tokens.extend_from_slice(sys_tokens);
        let hashes = sys_hashes.clone();
        let shared_blocks = hashes.len();
        let home = self.rng.random_range(0..self.p.replicas);
        let turns_left = self.rng.random_range(1..=self.p.shape.max_turns.max(1));
        let mut c = Conversation {
            tokens,
            hashes,
            shared_blocks,
            reported_blocks: 0,
            home,
            turns_left,
            touched: Vec::new(),
            lookup: Arc::new(LookupPlan {
                request: LookupRouteRequest::default(),
                chain: Vec::new(),
            }),
        };
        self.add_user_message(&mut c);
        c
    }

    /// Appends the pending user message of the next turn and rebuilds the lookup for it.
    fn add_user_message(&mut self, c: &mut Conversation) {
        let n = around(&mut self.rng, self.p.shape.user_tokens);
        push_tokens(&mut self.rng, &mut c.tokens, n);
        extend_hashes(&c.tokens, &mut c.hashes, self.p.shape.block_size);
        let bs = i32::try_from(self.p.shape.block_size).unwrap_or(i32::MAX);
        let mut request = LookupRouteRequest {
            model_id: self.p.model.clone(),
            tenant_id: self.p.tenant.clone(),
            hash_scheme: self.p.hash_scheme.clone(),
            ..Default::default()
        };
        match self.p.input {
            InputForm::Chain => {
                request.block_hashes = c.hashes.iter().map(|&h| to_wire(h).to_vec()).collect();
                request.block_token_counts = vec![bs; c.hashes.len()];
            }
            InputForm::TokenIds => request.token_ids = c.tokens.clone(),
        }
        c.lookup = Arc::new(LookupPlan {
            request,
            chain: c.hashes.clone(),
        });
    }

    /// The lookup for the next turn of a uniformly random live conversation.
    pub fn random_lookup(&mut self) -> Arc<LookupPlan> {
        let i = self.rng.random_range(0..self.convs.len());
        self.convs[i].lookup.clone()
    }

    /// Serves the next turn of a random conversation on its (sticky) replica: appends the
    /// assistant reply, records the replica's new holdings in the ground truth and returns the
    /// update that replica reports (the full chain it computed). Retires finished conversations
    /// (queueing evictions of their private blocks) and replaces them.
    pub fn next_turn(&mut self) -> Turn {
        let i = self.rng.random_range(0..self.convs.len());
        let mut c = std::mem::replace(&mut self.convs[i], Conversation::placeholder());
        if self.rng.random::<f64>() >= self.p.shape.sticky || self.dead[c.home] {
            c.home = self.rng.random_range(0..self.p.replicas);
        }
        let n = around(&mut self.rng, self.p.shape.assistant_tokens);
        push_tokens(&mut self.rng, &mut c.tokens, n);
        extend_hashes(&c.tokens, &mut c.hashes, self.p.shape.block_size);
        c.reported_blocks = c.hashes.len();
        let r = c.home;
        if !self.dead[r] {
            let held = &mut self.held[r];
            held.extend(c.hashes.iter().copied());
        }
        if !c.touched.contains(&r) {
            c.touched.push(r);
        }
        let bs = i32::try_from(self.p.shape.block_size).unwrap_or(i32::MAX);
        let update = CacheStateUpdate {
            replica_id: self.replica_ids[r].clone(),
            model_id: self.p.model.clone(),
            tenant_id: self.p.tenant.clone(),
            hash_scheme: self.p.hash_scheme.clone(),
            timestamp_us: 0,
            prefixes: vec![PrefixEntry {
                block_hashes: c.hashes.iter().map(|&h| to_wire(h).to_vec()).collect(),
                block_token_counts: vec![bs; c.hashes.len()],
                tier: CacheTier::T1 as i32,
                ..Default::default()
            }],
            stats: None,
            adapter_id: String::new(),
        };
        let blocks = c.hashes.len();
        c.turns_left = c.turns_left.saturating_sub(1);
        if c.turns_left == 0 {
            self.retire(&c);
            c = self.new_conversation();
        } else {
            self.add_user_message(&mut c);
        }
        self.convs[i] = c;
        Turn {
            replica: r,
            update,
            blocks,
        }
    }
}

impl Conversation {
    fn placeholder() -> Conversation {
        Conversation {
            tokens: Vec::new(),
            hashes: Vec::new(),
            shared_blocks: 0,
            reported_blocks: 0,
            home: 0,
            turns_left: 0,
            touched: Vec::new(),
            lookup: Arc::new(LookupPlan {
                request: LookupRouteRequest::default(),
                chain: Vec::new(),
            }),
        }
    }
}

impl Fleet {
    /// Queues PREFIX_EVICTED of a finished conversation's private blocks on every replica that
    /// still holds them, deepest block first (as an engine's LRU frees a chain's leaves first).
    fn retire(&mut self, c: &Conversation) {
        for &r in &c.touched {
            for &h in c.hashes[c.shared_blocks..c.reported_blocks].iter().rev() {
                if self.held[r].contains(&h) {
                    self.evictions.push_back((r, h));
                }
            }
        }
    }

    /// Next eviction to publish, applied to the ground truth now: (replica, block hash).
    pub fn pop_eviction(&mut self) -> Option<(usize, u64)> {
        while let Some((r, h)) = self.evictions.pop_front() {
            if self.held[r].remove(&h) {
                return Some((r, h));
            }
        }
        None
    }

    /// Evictions still waiting to be published.
    pub fn eviction_backlog(&self) -> usize {
        self.evictions.len()
    }

    /// A random replica to clear, applied to the ground truth now.
    pub fn clear_random_replica(&mut self) -> usize {
        let r = self.rng.random_range(0..self.p.replicas);
        self.held[r].clear();
        r
    }

    /// Forgets a replica whose report stream broke: the server's view of it is unknown, so it
    /// leaves the truth model and takes no more turns.
    pub fn mark_dead(&mut self, r: usize) {
        self.dead[r] = true;
        self.held[r].clear();
    }

    /// (replica, block) entries the fleet truly holds right now.
    pub fn held_entries(&self) -> usize {
        self.held.iter().map(HashSet::len).sum()
    }

    /// Blocks of `chain` that replica `r` holds as a leading run.
    ///
    /// Replicas only ever receive whole chains from the root, and events only remove the
    /// private blocks of finished conversations deepest-first, or everything (ALL_CLEARED), so a
    /// replica's holdings along a live conversation's chain are always a leading run: a binary
    /// search finds its end.
    fn depth(&self, r: usize, chain: &[u64]) -> usize {
        let held = &self.held[r];
        let depth = chain.partition_point(|h| held.contains(h));
        debug_assert!(chain[depth..].iter().all(|h| !held.contains(h)));
        depth
    }

    /// Judges an answer: `top` is the first score's replica id and `matched_tokens`.
    pub fn judge(&self, chain: &[u64], top: Option<(&str, i32)>) -> Verdict {
        let mut best_blocks = 0;
        let mut least_blocks = usize::MAX;
        for r in 0..self.held.len() {
            let d = self.depth(r, chain);
            best_blocks = best_blocks.max(d);
            least_blocks = least_blocks.min(d);
        }
        let top_blocks = top
            .and_then(|(id, _)| self.replica_index.get(id))
            .map(|&r| self.depth(r, chain))
            .unwrap_or(0);
        let best_tokens = best_blocks * self.p.shape.block_size;
        let matched = top.map(|(_, m)| m).unwrap_or(0);
        Verdict {
            best_blocks,
            top_blocks,
            hit: best_blocks > 0 && top.is_some() && top_blocks == best_blocks,
            matched_exact: i64::from(matched) == best_tokens as i64,
            all_tied: best_blocks > 0 && least_blocks == best_blocks,
            overclaim: i64::from(matched) > best_tokens as i64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> WorkloadParams {
        WorkloadParams {
            replicas: 4,
            shape: ConversationShape {
                system_prompts: 8,
                zipf_s: 1.1,
                system_prompt_tokens: 256,
                conversations: 16,
                max_turns: 4,
                user_tokens: 32,
                assistant_tokens: 64,
                sticky: 0.9,
                block_size: 16,
            },
            seed: 7,
            tenant: "t".into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            input: InputForm::Chain,
        }
    }

    #[test]
    fn chains_extend_and_truth_follows_reports() {
        let mut f = Fleet::new(params());
        for _ in 0..500 {
            let t = f.next_turn();
            let chain: Vec<u64> = t.update.prefixes[0]
                .block_hashes
                .iter()
                .map(|b| u64::from_be_bytes(b.as_slice().try_into().unwrap()))
                .collect();
            let v = f.judge(&chain, Some((&replica_name(t.replica), 0)));
            assert_eq!(v.best_blocks, chain.len());
            assert!(v.hit);
            while f.pop_eviction().is_some() {}
        }
        let plan = f.random_lookup();
        assert_eq!(plan.request.block_hashes.len(), plan.chain.len());
    }
}
