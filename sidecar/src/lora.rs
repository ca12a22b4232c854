//! LoRA id → adapter identity mapping (spec `sidecar.md` §7).

use std::collections::HashMap;

/// Parsed `--lora-adapter-names`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterMap {
    names: HashMap<i64, String>,
}

impl AdapterMap {
    /// Parses `id=name,…`. Blank items are skipped; a malformed pair, a non-integer id, an empty
    /// name or a duplicate id is an error.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut names = HashMap::new();
        for item in spec.split(',') {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let Some((id, name)) = item.split_once('=') else {
                return Err(format!("malformed adapter mapping {item:?}: want id=name"));
            };
            let id: i64 = id
                .trim()
                .parse()
                .map_err(|_| format!("adapter mapping {item:?}: id is not an integer"))?;
            let name = name.trim();
            if name.is_empty() {
                return Err(format!("adapter mapping {item:?}: empty name"));
            }
            if names.insert(id, name.to_string()).is_some() {
                return Err(format!("adapter mapping: duplicate id {id}"));
            }
        }
        Ok(Self { names })
    }

    /// Number of mapped ids.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when no id is mapped.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The adapter partition of an event that also carries the engine's public adapter name
    /// (`lora_name`): a mapped id wins, then the engine's name, then the id-only rule of
    /// [`AdapterMap::resolve`].
    pub fn resolve_named<'a>(
        &'a self,
        lora_id: Option<i64>,
        lora_name: Option<&'a str>,
    ) -> Option<&'a str> {
        let mapped = lora_id.and_then(|id| self.names.get(&id).map(String::as_str));
        mapped
            .or(lora_name.filter(|n| !n.is_empty()))
            .or_else(|| self.resolve(lora_id))
    }

    /// The adapter partition of an event: none → `""` (base), mapped → its name, unmapped →
    /// `None` (fail closed: the event must be dropped).
    pub fn resolve(&self, lora_id: Option<i64>) -> Option<&str> {
        match lora_id {
            None => Some(""),
            Some(id) => self.names.get(&id).map(String::as_str),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_resolve() {
        let m = AdapterMap::parse(" 1=sql-lora, ,2 = chat ,").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m.resolve(None), Some(""));
        assert_eq!(m.resolve(Some(1)), Some("sql-lora"));
        assert_eq!(m.resolve(Some(2)), Some("chat"));
        assert_eq!(m.resolve(Some(3)), None);
        assert!(AdapterMap::parse("").unwrap().is_empty());
    }

    #[test]
    fn engine_names_fill_unmapped_ids() {
        let m = AdapterMap::parse("1=sql-lora").unwrap();
        assert_eq!(m.resolve_named(Some(1), Some("other")), Some("sql-lora"));
        assert_eq!(m.resolve_named(Some(2), Some("chat")), Some("chat"));
        assert_eq!(m.resolve_named(None, Some("chat")), Some("chat"));
        assert_eq!(m.resolve_named(None, None), Some(""));
        assert_eq!(m.resolve_named(Some(2), None), None);
        assert_eq!(m.resolve_named(Some(2), Some("")), None);
    }

    #[test]
    fn parse_errors() {
        for bad in ["1", "x=a", "1=", "1=a,1=b", "=a", "1.5=a"] {
            assert!(AdapterMap::parse(bad).is_err(), "{bad}");
        }
    }
}
