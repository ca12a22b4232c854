//! Wire-compatibility guard for the frozen `inferencecache.v1alpha1` contract.
//!
//! The proto is compiled to a descriptor and rendered as one line per service, method (with its
//! streaming flags), message, field (name, number, type, label, type name) and enum value. The
//! rendering must equal the checked-in `wire-baseline.txt` exactly: renumbering, removing or
//! retyping anything fails, and so does an addition until the baseline is updated on purpose
//! with `UPDATE_WIRE_BASELINE=1 cargo test -p inferencecache-proto --test wire_compat`.
//!
//! A second test pins the proto file's SHA-256 in `docs/grpc-contract.md`, so a contract change
//! cannot land without its documentation.

use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorSet};
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const PROTO: &str = "inferencecache/v1alpha1/inferencecache.proto";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn compile() -> FileDescriptorSet {
    let dir = crate_dir();
    protox::compile([dir.join(PROTO)], [&dir]).expect("the contract proto must compile")
}

fn render_enum(out: &mut String, scope: &str, e: &EnumDescriptorProto) {
    let name = format!("{scope}.{}", e.name());
    writeln!(out, "enum {name}").unwrap();
    for v in &e.value {
        writeln!(out, "  value {name}.{} = {}", v.name(), v.number()).unwrap();
    }
}

fn render_message(out: &mut String, scope: &str, m: &DescriptorProto) {
    let name = format!("{scope}.{}", m.name());
    let map_entry = m
        .options
        .as_ref()
        .and_then(|o| o.map_entry)
        .unwrap_or(false);
    writeln!(
        out,
        "message {name}{}",
        if map_entry { " (map entry)" } else { "" }
    )
    .unwrap();
    for f in &m.field {
        let label = match f.label() {
            Label::Optional if f.proto3_optional() => "proto3_optional",
            Label::Optional => "singular",
            Label::Required => "required",
            Label::Repeated => "repeated",
        };
        let ty = match f.r#type() {
            Type::Message | Type::Enum | Type::Group => {
                format!("{:?} {}", f.r#type(), f.type_name())
            }
            other => format!("{other:?}"),
        };
        writeln!(
            out,
            "  field {name}.{} = {} {label} {ty}",
            f.name(),
            f.number()
        )
        .unwrap();
    }
    for nested in &m.nested_type {
        render_message(out, &name, nested);
    }
    for e in &m.enum_type {
        render_enum(out, &name, e);
    }
}

fn render(set: &FileDescriptorSet) -> String {
    let mut out = String::new();
    for file in &set.file {
        let package = file.package();
        writeln!(
            out,
            "file {} package {package} syntax {}",
            file.name(),
            file.syntax()
        )
        .unwrap();
        for s in &file.service {
            writeln!(out, "service {package}.{}", s.name()).unwrap();
            for m in &s.method {
                writeln!(
                    out,
                    "  rpc {} ({}{}) returns ({}{})",
                    m.name(),
                    if m.client_streaming() { "stream " } else { "" },
                    m.input_type(),
                    if m.server_streaming() { "stream " } else { "" },
                    m.output_type(),
                )
                .unwrap();
            }
        }
        for m in &file.message_type {
            render_message(&mut out, &format!(".{package}"), m);
        }
        for e in &file.enum_type {
            render_enum(&mut out, &format!(".{package}"), e);
        }
    }
    out
}

#[test]
fn descriptor_matches_checked_in_baseline() {
    let rendered = render(&compile());
    let baseline_path = crate_dir().join("wire-baseline.txt");
    if std::env::var_os("UPDATE_WIRE_BASELINE").is_some() {
        std::fs::write(&baseline_path, &rendered).expect("write baseline");
        return;
    }
    let baseline = std::fs::read_to_string(&baseline_path).expect("read proto/wire-baseline.txt");
    if rendered != baseline {
        let diff: Vec<String> = diff_lines(&baseline, &rendered);
        panic!(
            "the wire contract changed (a field, enum value or RPC was added, removed, renumbered \
             or retyped). Differences (- baseline, + proto):\n{}\nIf this is a deliberate \
             addition, update docs/grpc-contract.md and rerun with UPDATE_WIRE_BASELINE=1.",
            diff.join("\n")
        );
    }
}

fn diff_lines(old: &str, new: &str) -> Vec<String> {
    let old: std::collections::BTreeSet<&str> = old.lines().collect();
    let new: std::collections::BTreeSet<&str> = new.lines().collect();
    let mut out: Vec<String> = old.difference(&new).map(|l| format!("- {l}")).collect();
    out.extend(new.difference(&old).map(|l| format!("+ {l}")));
    out
}

/// Spot checks written independently of the baseline, straight from the contract tables, so a
/// baseline regenerated by mistake still cannot hide the most load-bearing numbers.
#[test]
fn key_numbers_match_contract_tables() {
    let rendered = render(&compile());
    for line in [
        "  rpc ReportCacheState (stream .inferencecache.v1alpha1.CacheStateUpdate) returns (.inferencecache.v1alpha1.Ack)",
        "  rpc StreamCacheEvents (.inferencecache.v1alpha1.StreamEventsRequest) returns (stream .inferencecache.v1alpha1.CacheEvent)",
        "  rpc StreamMetrics (.inferencecache.v1alpha1.StreamMetricsRequest) returns (stream .inferencecache.v1alpha1.Metric)",
        "  field .inferencecache.v1alpha1.LookupRouteRequest.block_hashes = 7 repeated Bytes",
        "  field .inferencecache.v1alpha1.LookupRouteRequest.token_ids = 9 repeated Uint32",
        "  field .inferencecache.v1alpha1.LookupRouteRequest.adapter_id = 11 singular String",
        "  field .inferencecache.v1alpha1.ReplicaScore.score = 2 singular Float",
        "  field .inferencecache.v1alpha1.ReplicaScore.tier = 5 singular Enum .inferencecache.v1alpha1.CacheTier",
        "  field .inferencecache.v1alpha1.LookupRouteResponse.lookup_latency_us = 3 singular Int64",
        "  field .inferencecache.v1alpha1.CacheStateUpdate.stats = 7 singular Message .inferencecache.v1alpha1.ReplicaStats",
        "  field .inferencecache.v1alpha1.CacheEvent.type = 1 singular Enum .inferencecache.v1alpha1.CacheEvent.Type",
        "  value .inferencecache.v1alpha1.CacheEvent.Type.ALL_CLEARED = 4",
        "  value .inferencecache.v1alpha1.CacheTier.CACHE_TIER_T3 = 3",
        "  field .inferencecache.v1alpha1.Metric.value = 4 singular Double",
    ] {
        assert!(
            rendered.lines().any(|l| l == line),
            "missing from the proto: {line}"
        );
    }
}

#[test]
fn contract_doc_records_proto_sha256() {
    let proto = std::fs::read(crate_dir().join(PROTO)).expect("read proto");
    let digest = Sha256::digest(&proto);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let doc_path = crate_dir().join("..").join("docs").join("grpc-contract.md");
    let doc = std::fs::read_to_string(Path::new(&doc_path)).expect("read docs/grpc-contract.md");
    let recorded = doc
        .lines()
        .find_map(|l| l.trim().strip_prefix("Proto SHA-256: `"))
        .and_then(|rest| rest.split('`').next())
        .expect("docs/grpc-contract.md must contain a line `Proto SHA-256: `<hex>``");
    assert_eq!(
        recorded, hex,
        "proto/{PROTO} changed but docs/grpc-contract.md still records the old SHA-256: \
         update the doc (and the contract text) in the same commit"
    );
}
