//! The store's reads: a key's holders, the chain walk (`walk_from`: stretch by stretch over the
//! runs, lock-free under a guard), one entry, and the scans and samples the cap, the quotas and
//! the sweep walk the store with.

use super::*;

impl RunStore {
    /// The live holders of the 8-byte key `key`, if present, each with its entry's token count.
    pub fn holders(&self, key: u64, guard: &Guard) -> Option<Vec<Holder>> {
        self.holders_keyed(key, None, guard)
    }

    /// The live holders of the key with `digest` and long part `long` ([`long_part`]), if
    /// present, each with its entry's token count ([`BlockRun::tokens_at`]).
    pub fn holders_keyed(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &Guard,
    ) -> Option<Vec<Holder>> {
        let mut out = Vec::new();
        self.for_each_holder_keyed(digest, long, guard, |h| out.push(h))
            .then_some(out)
    }

    /// Calls `f` with each live holder of the key with `digest` and long part `long`, with its
    /// entry's token count; false when the key is absent. Allocates nothing.
    pub fn for_each_holder_keyed(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &Guard,
        mut f: impl FnMut(Holder),
    ) -> bool {
        let Some((_, run, o)) = self.find_key(digest, long, guard) else {
            return false;
        };
        run.for_each_holder(|_, h| f(h.with_tokens(run.tokens_at(&h, o))));
        true
    }

