//! The run store against a plain map: random chain ingests and removals (ranges forwards and
//! backwards, random key sequences with repeats, several replicas, changing tiers, token
//! counts and timestamps), then every key's holders and walks from every key compared.

use super::*;
use crate::raw::key::{EightByteKeys, long_part};
use proptest::prelude::*;
use std::collections::BTreeMap;

/// Per key, per replica: (tier, tokens, last_seen, generation as first seen by the model).
type Model = BTreeMap<u64, BTreeMap<u32, (u8, i32, i64)>>;

#[derive(Clone, Debug)]
enum Op {
    Ingest {
        keys: Vec<u64>,
        rep: u32,
        tier: u8,
        tokens: Vec<i32>,
        ts: i64,
    },
    Evict {
        keys: Vec<u64>,
        rep: u32,
    },
    Clear {
        rep: u32,
    },
    /// Removes every entry last seen before `cutoff`.
    Sweep {
        cutoff: i64,
    },
    /// Removes keys with all their holders.
    RemoveKeys {
        keys: Vec<u64>,
    },
}

const UNIVERSE: u64 = 48;

fn chain() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        (1..=UNIVERSE, 1usize..40, any::<bool>()).prop_map(|(start, len, backwards)| {
            let mut keys: Vec<u64> = (0..len as u64)
                .map(|i| (start + i - 1) % UNIVERSE + 1)
                .collect();
            keys.dedup();
            if backwards {
                keys.reverse();
            }
            keys
        }),
        prop::collection::vec(1..=UNIVERSE, 1..12),
        // Longer than `has_repeats`' pairwise bound, so its set finds the repeats.
        prop::collection::vec(1..=UNIVERSE, 17..40),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (chain(), 0u32..5, 1u8..=4, prop::collection::vec(prop_oneof![3 => Just(16), 1 => 1i32..16], 40), 0i64..4)
            .prop_map(|(keys, rep, tier, tokens, ts)| Op::Ingest { keys, rep, tier, tokens, ts: 1_000 + ts * 100 }),
        2 => (chain(), 0u32..5).prop_map(|(keys, rep)| Op::Evict { keys, rep }),
        1 => (0u32..5).prop_map(|rep| Op::Clear { rep }),
        1 => (0i64..4).prop_map(|c| Op::Sweep { cutoff: 1_050 + c * 100 }),
        1 => chain().prop_map(|keys| Op::RemoveKeys { keys }),
    ]
}

/// Ops of an engine's prefix cache: chains of consecutive keys whose token counts are their
/// keys' positions (16 tokens a key, the first block carrying its prefix's, K8), written by
/// few replicas at one tier and mostly one time, so a chain that starts at a held block
/// continues it with the same state and runs held by one replica are common, and removals of
/// consecutive keys, which often remove such a run's last blocks (an LRU's leaves).
fn tail_op() -> impl Strategy<Value = Op> {
    let range = (1..=UNIVERSE, 1u64..16)
        .prop_map(|(start, len)| (start..(start + len).min(UNIVERSE + 1)).collect::<Vec<u64>>());
    prop_oneof![
        4 => (range.clone(), 0u32..3, 0i64..4).prop_map(|(keys, rep, ts)| {
            let mut tokens = vec![16; 40];
            tokens[0] = 16 * keys[0] as i32;
            // Mostly one time: a re-ingest leaves the blocks as they are.
            let ts = if ts == 0 { 1_100 } else { 1_000 };
            Op::Ingest { keys, rep, tier: 1, tokens, ts }
        }),
        3 => (range, 0u32..3).prop_map(|(keys, rep)| Op::Evict { keys, rep }),
        1 => (0u32..3).prop_map(|rep| Op::Clear { rep }),
        1 => (0i64..2).prop_map(|c| Op::Sweep { cutoff: 1_050 + c * 100 }),
    ]
}

/// What a write did: (blocks added, keys new) for an ingest, (blocks removed, keys removed)
/// for a removal, and the (key, replica) entries it added or removed, in chain order for an
/// ingest or a PREFIX_EVICTED, sorted for the others.
type Done = ((usize, usize), Vec<(u64, u32)>);

/// A chain's entry token counts: the running (wrapping) sums of its blocks' counts.
fn cumulative(counts: &[i32]) -> Vec<i32> {
    counts
        .iter()
        .scan(0i32, |sum, &c| {
            *sum = sum.wrapping_add(c);
            Some(*sum)
        })
        .collect()
}

/// The holders of offset `o` of `run`, each with its entry's token count.
fn holders_at(run: &BlockRun, o: usize) -> Vec<Holder> {
    let mut hs = Vec::new();
    run.for_each_holder(|_, h| hs.push(h.with_tokens(run.tokens_at(&h, o))));
    hs
}

