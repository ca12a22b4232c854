//! `LookupRoute`, step by step as the handler algorithm of `server.md` §7.1 (H1–H13).
//!
//! No request content ever produces a gRPC error, and the handler logs nothing.

use crate::policy::Policy;
use crate::route_index::RouteQuery;
use crate::state::AppState;
use crate::translate::Reason;
use inferencecache_engine::fingerprint;
use inferencecache_engine::{LookupRequest, PROBE_TENANT, Strategy};
use inferencecache_proto::v1alpha1 as pb;
use sha2::{Digest, Sha256};
use smallvec::SmallVec;
use std::time::{Duration, Instant};

/// Most token ids a lookup may carry (`MaxLookupTokens`).
pub const MAX_LOOKUP_TOKENS: usize = 1 << 20;
/// Largest `prompt_text` accepted, in bytes (`MaxPromptTextBytes`).
pub const MAX_PROMPT_TEXT_BYTES: usize = 1 << 20;
/// Deadline applied when the server will tokenize and the caller set none.
pub const DEFAULT_TOKENIZE_TIMEOUT: Duration = Duration::from_secs(5);

/// What H4 resolved the request's inputs to.
enum Inputs<'r> {
    /// Wire chain and/or `prefix_hash`, passed through (chain blanked when chain matching is off).
    Explicit {
        chain: &'r [Vec<u8>],
        counts: &'r [i32],
        exact: &'r [u8],
        exact_tokens: i32,
    },
    /// Fingerprinted from `token_ids`: a chain, or only its last hash when chain matching is off.
    Derived {
        chain: Vec<[u8; 8]>,
        counts: Vec<i32>,
        exact: [u8; 8],
        exact_tokens: i32,
        chain_on: bool,
    },
    /// No input at all: the exact path with an empty key (D8).
    Empty,
    /// Resolution failed open: `NO_HINT` without an index call.
    FailOpen,
}

/// A fail-open or final answer under construction.
struct Answer {
    reason: Reason,
    scores: Vec<pb::ReplicaScore>,
    /// Whether the answer was built after the index was consulted (echo `adapter_id`).
    consulted: bool,
}

impl Answer {
    fn envelope(reason: Reason) -> Self {
        Self {
            reason,
            scores: Vec::new(),
            consulted: false,
        }
    }
}

/// Parses the `grpc-timeout` header (`<digits><unit>`, units H M S m u n).
fn caller_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let raw = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = raw.split_at(raw.len().checked_sub(1)?);
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// Handles one `LookupRoute` call.
pub async fn handle(
    state: &AppState,
    metadata: &tonic::metadata::MetadataMap,
    req: &pb::LookupRouteRequest,
) -> pb::LookupRouteResponse {
    // Step 1: every response reports the time since `start`.
    let start = Instant::now();
    let (answer, echo) = if state.core().restoring() {
        // A warm restart is loading its checkpoint: fail open until the index is whole.
        (Answer::envelope(Reason::NoHint), Vec::new())
    } else if might_tokenize(req) && req.tenant_id != PROBE_TENANT {
        route_tokenizing(state, metadata, req, start).await
    } else {
        (route(state, metadata, req, start), Vec::new())
    };
    let elapsed = start.elapsed();
    let hint_used = !answer.scores.is_empty();
    // Step 17: exactly one observation per call.
    state.metrics().observe_lookup(
        state.index(),
        &req.model_id,
        answer.reason,
        hint_used,
        elapsed,
    );
    pb::LookupRouteResponse {
        replica_scores: answer.scores,
        reason_code: answer.reason.code().to_string(),
        lookup_latency_us: i64::try_from(elapsed.as_micros()).unwrap_or(i64::MAX),
        token_ids: echo,
        adapter_id: if answer.consulted {
            req.adapter_id.clone()
        } else {
            String::new()
        },
    }
}

