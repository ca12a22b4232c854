//! Positional hashing over engine page chains (spec `sidecar.md` §5): SC03, re-chunking of
//! engine pages of any size into index blocks, orphans, cascading removals, media and tiers,
//! extra keys.

use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
use inferencecache_sidecar::positional::{Entry, ReverseMap};
use inferencecache_sidecar::tier::Tier;
use inferencecache_sidecar::wire::BlockStored;

fn eh(i: u64) -> Vec<u8> {
    (0xE000 + i).to_be_bytes().to_vec()
}

/// `count` engine pages of `page` tokens starting at page `first` of `tokens`; the parent is
/// page `first - 1` of the same chain.
fn pages(first: usize, count: usize, tokens: &[u32], page: usize) -> BlockStored {
    BlockStored {
        block_hashes: (first..first + count).map(|i| eh(i as u64)).collect(),
        parent_block_hash: (first > 0).then(|| eh(first as u64 - 1)),
        token_ids: tokens[first * page..(first + count) * page].to_vec(),
        block_size: page as i64,
        ..BlockStored::default()
    }
}

fn hashes(entries: &[Entry]) -> Vec<[u8; 8]> {
    entries.iter().map(|e| e.prefix_hash).collect()
}

fn counts(entries: &[Entry]) -> Vec<i32> {
    entries.iter().map(|e| e.token_count).collect()
}

fn fingerprint(tokens: &[u32], bs: usize) -> Vec<[u8; 8]> {
    prefix_hashes(tokens, bs).into_iter().map(to_wire).collect()
}

#[test]
fn sc03_suffix_event_chains_from_parent() {
    let bs = 16;
    let tokens: Vec<u32> = (1000..1000 + 5 * bs as u32).collect();
    let mut m = ReverseMap::new(bs);
    let a = m.store(&pages(0, 3, &tokens, bs), "").entries;
    let b = m.store(&pages(3, 2, &tokens, bs), "").entries;
    let all: Vec<Entry> = a.iter().chain(&b).cloned().collect();
    assert_eq!(hashes(&all), fingerprint(&tokens, bs));
    assert_eq!(counts(&all), vec![16, 32, 48, 64, 80]);
    assert!(all.iter().all(|e| e.tier == Tier::Gpu));
    assert_eq!(m.len(), 5);
}

