//! Storage media → cache tiers.
//!
//! Engines name the memory a block copy lives in (`medium`); the index ranks replicas by tier.
//! The mapping, case-insensitive:
//!
//! | `medium` | Tier |
//! |---|---|
//! | absent, `GPU` | T1 |
//! | `CPU`, `CPU_PINNED` | T2 |
//! | `DISK`, `STORAGE`, `SSD`, `NVME`, `EXTERNAL`, `REMOTE`, anything naming LMCache | T3 |
//! | anything else | T3, counted as unknown and logged once per name |
//!
//! An unknown medium is assumed to be the coldest tier: the block is reported (a lookup may
//! still prefer the replica a little) but never as the fast tier it may not be.
//!
//! A copy whose vLLM `locality` is anything but `LOCAL` (vLLM sends `REMOTE` for a copy in an
//! offload pool that is not this replica's own) is T3 whatever its medium: a remote CPU or disk
//! pool is neither this replica's host memory (T2) nor its own disk, and T3 is the tier the
//! index ranks last. Remote copies and copies of another `ownership` (a secondary offloading
//! tier) are tracked apart from the local copy of the same medium ([`copy_key`]), so removing
//! one never removes the other.

use inferencecache_proto::v1alpha1::CacheTier;

/// Where an engine keeps one copy of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Device memory (HBM).
    Gpu,
    /// Host memory.
    Cpu,
    /// Disk, remote or shared pools.
    Storage,
}

/// How a medium name was classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classified {
    /// The tier the copy is reported at.
    pub tier: Tier,
    /// True when the name is not one of the known media (it then maps to [`Tier::Storage`]).
    pub unknown: bool,
}

/// Classifies a `medium` field (see the module table).
pub fn classify(medium: Option<&str>) -> Classified {
    let Some(name) = medium else {
        return known(Tier::Gpu);
    };
    let upper = name.trim().to_ascii_uppercase();
    match upper.as_str() {
        "GPU" | "" => known(Tier::Gpu),
        "CPU" | "CPU_PINNED" => known(Tier::Cpu),
        "DISK" | "STORAGE" | "SSD" | "NVME" | "EXTERNAL" | "REMOTE" => known(Tier::Storage),
        _ if upper.contains("LMCACHE") => known(Tier::Storage),
        _ => Classified {
            tier: Tier::Storage,
            unknown: true,
        },
    }
}

fn known(tier: Tier) -> Classified {
    Classified {
        tier,
        unknown: false,
    }
}

impl Tier {
    /// The wire tier.
    pub fn wire(self) -> CacheTier {
        match self {
            Tier::Gpu => CacheTier::T1,
            Tier::Cpu => CacheTier::T2,
            Tier::Storage => CacheTier::T3,
        }
    }
}

/// The media key a copy is tracked under: the upper-cased name, absent = `GPU`, so a store
/// without a medium and a removal naming `GPU` refer to the same copy.
pub fn media_key(medium: Option<&str>) -> String {
    match medium.map(str::trim) {
        None | Some("") => "GPU".to_string(),
        Some(name) => name.to_ascii_uppercase(),
    }
}

/// True when a `locality` names a copy outside this replica (anything but absent, empty or
/// `LOCAL`).
pub fn is_remote(locality: Option<&str>) -> bool {
    locality
        .map(str::trim)
        .is_some_and(|l| !l.is_empty() && !l.eq_ignore_ascii_case("LOCAL"))
}

/// Classifies a copy: a remote copy is T3 (known), a local one follows its medium.
pub fn classify_copy(medium: Option<&str>, locality: Option<&str>) -> Classified {
    if is_remote(locality) {
        known(Tier::Storage)
    } else {
        classify(medium)
    }
}

/// The key one copy is tracked under: [`media_key`], prefixed `REMOTE:` for a remote copy and
/// suffixed `@ownership` for a secondary offloading tier's copy.
pub fn copy_key(medium: Option<&str>, locality: Option<&str>, ownership: Option<&str>) -> String {
    let mut key = media_key(medium);
    if is_remote(locality) {
        key.insert_str(0, "REMOTE:");
    }
    if let Some(owner) = ownership.map(str::trim).filter(|o| !o.is_empty()) {
        key.push('@');
        key.push_str(owner);
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        assert_eq!(classify(None).tier, Tier::Gpu);
        assert_eq!(classify(Some("GPU")).tier, Tier::Gpu);
        assert_eq!(classify(Some("cpu")).tier, Tier::Cpu);
        assert_eq!(classify(Some("CPU_PINNED")).tier, Tier::Cpu);
        for name in [
            "DISK",
            "STORAGE",
            "EXTERNAL",
            "LocalDiskBackend-LMCache",
            "lmcache",
        ] {
            assert_eq!(classify(Some(name)), known(Tier::Storage), "{name}");
        }
        assert_eq!(
            classify(Some("HBM3")),
            Classified {
                tier: Tier::Storage,
                unknown: true
            }
        );
        assert!(Tier::Gpu < Tier::Cpu && Tier::Cpu < Tier::Storage);
        assert_eq!(Tier::Cpu.wire(), CacheTier::T2);
        assert_eq!(media_key(None), media_key(Some("gpu")));
    }

    #[test]
    fn remote_copies_are_t3_and_tracked_apart() {
        assert_eq!(
            classify_copy(Some("CPU"), Some("REMOTE")).tier,
            Tier::Storage
        );
        assert_eq!(
            classify_copy(Some("GPU"), Some("remote")).tier,
            Tier::Storage
        );
        assert_eq!(classify_copy(Some("CPU"), Some("LOCAL")).tier, Tier::Cpu);
        assert_eq!(classify_copy(Some("CPU"), None).tier, Tier::Cpu);
        assert_eq!(copy_key(Some("cpu"), None, None), "CPU");
        assert_eq!(copy_key(Some("CPU"), Some("LOCAL"), None), "CPU");
        assert_eq!(copy_key(Some("CPU"), Some("REMOTE"), None), "REMOTE:CPU");
        assert_eq!(copy_key(Some("CPU"), None, Some("lmcache")), "CPU@lmcache");
    }
}