fn route(
    state: &AppState,
    metadata: &tonic::metadata::MetadataMap,
    req: &pb::LookupRouteRequest,
    start: Instant,
) -> Answer {
    // H1: the reserved tenant never touches the index.
    if req.tenant_id == PROBE_TENANT {
        return Answer::envelope(Reason::NoHint);
    }
    state.policies().with_policy(&req.tenant_id, |policy| {
        route_with_policy(state, metadata, req, policy, start, None)
    })
}

/// Whether `prompt_text` could be the input (the policy decides for a wire chain, step 5).
fn might_tokenize(req: &pb::LookupRouteRequest) -> bool {
    !req.prompt_text.is_empty() && req.prefix_hash.is_empty() && req.token_ids.is_empty()
}

fn will_tokenize(req: &pb::LookupRouteRequest, chain_on: bool) -> bool {
    might_tokenize(req)
        && (!chain_on || (req.block_hashes.is_empty() && req.block_token_counts.is_empty()))
}

/// The deadline of H2 and step 5.
fn deadline_for(
    metadata: &tonic::metadata::MetadataMap,
    policy: &Policy,
    will_tokenize: bool,
    start: Instant,
) -> Option<Instant> {
    let budget = (policy.lookup_timeout_ms > 0)
        .then(|| Duration::from_millis(policy.lookup_timeout_ms as u64));
    let mut deadline = caller_timeout(metadata).map(|t| start + t);
    if let Some(b) = budget {
        let ours = start + b;
        deadline = Some(deadline.map_or(ours, |d| d.min(ours)));
    }
    if deadline.is_none() && will_tokenize {
        deadline = Some(start + DEFAULT_TOKENIZE_TIMEOUT);
    }
    deadline
}

/// The `prompt_text` path (§7.2 case 3, §7.3): tokenize off the runtime's workers, abandon the
/// work when the deadline fires first, then run the ordinary pipeline on the tokens. Every answer
/// built after tokenizing echoes the tokens (§7.4).
async fn route_tokenizing(
    state: &AppState,
    metadata: &tonic::metadata::MetadataMap,
    req: &pb::LookupRouteRequest,
    start: Instant,
) -> (Answer, Vec<u32>) {
    let policy = state.policies().resolve(&req.tenant_id);
    if !will_tokenize(req, policy.enable_chain_matching) {
        return (
            route_with_policy(state, metadata, req, &policy, start, None),
            Vec::new(),
        );
    }
    let deadline = deadline_for(metadata, &policy, true, start);
    // Step 6.
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return (Answer::envelope(Reason::Timeout), Vec::new());
    }
    // H3: prompt_text never counts as a chain.
    if policy.require_chain {
        return (Answer::envelope(Reason::PolicyRequiresChain), Vec::new());
    }
    let tokens = match tokenize(state, req, deadline).await {
        Ok(tokens) => tokens,
        Err(answer) => return (answer, Vec::new()),
    };
    let answer = route_with_policy(state, metadata, req, &policy, start, Some(&tokens));
    (answer, tokens)
}

/// Tokenizes `prompt_text` (H4 case 3), or returns the fail-open answer (never an echo).
async fn tokenize(
    state: &AppState,
    req: &pb::LookupRouteRequest,
    deadline: Option<Instant>,
) -> Result<Vec<u32>, Answer> {
    use inferencecache_tokenize::TokenizeError;
    if req.prompt_text.len() > MAX_PROMPT_TEXT_BYTES {
        return Err(Answer::envelope(Reason::NoHint));
    }
    let Some(tokenizer) = state.tokenizer().cloned() else {
        return Err(Answer::envelope(Reason::NoHint));
    };
    // Never wait for a slot: saturation fails open.
    let Ok(permit) = state.tokenizer_slots().clone().try_acquire_owned() else {
        return Err(Answer::envelope(Reason::NoHint));
    };
    let (model, prompt) = (req.model_id.clone(), req.prompt_text.clone());
    let deadline = deadline.unwrap_or_else(|| Instant::now() + DEFAULT_TOKENIZE_TIMEOUT);
    // The permit moves into the blocking task, so abandoned work keeps its slot until it ends.
    let work = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        tokenizer.encode_chat_until(&model, &prompt, deadline)
    });
    match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), work).await {
        Err(_) | Ok(Ok(Err(TokenizeError::DeadlineExceeded))) => {
            Err(Answer::envelope(Reason::Timeout))
        }
        Ok(Ok(Ok(tokens))) if !tokens.is_empty() && tokens.len() <= MAX_LOOKUP_TOKENS => Ok(tokens),
        Ok(_) => Err(Answer::envelope(Reason::NoHint)),
    }
}

