//! Replica ids as lookups return them: interned, copyable handles.
//!
//! A LookupRoute names every replica it ranks. With `Arc<str>` ids, each named replica cost an
//! atomic increment when the result was built and a decrement when it was dropped: on W1M's
//! eight-replica Q50 route, about an eighth of the route's time went to those two `lock`
//! instructions per replica. A [`ReplicaId`] is a `&'static str` to one process-wide copy of the
//! id, so building, copying and dropping a result touches no shared counter.
//!
//! # Lifetime
//!
//! An id is interned the first time an index sees it (a scope's new replica, a stats report)
//! and is never freed: a result may hold it for as long as its caller likes. The records that
//! name a replica are reclaimed once it holds nothing (`dir.rs`), so what a renamed pod leaves
//! behind is its id's text and one set slot, once per process (the interner deduplicates),
//! bounded by the distinct ids the process has ever seen.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// The interned ids. A plain `std` mutex even in loom builds: interning runs on the writer
/// paths that create records, holds the lock only for a set lookup or insert (no loom
/// operation inside), and orders nothing the models check.
static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();

/// A replica id: derefs to the id's text; equality, ordering and hashing are the text's.
/// (Equality compares the pointers: the interner keeps one copy per text, so two ids have the
/// same text exactly when they are the same copy.)
#[derive(Clone, Copy, Eq, PartialOrd, Ord)]
pub struct ReplicaId(&'static str);

impl PartialEq for ReplicaId {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl std::hash::Hash for ReplicaId {
    /// The text's hash (as `Borrow<str>` requires: maps keyed by ids are looked up by `&str`).
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl ReplicaId {
    /// The interned copy of `id` (created on first use).
    pub fn intern(id: &str) -> Self {
        let mut names = NAMES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&name) = names.get(id) {
            return ReplicaId(name);
        }
        let name: &'static str = Box::leak(id.into());
        names.insert(name);
        ReplicaId(name)
    }

    /// The id's text.
    #[inline]
    pub fn as_str(self) -> &'static str {
        self.0
    }
}

impl std::ops::Deref for ReplicaId {
    type Target = str;
    #[inline]
    fn deref(&self) -> &str {
        self.0
    }
}

impl AsRef<str> for ReplicaId {
    fn as_ref(&self) -> &str {
        self.0
    }
}

impl std::borrow::Borrow<str> for ReplicaId {
    fn borrow(&self) -> &str {
        self.0
    }
}

impl From<&str> for ReplicaId {
    fn from(id: &str) -> Self {
        ReplicaId::intern(id)
    }
}

impl PartialEq<str> for ReplicaId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for ReplicaId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl std::fmt::Debug for ReplicaId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.0, f)
    }
}

impl std::fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn interning_keeps_one_copy_per_text() {
        let a = ReplicaId::intern("pod-a");
        let b = ReplicaId::intern(&String::from("pod-a"));
        let c = ReplicaId::intern("pod-b");
        assert!(std::ptr::eq(a.as_str(), b.as_str()), "one copy per text");
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Same address, different length: a prefix is a different id.
        let ab = ReplicaId::intern("pod-ab");
        let a_of_ab = ReplicaId::intern(&ab[..5]);
        assert_ne!(a_of_ab, ab);
        assert_eq!(a_of_ab, a);
        assert!(a < c, "ordered as text");
        assert_eq!(&*a, "pod-a");
        assert_eq!(a, "pod-a");
        assert_eq!(format!("{a}/{a:?}"), "pod-a/\"pod-a\"");
        assert_eq!(ReplicaId::intern("").as_str(), "");
    }
}