/// Applies `op` to the model.
fn apply(model: &mut Model, op: &Op) -> Done {
    let mut counts = (0, 0);
    let mut changes = Vec::new();
    let mut remove = |model: &mut Model, k: u64, rep: u32| {
        if let Some(e) = model.get_mut(&k)
            && e.remove(&rep).is_some()
        {
            changes.push((k, rep));
            counts.0 += 1;
            if e.is_empty() {
                model.remove(&k);
                counts.1 += 1;
            }
        }
    };
    match op {
        Op::Ingest {
            keys,
            rep,
            tier,
            tokens,
            ts,
        } => {
            let mut added = (0, 0);
            let mut changes = Vec::new();
            for (k, t) in keys.iter().zip(cumulative(tokens)) {
                added.1 += usize::from(!model.contains_key(k));
                let e = model.entry(*k).or_default();
                let ls = e.get(rep).map_or(*ts, |&(_, _, old)| old.max(*ts));
                if e.insert(*rep, (*tier, t, ls)).is_none() {
                    added.0 += 1;
                    changes.push((*k, *rep));
                }
            }
            return (added, changes);
        }
        Op::Evict { keys, rep } => {
            for k in keys {
                remove(model, *k, *rep);
            }
        }
        Op::Clear { rep } => {
            let keys: Vec<u64> = model.keys().copied().collect();
            for k in keys {
                remove(model, k, *rep);
            }
        }
        Op::Sweep { cutoff } => {
            let stale: Vec<(u64, u32)> = model
                .iter()
                .flat_map(|(k, e)| {
                    e.iter()
                        .filter(|(_, s)| s.2 < *cutoff)
                        .map(move |(r, _)| (*k, *r))
                })
                .collect();
            for (k, r) in stale {
                remove(model, k, r);
            }
        }
        Op::RemoveKeys { keys } => {
            for k in keys {
                let reps: Vec<u32> = model
                    .get(k)
                    .map(|e| e.keys().copied().collect())
                    .unwrap_or_default();
                for r in reps {
                    remove(model, *k, r);
                }
            }
        }
    }
    if !matches!(op, Op::Evict { .. }) {
        changes.sort_unstable();
    }
    (counts, changes)
}

/// How the model's key ids become the store's keys: `Plain` passes the ids as 8-byte keys
/// (`&[u64]`); `Mixed` passes bytes, every third id a key of another length than 8 (id 3 the
/// empty key), the others the id's 8 big-endian bytes.
#[derive(Clone, Copy, Debug)]
enum Naming {
    Plain,
    Mixed,
}

impl Naming {
    fn bytes(self, id: u64) -> Vec<u8> {
        match self {
            Naming::Mixed if id == 3 => Vec::new(),
            Naming::Mixed if id.is_multiple_of(3) => format!("long key {id}")
                .repeat(1 + (id % 4) as usize)
                .into_bytes(),
            _ => id.to_be_bytes().to_vec(),
        }
    }

    /// The digests and bytes of `ids`.
    fn keys(self, ids: &[u64]) -> (Vec<u64>, Vec<Vec<u8>>) {
        let bytes: Vec<Vec<u8>> = ids.iter().map(|&id| self.bytes(id)).collect();
        (bytes.iter().map(|b| digest(b)).collect(), bytes)
    }

    /// The id of the key with `digest` and long part `long`.
    fn id(self, digest: u64, long: Option<&[u8]>) -> u64 {
        (1..=UNIVERSE)
            .find(|&id| {
                let b = self.bytes(id);
                crate::raw::key::digest(&b) == digest && long_part(&b) == long
            })
            .unwrap_or_else(|| panic!("no key id has digest {digest:#x} and part {long:?}"))
    }
}

fn digest(bytes: &[u8]) -> u64 {
    crate::raw::key::digest(bytes)
}

fn state(holders: &[Holder]) -> BTreeMap<u32, (u8, i32, i64)> {
    holders
        .iter()
        .map(|h| (h.rep(), (h.tier(), h.tokens(), h.last_seen_ms())))
        .collect()
}

