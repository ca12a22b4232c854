//! The exact path: a population of at most [`EXACT_MAX`](super::EXACT_MAX) entries (cap) or keys
//! (quota) is enumerated and its victims taken exactly in the ideal order.

use super::super::Index;
use super::super::records::Partition;
use super::context::{Cx, run_age};
use super::hand::{Hand, RANK_MAX, Rank, Victim};
use crate::ReplicaId;
use crate::raw::key::KeyBytes;
use crate::raw::key::own_key;
use crate::sync::Ordering;
use crossbeam_epoch::{self as epoch};
use std::sync::Arc;

impl Index {
    /// Enumerates the whole non-reserved population and evicts its `need` first entries in the
    /// ideal order. Returns the entries removed.
    pub(super) fn exact_cap(&self, hand: &mut Hand<Partition>, cx: &mut Cx, need: i64) -> usize {
        type Full = (
            Rank,
            Arc<str>,
            Arc<str>,
            Arc<str>,
            Arc<str>,
            Vec<u8>,
            ReplicaId,
        );
        let mut all: Vec<(Full, Victim)> = Vec::new();
        {
            let guard = epoch::pin();
            for (pi, p) in hand.parts.iter().enumerate() {
                if !cx.eligible(p) {
                    continue;
                }
                let reps = p.scope.replicas.load(&guard);
                p.store.for_each_key(&guard, |digest, run, o| {
                    let key = KeyBytes::new(digest, run.long_key(o));
                    self.visit(cx, p, run, o, &guard, |rank, rep, generation| {
                        let full = (
                            rank,
                            p.tenant.name.clone(),
                            p.model.name.clone(),
                            p.scope.scheme.clone(),
                            p.adapter.clone(),
                            key.as_ref().to_vec(),
                            reps[rep as usize].name.clone(),
                        );
                        let v = Victim {
                            rank,
                            part: pi,
                            key: own_key(key.as_ref()),
                            rep,
                            generation,
                        };
                        all.push((full, v));
                    });
                });
            }
        }
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut removed = 0;
        for (_, v) in &all {
            if removed as i64 >= need
                || self.storage_entries.load(Ordering::Relaxed) <= self.cfg.max_entries
            {
                break;
            }
            let part = &hand.parts[v.part];
            if self.evict_entry(part, v, RANK_MAX, cx, None) {
                removed += 1;
            }
        }
        removed
    }

    /// Enumerates the tenant's keys and deletes its `need` oldest keys in the ideal order.
    pub(super) fn exact_quota(&self, hand: &mut Hand<Partition>, cx: &Cx, need: i64) -> usize {
        type Full = (i64, Arc<str>, Arc<str>, Arc<str>, Vec<u8>);
        let mut all: Vec<(Full, usize)> = Vec::new();
        {
            let guard = epoch::pin();
            for (pi, p) in hand.parts.iter().enumerate() {
                if p.keys.load(Ordering::Relaxed) <= 0 {
                    continue;
                }
                p.store.for_each_key(&guard, |digest, run, o| {
                    let full = (
                        run_age(run),
                        p.model.name.clone(),
                        p.scope.scheme.clone(),
                        p.adapter.clone(),
                        KeyBytes::new(digest, run.long_key(o)).as_ref().to_vec(),
                    );
                    all.push((full, pi));
                });
            }
        }
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut removed = 0;
        for (full, pi) in all.iter().take(need.max(0) as usize) {
            let part = &hand.parts[*pi];
            if self.evict_key(part, &full.4, i64::MAX, cx.now_us) {
                removed += 1;
                part.tenant.quota_evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        removed
    }
}
