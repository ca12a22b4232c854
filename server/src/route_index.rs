//! The seam between the LookupRoute handler and the index (H7): the one call the handler
//! makes, behind a trait so a test double can stand in for the engine (and show that the
//! handler gives up at its deadline).

use inferencecache_engine::{Index, LookupRequest, RouteResult};
use std::time::Instant;

/// The one index call `LookupRoute` makes (step 13, H7). The production [`Index`] is wait-free
/// and answers inline; an implementation that may block (a test double) must give up at
/// `deadline` and return `None`, which the handler answers with `TIMEOUT`.
pub trait RouteIndex: Send + Sync {
    /// Answers `query`, or `None` when `deadline` fired first (the work is abandoned).
    fn route(&self, query: RouteQuery<'_, '_>, deadline: Option<Instant>) -> Option<RouteResult>;
}

/// A lookup as the handler resolved it: the wire chain, or fingerprints derived from tokens.
/// Two concrete forms keep [`RouteIndex`] object-safe without copying the chain.
#[derive(Clone, Copy)]
pub enum RouteQuery<'q, 'r> {
    /// Chain and exact key as sent (also the empty request).
    Wire(&'q LookupRequest<'r, Vec<u8>>),
    /// Chain or exact key fingerprinted from `token_ids` / `prompt_text`.
    Fingerprint(&'q LookupRequest<'r, [u8; 8]>),
}

impl RouteQuery<'_, '_> {
    /// Runs the query on the engine index.
    pub fn route_on(self, index: &Index) -> RouteResult {
        match self {
            Self::Wire(req) => index.lookup_route(req),
            Self::Fingerprint(req) => index.lookup_route(req),
        }
    }
}

impl RouteIndex for Index {
    /// Wait-free, so the deadline never interrupts it (the handler checks it afterwards).
    fn route(&self, query: RouteQuery<'_, '_>, _deadline: Option<Instant>) -> Option<RouteResult> {
        Some(query.route_on(self))
    }
}
