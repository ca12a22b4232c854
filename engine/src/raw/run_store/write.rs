//! The store's writes: an ingest's chain, stretch by stretch, under the writer lock (new runs,
//! joins, repointed slots), and the trims that copy sparse runs.

use super::*;

impl RunStore {
    /// Cuts `keys` into stretches (module docs, "Writes"). With `counts` (an ingest: the
    /// blocks' own token counts), a stretch also ends where its run's token step would break
    /// (`block_run`, "Token counts"): after its first block, every block's count is the step
    /// (an absent stretch's is its second block's count), and it follows its run forwards
    /// only. Fills `w.values` and `w.stretches`.
    pub(super) fn cut<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        chain: Keys<'_, K>,
        counts: Option<&[i32]>,
        guard: &Guard,
    ) {
        let keys = chain.digests;
        let StoreWriter {
            values, stretches, ..
        } = w;
        values.clear();
        stretches.clear();
        // Whether block `i` may continue the absent stretch that began at `from`.
        let steady =
            |i: usize, from: usize| i == from + 1 || counts.is_none_or(|c| c[i] == c[from + 1]);
        let mut fetched = 0;
        let mut i = 0;
        // The probe of `keys[i]` when an absent stretch's loop made it already.
        let mut carried = None;
        while i < keys.len() {
            let found = carried
                .take()
                .unwrap_or_else(|| self.table.find(keys[i], guard).map(SlotValue::get));
            let Some(v) = found else {
                let from = i;
                loop {
                    values.push(None);
                    i += 1;
                    let ahead = (i + AHEAD).min(keys.len());
                    for k in &keys[fetched.max(i)..ahead] {
                        self.table.prefetch(*k, guard);
                    }
                    fetched = fetched.max(ahead);
                    if i == keys.len() || i - from == MAX_LEN {
                        break;
                    }
                    if let Some(v) = self.table.find(keys[i], guard) {
                        carried = Some(Some(v.get()));
                        break;
                    }
                    if !steady(i, from) {
                        carried = Some(None);
                        break;
                    }
                }
                stretches.push(Stretch::Absent { from, to: i });
                continue;
            };
            let (run, o) = unpack(v);
            let r = run_ref(run);
            let from = i;
            if !key_is_at(&chain, i, r, o) {
                values.push(None);
                stretches.push(Stretch::Taken);
                i += 1;
                continue;
            }
            values.push(Some(pack(run, o)));
            i += 1;
            let run_keys = r.keys();
            let live = |p: usize| p < run_keys.len() && !r.is_dead(p);
            // Digests first; long parts only where a key has one.
            let compare_bytes = chain.bytes.is_some() || r.is_long();
            let same = |i: usize, p: usize| {
                run_keys[p] == keys[i] && (!compare_bytes || key_is_at(&chain, i, r, p))
            };
            let step = r.step();
            let descending = counts.is_none()
                && i < keys.len()
                && o > 0
                && live(o - 1)
                && same(i, o - 1)
                && !(live(o + 1) && same(i, o + 1));
            while i < keys.len() && counts.is_none_or(|c| c[i] == step) {
                let step = i - from;
                let p = if descending {
                    match o.checked_sub(step) {
                        Some(p) => p,
                        None => break,
                    }
                } else {
                    o + step
                };
                if !live(p) || !same(i, p) {
                    break;
                }
                values.push(Some(pack(run, p)));
                i += 1;
            }
            // A removal's stretch of a run with one holder will most likely lose its slots:
            // their home lines are fetched now, while the rest of the chain is cut (the keys
            // are present: no summary word is read for them).
            if counts.is_none() && r.holder_count() == 1 {
                for k in &keys[from..i.min(from + AHEAD)] {
                    self.table.prefetch_present(*k, guard);
                }
            }
            stretches.push(Stretch::InRun {
                from,
                to: i,
                run,
                descending,
            });
        }
    }

    /// A new registered run over `keys` with token step `step`, counting the slots its caller
    /// points at it.
    pub(super) fn new_run<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        holders: &[Holder],
        keys: Keys<'_, K>,
        step: i32,
    ) -> Option<NonNull<BlockRun>> {
        let capacity = self.holder_capacity(holders.len());
        let run = BlockRun::create_keyed(holders, capacity, keys.digests, keys.bytes, step)?;
        if self.ids.register(&mut w.alloc, run).is_none() {
            // SAFETY: never registered, never in a slot.
            unsafe { BlockRun::discard(run) };
            return None;
        }
        let r = run_ref(run);
        r.add_refs(keys.len() as u64);
        self.run_bytes
            .fetch_add(r.bytes() as u64, Ordering::Relaxed);
        Some(run)
    }

    /// Drops `n` slot references of `run`; retires it with its last, or lists it for trimming
    /// if it became sparse.
    pub(super) fn release(
        &self,
        w: &mut StoreWriter,
        run: NonNull<BlockRun>,
        n: u64,
        guard: &Guard,
    ) {
        let r = run_ref(run);
        if r.release(n) {
            self.run_bytes
                .fetch_sub(r.bytes() as u64, Ordering::Relaxed);
            // SAFETY: registered by `new_run`, no slot names it any more, released once.
            unsafe { BlockRun::retire(run, &self.ids, &mut w.alloc, &self.reaper, guard) };
        } else if is_sparse(r) {
            w.sparse.push(run);
        }
    }

    /// Copies each run listed sparse onto new runs over its live offsets (module docs,
    /// "Trimming"), one per stretch of consecutive live offsets (a copy keeps its tokens
    /// affine: `block_run`, "Token counts"); a run whose stretches would take more bytes as
    /// runs of their own than it does is left as it is. Runs at the end of a write, once no
    /// stretch of it names a run any more.
    pub(super) fn trim(&self, w: &mut StoreWriter, guard: &Guard) {
        while let Some(run) = w.sparse.pop() {
            let r = run_ref(run);
            // A run retired since it was listed has no references (its memory waits for this
            // write's guard); one listed twice is no longer sparse after its first trim.
            if r.refs() == 0 || !is_sparse(r) {
                continue;
            }
            let mut ranges = Vec::new();
            let mut o = 0;
            while o < r.len() {
                if r.is_dead(o) {
                    o += 1;
                    continue;
                }
                let end = r.live_end(o);
                ranges.push(o..end);
                o = end;
            }
            let copies: usize = ranges.iter().map(|range| r.copy_bytes(range.len())).sum();
            if ranges.len() > 1 && copies >= r.bytes() {
                continue;
            }
            for range in ranges {
                self.copy_range(w, run, range, guard);
            }
        }
    }

    /// Copies the live offsets `range` of `run` onto a new run with its live holders (their
    /// tokens moved to the range's first offset) and its hints, and repoints their slots.
    pub(super) fn copy_range(
        &self,
        w: &mut StoreWriter,
        run: NonNull<BlockRun>,
        range: std::ops::Range<usize>,
        guard: &Guard,
    ) {
        let r = run_ref(run);
        let mut keys = std::mem::take(&mut w.ordered);
        let mut values = std::mem::take(&mut w.ordered_values);
        let mut holders = std::mem::take(&mut w.holders);
        values.clear();
        holders.clear();
        let bytes = copy_keys(r, range.clone(), &mut keys);
        values.extend(range.clone().map(|o| Some(pack(run, o))));
        r.for_each_holder(|_, h| holders.push(h.with_tokens(r.tokens_at(&h, range.start))));
        let copied = Keys {
            digests: &keys,
            bytes: bytes.as_deref(),
        };
        if let Some(new) = self.new_run(w, &holders, copied, r.step()) {
            let n = run_ref(new);
            r.for_each_hint(|k, target| n.set_hint(k, target));
            self.repoint(w, &keys, &values, run, Some(new), guard);
        }
        w.ordered = keys;
        w.ordered_values = values;
        w.holders = holders;
    }

    /// Ingests `keys` for `writing`, with the blocks' own token counts `counts`: block `i`'s
    /// entry holds the chain's cumulative count `counts[0] + … + counts[i]` (wrapping; the
    /// index's K8), a chain that repeats a key leaving it with its last occurrence's.
    pub fn ingest<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        counts: &[i32],
        writing: Writing,
        guard: &Guard,
    ) -> IngestReport {
        self.ingest_with(keys, counts, writing, guard, |_, _| {})
    }

    /// [`RunStore::ingest`], calling `added(i, holder)` for each block `keys[i]` the replica did
    /// not hold before, in chain order (the change events, N1), with the entry it got (its
    /// token count the block's). A chain that repeats a key reports each occurrence that added
    /// the replica. A key whose digest another key of the store holds (keys of other lengths
    /// than 8 whose digests collide) is left as it was and counted in
    /// [`IngestReport::dropped`].
    pub fn ingest_with<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        counts: &[i32],
        writing: Writing,
        guard: &Guard,
        mut added: impl FnMut(usize, Holder),
    ) -> IngestReport {
        let keys: Keys<'k, K> = keys.into();
        let n = keys.len().min(counts.len());
        let (keys, counts) = (keys.range(0..n), &counts[..n]);
        let mut w = self.lock_writer();
        let mut report = IngestReport::default();
        let mut cumulative = std::mem::take(&mut w.cumulative);
        cumulative.clear();
        cumulative.extend(counts.iter().scan(0i32, |sum, &c| {
            *sum = sum.wrapping_add(c);
            Some(*sum)
        }));
        if w.has_repeats(keys.digests) {
            // Key by key, each a chain of one block holding its cumulative count.
            for i in 0..n {
                self.ingest_locked(
                    &mut w,
                    keys.range(i..i + 1),
                    &cumulative[i..=i],
                    &cumulative[i..=i],
                    writing,
                    guard,
                    &mut report,
                    &mut |_, h| added(i, h),
                );
            }
        } else {
            self.ingest_locked(
                &mut w,
                keys,
                counts,
                &cumulative,
                writing,
                guard,
                &mut report,
                &mut added,
            );
        }
        w.cumulative = cumulative;
        self.trim(&mut w, guard);
        report
    }

    /// The ingest of a chain without repeats: `counts` are its blocks' own token counts,
    /// `cumulative` their running sums (the entries' token counts).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ingest_locked<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        chain: Keys<'_, K>,
        counts: &[i32],
        cumulative: &[i32],
        writing: Writing,
        guard: &Guard,
        report: &mut IngestReport,
        added: &mut impl FnMut(usize, Holder),
    ) {
        let keys = chain.digests;
        if keys.is_empty() {
            return;
        }
        self.cut(w, chain, Some(counts), guard);
        w.owners.clear();
        let stretches = std::mem::take(&mut w.stretches);
        for &s in &stretches {
            match s {
                Stretch::Taken => report.dropped += 1,
                Stretch::Absent { from, to } => {
                    let me = Holder::new(
                        writing.rep,
                        writing.tier,
                        cumulative[from],
                        writing.ts_ms,
                        w.next_generation(),
                    );
                    let step = if to - from > 1 { counts[from + 1] } else { 0 };
                    let Some(run) = self.new_run(w, &[me], chain.range(from..to), step) else {
                        report.dropped += to - from;
                        continue;
                    };
                    for k in keys[from..to].iter().take(AHEAD) {
                        self.table.prefetch(*k, guard);
                    }
                    let mut slots = self.table.lock();
                    for (o, k) in keys[from..to].iter().enumerate() {
                        if let Some(n) = keys.get(from + o + AHEAD) {
                            self.table.prefetch(*n, guard);
                        }
                        // The cut found every key of an absent stretch absent, under this
                        // writer lock, and the chain has no repeats.
                        slots.insert_absent(*k, slot(pack(run, o)), guard);
                    }
                    drop(slots);
                    report.added += to - from;
                    report.new_keys += to - from;
                    (from..to).for_each(|i| added(i, me.with_tokens(cumulative[i])));
                    w.owners.push((run, to));
                }
                Stretch::InRun { from, to, run, .. } => {
                    let r = run_ref(run);
                    // The stretch names offsets `o_from..` forwards (an ingest's cut follows a
                    // run forwards only), so its entries' counts are `base + step · o`.
                    let (_, o_from) = unpack(w.values[from].unwrap_or_default());
                    let step = r.step();
                    let base = cumulative[from].wrapping_sub(step.wrapping_mul(o_from as i32));
                    let mut holders = std::mem::take(&mut w.holders);
                    holders.clear();
                    r.for_each_holder(|_, h| holders.push(h));
                    // What the stretch needs: nothing, or a new run with `holders`, which adds
                    // the replica's entry `joined` (else refreshes it).
                    let (copy, joined) = 'decide: {
                        match holders.iter().position(|h| h.rep() == writing.rep) {
                            Some(i) => {
                                let fresh = holders[i].refreshed(base, writing.tier, writing.ts_ms);
                                if fresh == holders[i] {
                                    break 'decide (false, None);
                                }
                                holders[i] = fresh;
                                (true, None)
                            }
                            None => {
                                let me = Holder::new(
                                    writing.rep,
                                    writing.tier,
                                    base,
                                    writing.ts_ms,
                                    w.next_generation(),
                                );
                                if to - from == r.live_count() && r.push_holder(me) {
                                    self.ids.lower_age(r.id(), me.last_seen_ms());
                                    report.added += to - from;
                                    (from..to)
                                        .for_each(|i| added(i, me.with_tokens(cumulative[i])));
                                    break 'decide (false, None);
                                }
                                if holders.len() == MAX_HOLDERS {
                                    report.dropped += to - from;
                                    break 'decide (false, None);
                                }
                                let at = holders.partition_point(|h| h.rep() < writing.rep);
                                holders.insert(at, me);
                                (true, Some(me))
                            }
                        }
                    };
                    let new = if copy {
                        // The copy's offset 0 is the stretch's first block.
                        for h in holders.iter_mut() {
                            *h = h.with_tokens(r.tokens_at(h, o_from));
                        }
                        self.new_run(w, &holders, chain.range(from..to), step)
                    } else {
                        None
                    };
                    w.holders = holders;
                    if !copy {
                        w.owners.push((run, to));
                        continue;
                    }
                    let Some(new) = new else {
                        report.dropped += to - from;
                        continue;
                    };
                    match joined {
                        Some(me) => {
                            report.added += to - from;
                            (from..to).for_each(|i| added(i, me.with_tokens(cumulative[i])));
                        }
                        None => report.refreshed += to - from,
                    }
                    let end = o_from + (to - from);
                    let n = run_ref(new);
                    if end == r.len() {
                        r.for_each_hint(|k, target| n.set_hint(k, target));
                    } else if !r.is_dead(end) {
                        n.set_hint(r.key(end), HintTarget::at(r, pack(run, end)));
                    }
                    let olds = std::mem::take(&mut w.values);
                    self.repoint(w, &keys[from..to], &olds[from..to], run, Some(new), guard);
                    w.values = olds;
                    w.owners.push((new, to));
                }
            }
        }
        w.stretches = stretches;
        // The chain's first key gets a root slot, unless the chain visibly continues a
        // prefix (module docs, "Root slots").
        if self.options.roots
            && !continues_a_prefix(counts)
            && let Some(v) = self.table.find(keys[0], guard)
            && v.get() & FLAG == 0
        {
            let flagged = slot(v.get() | FLAG);
            self.table.lock().insert(keys[0], flagged, guard);
            self.roots.lock().insert(keys[0], flagged, guard);
        }
        // Each stretch's run hints at the block after it, as the ingest left it.
        for pair in w.owners.windows(2) {
            let (run, to) = pair[0];
            if let Some(v) = self.table.find(keys[to], guard) {
                let target = run_ref(unpack(v.get()).0);
                run_ref(run).set_hint(keys[to], HintTarget::at(target, v.get()));
            }
        }
    }

    /// Points the slots of `keys` (offsets of `old`, as `olds` name them) at offsets `0..` of
    /// `new`, or removes them; marks each old offset dead before its slot changes (invariant 2)
    /// and releases them.
    pub(super) fn repoint(
        &self,
        w: &mut StoreWriter,
        keys: &[u64],
        olds: &[Option<u64>],
        old: NonNull<BlockRun>,
        new: Option<NonNull<BlockRun>>,
        guard: &Guard,
    ) {
        for k in keys.iter().take(AHEAD) {
            self.table.prefetch_present(*k, guard);
        }
        let o_run = run_ref(old);
        let mut slots: SlotWriter<'_> = self.table.lock();
        for (o, (k, was)) in keys.iter().zip(olds).enumerate() {
            if let Some(n) = keys.get(o + AHEAD) {
                self.table.prefetch_present(*n, guard);
            }
            let (_, old_o) = unpack(was.unwrap_or_default());
            o_run.set_dead(old_o);
            let replaced = match new {
                Some(r) => slots.insert(*k, slot(pack(r, o)), guard),
                None => slots.remove(*k, guard),
            };
            if replaced.is_some_and(|v| v.get() & FLAG != 0) {
                let mut roots = self.roots.lock();
                match new {
                    Some(r) => {
                        let flagged = slot(pack(r, o) | FLAG);
                        slots.insert(*k, flagged, guard);
                        roots.insert(*k, flagged, guard);
                    }
                    None => {
                        roots.remove(*k, guard);
                    }
                }
            }
        }
        drop(slots);
        self.release(w, old, keys.len() as u64, guard);
    }
}

/// Whether a chain with the blocks' own token counts `counts` visibly continues a prefix the
/// ingest does not name: its first block's count, which carries the prefix's tokens (K8), is
/// larger than its second block's. Only such a chain's first key is no chain's block 0.
fn continues_a_prefix(counts: &[i32]) -> bool {
    matches!(counts, [first, second, ..] if first > second)
}