fn route_with_policy(
    state: &AppState,
    metadata: &tonic::metadata::MetadataMap,
    req: &pb::LookupRouteRequest,
    policy: &Policy,
    start: Instant,
    prompt_tokens: Option<&[u32]>,
) -> Answer {
    // Step 4.
    let chain_on = policy.enable_chain_matching;
    // H2 and step 5: the tighter of the caller's deadline and the tenant's budget; tokenizing
    // without a deadline gets the default one.
    let budget = (policy.lookup_timeout_ms > 0)
        .then(|| Duration::from_millis(policy.lookup_timeout_ms as u64));
    let deadline = deadline_for(metadata, policy, will_tokenize(req, chain_on), start);
    let expired = |d: Option<Instant>| d.is_some_and(|d| Instant::now() >= d);
    // Step 6.
    if expired(deadline) {
        return Answer::envelope(Reason::Timeout);
    }
    // H3: requireChain needs a well-formed wire chain; token_ids and prompt_text do not count.
    let wire_chain_ok =
        !req.block_hashes.is_empty() && req.block_hashes.len() == req.block_token_counts.len();
    if policy.require_chain && !wire_chain_ok {
        return Answer::envelope(Reason::PolicyRequiresChain);
    }
    // H4.
    let inputs = resolve_inputs(state, req, chain_on, prompt_tokens);
    // Step 9.
    if expired(deadline) {
        return Answer::envelope(Reason::Timeout);
    }
    match inputs {
        // Step 10.
        Inputs::FailOpen => Answer::envelope(Reason::NoHint),
        Inputs::Explicit {
            chain,
            counts,
            exact,
            exact_tokens,
        } => consult(
            state,
            req,
            policy,
            chain,
            counts,
            exact,
            exact_tokens,
            deadline,
            budget,
        ),
        Inputs::Derived {
            chain,
            counts,
            exact,
            exact_tokens,
            chain_on,
        } => {
            if chain_on {
                consult(
                    state,
                    req,
                    policy,
                    &chain,
                    &counts,
                    &[],
                    exact_tokens,
                    deadline,
                    budget,
                )
            } else {
                consult::<[u8; 8]>(
                    state,
                    req,
                    policy,
                    &[],
                    &[],
                    &exact,
                    exact_tokens,
                    deadline,
                    budget,
                )
            }
        }
        Inputs::Empty => consult::<Vec<u8>>(
            state,
            req,
            policy,
            &[],
            &[],
            &[],
            req.prefix_token_count,
            deadline,
            budget,
        ),
    }
}

