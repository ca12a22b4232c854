//! The server's core handle: what the index's keepers share (the index, the policy store and
//! the last pushed policy body, the restore gate with the readiness it drives, the checkpoint
//! status and the endpoint registry producers' stats fill).
//!
//! `checkpoint` and `replication` take a [`Core`], not the whole `crate::state::AppState`:
//! they restore and apply the index, they neither serve nor count requests. So neither of them
//! imports the serving state, and the state can hold replication without an import circle.
//!
//! Invariants:
//! - Readiness is "started and not restoring" ([`Core::ready`]); every change of either is
//!   published on the readiness channel gRPC health and `/readyz` follow.
//! - While *restoring*, producers and `/policy` pushes wait ([`Core::wait_restored`]), so an
//!   older checkpoint never overwrites what a producer sent after it.

pub mod checkpoint_status;

use crate::endpoints::Registry;
use crate::policy::{Layer, PolicyStore, decode_push};
use checkpoint_status::Status;
use inferencecache_engine::Index;
use inferencecache_proto::v1alpha1 as pb;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A cheap clone of the core's shared parts.
#[derive(Clone)]
pub struct Core {
    inner: Arc<CoreInner>,
}

struct CoreInner {
    index: Arc<Index>,
    policies: Arc<PolicyStore>,
    /// The body of the last accepted `/policy` push (kept in checkpoints).
    pushed_policy: parking_lot::Mutex<Option<Arc<[u8]>>>,
    /// Started (and not stopped or draining).
    ready: AtomicBool,
    /// True while a warm restart loads its checkpoint (see `checkpoint/mod.rs`).
    restoring: tokio::sync::watch::Sender<bool>,
    /// Readiness as health and `/readyz` report it: started, not restoring, not draining.
    readiness: tokio::sync::watch::Sender<bool>,
    checkpoint_status: Arc<Status>,
    /// The endpoint picker's replica → `ip:port` map and in-flight counts (docs/epp.md).
    endpoints: Arc<Registry>,
}

impl Core {
    /// A core over `index` and its policy store (not started, not restoring).
    pub fn new(index: Arc<Index>, policies: Arc<PolicyStore>) -> Self {
        Self {
            inner: Arc::new(CoreInner {
                index,
                policies,
                pushed_policy: parking_lot::Mutex::new(None),
                ready: AtomicBool::new(false),
                restoring: tokio::sync::watch::Sender::new(false),
                readiness: tokio::sync::watch::Sender::new(false),
                checkpoint_status: Arc::default(),
                endpoints: Arc::default(),
            }),
        }
    }

    /// The index.
    pub fn index(&self) -> &Arc<Index> {
        &self.inner.index
    }

    /// The policy store the index reads.
    pub fn policies(&self) -> &Arc<PolicyStore> {
        &self.inner.policies
    }

    /// Applies an accepted `/policy` push and keeps its body for checkpoints.
    pub fn push_policy(&self, body: &[u8], layer: Layer) {
        *self.inner.pushed_policy.lock() = Some(Arc::from(body));
        self.inner.policies.replace_pushed(layer);
    }

    /// The last accepted `/policy` push body.
    pub fn pushed_policy_body(&self) -> Option<Arc<[u8]>> {
        self.inner.pushed_policy.lock().clone()
    }

    /// Re-applies a push body stored in a checkpoint (an undecodable one is logged and
    /// skipped: the checkpoint's index is still restored).
    pub fn restore_pushed_policy(&self, body: &[u8]) {
        match decode_push(body) {
            Ok(layer) => self.push_policy(body, layer),
            Err(err) => tracing::error!(err = %err, "checkpoint_policy_refused"),
        }
    }

    /// Checkpoint state for `/checkpoint` and the metrics.
    pub fn checkpoint_status(&self) -> &Arc<Status> {
        &self.inner.checkpoint_status
    }

    /// The endpoint picker's endpoint registry (filled from producers' stats whether or not
    /// the picker runs).
    pub fn endpoints(&self) -> &Arc<Registry> {
        &self.inner.endpoints
    }

    /// Records the engine address a producer's stats carry (every server applying the update
    /// learns it, so picker replicas agree).
    pub fn observe_endpoint(&self, update: &pb::CacheStateUpdate) {
        if let Some(stats) = &update.stats {
            self.inner
                .endpoints
                .observe(&update.replica_id, &stats.endpoint);
        }
    }

    /// Whether the index is started and not restoring (drives `/readyz` and gRPC health).
    pub fn ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire) && !self.restoring()
    }

    /// Marks the server started (or stopped, or draining) and publishes the readiness.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::Release);
        self.publish_readiness();
    }

    fn publish_readiness(&self) {
        let ready = self.ready();
        self.inner.readiness.send_if_modified(|r| {
            let changed = *r != ready;
            *r = ready;
            changed
        });
    }

    /// Readiness changes (health follows it).
    pub fn readiness(&self) -> tokio::sync::watch::Receiver<bool> {
        self.inner.readiness.subscribe()
    }

    /// Enters the warm-restart *restoring* state (before the listeners serve).
    pub fn begin_restore(&self) {
        self.inner.restoring.send_replace(true);
        self.publish_readiness();
    }

    /// Leaves the *restoring* state: waiting producers go on, readiness may turn true.
    pub fn end_restore(&self) {
        self.inner.restoring.send_replace(false);
        self.publish_readiness();
    }

    /// Whether a warm restart is loading its checkpoint.
    pub fn restoring(&self) -> bool {
        *self.inner.restoring.borrow()
    }

    /// Waits until no restore is running (at once when none is).
    pub async fn wait_restored(&self) {
        if !self.restoring() {
            return;
        }
        let mut rx = self.inner.restoring.subscribe();
        let _ = rx.wait_for(|restoring| !*restoring).await;
    }
}