    /// The slot value of the key with `digest` and long part `long`, with the run and offset
    /// it names; `None` when the key is absent (its digest's slot, if any, is another key's).
    pub(super) fn find_key<'g>(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &'g Guard,
    ) -> Option<(u64, &'g BlockRun, usize)> {
        let value = self.table.find(digest, guard)?.get();
        Self::keyed(value, digest, long)
    }

    /// [`RunStore::find_key`] for a key expected present (a victim's), past the key table's
    /// summary word ([`SlotTable::find_present`]).
    pub(super) fn find_victim<'g>(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &'g Guard,
    ) -> Option<(u64, &'g BlockRun, usize)> {
        let value = self.table.find_present(digest, guard)?.get();
        Self::keyed(value, digest, long)
    }

    /// The run and offset a slot value names, if that block's key is `digest` with long part
    /// `long`.
    pub(super) fn keyed<'g>(
        value: u64,
        digest: u64,
        long: Option<&[u8]>,
    ) -> Option<(u64, &'g BlockRun, usize)> {
        let (run, o) = unpack(value);
        let run = run_ref(run);
        run.is_key(o, digest, long).then_some((value, run, o))
    }

    /// Walks the longest prefix of `request` present in the store: calls `visit(run, from, to)`
    /// for each stretch `request[from..to]` whose blocks `run`'s live holders hold, in request
    /// order, until a block is absent or `visit` returns false. Returns the blocks visited.
    pub fn walk<'k, K: AsRef<[u8]> + 'k>(
        &self,
        request: impl Into<Keys<'k, K>>,
        guard: &Guard,
        visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize {
        let keys: Keys<'k, K> = request.into();
        match keys.digests.first() {
            Some(&first) => match self.first_block(first, guard) {
                Some(value) => self.walk_from(value, keys, guard, visit),
                None => 0,
            },
            None => 0,
        }
    }

    /// The slot value of the key with digest `digest` as a walk's block 0 finds it (the key table's
    /// summary word, the root slots, then the key table), if some key has that digest: a caller can
    /// rule out a walk whose block 0 is absent before it prepares the rest of its request
    /// ([`RunStore::walk_from`]).
    #[inline]
    pub fn first_block(&self, digest: u64, guard: &Guard) -> Option<u64> {
        if !self.options.roots {
            return self.table.find(digest, guard).map(SlotValue::get);
        }
        // The key table's summary word first: every root is a key of the key table too, so a
        // key the word rules out is in neither table, and most absent keys (a request for a
        // novel prefix) stop there, at one load, without the root table's probe. A present
        // key then usually finds its value in the root table, whose lines stay cached, rather
        // than in the key table's slot line.
        let probe = self.table.probe(digest, guard)?;
        if !probe.may_contain() {
            return None;
        }
        if let Some(root) = self.roots.find(digest, guard) {
            return Some(root.get());
        }
        probe.find().map(SlotValue::get)
    }

    /// [`RunStore::walk`] from block 0's slot value `value`, as [`RunStore::first_block`]
    /// found it for `request`'s first key.
    pub fn walk_from(
        &self,
        mut value: u64,
        keys: impl Request,
        guard: &Guard,
        mut visit: impl FnMut(&BlockRun, usize, usize) -> bool,
    ) -> usize {
        let len = keys.len();
        let mut pos = 0;
        // Whether `value`'s lines are fetched already (a hint's were, when it was read).
        let mut fetched = false;
        // A key placed in the key table when its lines were prefetched, with its position in
        // the request: the find at that position (where a walk usually stops) reuses it.
        let mut placed: Option<(usize, Option<Probe<'_>>)> = None;
        loop {
            let (run, o) = unpack(value);
            if !fetched {
                BlockRun::prefetch(run.as_ptr(), o);
            }
            let run = run_ref(run);
            // The slot or hint matched the digest; a key of another length (the request's or
            // the run's) must match its bytes too.
            let long = keys.long(pos);
            if (long.is_some() || run.is_long()) && run.long_key(o) != long {
                return pos;
            }
            let max = (run.live_end(o) - o - 1).min(len - pos - 1);
            let landing = pos + 1 + max;
            // The next block if the request follows the stretch to its end: its hint is read
            // now and its run's lines fetched, so they come in while the keys are compared; the
            // hint is checked (which reads that run) only after the compare.
            let mut ahead = None;
            if landing < len {
                let k = keys.digest(landing);
                match self.options.hints.then(|| run.peek_hint(k)).flatten() {
                    Some(hinted) => {
                        hinted.prefetch(&self.ids);
                        // The landing after the hinted stretch, if the request follows it too:
                        // the summary word that settles an absent key there (the usual reason
                        // a walk stops) arrives with the hinted run instead of after it.
                        let after = landing + hinted.span();
                        if after < len {
                            let probe = self.table.probe(keys.digest(after), guard);
                            if let Some(probe) = &probe {
                                probe.prefetch_summary();
                            }
                            placed = Some((after, probe));
                        }
                        ahead = Some(hinted);
                    }
                    None => {
                        // A block no hint names is most often absent (a run's hints name the
                        // runs that follow it): its summary word settles that, so only that
                        // word is fetched. Fetching its slot lines too cost a Q50 walk, which
                        // stops there, a tenth of its time in memory traffic it never used.
                        let probe = self.table.probe(k, guard);
                        if let Some(probe) = &probe {
                            probe.prefetch_summary();
                        }
                        placed = Some((landing, probe));
                    }
                }
            }
            let run_keys = &run.keys()[o + 1..o + 1 + max];
            let mut m = keys.leading_digests(pos + 1, run_keys);
            if run.is_long() || keys.any_long() {
                m = (0..m)
                    .take_while(|&j| key_is_at(&keys, pos + 1 + j, run, o + 1 + j))
                    .count();
            }
            let to = pos + 1 + m;
            if !visit(run, pos, to) || to == len {
                return to;
            }
            pos = to;
            let hinted = ahead
                .filter(|_| m == max)
                .and_then(|h| h.check(&self.ids, guard));
            fetched = hinted.is_some();
            let next = hinted.or_else(|| {
                let probe = match placed {
                    Some((at, probe)) if at == pos => probe,
                    _ => self.table.probe(keys.digest(pos), guard),
                };
                probe.and_then(|probe| probe.find()).map(SlotValue::get)
            });
            match next {
                Some(v) => value = v,
                None => return pos,
            }
        }
    }

    /// Calls `f(digest, run, offset)` for the present keys among `count` key-table slots from
    /// cursor `from` on, and returns the cursor after them (wrapping): a sampling scan spread
    /// over calls, as the cap's hand takes victims. One lap of the cursor over an unchanging
    /// store visits every key once.
    pub fn scan(
        &self,
        from: usize,
        count: usize,
        guard: &Guard,
        mut f: impl FnMut(u64, &BlockRun, usize),
    ) -> usize {
        self.table.for_each_value_from(from, count, guard, |v| {
            let (run, o) = unpack(v);
            let r = run_ref(run);
            f(r.key(o), r, o);
        })
    }

    /// Calls `f(digest, run, offset)` for the key in the key-table slot `random` picks, if the
    /// slot is live ([`SlotTable::sample`]); returns whether it was.
    pub fn sample(
        &self,
        random: u64,
        guard: &Guard,
        f: impl FnOnce(u64, &BlockRun, usize),
    ) -> bool {
        let Some(v) = self.table.sample(random, guard) else {
            return false;
        };
        let (run, o) = unpack(v);
        let r = run_ref(run);
        f(r.key(o), r, o);
        true
    }

    /// Calls `f` for the runs registered at positions `first..end` of the run registry
    /// (`0..`[`RunStore::run_scan_len`]), with the run when its holders may have a `last_seen`
    /// at or before `max_age` (ms), else with [`ScanStep::Young`] (the run not read), until `f`
    /// returns `false`: the walk for old entries of the cap and the quotas, one visit per run
    /// rather than per key. Returns where it stopped (after an old run, at a young one; `end`
    /// if `f` never stopped it). The runs are live while `guard` is pinned.
    pub fn scan_runs(
        &self,
        first: usize,
        end: usize,
        max_age: i64,
        guard: &Guard,
        f: impl FnMut(ScanStep<'_>) -> bool,
    ) -> usize {
        self.ids.scan(first, end, max_age, guard, f)
    }

    /// Positions of the run registry (a run scan's lap).
    pub fn run_scan_len(&self) -> usize {
        self.ids.scan_len()
    }

    /// Prefetches the slot lines of a key about to be removed (its key-table slot and, were it
    /// a chain's first key, its root slot): the cap fetches its next victim's while the ingest
    /// in between runs.
    #[inline]
    pub fn prefetch_removal(&self, digest: u64, guard: &Guard) {
        self.table.prefetch_present(digest, guard);
        self.roots.prefetch_present(digest, guard);
    }

    /// Slots of the key table (a scan's lap).
    pub fn scan_len(&self, guard: &Guard) -> usize {
        self.table.scan_len(guard)
    }

    /// Replica `rep`'s entry of the key with `digest` and long part `long`, if present, with
    /// its token count (lock-free).
    pub fn entry(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
    ) -> Option<Holder> {
        let (_, run, o) = self.find_key(digest, long, guard)?;
        let mut found = None;
        run.for_each_holder(|_, h| {
            if h.rep() == rep {
                found = Some(h.with_tokens(run.tokens_at(&h, o)));
            }
        });
        found
    }

    /// Calls `f(key, run, offset)` for every present key (dump, digest, snapshot). Writers
    /// running meanwhile may move keys past the visit.
    pub fn for_each_key(&self, guard: &Guard, mut f: impl FnMut(u64, &BlockRun, usize)) {
        self.table.for_each_value(guard, |v| {
            let (run, o) = unpack(v);
            let r = run_ref(run);
            f(r.key(o), r, o);
        });
    }
}