fn check(
    store: &RunStore,
    naming: Naming,
    model: &Model,
    generations: &mut BTreeMap<(u64, u32), u32>,
) {
    let guard = crossbeam_epoch::pin();
    assert_eq!(store.len(), model.len(), "keys present");
    for k in 1..=UNIVERSE {
        let bytes = naming.bytes(k);
        let got = store.holders_keyed(digest(&bytes), long_part(&bytes), &guard);
        match model.get(&k) {
            None => assert_eq!(got, None, "key {k} should be absent"),
            Some(want) => {
                let got = got.expect("a present key");
                assert_eq!(&state(&got), want, "holders of key {k}");
                assert_eq!(got.len(), want.len(), "one entry per replica of key {k}");
                for h in &got {
                    // A holder keeps its generation while it holds the key (V3, L9).
                    let g = generations.entry((k, h.rep())).or_insert(h.generation());
                    assert_eq!(
                        *g,
                        h.generation(),
                        "generation of key {k} replica {}",
                        h.rep()
                    );
                }
            }
        }
    }
    let mut listed = BTreeMap::new();
    store.for_each_key(&guard, |d, run, o| {
        assert_eq!(run.key(o), d);
        let k = naming.id(d, run.long_key(o));
        assert!(
            listed.insert(k, state(&holders_at(run, o))).is_none(),
            "key {k} listed twice"
        );
    });
    assert_eq!(&listed, model, "for_each_key lists the model");
    // Every run's references are its live offsets, and trimming bounds its dead ones.
    let mut runs = std::collections::BTreeSet::new();
    store.for_each_key(&guard, |_, run, _| {
        if runs.insert(run as *const BlockRun as usize) {
            let live = run.live_count();
            assert_eq!(run.refs() as usize, live, "a run's references");
            let (ranges, split) = split_bytes(run);
            assert!(
                run.len() - live <= 3 * live || (ranges > 1 && split >= run.bytes()),
                "a run of {} offsets keeps only {live} live",
                run.len()
            );
        }
    });
    generations.retain(|(k, r), _| model.get(k).is_some_and(|e| e.contains_key(r)));
    // Walks from every key along the universe's ascending ranges: the stretches cover the
    // longest present prefix, each block with its model holders.
    for start in 1..=UNIVERSE {
        let request: Vec<u64> = (start..=UNIVERSE).chain(1..start).collect();
        let (digests, bytes) = naming.keys(&request);
        let keys = Keys::with_bytes(&digests, &bytes).expect("as many bytes as digests");
        let mut blocks = Vec::new();
        let mut visit = |run: &BlockRun, from: usize, to: usize| {
            for (k, d) in request[from..to].iter().zip(&digests[from..to]) {
                // A run's keys are distinct: the block's offset is where its digest is.
                let o = run
                    .keys()
                    .iter()
                    .position(|x| x == d)
                    .expect("a key of the run");
                blocks.push((*k, state(&holders_at(run, o))));
            }
            true
        };
        let matched = match naming {
            Naming::Plain => store.walk(&request, &guard, &mut visit),
            Naming::Mixed => store.walk(keys, &guard, &mut visit),
        };
        let want = request.iter().take_while(|k| model.contains_key(k)).count();
        assert_eq!(matched, want, "walk from {start}");
        assert_eq!(blocks.len(), want);
        for (k, hs) in &blocks {
            assert_eq!(hs, &model[k], "walk from {start}: holders of key {k}");
        }
    }
}

/// Applies `op` to the store; returns what [`apply`] does.
fn perform(store: &RunStore, naming: Naming, op: &Op) -> Done {
    let guard = crossbeam_epoch::pin();
    let mut changes = Vec::new();
    let chain = match op {
        Op::Ingest { keys, .. } | Op::Evict { keys, .. } | Op::RemoveKeys { keys } => {
            naming.keys(keys)
        }
        Op::Clear { .. } | Op::Sweep { .. } => (Vec::new(), Vec::new()),
    };
    let mixed = Keys::with_bytes(&chain.0, &chain.1).expect("as many bytes as digests");
    let counts = match op {
        Op::Ingest {
            keys,
            rep,
            tier,
            tokens,
            ts,
        } => {
            let writing = Writing {
                rep: *rep,
                tier: *tier,
                ts_ms: *ts,
            };
            let tokens = &tokens[..keys.len()];
            let sums = cumulative(tokens);
            let added = |i: usize, h: Holder| {
                // A new entry: the write's state, its own timestamp.
                assert_eq!(
                    (h.tier(), h.tokens(), h.last_seen_ms()),
                    (*tier, sums[i], *ts),
                    "the entry added for block {i}"
                );
                changes.push((keys[i], h.rep()));
            };
            let report = match naming {
                Naming::Plain => store.ingest_with(keys, tokens, writing, &guard, added),
                Naming::Mixed => store.ingest_with(mixed, tokens, writing, &guard, added),
            };
            assert_eq!(report.dropped, 0);
            (report.added, report.new_keys)
        }
        Op::Evict { keys, rep } => {
            let removed = |i: usize, h: Holder| changes.push((keys[i], h.rep()));
            let report = match naming {
                Naming::Plain => store.evict_with(keys, *rep, &guard, removed),
                Naming::Mixed => store.evict_with(mixed, *rep, &guard, removed),
            };
            (report.removed, report.keys_removed)
        }
        Op::Clear { rep } => {
            let report = store.remove_holders_with(
                |h| h.rep() == *rep,
                &guard,
                |d, long, h| changes.push((naming.id(d, long), h.rep())),
            );
            (report.removed, report.keys_removed)
        }
        Op::Sweep { cutoff } => {
            let report = store.remove_holders_with(
                |h| h.last_seen_ms() < *cutoff,
                &guard,
                |d, long, h| changes.push((naming.id(d, long), h.rep())),
            );
            (report.removed, report.keys_removed)
        }
        Op::RemoveKeys { keys } => {
            let removed =
                |d, long: Option<&[u8]>, h: Holder| changes.push((naming.id(d, long), h.rep()));
            let report = match naming {
                Naming::Plain => store.remove_keys_with(keys, &guard, removed),
                Naming::Mixed => store.remove_keys_with(mixed, &guard, removed),
            };
            (report.removed, report.keys_removed)
        }
    };
    if !matches!(op, Op::Ingest { .. } | Op::Evict { .. }) {
        changes.sort_unstable();
    }
    (counts, changes)
}