/// H4 (§7.2): resolves which input the index sees. Reads the request only.
fn resolve_inputs<'r>(
    state: &AppState,
    req: &'r pb::LookupRouteRequest,
    chain_on: bool,
    prompt_tokens: Option<&[u32]>,
) -> Inputs<'r> {
    let has_wire_chain = !req.block_hashes.is_empty() || !req.block_token_counts.is_empty();
    if chain_on {
        if has_wire_chain || !req.prefix_hash.is_empty() {
            if req.block_hashes.len() != req.block_token_counts.len() {
                return Inputs::FailOpen;
            }
            // Like `MaxLookupTokens` for token_ids: a chain longer than any ingested chain may
            // be (`--max-chain-length`) fails open before the index is asked.
            if state.limits().lookup_chain_too_long(req.block_hashes.len()) {
                state
                    .metrics()
                    .limits
                    .add(crate::limits::Exceeded::LookupChainLength, 1);
                return Inputs::FailOpen;
            }
            return Inputs::Explicit {
                chain: &req.block_hashes,
                counts: &req.block_token_counts,
                exact: &req.prefix_hash,
                exact_tokens: req.prefix_token_count,
            };
        }
    } else if !req.prefix_hash.is_empty() {
        return Inputs::Explicit {
            chain: &[],
            counts: &[],
            exact: &req.prefix_hash,
            exact_tokens: req.prefix_token_count,
        };
    }
    if !req.token_ids.is_empty() {
        return derive(&req.token_ids, state.block_size(), chain_on);
    }
    if !req.prompt_text.is_empty() {
        // Tokenized before the pipeline ran (`route_tokenizing`); without tokens the tokenizer
        // was unavailable, saturated or failed.
        return match prompt_tokens {
            Some(tokens) => derive(tokens, state.block_size(), chain_on),
            None => Inputs::FailOpen,
        };
    }
    if !chain_on && has_wire_chain {
        // Chain matching disabled and only a wire chain: nothing usable (§7.2 disabled, case 3).
        return Inputs::FailOpen;
    }
    Inputs::Empty
}

fn derive<'r>(tokens: &[u32], block_size: usize, chain_on: bool) -> Inputs<'r> {
    if tokens.len() > MAX_LOOKUP_TOKENS {
        return Inputs::FailOpen;
    }
    let (chain, counts) = fingerprint::chain(tokens, block_size);
    let Some(last) = chain.last().copied() else {
        return Inputs::FailOpen;
    };
    let total: i64 = counts.iter().map(|c| i64::from(*c)).sum();
    let exact_tokens = i32::try_from(total).unwrap_or(i32::MAX);
    Inputs::Derived {
        chain,
        counts,
        exact: last,
        exact_tokens,
        chain_on,
    }
}

