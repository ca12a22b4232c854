//! The pick: an ordered endpoint list from cached-prefix matches and load.
//!
//! For each candidate endpoint `e` (docs/epp.md, "The pick"):
//!
//! ```text
//! hit(e)   = matched_tokens(e) / prompt_tokens            in [0, 1] (0 without a match)
//! load(e)  = pressure(e) + in_flight(e) / inflight_capacity
//! value(e) = hit(e) − load_weight · load(e)
//! ```
//!
//! `pressure` is the engine's own load from the sidecar's stats ((running + waiting requests) /
//! ceiling, in [0, 1]); `in_flight` is what this picker sent there and has not seen finish. The
//! list is ordered by `value` (higher first), then by fewer in flight, then by a rotation that
//! moves with every pick, so equal candidates (no cache hit anywhere, an idle fleet) take
//! turns instead of all landing on the first. A shared system prompt gives its holder a
//! constant `hit` lead, which the holder keeps only while its load stays below the others' by
//! `hit / load_weight`: past that, requests spill to the next engine (which then caches the
//! prompt too).
//!
//! Pure and synchronous: no index, no clock, no I/O (the caller gathers the inputs).

/// One endpoint the request may go to, with what the pick weighs.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// `ip:port`.
    pub endpoint: String,
    /// Tokens of the request's prompt cached at this endpoint's replica (0: none).
    pub matched_tokens: u32,
    /// The engine's own load in [0, 1] (0 when the sidecar reported none).
    pub pressure: f32,
    /// Requests this picker routed here that have not finished.
    pub in_flight: u32,
}

/// The pick's tunables (`--epp-load-weight`, `--epp-inflight-capacity`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub load_weight: f64,
    pub inflight_capacity: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            load_weight: 1.0,
            inflight_capacity: 8.0,
        }
    }
}

/// The ordered candidates (best first) and whether the best one was chosen for a cache hit.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    pub order: Vec<Candidate>,
    /// The first endpoint holds part of the prompt.
    pub prefix_hit: bool,
}

/// `value(e)` of the formula above.
pub fn value(candidate: &Candidate, prompt_tokens: u32, weights: Weights) -> f64 {
    let hit = if prompt_tokens == 0 {
        0.0
    } else {
        (f64::from(candidate.matched_tokens) / f64::from(prompt_tokens)).min(1.0)
    };
    let pressure = if candidate.pressure.is_finite() {
        f64::from(candidate.pressure).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let capacity = if weights.inflight_capacity > 0.0 {
        weights.inflight_capacity
    } else {
        1.0
    };
    let load = pressure + f64::from(candidate.in_flight) / capacity;
    hit - weights.load_weight.max(0.0) * load
}

/// Orders `candidates` best first. `rotation` (any counter that moves between picks) breaks
/// exact ties in turn.
pub fn rank(
    mut candidates: Vec<Candidate>,
    prompt_tokens: u32,
    weights: Weights,
    rotation: u64,
) -> Ranked {
    let n = candidates.len().max(1) as u64;
    // The candidates' positions before sorting give the rotation a stable meaning.
    candidates.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
    let mut keyed: Vec<(f64, u32, u64, Candidate)> = candidates
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let turn = (i as u64 + n - rotation % n) % n;
            (value(&c, prompt_tokens, weights), c.in_flight, turn, c)
        })
        .collect();
    keyed.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let order: Vec<Candidate> = keyed.into_iter().map(|(_, _, _, c)| c).collect();
    let prefix_hit = order.first().is_some_and(|c| c.matched_tokens > 0);
    Ranked { order, prefix_hit }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(endpoint: &str, matched: u32, pressure: f32, in_flight: u32) -> Candidate {
        Candidate {
            endpoint: endpoint.into(),
            matched_tokens: matched,
            pressure,
            in_flight,
        }
    }

    fn endpoints(ranked: &Ranked) -> Vec<&str> {
        ranked.order.iter().map(|c| c.endpoint.as_str()).collect()
    }

    #[test]
    fn longest_prefix_first_when_loads_are_equal() {
        let ranked = rank(
            vec![
                candidate("a:1", 0, 0.0, 0),
                candidate("b:1", 64, 0.0, 0),
                candidate("c:1", 32, 0.0, 0),
            ],
            128,
            Weights::default(),
            0,
        );
        assert_eq!(endpoints(&ranked), ["b:1", "c:1", "a:1"]);
        assert!(ranked.prefix_hit);
    }

    #[test]
    fn exact_values() {
        let w = Weights::default();
        // hit 0.5, load 0.25 + 2/8 = 0.5 → 0.
        assert_eq!(value(&candidate("x", 64, 0.25, 2), 128, w), 0.0);
        // A match longer than the prompt counts as a full hit; no prompt means no hit.
        assert_eq!(value(&candidate("x", 200, 0.0, 0), 100, w), 1.0);
        assert_eq!(value(&candidate("x", 10, 0.0, 0), 0, w), 0.0);
        // Out-of-range or NaN pressure cannot push a value out of its bounds.
        assert_eq!(value(&candidate("x", 0, 7.0, 0), 10, w), -1.0);
        assert_eq!(value(&candidate("x", 0, f32::NAN, 0), 10, w), 0.0);
    }

    #[test]
    fn load_spills_a_shared_prefix_to_the_next_engine() {
        let w = Weights::default();
        // The holder of 90% of the prompt keeps it up to 7 in flight (0.9 − 7/8 > 0)...
        let ranked = rank(
            vec![candidate("a:1", 90, 0.0, 7), candidate("b:1", 0, 0.0, 0)],
            100,
            w,
            0,
        );
        assert_eq!(endpoints(&ranked), ["a:1", "b:1"]);
        // ...and loses it at 8 (0.9 − 1 < 0).
        let ranked = rank(
            vec![candidate("a:1", 90, 0.0, 8), candidate("b:1", 0, 0.0, 0)],
            100,
            w,
            0,
        );
        assert_eq!(endpoints(&ranked), ["b:1", "a:1"]);
        assert!(!ranked.prefix_hit);
        // The engine's own pressure counts the same way.
        let ranked = rank(
            vec![candidate("a:1", 50, 0.6, 0), candidate("b:1", 0, 0.0, 0)],
            100,
            w,
            0,
        );
        assert_eq!(endpoints(&ranked), ["b:1", "a:1"]);
    }

    #[test]
    fn ties_rotate_and_fewer_in_flight_wins() {
        let all = || {
            vec![
                candidate("c:1", 0, 0.0, 0),
                candidate("a:1", 0, 0.0, 0),
                candidate("b:1", 0, 0.0, 0),
            ]
        };
        let firsts: Vec<String> = (0..6)
            .map(|r| {
                rank(all(), 10, Weights::default(), r).order[0]
                    .endpoint
                    .clone()
            })
            .collect();
        assert_eq!(firsts, ["a:1", "b:1", "c:1", "a:1", "b:1", "c:1"]);
        // Zero load weight: the value ties, in-flight still orders.
        let weights = Weights {
            load_weight: 0.0,
            inflight_capacity: 8.0,
        };
        let ranked = rank(
            vec![candidate("a:1", 0, 0.0, 3), candidate("b:1", 0, 0.0, 1)],
            10,
            weights,
            0,
        );
        assert_eq!(endpoints(&ranked), ["b:1", "a:1"]);
    }

    #[test]
    fn empty_candidates_rank_empty() {
        let ranked = rank(Vec::new(), 10, Weights::default(), 3);
        assert!(ranked.order.is_empty());
        assert!(!ranked.prefix_hit);
    }
}