fn run_ops(options: StoreOptions, naming: Naming, ops: &[Op]) {
    let store = RunStore::new(options);
    let mut model = Model::new();
    let mut generations = BTreeMap::new();
    for op in ops {
        let done = perform(&store, naming, op);
        assert_eq!(done, apply(&mut model, op), "counts and changes of {op:?}");
        check(&store, naming, &model, &mut generations);
    }
    // Everything removed: nothing left, no run bytes, no root slot.
    let guard = crossbeam_epoch::pin();
    let all: Vec<u64> = (1..=UNIVERSE).collect();
    let (digests, bytes) = naming.keys(&all);
    for rep in 0..5 {
        store.evict(
            Keys::with_bytes(&digests, &bytes).expect("as many"),
            rep,
            &guard,
        );
    }
    assert!(store.is_empty());
    assert_eq!(store.root_count(), 0);
    assert_eq!(store.run_bytes(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn repeats_are_found_exactly(
        keys in prop_oneof![
            prop::collection::vec(0..64u64, 0..200),
            prop::collection::vec(any::<u64>(), 0..200),
            // Distinct random keys but one, repeated: the filter sees a shared bit and the set
            // must find the pair.
            (prop::collection::vec(any::<u64>(), 2..200), any::<prop::sample::Index>(), any::<prop::sample::Index>())
                .prop_map(|(mut keys, from, to)| {
                    let (from, to) = (from.index(keys.len()), to.index(keys.len()));
                    keys[to] = keys[from];
                    keys
                }),
        ],
        seed in any::<u64>(),
    ) {
        let naive = keys.iter().enumerate().any(|(i, k)| keys[i + 1..].contains(k));
        let mut seen = Vec::new();
        prop_assert_eq!(has_repeats(&keys, &mut seen, seed), naive);
        // The scratch is reused: a second call on other keys is as exact.
        let mut distinct = keys.clone();
        distinct.sort_unstable();
        distinct.dedup();
        prop_assert!(!has_repeats(&distinct, &mut seen, seed));
    }

    #[test]
    fn matches_the_model(ops in prop::collection::vec(op(), 1..40)) {
        run_ops(StoreOptions::default(), Naming::Plain, &ops);
    }

    #[test]
    fn matches_the_model_with_keys_of_other_lengths(ops in prop::collection::vec(op(), 1..40)) {
        run_ops(StoreOptions::default(), Naming::Mixed, &ops);
    }

    #[test]
    fn matches_the_model_with_continuations_and_tail_removals(ops in prop::collection::vec(tail_op(), 1..60)) {
        run_ops(StoreOptions::default(), Naming::Plain, &ops);
    }

    #[test]
    fn matches_the_model_without_aids(ops in prop::collection::vec(op(), 1..40)) {
        run_ops(StoreOptions { hints: false, roots: false, gone: false, join: false }, Naming::Plain, &ops);
    }
}

#[test]
fn a_shared_prefix_is_three_runs_and_walks_in_three_stretches() {
    // W1M's shape: replicas 0..8 share blocks 1..=16, pairs share 17..=32, each its own tail.
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    let chain = |rep: u64| -> Vec<u64> {
        (1..=16)
            .chain((17..=32).map(|k| k + 100 * (rep / 2)))
            .chain((33..=64).map(|k| k + 1_000 * (rep + 1)))
            .collect()
    };
    for rep in 0..8u32 {
        let keys = chain(u64::from(rep));
        let report = store.ingest(
            &keys,
            &[16; 64],
            Writing {
                rep,
                tier: 1,
                ts_ms: 5,
            },
            &guard,
        );
        assert_eq!(report.added, 64);
    }
    let request = chain(3);
    let mut stretches = Vec::new();
    let matched = store.walk(&request, &guard, |run, from, to| {
        let mut reps = Vec::new();
        run.for_each_holder(|_, h| reps.push(h.rep()));
        reps.sort_unstable();
        let mut spans = Vec::new();
        run.for_each_hint(|key, target| spans.push((key, target.span)));
        spans.sort_unstable();
        stretches.push((from, to, reps, spans));
        true
    });
    assert_eq!(matched, 64);
    // Each run hints at the runs that followed it, with the stretch each of them holds: the
    // shared run at the four pairs' 16 blocks, each pair's run at its two tails' 32.
    let pair = |p: u64| (17 + 100 * p, 16);
    let tail = |rep: u64| (33 + 1_000 * (rep + 1), 32);
    assert_eq!(
        stretches,
        [
            (0, 16, (0..8).collect(), (0..4).map(pair).collect()),
            (16, 32, vec![2, 3], vec![tail(2), tail(3)]),
            (32, 64, vec![3], vec![])
        ]
    );
    assert_eq!(store.root_count(), 1, "every chain began with key 1");
}

/// The stretches a walk of `request` visits: (from, to, live offsets of the run).
fn stretches(store: &RunStore, request: &[u64]) -> (usize, Vec<(usize, usize, usize)>) {
    let guard = crossbeam_epoch::pin();
    let mut seen = Vec::new();
    let matched = store.walk(request, &guard, |run, from, to| {
        seen.push((from, to, run.len()));
        true
    });
    (matched, seen)
}

#[test]
fn only_a_chain_that_does_not_continue_a_prefix_gets_a_root_slot() {
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    let writing = Writing {
        rep: 1,
        tier: 1,
        ts_ms: 5,
    };
    // Blocks 1–4 from the chain's start, then 5–8 after them: block 5 carries 4 blocks' tokens.
    store.ingest(&[1, 2, 3, 4], &[16; 4], writing, &guard);
    assert_eq!(store.root_count(), 1);
    store.ingest(&[5, 6, 7, 8], &[80, 16, 16, 16], writing, &guard);
    assert_eq!(store.root_count(), 1, "block 5 continues a prefix");
    // One block alone, or a first block no larger than the next, reads as a chain's start.
    store.ingest(&[9], &[80], writing, &guard);
    store.ingest(&[10, 11], &[16, 16], writing, &guard);
    assert_eq!(store.root_count(), 3);
    // Every block answers, with its cumulative tokens (K8), root or not.
    let (matched, _) = stretches(&store, &(1..=8).collect::<Vec<u64>>());
    assert_eq!(matched, 8);
    let tokens = |key: u64| store.holders(key, &guard).expect("present")[0].tokens();
    assert_eq!([1, 4, 5, 8].map(tokens), [16, 64, 80, 128]);
    // Removing the blocks leaves no root slot behind.
    for rep_keys in [&[5u64, 6, 7, 8][..], &[1, 2, 3, 4], &[9], &[10, 11]] {
        store.evict(rep_keys, 1, &guard);
    }
    assert!(store.is_empty());
    assert_eq!(store.root_count(), 0);
}

#[test]
fn a_chain_evicted_from_its_tail_keeps_a_bounded_run() {
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    let chain: Vec<u64> = (1..=64).collect();
    let writing = Writing {
        rep: 7,
        tier: 1,
        ts_ms: 5,
    };
    store.ingest(&chain, &[16; 64], writing, &guard);
    let full = store.run_bytes();
    for last in (2..=64u64).rev() {
        let report = store.evict(&[last], 7, &guard);
        assert_eq!(report.keys_removed, 1);
        let live = last as usize - 1;
        let (matched, seen) = stretches(&store, &chain);
        assert_eq!(matched, live, "the head walks whole");
        // One run holds the head, and it is at most four times its live blocks long.
        assert_eq!(seen.len(), 1);
        assert!(
            seen[0].2 < 4 * live.max(1),
            "{live} live in a run of {}",
            seen[0].2
        );
    }
    // What is left costs no more than a fresh run of three blocks.
    let small = RunStore::default();
    small.ingest(&chain[..3], &[16; 3], writing, &guard);
    assert!(
        store.run_bytes() <= small.run_bytes() && small.run_bytes() < full,
        "{} run bytes left of {full}",
        store.run_bytes()
    );
}

/// Bytes the runs of `run`'s stretches of consecutive live offsets would take.
fn split_bytes(run: &BlockRun) -> (usize, usize) {
    let (mut ranges, mut bytes, mut o) = (0, 0, 0);
    while o < run.len() {
        if run.is_dead(o) {
            o += 1;
            continue;
        }
        let end = run.live_end(o);
        ranges += 1;
        bytes += run.copy_bytes(end - o);
        o = end;
    }
    (ranges, bytes)
}

#[test]
fn a_trimmed_run_splits_into_its_live_stretches_with_their_token_counts() {
    let guard = crossbeam_epoch::pin();
    let writing = Writing {
        rep: 2,
        tier: 1,
        ts_ms: 5,
    };
    let tokens = |store: &RunStore, key: u64| {
        let holders = store.holders(key, &guard).expect("a present key");
        assert_eq!(holders.len(), 1);
        assert_eq!(holders[0].rep(), 2);
        holders[0].tokens()
    };
    // Blocks 1, 2, 63, 64 of 64 left: two runs of two cost less than the run of 64.
    let store = RunStore::default();
    let chain: Vec<u64> = (1..=64).collect();
    store.ingest(&chain, &[16; 64], writing, &guard);
    let report = store.evict(&(3..=62).collect::<Vec<u64>>(), 2, &guard);
    assert_eq!(report.removed, 60);
    assert_eq!(stretches(&store, &chain), (2, vec![(0, 2, 2)]));
    assert_eq!(stretches(&store, &[63, 64]), (2, vec![(0, 2, 2)]));
    // A trim is a copy: no stretch joins blocks that were not neighbours.
    assert_eq!(
        stretches(&store, &[1, 2, 63, 64]),
        (4, vec![(0, 2, 2), (2, 4, 2)])
    );
    assert_eq!(
        [1, 2, 63, 64].map(|k| tokens(&store, k)),
        [16, 32, 63 * 16, 64 * 16]
    );
    assert_eq!(store.root_count(), 1, "key 1 keeps its root slot");
    // Blocks 1, 2, 15, 16 of 16 left: two runs of two would cost more; the run stays.
    let store = RunStore::default();
    let chain: Vec<u64> = (1..=16).collect();
    store.ingest(&chain, &[16; 16], writing, &guard);
    store.evict(&(3..=14).collect::<Vec<u64>>(), 2, &guard);
    assert_eq!(
        stretches(&store, &[1, 2, 15, 16]),
        (4, vec![(0, 2, 16), (2, 4, 16)])
    );
    assert_eq!(
        [1, 2, 15, 16].map(|k| tokens(&store, k)),
        [16, 32, 15 * 16, 16 * 16]
    );
}

#[test]
fn a_stretch_keeps_more_than_64_holders() {
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    for rep in 0..100u32 {
        let report = store.ingest(
            &[1, 2],
            &[16, 16],
            Writing {
                rep,
                tier: 1,
                ts_ms: 1,
            },
            &guard,
        );
        assert_eq!(report.added, 2);
    }
    assert_eq!(store.holders(2, &guard).map(|h| h.len()), Some(100));
    for rep in (0..100u32).step_by(3) {
        assert_eq!(store.evict(&[1, 2], rep, &guard).removed, 2);
    }
    let mut reps: Vec<u32> = store
        .holders(1, &guard)
        .expect("key 1")
        .iter()
        .map(|h| h.rep())
        .collect();
    reps.sort_unstable();
    assert_eq!(reps, (0..100).filter(|r| r % 3 != 0).collect::<Vec<u32>>());
}

#[test]
fn key_zero_is_an_ordinary_key() {
    // Key 0 marks an unused hint inside a run, so it is never hinted; it is stored, walked and
    // removed like any other key.
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    store.ingest(
        &[7, 0, 9],
        &[16; 3],
        Writing {
            rep: 1,
            tier: 1,
            ts_ms: 1,
        },
        &guard,
    );
    store.ingest(
        &[0, 9],
        &[16; 2],
        Writing {
            rep: 2,
            tier: 1,
            ts_ms: 1,
        },
        &guard,
    );
    let mut seen = Vec::new();
    let matched = store.walk(&[7, 0, 9], &guard, |run, from, to| {
        let mut reps = Vec::new();
        run.for_each_holder(|_, h| reps.push(h.rep()));
        reps.sort_unstable();
        seen.push((from, to, reps));
        true
    });
    assert_eq!(matched, 3);
    assert_eq!(seen, [(0, 1, vec![1]), (1, 3, vec![1, 2])]);
    assert_eq!(store.evict(&[7, 0, 9], 1, &guard).removed, 3);
    assert_eq!(
        store.evict(&[0, 9], 2, &guard),
        EvictReport {
            removed: 2,
            keys_removed: 2
        }
    );
    assert!(store.is_empty());
    assert_eq!(store.run_bytes(), 0);
}

#[test]
fn concurrent_walks_see_held_blocks_while_a_writer_churns() {
    // One writer ingests and removes chains of a small key space for four replicas while two
    // readers walk it: every block a walk visits has at least one live holder of a known
    // replica, and the store ends equal to the model of the writer's operations.
    use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
    let store = std::sync::Arc::new(RunStore::default());
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut walks = 0u64;
                while !stop.load(AtomicOrdering::Relaxed) {
                    let start = (walks * 7 + r) % UNIVERSE + 1;
                    let request: Vec<u64> = (start..=UNIVERSE).collect();
                    let guard = crossbeam_epoch::pin();
                    store.walk(&request, &guard, |run, from, to| {
                        assert!(from < to);
                        let mut n = 0;
                        run.for_each_holder(|_, h| {
                            assert!(h.rep() < 4, "replica {}", h.rep());
                            n += 1;
                        });
                        assert!(n > 0, "a visited block has a holder");
                        true
                    });
                    walks += 1;
                }
                walks
            })
        })
        .collect();
    let mut model = Model::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for _ in 0..20_000 {
        let start = next() % UNIVERSE + 1;
        let len = next() % 24 + 1;
        let mut keys: Vec<u64> = (start..start + len)
            .map(|k| (k - 1) % UNIVERSE + 1)
            .collect();
        if next() % 2 == 0 {
            keys.reverse();
        }
        let rep = (next() % 4) as u32;
        let op = if next() % 3 == 0 {
            Op::Evict { keys, rep }
        } else {
            let ts = 1_000 + (next() % 4) as i64 * 100;
            let tokens = vec![16; keys.len()];
            Op::Ingest {
                keys,
                rep,
                tier: 1,
                tokens,
                ts,
            }
        };
        let done = perform(&store, Naming::Plain, &op);
        assert_eq!(done, apply(&mut model, &op), "counts of {op:?}");
    }
    stop.store(true, AtomicOrdering::Relaxed);
    for r in readers {
        assert!(r.join().expect("a reader panicked") > 0);
    }
    check(&store, Naming::Plain, &model, &mut BTreeMap::new());
}

