//! The records of the replication stream: one NATS message is one [`Batch`] of records from
//! one server, in the order that server accepted them.
//!
//! The encoding is protobuf (prost), reusing the contract's own messages for updates and
//! events, so a record holds exactly what a producer sent (with its timestamp resolved).
//! Internal to the stream: these messages are not part of the gRPC contract.

use inferencecache_proto::v1alpha1 as pb;

/// Largest encoded batch a server publishes (NATS' default `max_payload` is 1 MiB).
pub const MAX_BATCH_BYTES: usize = 512 * 1024;

/// One message of the stream.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Batch {
    /// The publishing server (`--nats-server-id`).
    #[prost(string, tag = "1")]
    pub origin: String,
    /// Random per process start of the publisher: with `seq`, the message id (dedup).
    #[prost(uint64, tag = "2")]
    pub epoch: u64,
    /// The publisher's batch number within its epoch (1, 2, ...).
    #[prost(uint64, tag = "3")]
    pub seq: u64,
    /// The records, applied in order.
    #[prost(message, repeated, tag = "4")]
    pub records: Vec<Record>,
}

impl Batch {
    /// The `Nats-Msg-Id` of this batch: a retried publish has the same id and is deduplicated
    /// by the stream.
    pub fn message_id(&self) -> String {
        format!("{}:{:x}:{}", self.origin, self.epoch, self.seq)
    }
}

/// One state change.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Record {
    #[prost(oneof = "Body", tags = "10, 11, 12, 13, 14")]
    pub body: Option<Body>,
}

/// What a record changes.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Body {
    /// An admitted `CacheStateUpdate`, `timestamp_us` resolved.
    #[prost(message, tag = "10")]
    Update(pb::CacheStateUpdate),
    /// A `CacheEvent`, `timestamp_us` resolved.
    #[prost(message, tag = "11")]
    Event(pb::CacheEvent),
    /// An accepted `/policy` push body.
    #[prost(bytes, tag = "12")]
    Policy(Vec<u8>),
    /// Entries the leader's cap, quotas or sweep removed.
    #[prost(message, tag = "13")]
    Evictions(Evictions),
    /// LFU credits counted by one server's lookups.
    #[prost(message, tag = "14")]
    Credits(Credits),
}

/// One replica's entries in one partition: what eviction and credit records address.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Holder {
    #[prost(string, tag = "1")]
    pub tenant_id: String,
    #[prost(string, tag = "2")]
    pub model_id: String,
    #[prost(string, tag = "3")]
    pub hash_scheme: String,
    #[prost(string, tag = "4")]
    pub adapter_id: String,
    #[prost(string, tag = "5")]
    pub replica_id: String,
}

/// Entries of one holder that the leader evicted, each with the `last_seen` it had (an entry
/// refreshed since is kept).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Evictions {
    #[prost(message, optional, tag = "1")]
    pub holder: Option<Holder>,
    #[prost(bytes = "vec", repeated, tag = "2")]
    pub keys: Vec<Vec<u8>>,
    #[prost(int64, repeated, tag = "3")]
    pub last_seen_ms: Vec<i64>,
}

/// Credits of one holder: `keys[i]` was credited `times[i]` times.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Credits {
    #[prost(message, optional, tag = "1")]
    pub holder: Option<Holder>,
    #[prost(bytes = "vec", repeated, tag = "2")]
    pub keys: Vec<Vec<u8>>,
    #[prost(uint32, repeated, tag = "3")]
    pub times: Vec<u32>,
}

/// Splits an admitted update whose encoding exceeds `limit` into updates of whole prefix refs
/// that each fit (stats go with the last part, as an ingest applies them after its refs). A
/// single ref larger than `limit` stays alone in its part (the publisher drops and counts a
/// batch over the stream's payload limit).
pub fn split_update(update: pb::CacheStateUpdate, limit: usize) -> Vec<pb::CacheStateUpdate> {
    use prost::Message;
    if update.encoded_len() <= limit {
        return vec![update];
    }
    let mut shell = update;
    let prefixes = std::mem::take(&mut shell.prefixes);
    let stats = shell.stats.take();
    let base = shell.encoded_len();
    let mut parts: Vec<pb::CacheStateUpdate> = Vec::new();
    let mut current = shell.clone();
    let mut size = base;
    for p in prefixes {
        let len = p.encoded_len() + 8;
        if size + len > limit && !current.prefixes.is_empty() {
            parts.push(std::mem::replace(&mut current, shell.clone()));
            size = base;
        }
        size += len;
        current.prefixes.push(p);
    }
    current.stats = stats;
    parts.push(current);
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn a_large_update_splits_into_parts_that_fit_and_keep_every_ref_in_order() {
        let update = pb::CacheStateUpdate {
            replica_id: "r".into(),
            model_id: "m".into(),
            tenant_id: "t".into(),
            hash_scheme: "s".into(),
            timestamp_us: 7,
            prefixes: (0..1000u32)
                .map(|i| pb::PrefixEntry {
                    block_hashes: (0..16u32)
                        .map(|b| (i * 16 + b).to_be_bytes().to_vec())
                        .collect(),
                    block_token_counts: vec![16; 16],
                    ..Default::default()
                })
                .collect(),
            stats: Some(pb::ReplicaStats::default()),
            ..Default::default()
        };
        let total = update.prefixes.len();
        let parts = split_update(update.clone(), 16 * 1024);
        assert!(parts.len() > 1);
        assert!(parts.iter().all(|p| p.encoded_len() <= 16 * 1024));
        assert!(parts[..parts.len() - 1].iter().all(|p| p.stats.is_none()));
        assert!(parts.last().is_some_and(|p| p.stats.is_some()));
        let refs: Vec<_> = parts.iter().flat_map(|p| p.prefixes.clone()).collect();
        assert_eq!(refs.len(), total);
        assert_eq!(refs, update.prefixes);
        assert!(
            parts
                .iter()
                .all(|p| p.timestamp_us == 7 && p.tenant_id == "t")
        );
    }

    #[test]
    fn a_batch_round_trips_and_names_itself() {
        let batch = Batch {
            origin: "a".into(),
            epoch: 0xab,
            seq: 3,
            records: vec![Record {
                body: Some(Body::Policy(b"{}".to_vec())),
            }],
        };
        let bytes = batch.encode_to_vec();
        assert_eq!(Batch::decode(bytes.as_slice()).ok(), Some(batch.clone()));
        assert_eq!(batch.message_id(), "a:ab:3");
    }
}
