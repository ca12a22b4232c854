//! Positional hashing (spec `sidecar.md` §5): SC03 and chained-split equivalence with
//! `fingerprint::prefix_hashes` of the whole token sequence.

use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
use inferencecache_sidecar::positional::ReverseMap;
use inferencecache_sidecar::wire::BlockStored;

fn eh(i: u64) -> Vec<u8> {
    (0xE000 + i).to_be_bytes().to_vec()
}

fn stored(
    first: usize,
    count: usize,
    tokens: &[u32],
    bs: usize,
    parent: Option<u64>,
) -> BlockStored {
    BlockStored {
        block_hashes: (first..first + count).map(|i| eh(i as u64)).collect(),
        parent_block_hash: parent.map(|p| p.to_be_bytes().to_vec()),
        token_ids: tokens[first * bs..(first + count) * bs].to_vec(),
        block_size: bs as i64,
        lora_id: None,
    }
}

#[test]
fn sc03_suffix_event_chains_from_parent() {
    let bs = 16;
    let tokens: Vec<u32> = (1000..1000 + 5 * bs as u32).collect();
    let mut m = ReverseMap::new();
    let a = m.store(&stored(0, 3, &tokens, bs, None), "");
    let b = m.store(&stored(3, 2, &tokens, bs, Some(0xE002)), "");
    let got: Vec<[u8; 8]> = a.iter().chain(&b).map(|e| e.prefix_hash).collect();
    let want: Vec<[u8; 8]> = prefix_hashes(&tokens, bs)
        .into_iter()
        .map(to_wire)
        .collect();
    assert_eq!(got, want);
    let counts: Vec<i32> = a.iter().chain(&b).map(|e| e.token_count).collect();
    assert_eq!(counts, vec![16, 32, 48, 64, 80]);
    assert_eq!(b.last().unwrap().token_count, 5 * bs as i32);
    assert_eq!(m.len(), 5);
}

#[test]
fn sc03_unknown_parent_starts_fresh() {
    let bs = 4;
    let tokens: Vec<u32> = (0..5 * bs as u32).collect();
    let mut m = ReverseMap::new();
    // Parent 0xBEEF was never stored: the suffix is hashed as a fresh sequence at 0 tokens.
    let b = m.store(&stored(3, 2, &tokens, bs, Some(0xBEEF)), "");
    let want: Vec<[u8; 8]> = prefix_hashes(&tokens[3 * bs..], bs)
        .into_iter()
        .map(to_wire)
        .collect();
    assert_eq!(b.iter().map(|e| e.prefix_hash).collect::<Vec<_>>(), want);
    assert_eq!(
        b.iter().map(|e| e.token_count).collect::<Vec<_>>(),
        vec![4, 8]
    );
}

/// Tiny deterministic generator (no extra dependency).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[test]
fn any_split_into_chained_events_equals_whole_sequence_fingerprint() {
    let mut rng = Lcg(7);
    for _ in 0..300 {
        let bs = [1usize, 2, 3, 16, 32, 128][(rng.next() % 6) as usize];
        let blocks = 1 + (rng.next() % 12) as usize;
        let tokens: Vec<u32> = (0..blocks * bs)
            .map(|_| (rng.next() as u32) ^ ((rng.next() as u32) << 16))
            .collect();
        let mut m = ReverseMap::new();
        let mut got = Vec::new();
        let mut first = 0;
        while first < blocks {
            let count = 1 + (rng.next() as usize % (blocks - first));
            let parent = (first > 0).then(|| 0xE000 + first as u64 - 1);
            let ev = stored(first, count, &tokens, bs, parent);
            got.extend(m.store(&ev, ""));
            first += count;
        }
        let want = prefix_hashes(&tokens, bs);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.prefix_hash, to_wire(*w));
            assert_eq!(g.token_count, ((i + 1) * bs) as i32);
        }
    }
}

#[test]
fn mismatched_token_ids_yield_nothing_and_partial_tail_is_tolerated() {
    let bs = 4;
    let tokens: Vec<u32> = (0..8).collect();
    let mut m = ReverseMap::new();
    // Two hashes but tokens for one block only.
    let mut ev = stored(0, 2, &tokens, bs, None);
    ev.token_ids.truncate(5);
    assert!(m.store(&ev, "").is_empty());
    // Missing token_ids.
    ev.token_ids.clear();
    assert!(m.store(&ev, "").is_empty());
    assert!(m.is_empty());
    // A trailing partial block is dropped and tolerated.
    let mut ev = stored(0, 2, &tokens, bs, None);
    ev.token_ids.extend([100, 101]);
    assert_eq!(m.store(&ev, "").len(), 2);
    // No hashes → nothing.
    let ev = BlockStored {
        block_hashes: vec![],
        parent_block_hash: None,
        token_ids: tokens.clone(),
        block_size: 4,
        lora_id: None,
    };
    assert!(m.store(&ev, "").is_empty());
}

#[test]
fn remove_yields_known_entries_and_clear_empties() {
    let bs = 2;
    let tokens: Vec<u32> = (0..6).collect();
    let mut m = ReverseMap::new();
    let stored_entries = m.store(&stored(0, 3, &tokens, bs, None), "sql-lora");
    let removed = m.remove(&[eh(1), eh(99)]);
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0], stored_entries[1]);
    assert_eq!(removed[0].adapter, "sql-lora");
    assert_eq!(m.len(), 2);
    m.clear();
    assert!(m.is_empty());
}