/// Replica `rep` writing at tier 1, time 5.
fn writing(rep: u32) -> Writing {
    Writing {
        rep,
        tier: 1,
        ts_ms: 5,
    }
}

#[test]
fn a_key_whose_digest_another_key_holds_is_neither_stored_nor_answered() {
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    let long = b"a key longer than eight bytes".to_vec();
    // An 8-byte key whose value is the long key's digest: the same slot key, another key.
    let eight = digest(&long).to_be_bytes().to_vec();
    let (a, b) = (1u64.to_be_bytes().to_vec(), 2u64.to_be_bytes().to_vec());
    let keys = |ks: &[&Vec<u8>]| -> (Vec<u64>, Vec<Vec<u8>>) {
        (
            ks.iter().map(|k| digest(k)).collect(),
            ks.iter().map(|k| k.to_vec()).collect(),
        )
    };
    let (d, by) = keys(&[&a, &long, &b]);
    let report = store.ingest(
        Keys::with_bytes(&d, &by).expect("keys"),
        &[16; 3],
        writing(1),
        &guard,
    );
    assert_eq!((report.added, report.dropped), (3, 0));
    let holders = |k: &Vec<u8>| store.holders_keyed(digest(k), long_part(k), &guard);
    assert!(holders(&long).is_some());
    assert_eq!(
        holders(&eight),
        None,
        "the long key does not answer for the 8-byte one"
    );
    // A walk through the run stops where the request's key is the other one, though the run's
    // digest there is the same.
    let (d, by) = keys(&[&a, &eight, &b]);
    let matched = store.walk(
        Keys::with_bytes(&d, &by).expect("keys"),
        &guard,
        |_, _, _| true,
    );
    assert_eq!(matched, 1);
    let (d, by) = keys(&[&a, &long, &b]);
    let matched = store.walk(
        Keys::with_bytes(&d, &by).expect("keys"),
        &guard,
        |_, _, _| true,
    );
    assert_eq!(matched, 3);
    // A request beginning with the other key matches nothing.
    let (d, by) = keys(&[&eight]);
    assert_eq!(
        store.walk(
            Keys::with_bytes(&d, &by).expect("keys"),
            &guard,
            |_, _, _| true
        ),
        0
    );
    // Writes of the other key: not stored, nothing of the long key's removed.
    let report = store.ingest(
        Keys::with_bytes(&d, &by).expect("keys"),
        &[16],
        writing(2),
        &guard,
    );
    assert_eq!((report.added, report.dropped), (0, 1));
    assert_eq!(
        store
            .evict(Keys::with_bytes(&d, &by).expect("keys"), 1, &guard)
            .removed,
        0
    );
    let gone = store.remove_keys(Keys::with_bytes(&d, &by).expect("keys"), &guard);
    assert_eq!(gone.removed, 0);
    // Both in one chain: the long key is written, the other dropped.
    let (d, by) = keys(&[&long, &eight]);
    let report = store.ingest(
        Keys::with_bytes(&d, &by).expect("keys"),
        &[16; 2],
        writing(3),
        &guard,
    );
    assert_eq!((report.added, report.dropped), (1, 1));
    let reps: Vec<u32> = holders(&long)
        .expect("held")
        .iter()
        .map(Holder::rep)
        .collect();
    assert_eq!(reps, [1, 3]);
    assert_eq!(store.len(), 3);
    // Removed by its own bytes, the long key goes.
    let (d, by) = keys(&[&long]);
    assert_eq!(
        store
            .remove_keys(Keys::with_bytes(&d, &by).expect("keys"), &guard)
            .removed,
        2
    );
    assert_eq!(holders(&long), None);
}

