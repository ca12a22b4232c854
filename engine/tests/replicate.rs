//! Replicated mode's engine hooks: a leader that decides evictions and followers that apply its
//! decisions end with the same entries (equal digests), whatever happened to a victim between
//! the decision and its application.

mod common;

use common::*;
use inferencecache_engine::*;
use parking_lot::Mutex;
use std::sync::Arc;

/// A decision as the server would log it.
type Decision = (String, String, String, String, String, Vec<u8>, i64);

#[derive(Default)]
struct Log(Mutex<Vec<Decision>>);

impl DecisionLog for Log {
    fn removed(&self, d: &Decided<'_>) {
        self.0.lock().push((
            d.tenant_id.to_owned(),
            d.model_id.to_owned(),
            d.hash_scheme.to_owned(),
            d.adapter_id.to_owned(),
            d.replica_id.to_owned(),
            d.key.to_vec(),
            d.last_seen_ms,
        ));
    }
}

fn apply(to: &Index, decisions: &[Decision]) -> u64 {
    decisions
        .iter()
        .map(|(t, m, s, a, r, k, ms)| to.remove_decided(t, m, s, a, r, &[(k.as_slice(), *ms)]))
        .sum()
}

fn key(i: u64) -> Vec<u8> {
    (0xD00D_0000_0000_0000u64 + i).to_be_bytes().to_vec()
}

fn capped(cap: i64) -> IndexConfig {
    IndexConfig {
        max_entries: cap,
        ..cfg_1h()
    }
}

#[test]
fn a_follower_without_local_eviction_keeps_what_the_cap_and_the_sweep_would_remove() {
    let e = env_with(capped(10));
    e.ix.set_local_eviction(false);
    for i in 0..25 {
        e.clock.advance_us(1_000);
        e.put("r", &key(i), 16);
    }
    assert_eq!(
        e.ix.storage_entries(),
        25,
        "no cap enforcement on a follower"
    );
    e.clock.advance_us(2 * HOUR_MS * 1_000);
    assert_eq!(
        e.ix.sweep_now().entries_removed,
        0,
        "no TTL removal on a follower"
    );
    assert_eq!(e.ix.storage_entries(), 25);
    e.ix.set_local_eviction(true);
    assert_eq!(e.ix.sweep_now().entries_removed, 25);
}

#[test]
fn the_leaders_cap_decisions_applied_by_a_follower_give_equal_digests() {
    let leader = env_with(capped(50));
    let follower = env_with(capped(50));
    follower.ix.set_local_eviction(false);
    let log = Arc::new(Log::default());
    leader.ix.set_decision_log(Some(log.clone()));
    for i in 0..200u64 {
        let ts = T0 + i as i64 * 1_000;
        for e in [&leader, &follower] {
            e.put_with(
                &Put {
                    replica: if i % 3 == 0 { "a" } else { "b" },
                    ts,
                    tier: 1,
                    ..Put::default()
                },
                &key(i),
                16,
            );
        }
    }
    assert_eq!(leader.ix.storage_entries(), 50);
    assert_eq!(follower.ix.storage_entries(), 200);
    let decisions = std::mem::take(&mut *log.0.lock());
    assert_eq!(decisions.len(), 150, "one decision per evicted entry");
    assert_eq!(apply(&follower.ix, &decisions), 150);
    assert_eq!(follower.ix.storage_entries(), 50);
    assert_eq!(leader.ix.digest(), follower.ix.digest());
    assert_eq!(leader.ix.digest().entries, 50);
    // The leader applying its own decisions changes nothing.
    assert_eq!(apply(&leader.ix, &decisions), 0);
    assert_eq!(leader.ix.digest(), follower.ix.digest());
}

#[test]
fn a_victim_refreshed_after_the_decision_survives_everywhere() {
    let leader = env_with(capped(1));
    let follower = env_with(capped(1));
    follower.ix.set_local_eviction(false);
    let log = Arc::new(Log::default());
    leader.ix.set_decision_log(Some(log.clone()));
    let put = |e: &Env, i: u64, ts: i64| {
        e.put_with(
            &Put {
                ts,
                ..Put::default()
            },
            &key(i),
            16,
        )
    };
    for e in [&leader, &follower] {
        put(e, 0, T0);
        put(e, 1, T0 + 1_000);
    }
    // The leader evicted key 0; before its decision reaches the log, key 0 is reported again
    // (newer) and key 1 is refreshed too, evicting... nothing more on the follower.
    let decisions = std::mem::take(&mut *log.0.lock());
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0].5, key(0));
    for e in [&leader, &follower] {
        put(e, 0, T0 + 5_000);
    }
    // The refresh made the leader evict key 1 (the oldest now); the follower holds both.
    let second = std::mem::take(&mut *log.0.lock());
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].5, key(1));
    for ix in [&leader.ix, &follower.ix] {
        apply(ix, &decisions);
        apply(ix, &second);
    }
    assert_eq!(follower.ix.storage_entries(), 1);
    assert_eq!(leader.ix.digest(), follower.ix.digest());
    let hit = follower.exact(&key(0));
    assert_eq!(ids(&hit.scores), ["r"], "the refreshed victim is kept");
}