/// Steps 11–16: gates, the index call, floors, affinity, credit.
#[allow(clippy::too_many_arguments)]
fn consult<H: ChainHash>(
    state: &AppState,
    req: &pb::LookupRouteRequest,
    policy: &Policy,
    chain: &[H],
    counts: &[i32],
    exact: &[u8],
    exact_tokens: i32,
    deadline: Option<Instant>,
    budget: Option<Duration>,
) -> Answer {
    // H5: the pre-lookup gate measures the resolved input.
    let effective: i64 = if chain.is_empty() {
        i64::from(exact_tokens)
    } else {
        counts.iter().map(|c| i64::from(*c)).sum()
    };
    let gated =
        policy.minimum_prefix_tokens > 0 && effective < i64::from(policy.minimum_prefix_tokens);
    if gated && !policy.affinity_routing {
        return Answer::envelope(Reason::NoHint);
    }
    // Steps 12–13 (H6 happened during resolution: a disabled chain is never passed on).
    let index = state.index();
    let lookup = LookupRequest {
        tenant_id: &req.tenant_id,
        model_id: &req.model_id,
        hash_scheme: &req.hash_scheme,
        adapter_id: &req.adapter_id,
        prefix_hash: exact,
        prefix_token_count: exact_tokens,
        block_hashes: chain,
        block_token_counts: counts,
        ttft_ms: req.slo.as_ref().map_or(0, |s| s.ttft_ms),
        tbt_ms: req.slo.as_ref().map_or(0, |s| s.tbt_ms),
    };
    // H7: the production index is wait-free and answers inline; an index that may block gives
    // up at the deadline itself (`RouteIndex`).
    let index_start = Instant::now();
    let Some(mut result) = state.route_index().route(H::query(&lookup), deadline) else {
        return Answer::envelope(Reason::Timeout);
    };
    let index_elapsed = index_start.elapsed();
    state.metrics().observe_index_latency(index_elapsed);
    let late =
        deadline.is_some_and(|d| Instant::now() >= d) || budget.is_some_and(|b| index_elapsed > b);
    if late {
        // A timed-out result is discarded, never credited.
        return Answer::envelope(Reason::Timeout);
    }
    // H8.
    if result.strategy == Strategy::TenantHot && !policy.enable_tenant_hot {
        result.strategy = Strategy::None;
        result.scores.clear();
    }
    // H9: below the minimum prefix, a match or hot tenant becomes None (diagnostics stay).
    if gated && matches!(result.strategy, Strategy::PrefixMatch | Strategy::TenantHot) {
        result.strategy = Strategy::None;
        result.scores.clear();
        result.hits = Default::default();
    }
    // H10: the matched-tokens floor prunes scores and hits together.
    if result.strategy == Strategy::PrefixMatch && policy.minimum_matched_tokens > 0 {
        let floor = policy.minimum_matched_tokens;
        result.retain_replicas(|s| s.matched_tokens >= floor);
        if result.scores.is_empty() {
            result.strategy = Strategy::None;
        }
    }
    // H11: the routing floor is all-or-nothing on the top score (the reference score, which
    // the opt-in load-aware ranking does not use: R10 skips it).
    if result.strategy == Strategy::PrefixMatch
        && state.load_aware().is_none()
        && policy.routing_floor_score > 0.0
        && result
            .scores
            .first()
            .is_some_and(|top| top.score < policy.routing_floor_score)
    {
        result.strategy = Strategy::None;
        result.scores.clear();
        result.hits = Default::default();
    }
    if result.strategy == Strategy::None {
        result.scores.clear();
        // H12: affinity fallback.
        if let Some(replica) = affinity(state, req, policy, chain, exact) {
            return Answer {
                reason: Reason::AffinityHint,
                scores: vec![pb::ReplicaScore {
                    replica_id: replica,
                    ..Default::default()
                }],
                consulted: true,
            };
        }
        return Answer {
            reason: Reason::NoHint,
            scores: Vec::new(),
            consulted: true,
        };
    }
    // H13: credit what is delivered (only an LFU PrefixMatch captured anything).
    if result.strategy == Strategy::PrefixMatch {
        match state.replication() {
            // Replicated mode: credits travel through the stream like every other change.
            Some(replication) => replication.credit(&result.hits),
            None => index.credit_hits(&result.hits),
        }
    }
    // Opt-in: the load-aware ranking replaces the reference order (docs/configuration.md).
    if let Some(ranking) = state.load_aware()
        && result.strategy == Strategy::PrefixMatch
    {
        let stats = index.cache_state(&req.tenant_id, &req.model_id).replicas;
        return Answer {
            reason: Reason::from_strategy(result.strategy),
            scores: ranking.rank(effective, &result.scores, &stats),
            consulted: true,
        };
    }
    let scores = result
        .scores
        .iter()
        .map(|s| pb::ReplicaScore {
            replica_id: s.replica_id.to_string(),
            score: s.score,
            matched_tokens: s.matched_tokens,
            estimated_cache_hit_prob: s.estimated_cache_hit_prob,
            tier: s.tier,
        })
        .collect();
    Answer {
        reason: Reason::from_strategy(result.strategy),
        scores,
        consulted: true,
    }
}

/// The chain element types the handler resolves to, each with its [`RouteQuery`] form.
trait ChainHash: AsRef<[u8]> + Sized {
    fn query<'q, 'r>(req: &'q LookupRequest<'r, Self>) -> RouteQuery<'q, 'r>;
}

impl ChainHash for Vec<u8> {
    fn query<'q, 'r>(req: &'q LookupRequest<'r, Self>) -> RouteQuery<'q, 'r> {
        RouteQuery::Wire(req)
    }
}

impl ChainHash for [u8; 8] {
    fn query<'q, 'r>(req: &'q LookupRequest<'r, Self>) -> RouteQuery<'q, 'r> {
        RouteQuery::Fingerprint(req)
    }
}