#[test]
fn a_scan_lap_visits_every_key_once_and_a_run_holder_goes_with_its_run_mates() {
    let store = RunStore::default();
    let guard = crossbeam_epoch::pin();
    let a: Vec<u64> = (1..=32).collect();
    store.ingest(&a, &[16; 32], writing(1), &guard);
    store.ingest(&a[..16], &[16; 16], writing(2), &guard);
    // One lap in uneven steps: every key once, with the run naming it.
    let lap = store.scan_len(&guard);
    let mut seen = BTreeMap::new();
    let mut cursor = 5;
    let mut visited = 0;
    while visited < lap {
        let step = 7.min(lap - visited);
        cursor = store.scan(cursor, step, &guard, |k, run, o| {
            assert_eq!(run.key(o), k);
            *seen.entry(k).or_insert(0) += 1;
        });
        visited += step;
    }
    assert_eq!(cursor, 5, "a lap ends where it began");
    assert_eq!(seen.len(), 32);
    assert!(seen.values().all(|&n| n == 1));
    // Replica 1's copy of the shared stretch (keys 1..=16) goes whole; replica 2 keeps it.
    let mut removed = Vec::new();
    let report = store.remove_run_holder_with(5, None, 1, &guard, |k, long, h| {
        assert_eq!(long, None);
        removed.push((k, h.rep()));
    });
    assert_eq!((report.removed, report.keys_removed), (16, 0));
    removed.sort_unstable();
    assert_eq!(removed, (1..=16).map(|k| (k, 1)).collect::<Vec<_>>());
    let reps = |k| -> Vec<u32> {
        store
            .holders(k, &guard)
            .map(|hs| hs.iter().map(Holder::rep).collect())
            .unwrap_or_default()
    };
    assert_eq!(reps(1), [2]);
    assert_eq!(reps(17), [1]);
    // A replica that does not hold the key's run, or an absent key: nothing.
    let none = store.remove_run_holder_with(20, None, 2, &guard, |_, _, _| unreachable!());
    assert_eq!(none, EvictReport::default());
    let none = store.remove_run_holder_with(99, None, 1, &guard, |_, _, _| unreachable!());
    assert_eq!(none, EvictReport::default());
    // The tail's only holder: its keys go.
    let report = store.remove_run_holder_with(20, None, 1, &guard, |_, _, _| {});
    assert_eq!((report.removed, report.keys_removed), (16, 16));
    assert_eq!(store.len(), 16);
    assert_eq!(reps(20), Vec::<u32>::new());
}