#[test]
fn quota_and_ttl_decisions_replicate_too() {
    let leader = env();
    let follower = env();
    follower.ix.set_local_eviction(false);
    let log = Arc::new(Log::default());
    leader.ix.set_decision_log(Some(log.clone()));
    for e in [&leader, &follower] {
        e.set_quota("t", 5);
        e.set_ttl("u", 60_000);
    }
    for i in 0..12u64 {
        for e in [&leader, &follower] {
            e.put_with(
                &Put {
                    ts: T0 + i as i64,
                    ..Put::default()
                },
                &key(i),
                16,
            );
            e.put_with(
                &Put {
                    tenant: "u",
                    ts: T0 + i as i64,
                    ..Put::default()
                },
                &key(100 + i),
                16,
            );
        }
    }
    for e in [&leader, &follower] {
        e.clock.advance_us(120_000_000);
    }
    leader.ix.sweep_now();
    follower.ix.sweep_now();
    let decisions = std::mem::take(&mut *log.0.lock());
    assert_eq!(
        decisions.len(),
        7 + 12,
        "7 over the quota of t, 12 expired of u"
    );
    apply(&follower.ix, &decisions);
    assert_eq!(leader.ix.digest(), follower.ix.digest());
    assert_eq!(follower.ix.storage_entries(), 5);
}

#[test]
fn logged_credits_protect_the_same_entries_under_lfu() {
    let leader = env_with(capped(4));
    let follower = env_with(capped(4));
    follower.ix.set_local_eviction(false);
    let log = Arc::new(Log::default());
    leader.ix.set_decision_log(Some(log.clone()));
    for e in [&leader, &follower] {
        e.set_lfu("t");
        for i in 0..4u64 {
            e.put_with(
                &Put {
                    ts: T0 + i as i64 * 1_000,
                    ..Put::default()
                },
                &key(i),
                16,
            );
        }
    }
    // Key 0 (the oldest) is looked up on the follower; the credit travels as data.
    let hits = follower.exact(&key(0)).hits;
    let mut credits: Vec<(String, String, String, String, String, Vec<u8>)> = Vec::new();
    hits.for_each_hit(|t, m, s, a, r, k| {
        credits.push((t.into(), m.into(), s.into(), a.into(), r.into(), k.to_vec()));
    });
    assert_eq!(credits.len(), 1);
    for e in [&leader, &follower] {
        for (t, m, s, a, r, k) in &credits {
            e.ix.credit_entry(t, m, s, a, r, k, 3);
        }
    }
    for e in [&leader, &follower] {
        e.put_with(
            &Put {
                ts: T0 + 10_000,
                ..Put::default()
            },
            &key(9),
            16,
        );
    }
    let decisions = std::mem::take(&mut *log.0.lock());
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0].5, key(1), "the credited oldest key survives");
    apply(&follower.ix, &decisions);
    assert_eq!(leader.ix.digest(), follower.ix.digest());
}

#[test]
fn the_digest_sees_every_field_and_no_order() {
    let a = env();
    let b = env();
    for i in 0..20u64 {
        a.put_with(
            &Put {
                ts: T0 + i as i64 * 1_000,
                ..Put::default()
            },
            &key(i),
            16,
        );
    }
    for i in (0..20u64).rev() {
        b.put_with(
            &Put {
                ts: T0 + i as i64 * 1_000,
                ..Put::default()
            },
            &key(i),
            16,
        );
    }
    assert_eq!(a.ix.digest(), b.ix.digest());
    let base = a.ix.digest();
    let variants: [Put<'_>; 4] = [
        Put {
            ts: T0 + 1_000,
            ..Put::default()
        },
        Put {
            tier: 2,
            ts: T0,
            ..Put::default()
        },
        Put {
            replica: "other",
            ts: T0,
            ..Put::default()
        },
        Put {
            adapter: "lora",
            ts: T0,
            ..Put::default()
        },
    ];
    for v in &variants {
        let c = env();
        for i in 1..20u64 {
            c.put_with(
                &Put {
                    ts: T0 + i as i64 * 1_000,
                    ..Put::default()
                },
                &key(i),
                16,
            );
        }
        c.put_with(v, &key(0), 16);
        assert_ne!(
            c.ix.digest(),
            base,
            "{:?}",
            (v.ts, v.tier, v.replica, v.adapter)
        );
    }
    assert_eq!(a.ix.remove_everything(), 20);
    assert_eq!(a.ix.digest(), IndexDigest::default());
}
