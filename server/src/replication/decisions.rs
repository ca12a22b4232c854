//! The leader's eviction decisions: what local eviction removes (the cap, quotas, the TTL
//! sweep) is logged here, grouped per holder, and published as records every server applies
//! alike. Followers install the log with local eviction off, so they decide nothing.

use super::outbox::Outbox;
use super::record::{Body, Evictions, Holder, Record};
use crate::core::Core;
use inferencecache_engine::{Decided, DecisionLog};
use std::sync::Arc;

/// The leader's removals, grouped per (partition, replica), published after each command of
/// the apply thread.
pub struct Decisions {
    outbox: Arc<Outbox>,
    pending: parking_lot::Mutex<Vec<Evictions>>,
}

impl Decisions {
    pub fn new(outbox: Arc<Outbox>) -> Self {
        Self {
            outbox,
            pending: parking_lot::Mutex::new(Vec::new()),
        }
    }

    pub fn flush(&self) {
        let pending = std::mem::take(&mut *self.pending.lock());
        for e in pending {
            self.outbox.push_decided(Record {
                body: Some(Body::Evictions(e)),
            });
        }
    }
}

impl DecisionLog for Decisions {
    fn removed(&self, d: &Decided<'_>) {
        let mut pending = self.pending.lock();
        let same = pending.last().is_some_and(|e| {
            e.keys.len() < 4096
                && e.holder.as_ref().is_some_and(|h| {
                    h.tenant_id == d.tenant_id
                        && h.model_id == d.model_id
                        && h.hash_scheme == d.hash_scheme
                        && h.adapter_id == d.adapter_id
                        && h.replica_id == d.replica_id
                })
        });
        if !same {
            pending.push(Evictions {
                holder: Some(Holder {
                    tenant_id: d.tenant_id.into(),
                    model_id: d.model_id.into(),
                    hash_scheme: d.hash_scheme.into(),
                    adapter_id: d.adapter_id.into(),
                    replica_id: d.replica_id.into(),
                }),
                ..Default::default()
            });
        }
        if let Some(e) = pending.last_mut() {
            e.keys.push(d.key.to_vec());
            e.last_seen_ms.push(d.last_seen_ms);
        }
    }
}

/// Followers never evict: the index starts with local eviction off and the log installed
/// (it only receives what local eviction removes, i.e. nothing until this server leads).
pub fn install_decisions(state: &Core, decisions: Arc<Decisions>) {
    state.index().set_local_eviction(false);
    state.index().set_decision_log(Some(decisions));
}