/// H12 (§7.5): a deterministic replica from the request's hashes so repeats land together.
fn affinity<H: AsRef<[u8]>>(
    state: &AppState,
    req: &pb::LookupRouteRequest,
    policy: &Policy,
    chain: &[H],
    exact: &[u8],
) -> Option<String> {
    if !policy.affinity_routing
        || req.tenant_id.is_empty()
        || req.model_id.is_empty()
        || req.hash_scheme.is_empty()
    {
        return None;
    }
    if req.block_hashes.len() != req.block_token_counts.len() {
        return None;
    }
    let seed = affinity_seed(chain, exact)?;
    state
        .index()
        .affinity_hint(&req.tenant_id, &req.model_id, &req.hash_scheme, &seed)
        .map(|r| r.to_string())
}

/// Seed bytes kept on the stack: 1 KiB holds the O5 seed of 85 derived (8-byte) or 28 wire
/// SHA-256 hashes; longer chains spill to the heap.
pub type AffinitySeed = SmallVec<[u8; 1024]>;

/// O5: `u32_be(len) ‖ hash` over a non-empty resolved chain, else the exact key, else none.
pub fn affinity_seed<H: AsRef<[u8]>>(chain: &[H], exact: &[u8]) -> Option<AffinitySeed> {
    if !chain.is_empty() {
        let mut seed = AffinitySeed::new();
        for h in chain {
            let h = h.as_ref();
            seed.extend_from_slice(&u32::try_from(h.len()).unwrap_or(u32::MAX).to_be_bytes());
            seed.extend_from_slice(h);
        }
        return Some(seed);
    }
    (!exact.is_empty()).then(|| AffinitySeed::from_slice(exact))
}

/// `u64_be(SHA-256(seed)[0..8])`, exposed for tests of the golden picks.
pub fn seed_digest_prefix(seed: &[u8]) -> u64 {
    let d = Sha256::digest(seed);
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_units() {
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert("grpc-timeout", "20m".parse().unwrap());
        assert_eq!(caller_timeout(&md), Some(Duration::from_millis(20)));
        md.insert("grpc-timeout", "3S".parse().unwrap());
        assert_eq!(caller_timeout(&md), Some(Duration::from_secs(3)));
        md.insert("grpc-timeout", "x".parse().unwrap());
        assert_eq!(caller_timeout(&md), None);
    }

    #[test]
    fn affinity_seed_golden_chain() {
        let chain = [b"b1".to_vec(), b"b2".to_vec()];
        let seed = affinity_seed(&chain, b"ignored").unwrap();
        assert_eq!(seed[..], [0, 0, 0, 2, b'b', b'1', 0, 0, 0, 2, b'b', b'2']);
        assert!(!seed.spilled());
        assert_eq!(
            format!("{:016x}", seed_digest_prefix(&seed)),
            "81c893cc7a618745"
        );
        assert_eq!(
            format!("{:016x}", seed_digest_prefix(b"any-fingerprint")),
            "d274f6242b8bb8ff"
        );
        assert_eq!(affinity_seed::<Vec<u8>>(&[], b""), None);
        let exact = affinity_seed::<Vec<u8>>(&[], b"any-fingerprint").unwrap();
        assert_eq!(&exact[..], b"any-fingerprint");
    }

    #[test]
    fn affinity_seed_longer_than_the_stack_buffer() {
        // 100 SHA-256-sized hashes: 3600 seed bytes, past the inline 1 KiB.
        let chain: Vec<Vec<u8>> = (0..100u8).map(|i| vec![i; 32]).collect();
        let seed = affinity_seed(&chain, b"").unwrap();
        assert!(seed.spilled());
        assert_eq!(seed.len(), 100 * 36);
        for (i, part) in seed.chunks(36).enumerate() {
            assert_eq!(part[..4], [0, 0, 0, 32]);
            assert!(part[4..].iter().all(|b| usize::from(*b) == i));
        }
    }
}
