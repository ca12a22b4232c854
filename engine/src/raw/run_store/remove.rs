//! The store's removals: a replica's copies of keys (PREFIX_EVICTED, ALL_CLEARED, the TTL
//! sweep), whole keys (quotas), one entry or run holder (the cap), each under the writer lock
//! and published so that readers never see a freed run.

use super::*;

impl RunStore {
    /// Removes replica `rep` from `keys` (PREFIX_EVICTED).
    pub fn evict<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        rep: u32,
        guard: &Guard,
    ) -> EvictReport {
        self.evict_with(keys, rep, guard, |_, _| {})
    }

    /// [`RunStore::evict`], calling `removed(i, holder)` for each block `keys[i]` the replica
    /// held, in chain order (the change events, N1), with the entry it removed.
    pub fn evict_with<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        rep: u32,
        guard: &Guard,
        mut removed: impl FnMut(usize, Holder),
    ) -> EvictReport {
        let keys: Keys<'k, K> = keys.into();
        let mut w = self.lock_writer();
        let report = match self.evict_locked(&mut w, keys, rep, guard, &mut removed) {
            Some(report) => report,
            None => {
                let mut report = EvictReport::default();
                for i in 0..keys.len() {
                    let one = keys.range(i..i + 1);
                    let mut at = |_, h| removed(i, h);
                    report += self
                        .evict_locked(&mut w, one, rep, guard, &mut at)
                        .unwrap_or_default();
                }
                report
            }
        };
        self.trim(&mut w, guard);
        report
    }

    /// Removes replica `rep` from every key it holds (ALL_CLEARED).
    pub fn clear_replica(&self, rep: u32, guard: &Guard) -> EvictReport {
        self.remove_holders(|h| h.rep() == rep, guard)
    }

    /// Removes every holder `doomed` picks (the TTL sweep: the stale ones; ALL_CLEARED: one
    /// replica's) from every key it holds. Run by run: each replica a run holds that is picked
    /// leaves the run over its live offsets, one stretch.
    pub fn remove_holders(&self, doomed: impl Fn(&Holder) -> bool, guard: &Guard) -> EvictReport {
        self.remove_holders_with(doomed, guard, |_, _, _| {})
    }

    /// [`RunStore::remove_holders`], calling `removed(digest, long part, holder)` for each entry
    /// it removes. The key table is walked segment by segment in slices of [`SLICE`] slots, the
    /// writer lock taken per slice (other writers wait for one slice at most); a slice restarts
    /// its segment's walk when that segment was rebuilt since the last slice (its positions
    /// moved), so every key present throughout is visited.
    pub fn remove_holders_with(
        &self,
        doomed: impl Fn(&Holder) -> bool,
        guard: &Guard,
        mut removed: impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let mut report = EvictReport::default();
        let mut keys = Vec::new();
        for segment in 0..SlotTable::segments() {
            let (mut from, mut done) = (0, 0);
            let mut table = self.table.segment_id(segment, guard);
            loop {
                let mut w = self.lock_writer();
                if self.table.segment_id(segment, guard) != table {
                    table = self.table.segment_id(segment, guard);
                    (from, done) = (0, 0);
                }
                let len = self.table.segment_capacity(segment, guard);
                if done >= len {
                    break;
                }
                let count = SLICE.min(len - done);
                let mut runs = Vec::new();
                let mut listed = std::collections::HashSet::new();
                from = self
                    .table
                    .for_each_value_in(segment, from, count, guard, |v| {
                        let (run, _) = unpack(v);
                        if listed.insert(run) {
                            let mut picked = Vec::new();
                            run_ref(run).for_each_holder(|_, h| {
                                if doomed(&h) {
                                    picked.push(h.rep());
                                }
                            });
                            if !picked.is_empty() {
                                runs.push((run, picked));
                            }
                        }
                    });
                done += count;
                for (run, picked) in runs {
                    let r = run_ref(run);
                    report +=
                        self.evict_from_run(&mut w, r, &picked, &mut keys, guard, &mut removed);
                }
                self.trim(&mut w, guard);
            }
        }
        report
    }

    /// Removes `keys` with all their holders (a quota's victims).
    pub fn remove_keys<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        guard: &Guard,
    ) -> EvictReport {
        self.remove_keys_with(keys, guard, |_, _, _| {})
    }

    /// [`RunStore::remove_keys`], calling `removed(digest, long part, holder)` for each entry it
    /// removes.
    pub fn remove_keys_with<'k, K: AsRef<[u8]> + 'k>(
        &self,
        keys: impl Into<Keys<'k, K>>,
        guard: &Guard,
        mut removed: impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let keys: Keys<'k, K> = keys.into();
        let mut w = self.lock_writer();
        let report = self.remove_keys_locked(&mut w, keys, guard, &mut removed);
        self.trim(&mut w, guard);
        report
    }

    pub(super) fn remove_keys_locked<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        keys: Keys<'_, K>,
        guard: &Guard,
        removed: &mut impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let mut report = EvictReport::default();
        for i in 0..keys.len() {
            let k = keys.digest(i);
            let Some((v, r, o)) = self.find_victim(k, keys.long(i), guard) else {
                continue;
            };
            r.for_each_holder(|_, h| {
                report.removed += 1;
                removed(k, keys.long(i), h.with_tokens(r.tokens_at(&h, o)));
            });
            report.keys_removed += 1;
            self.unlink_key(w, k, v, guard);
        }
        report
    }

    /// Takes the key with `digest`, whose slot holds `value`, out of the store: its offset
    /// dead, its slot and root slot gone, its run released.
    pub(super) fn unlink_key(&self, w: &mut StoreWriter, digest: u64, value: u64, guard: &Guard) {
        let (run, o) = unpack(value);
        // Invariant 2: the offset is dead before its slot goes.
        run_ref(run).set_dead(o);
        self.table.lock().remove(digest, guard);
        if value & FLAG != 0 {
            self.roots.lock().remove(digest, guard);
        }
        self.release(w, run, 1, guard);
    }

    /// Removes `rep` from every live block of the run that holds the key with `digest` and
    /// long part `long` (the cap's victim: one replica's copy of a stretch, all blocks of one
    /// age), calling `removed(digest, long part, holder)` for each entry it removes. Nothing
    /// when the key is absent or `rep` does not hold it.
    pub fn remove_run_holder_with(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
        mut removed: impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let mut w = self.lock_writer();
        let Some((_, r, _)) = self.find_victim(digest, long, guard) else {
            return EvictReport::default();
        };
        let mut held = false;
        r.for_each_holder(|_, h| held |= h.rep() == rep);
        if !held {
            return EvictReport::default();
        }
        let report = self.evict_from_run(&mut w, r, &[rep], &mut Vec::new(), guard, &mut removed);
        self.trim(&mut w, guard);
        report
    }

    /// Removes each of `reps` from every live block of `r`, calling `removed(digest, long
    /// part, holder)` for each entry it removes; `digests` is scratch.
    pub(super) fn evict_from_run(
        &self,
        w: &mut StoreWriter,
        r: &BlockRun,
        reps: &[u32],
        digests: &mut Vec<u64>,
        guard: &Guard,
        removed: &mut impl FnMut(u64, Option<&[u8]>, Holder),
    ) -> EvictReport {
        let bytes = copy_keys(r, (0..r.len()).filter(|&o| !r.is_dead(o)), digests);
        let live = Keys {
            digests,
            bytes: bytes.as_deref(),
        };
        let mut report = EvictReport::default();
        for &rep in reps {
            // A run's live keys are distinct: no repeat to rule out.
            let mut at = |i: usize, h| removed(live.digest(i), live.long(i), h);
            report += self
                .evict_locked(w, live, rep, guard, &mut at)
                .unwrap_or_default();
        }
        report
    }

    /// Calls `f` with replica `rep`'s entry of the key (as [`RunStore::entry`] finds it) while
    /// holding the writer lock, so no write changes the entry until `f` returns (an entry's
    /// first LFU credit creates its cell so: `raw/lfu.rs`).
    pub fn with_entry_locked<R>(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
        f: impl FnOnce(Option<Holder>) -> R,
    ) -> R {
        let _w = self.lock_writer();
        f(self.entry(digest, long, rep, guard))
    }

    /// Removes replica `rep`'s entry of the key if it is present and `doomed` picks it (checked
    /// under the writer lock: a cap victim re-validated; it may read the entry's [`RunMates`]),
    /// calling `removed(holder)` before it goes. Returns what it removed.
    pub fn remove_entry_if(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        rep: u32,
        guard: &Guard,
        doomed: impl FnOnce(&Holder, RunMates<'_>) -> bool,
        mut removed: impl FnMut(Holder),
    ) -> EvictReport {
        let mut w = self.lock_writer();
        let Some((value, run, o)) = self.find_victim(digest, long, guard) else {
            return EvictReport::default();
        };
        let (mut found, mut holding) = (None, 0);
        run.for_each_holder(|_, h| {
            holding += 1;
            if h.rep() == rep {
                found = Some(h.with_tokens(run.tokens_at(&h, o)));
            }
        });
        let Some(entry) = found.filter(|h| doomed(h, RunMates { run, offset: o })) else {
            return EvictReport::default();
        };
        if holding == 1 {
            // The replica is the block's only holder: its entry goes with the key, as a key's
            // removal takes it (`remove_keys_locked`), with no stretch to cut or run to copy.
            removed(entry);
            self.unlink_key(&mut w, digest, value, guard);
            self.trim(&mut w, guard);
            return EvictReport {
                removed: 1,
                keys_removed: 1,
            };
        }
        let report = one_key(digest, long, |key| {
            self.evict_locked(&mut w, key, rep, guard, &mut |_, h| removed(h))
                .unwrap_or_default()
        });
        self.trim(&mut w, guard);
        report
    }

    /// Removes the key with `digest` and long part `long` with all its holders if it is
    /// present and `doomed` picks its holders (checked under the writer lock: a quota victim
    /// re-validated), calling `removed(holder)` for each before they go.
    pub fn remove_key_if(
        &self,
        digest: u64,
        long: Option<&[u8]>,
        guard: &Guard,
        doomed: impl FnOnce(&[Holder]) -> bool,
        mut removed: impl FnMut(Holder),
    ) -> EvictReport {
        let mut w = self.lock_writer();
        let Some((_, run, o)) = self.find_victim(digest, long, guard) else {
            return EvictReport::default();
        };
        let mut holders = Vec::new();
        run.for_each_holder(|_, h| holders.push(h.with_tokens(run.tokens_at(&h, o))));
        if !doomed(&holders) {
            return EvictReport::default();
        }
        let report = one_key(digest, long, |key| {
            self.remove_keys_locked(&mut w, key, guard, &mut |_, _, h| removed(h))
        });
        self.trim(&mut w, guard);
        report
    }

    /// Removes `rep` from `keys`; `None`, having changed nothing, when two of the chain's keys
    /// name one block (a repeated key the store holds: written key by key instead).
    pub(super) fn evict_locked<K: AsRef<[u8]>>(
        &self,
        w: &mut StoreWriter,
        keys: Keys<'_, K>,
        rep: u32,
        guard: &Guard,
        removed_at: &mut impl FnMut(usize, Holder),
    ) -> Option<EvictReport> {
        self.cut(w, keys, None, guard);
        if w.blocks_repeat(keys.digests) {
            return None;
        }
        let mut removed = 0;
        let mut keys_removed = 0;
        let stretches = std::mem::take(&mut w.stretches);
        for &s in &stretches {
            let Stretch::InRun {
                from,
                to,
                run,
                descending,
            } = s
            else {
                continue;
            };
            let r = run_ref(run);
            let (mut at, mut holding) = (None, 0);
            r.for_each_holder(|i, h| {
                holding += 1;
                if h.rep() == rep {
                    at = Some((i, h));
                }
            });
            let Some((at, gone)) = at else {
                continue;
            };
            // The removed entry of chain block `i`, with its token count.
            let entry = |values: &[Option<u64>], i: usize| {
                let o = unpack(values[i].unwrap_or_default()).1;
                gone.with_tokens(r.tokens_at(&gone, o))
            };
            if holding > 1 && self.options.gone && to - from == r.live_count() {
                (from..to).for_each(|i| removed_at(i, entry(&w.values, i)));
                r.set_gone(at);
                removed += to - from;
                continue;
            }
            // The stretch's keys in old-offset order (the chain's, matched in `cut`; a long
            // run's with their bytes).
            let mut ordered = std::mem::take(&mut w.ordered);
            let mut ordered_values = std::mem::take(&mut w.ordered_values);
            ordered_values.clear();
            ordered_values.extend_from_slice(&w.values[from..to]);
            if descending {
                ordered_values.reverse();
            }
            let bytes = if r.is_long() {
                let offsets = ordered_values
                    .iter()
                    .map(|v| unpack(v.unwrap_or_default()).1);
                copy_keys(r, offsets, &mut ordered)
            } else {
                ordered.clear();
                ordered.extend_from_slice(&keys.digests[from..to]);
                if descending {
                    ordered.reverse();
                }
                None
            };
            // The copy's offset 0 is the stretch's first offset in the run (`block_run`,
            // "Token counts").
            let first = unpack(ordered_values[0].unwrap_or_default()).1;
            let mut holders = std::mem::take(&mut w.holders);
            holders.clear();
            r.for_each_holder(|_, h| {
                if h.rep() != rep {
                    holders.push(h.with_tokens(r.tokens_at(&h, first)));
                }
            });
            let new = if holders.is_empty() {
                None
            } else {
                let copied = Keys {
                    digests: &ordered,
                    bytes: bytes.as_deref(),
                };
                self.new_run(w, &holders, copied, r.step())
            };
            // Without a run for the others (none could be built), the stretch stays as it was.
            if new.is_some() || holders.is_empty() {
                (from..to).for_each(|i| removed_at(i, entry(&w.values, i)));
                self.repoint(w, &ordered, &ordered_values, run, new, guard);
                if new.is_none() {
                    keys_removed += to - from;
                }
                removed += to - from;
            }
            w.holders = holders;
            w.ordered = ordered;
            w.ordered_values = ordered_values;
        }
        w.stretches = stretches;
        Some(EvictReport {
            removed,
            keys_removed,
        })
    }
}