#[test]
fn unknown_parent_is_skipped_not_indexed_as_a_prompt_start() {
    let bs = 4;
    let tokens: Vec<u32> = (0..5 * bs as u32).collect();
    let mut m = ReverseMap::new(bs);
    // Pages 3–4 arrive without pages 0–2 (a gap, or a chain older than the subscription):
    // indexing them from 0 tokens would claim a prefix the engine never cached.
    let stored = m.store(&pages(3, 2, &tokens, bs), "");
    assert!(stored.entries.is_empty());
    assert_eq!(stored.orphan_pages, 2);
    assert!(m.is_empty());
    // And a later child of the skipped pages is skipped too.
    let later: Vec<u32> = (0..6 * bs as u32).collect();
    assert_eq!(m.store(&pages(5, 1, &later, bs), "").orphan_pages, 1);
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
fn any_page_size_and_split_equals_the_whole_sequence_fingerprint() {
    // Engine pages smaller than (SGLang page_size = 1), equal to, larger than, and not
    // dividing the index block: the blocks are those of the whole prompt, each reported once,
    // when its last token's page is stored.
    let mut rng = Lcg(7);
    for _ in 0..400 {
        let bs = [1usize, 2, 3, 16, 32][(rng.next() % 5) as usize];
        let page = [1usize, 2, 5, 16, 24, 32, 48][(rng.next() % 7) as usize];
        let page_count = 1 + (rng.next() % 12) as usize;
        let tokens: Vec<u32> = (0..page_count * page)
            .map(|_| (rng.next() as u32) ^ ((rng.next() as u32) << 16))
            .collect();
        let mut m = ReverseMap::new(bs);
        let mut got = Vec::new();
        let mut first = 0;
        while first < page_count {
            let count = 1 + (rng.next() as usize % (page_count - first));
            got.extend(m.store(&pages(first, count, &tokens, page), "").entries);
            first += count;
        }
        let want = fingerprint(&tokens, bs);
        assert_eq!(hashes(&got), want, "bs {bs} page {page}");
        let want_counts: Vec<i32> = (1..=want.len()).map(|i| (i * bs) as i32).collect();
        assert_eq!(counts(&got), want_counts, "bs {bs} page {page}");
    }
}

#[test]
fn removing_a_page_evicts_its_blocks_and_every_later_block_of_the_chain() {
    // Pages of 24 tokens under 16-token blocks: block 1 (tokens 16..32) starts in page 0 and
    // ends in page 1, so it is owned by page 1.
    let (bs, page) = (16, 24);
    let tokens: Vec<u32> = (0..4 * page as u32).collect();
    let mut m = ReverseMap::new(bs);
    let all = m.store(&pages(0, 4, &tokens, page), "").entries;
    assert_eq!(counts(&all), vec![16, 32, 48, 64, 80, 96]);
    let removed = m.remove(&[eh(1)], None, true);
    // Page 1 owns blocks ending at 32 and 48; pages 2–3 own 64, 80, 96.
    let mut evicted = counts(&removed.evicted);
    evicted.sort_unstable();
    assert_eq!(evicted, vec![32, 48, 64, 80, 96]);
    assert!(removed.retiered.is_empty());
    assert_eq!(m.len(), 1);
    assert!(m.contains(&eh(0)));
    // The removed pages are unknown now: a removal of page 3 yields nothing, a store under
    // page 2 is an orphan.
    assert!(m.remove(&[eh(3)], None, true).evicted.is_empty());
    assert_eq!(m.store(&pages(3, 1, &tokens, page), "").orphan_pages, 1);
    // Page 1 stored again continues from page 0.
    let again = m.store(&pages(1, 1, &tokens, page), "").entries;
    assert_eq!(counts(&again), vec![32, 48]);
    assert_eq!(hashes(&again), fingerprint(&tokens, bs)[1..3].to_vec());
}

#[test]
fn sglang_one_token_pages_rechunk_into_blocks_across_events() {
    let bs = 16;
    let tokens: Vec<u32> = (500..564).collect();
    let mut m = ReverseMap::new(bs);
    // 40 one-token pages, then 24 more: blocks complete at 16, 32 (first event), 48, 64.
    let a = m.store(&pages(0, 40, &tokens, 1), "").entries;
    assert_eq!(counts(&a), vec![16, 32]);
    let b = m.store(&pages(40, 24, &tokens, 1), "").entries;
    assert_eq!(counts(&b), vec![48, 64]);
    let all: Vec<Entry> = a.into_iter().chain(b).collect();
    assert_eq!(hashes(&all), fingerprint(&tokens, bs));
    // Removing token 45's page evicts the block holding it (33..48) and everything after.
    let removed = m.remove(&[eh(45)], Some("GPU"), true);
    let mut evicted = counts(&removed.evicted);
    evicted.sort_unstable();
    assert_eq!(evicted, vec![48, 64]);
    assert_eq!(m.len(), 45);
}

#[test]
fn media_copies_report_the_hottest_remaining_tier() {
    let bs = 4;
    let tokens: Vec<u32> = (0..8).collect();
    let mut m = ReverseMap::new(bs);
    let mut cpu = pages(0, 2, &tokens, bs);
    cpu.medium = Some("CPU".into());
    let first = m.store(&cpu, "").entries;
    assert!(first.iter().all(|e| e.tier == Tier::Cpu));
    // A GPU copy of the same pages: reported again at T1.
    let mut gpu = cpu.clone();
    gpu.medium = Some("GPU".into());
    let hotter = m.store(&gpu, "").entries;
    assert_eq!(hashes(&hotter), hashes(&first));
    assert!(hotter.iter().all(|e| e.tier == Tier::Gpu));
    // Another CPU store changes nothing.
    assert!(m.store(&cpu, "").entries.is_empty());
    // Removing the GPU copy keeps the CPU one: re-reported at T2, nothing evicted.
    let removed = m.remove(&[eh(0), eh(1)], Some("GPU"), true);
    assert!(removed.evicted.is_empty());
    assert_eq!(hashes(&removed.retiered), hashes(&first));
    assert!(removed.retiered.iter().all(|e| e.tier == Tier::Cpu));
    // Removing the last copy evicts.
    let removed = m.remove(&[eh(0), eh(1)], Some("cpu"), true);
    assert_eq!(counts(&removed.evicted).len(), 2);
    assert!(m.is_empty());
    // Disk and unknown media are T3; the unknown one is flagged.
    let mut disk = pages(0, 1, &tokens, bs);
    disk.medium = Some("DISK".into());
    let s = m.store(&disk, "");
    assert_eq!(s.entries[0].tier, Tier::Storage);
    assert!(!s.unknown_medium);
    m.clear();
    disk.medium = Some("HBM9".into());
    let s = m.store(&disk, "");
    assert_eq!(s.entries[0].tier, Tier::Storage);
    assert!(s.unknown_medium);
}

#[test]
fn extra_keys_and_cache_salt_stop_the_chain() {
    let bs = 4;
    let tokens: Vec<u32> = (0..20).collect();
    let mut m = ReverseMap::new(bs);
    let mut ev = pages(0, 4, &tokens, bs);
    ev.first_keyed_block = Some(2);
    let s = m.store(&ev, "");
    assert_eq!(counts(&s.entries), vec![4, 8]);
    assert_eq!(s.keyed_pages, 2);
    // A later page under the keyed ones is an orphan: never a token-only match.
    assert_eq!(m.store(&pages(4, 1, &tokens, bs), "").orphan_pages, 1);
    let mut salted = pages(0, 2, &tokens, bs);
    salted.block_hashes = vec![eh(100), eh(101)];
    salted.cache_salt = Some("tenant-secret".into());
    let s = m.store(&salted, "");
    assert!(s.entries.is_empty());
    assert_eq!(s.keyed_pages, 2);
}

#[test]
fn mismatched_token_ids_yield_nothing_and_partial_tail_is_tolerated() {
    let bs = 4;
    let tokens: Vec<u32> = (0..8).collect();
    let mut m = ReverseMap::new(bs);
    // Two hashes but tokens for one page only.
    let mut ev = pages(0, 2, &tokens, bs);
    ev.token_ids.truncate(5);
    assert!(m.store(&ev, "").mismatched);
    // Missing token_ids.
    ev.token_ids.clear();
    assert!(m.store(&ev, "").mismatched);
    assert!(m.is_empty());
    // A trailing partial page is dropped and tolerated.
    let mut ev = pages(0, 2, &tokens, bs);
    ev.token_ids.extend([100, 101]);
    assert_eq!(m.store(&ev, "").entries.len(), 2);
    // No hashes → nothing.
    let ev = BlockStored {
        token_ids: tokens.clone(),
        block_size: 4,
        ..BlockStored::default()
    };
    let s = m.store(&ev, "");
    assert!(s.entries.is_empty() && !s.mismatched);
}

#[test]
fn remove_yields_known_entries_with_their_adapter_and_clear_empties() {
    let bs = 2;
    let tokens: Vec<u32> = (0..6).collect();
    let mut m = ReverseMap::new(bs);
    let stored = m.store(&pages(0, 3, &tokens, bs), "sql-lora").entries;
    // Without cascade (L2 mode) only the page itself goes.
    let removed = m.remove(&[eh(1), eh(99)], None, false);
    assert_eq!(removed.evicted, vec![stored[1].clone()]);
    assert_eq!(removed.evicted[0].adapter, "sql-lora");
    assert_eq!(m.len(), 2);
    m.clear();
    assert!(m.is_empty());
}