#[test]
fn leading_digests_stop_at_the_first_difference_wherever_it_is() {
    for n in 0..=11usize {
        let run_keys: Vec<u64> = (0..n as u64).map(|k| k * 31 + 7).collect();
        let request: Vec<[u8; 8]> = run_keys.iter().map(|k| k.to_be_bytes()).collect();
        let digests = run_keys.clone();
        let eight = EightByteKeys::new(&request).expect("8-byte keys");
        let keyed: Keys<'_> = Keys::eight(&digests);
        assert_eq!(eight.leading_digests(0, &run_keys), n, "all {n} equal");
        assert_eq!(keyed.leading_digests(0, &run_keys), n, "all {n} equal");
        for differ in 0..n {
            let mut other = run_keys.clone();
            other[differ] ^= 1 << 40;
            assert_eq!(
                eight.leading_digests(0, &other),
                differ,
                "{n} keys, differ at {differ}"
            );
            assert_eq!(
                keyed.leading_digests(0, &other),
                differ,
                "{n} keys, differ at {differ}"
            );
            // From an offset: keys `from..` against the run's.
            if differ > 0 {
                assert_eq!(eight.leading_digests(1, &other[1..]), differ - 1);
            }
        }
    }
    // A range past the request's end matches nothing rather than panicking.
    let request = [[0u8; 8]; 2];
    let eight = EightByteKeys::new(&request).expect("8-byte keys");
    assert_eq!(eight.leading_digests(1, &[0, 0]), 0);
}
