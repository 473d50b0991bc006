//! The init handshake (metadata checks, key selection) and the planning of the one-time init bootstrap.

use std::collections::HashMap;

use crate::tensor::{DType, StateDict, can_cast};

use super::Settings;
use super::bucket::Planned;
use super::settings::SyncerKind;
use super::wire::{BucketEntry, KeyMeta};

/// Why the sender refuses the receivers at init (it tells them the reason, then fails with it).
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The state dicts or the keys do not agree.
    Handshake(String),
    /// A setting does not fit the state dict (an `init_sync` prefix matching nothing).
    Config(String),
}

impl Refusal {
    pub fn reason(&self) -> &str {
        match self {
            Refusal::Handshake(reason) | Refusal::Config(reason) => reason,
        }
    }
}

/// What the handshake settles: the synced keys in the state dict's order (whatever order the caller listed
/// them in: patch entries and buckets are laid out in that order, and receivers validate it), the keys the
/// init bootstrap sends, and the receiver's ordinal and dtype of each.
#[derive(Debug)]
pub(crate) struct Selection {
    pub synced_keys: Vec<String>,
    pub synced_ordinals: Vec<u32>,
    /// Receiver dtype per synced key (same order).
    pub recv_dtypes: Vec<DType>,
    /// The init bootstrap's keys (patch with `init_sync`; else none).
    pub boot_keys: Vec<String>,
    /// Key → receiver ordinal, for the synced and bootstrap keys.
    pub ordinals: HashMap<String, u32>,
}

impl Selection {
    /// Handshake step 2: check the receivers' metadata against `state` and the settings, and select the
    /// keys; the first problem is the refusal.
    pub fn choose(
        settings: &Settings,
        meta: &[KeyMeta],
        state: &StateDict,
        keys_to_sync: &[String],
    ) -> Result<Selection, Refusal> {
        if settings.same_keys
            && let Some(diff) = first_difference(meta, state)
        {
            return Err(Refusal::Handshake(format!(
                "trainer and rollout state dicts differ: {diff}"
            )));
        }
        let patch_init = settings.kind == SyncerKind::Patch && settings.init_sync;
        let boot_keys: Vec<String> = match (patch_init, &settings.init_prefixes) {
            (false, _) => Vec::new(),
            (true, None) => state.keys().map(str::to_string).collect(),
            (true, Some(p)) => select_prefixed(state, p).map_err(Refusal::Config)?,
        };
        let mut all: Vec<&str> = keys_to_sync.iter().map(String::as_str).collect();
        for k in &boot_keys {
            if !keys_to_sync.contains(k) {
                all.push(k);
            }
        }
        let full_state = patch_init && settings.init_prefixes.is_none();
        let ordinals = check_metadata(meta, state, &all, full_state).map_err(Refusal::Handshake)?;
        if let Some((_, dup)) = keys_to_sync
            .iter()
            .enumerate()
            .find(|(i, k)| keys_to_sync[..*i].contains(k))
        {
            return Err(Refusal::Handshake(format!(
                "keys_to_sync lists '{dup}' twice"
            )));
        }
        let mut synced_keys = keys_to_sync.to_vec();
        synced_keys.sort_by_key(|k| ordinals.get(k).copied().unwrap_or(u32::MAX));
        let synced_ordinals: Vec<u32> = synced_keys
            .iter()
            .filter_map(|k| ordinals.get(k).copied())
            .collect();
        let recv_dtypes = synced_ordinals
            .iter()
            .map(|&o| meta[o as usize].dtype)
            .collect();
        Ok(Selection {
            synced_keys,
            synced_ordinals,
            recv_dtypes,
            boot_keys,
            ordinals,
        })
    }
}

/// Keys of `state` equal to a prefix or starting with `prefix.`; an empty list, or a prefix matching nothing,
/// is an error naming it.
pub(crate) fn select_prefixed(
    state: &StateDict,
    prefixes: &[String],
) -> Result<Vec<String>, String> {
    if prefixes.is_empty() {
        return Err(
            "init_sync.prefixes is an empty list (use null for the whole state dict)".into(),
        );
    }
    let matches = |k: &str, p: &str| {
        k == p || (k.len() > p.len() && k.starts_with(p) && k.as_bytes()[p.len()] == b'.')
    };
    for p in prefixes {
        if !state.keys().any(|k| matches(k, p)) {
            return Err(format!(
                "init_sync prefix '{p}' matches no key of the state dict"
            ));
        }
    }
    Ok(state
        .keys()
        .filter(|k| prefixes.iter().any(|p| matches(k, p)))
        .map(str::to_string)
        .collect())
}

fn list(keys: &[&str]) -> String {
    const SHOW: usize = 5;
    let mut s = keys
        .iter()
        .take(SHOW)
        .map(|k| format!("'{k}'"))
        .collect::<Vec<_>>()
        .join(", ");
    if keys.len() > SHOW {
        s.push_str(&format!(" and {} more", keys.len() - SHOW));
    }
    s
}

/// Check the receiver's metadata against the sender's state for `keys` (synced ∪ bootstrap); with
/// `full_state`, the receiver must not hold keys the sender lacks. Returns key → receiver ordinal.
pub(crate) fn check_metadata(
    meta: &[KeyMeta],
    state: &StateDict,
    keys: &[&str],
    full_state: bool,
) -> Result<HashMap<String, u32>, String> {
    let index: HashMap<&str, usize> = meta
        .iter()
        .enumerate()
        .map(|(i, m)| (m.name.as_str(), i))
        .collect();
    if index.len() != meta.len() {
        return Err("receiver metadata lists a key twice".into());
    }
    let missing_rx: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !index.contains_key(k))
        .collect();
    if !missing_rx.is_empty() {
        return Err(format!(
            "keys missing on the receiver: {}",
            list(&missing_rx)
        ));
    }
    let missing_tx: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| state.get(k).is_none())
        .collect();
    if !missing_tx.is_empty() {
        return Err(format!(
            "keys missing from the sender's state dict: {}",
            list(&missing_tx)
        ));
    }
    if full_state {
        let extra: Vec<&str> = meta
            .iter()
            .map(|m| m.name.as_str())
            .filter(|k| state.get(k).is_none())
            .collect();
        if !extra.is_empty() {
            return Err(format!(
                "keys only on the receiver (not aligned by init_sync): {}",
                list(&extra)
            ));
        }
    }
    let mut bad_shape = Vec::new();
    let mut bad_dtype = Vec::new();
    for &k in keys {
        let (Some(&i), Some(t)) = (index.get(k), state.get(k)) else {
            continue;
        };
        let m = &meta[i];
        if t.shape() != m.shape.as_slice() {
            bad_shape.push(format!(
                "'{k}' (sender {:?}, receiver {:?})",
                t.shape(),
                m.shape
            ));
        } else if !can_cast(t.dtype(), m.dtype) {
            bad_dtype.push(format!(
                "'{k}' (sender {}, receiver {})",
                t.dtype(),
                m.dtype
            ));
        }
    }
    if !bad_shape.is_empty() {
        return Err(format!(
            "shape mismatch for {}",
            bad_shape.into_iter().take(5).collect::<Vec<_>>().join(", ")
        ));
    }
    if !bad_dtype.is_empty() {
        return Err(format!(
            "dtype mismatch (only floating dtypes convert) for {}",
            bad_dtype.into_iter().take(5).collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(keys
        .iter()
        .filter_map(|&k| index.get(k).map(|&i| (k.to_string(), i as u32)))
        .collect())
}

/// The first difference between the sender's state dict and the receiver's metadata, in the sender's key order
/// (then the receiver's extra keys): a key on one side only, another shape, or dtypes that do not convert
/// (only floating dtypes may differ: patches and buckets carry the receiver's dtype). `None` when they match.
pub(crate) fn first_difference(meta: &[KeyMeta], state: &StateDict) -> Option<String> {
    let index: HashMap<&str, &KeyMeta> = meta.iter().map(|m| (m.name.as_str(), m)).collect();
    for (k, t) in state.iter() {
        let Some(m) = index.get(k) else {
            return Some(format!(
                "key '{k}' is in the sender's state dict but not the receiver's"
            ));
        };
        if t.shape() != m.shape.as_slice() {
            return Some(format!(
                "key '{k}' has shape {:?} on the sender and {:?} on the receiver",
                t.shape(),
                m.shape
            ));
        }
        if !can_cast(t.dtype(), m.dtype) {
            return Some(format!(
                "key '{k}' has dtype {} on the sender and {} on the receiver (only floating dtypes may differ)",
                t.dtype(),
                m.dtype
            ));
        }
    }
    meta.iter().find(|m| state.get(&m.name).is_none()).map(|m| {
        format!(
            "key '{}' is in the receiver's state dict but not the sender's",
            m.name
        )
    })
}

/// Bucket items for `keys` with the wire dtype chosen by `wire(sender dtype, receiver dtype)`.
pub(crate) fn plan_items(
    state: &StateDict,
    keys: &[&str],
    meta: &[KeyMeta],
    ordinals: &HashMap<String, u32>,
    wire: impl Fn(DType, DType) -> DType,
) -> Vec<Planned> {
    keys.iter()
        .filter_map(|&k| {
            let t = state.get(k)?;
            let &o = ordinals.get(k)?;
            let m = meta.get(o as usize)?;
            let dtype = wire(t.dtype(), m.dtype);
            Some(Planned {
                key: k.to_string(),
                src: t.dtype(),
                entry: BucketEntry {
                    ordinal: o,
                    dtype,
                    byte_len: t.numel() * dtype.size_bytes(),
                },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Class, Tensor};

    fn sd(keys: &[&str]) -> StateDict {
        let mut s = StateDict::new();
        for k in keys {
            s.insert(
                *k,
                Tensor::zeros(DType::F32, &[2], Class::Trainable).unwrap(),
            );
        }
        s
    }

    #[test]
    fn prefixes_match_whole_components() {
        let s = sd(&["model.a", "model.ab", "modelx.c", "model", "head.w"]);
        let check = |p: &[&str], expect: Result<Vec<&str>, &str>| {
            let p: Vec<String> = p.iter().map(|x| x.to_string()).collect();
            let got = select_prefixed(&s, &p);
            match expect {
                Ok(keys) => assert_eq!(
                    got.unwrap(),
                    keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
                    "{p:?}"
                ),
                Err(msg) => assert!(got.unwrap_err().contains(msg), "{p:?}"),
            }
        };
        check(&["model"], Ok(vec!["model.a", "model.ab", "model"]));
        check(&["model.a"], Ok(vec!["model.a"]));
        check(&["head", "modelx"], Ok(vec!["modelx.c", "head.w"]));
        check(&[], Err("empty list"));
        check(&["mod"], Err("'mod' matches no key"));
    }

    #[test]
    fn metadata_mismatches_name_the_keys() {
        let s = sd(&["a", "b"]);
        let meta = |names: &[(&str, DType, Vec<usize>)]| {
            names
                .iter()
                .map(|(n, d, sh)| KeyMeta {
                    name: n.to_string(),
                    dtype: *d,
                    shape: sh.clone(),
                })
                .collect::<Vec<_>>()
        };
        let ok = meta(&[("a", DType::Bf16, vec![2]), ("b", DType::F32, vec![2])]);
        assert_eq!(check_metadata(&ok, &s, &["a", "b"], true).unwrap().len(), 2);
        let e = check_metadata(&meta(&[("a", DType::F32, vec![2])]), &s, &["a", "b"], false)
            .unwrap_err();
        assert!(
            e.contains("missing on the receiver") && e.contains("'b'"),
            "{e}"
        );
        let e = check_metadata(
            &meta(&[("a", DType::F32, vec![3]), ("b", DType::F32, vec![2])]),
            &s,
            &["a", "b"],
            false,
        )
        .unwrap_err();
        assert!(e.contains("shape mismatch") && e.contains("'a'"), "{e}");
        let e = check_metadata(
            &meta(&[("a", DType::I32, vec![2]), ("b", DType::F32, vec![2])]),
            &s,
            &["a"],
            false,
        )
        .unwrap_err();
        assert!(e.contains("dtype mismatch") && e.contains("'a'"), "{e}");
        let e = check_metadata(
            &meta(&[
                ("a", DType::F32, vec![2]),
                ("b", DType::F32, vec![2]),
                ("c", DType::F32, vec![1]),
            ]),
            &s,
            &["a", "b"],
            true,
        )
        .unwrap_err();
        assert!(
            e.contains("only on the receiver") && e.contains("'c'"),
            "{e}"
        );
    }

    /// The handshake's key selection: synced keys in the state dict's order with the receiver's ordinals and
    /// dtypes, the bootstrap's keys, and each refusal of the kind the receivers are told.
    #[test]
    fn the_selection_orders_the_keys_and_refuses_with_the_first_problem() {
        use crate::syncer::settings::WeightSyncerConfig;
        use crate::syncer::{SyncOptions, WeightSyncer};
        let state = sd(&["a", "b", "c"]);
        let meta: Vec<KeyMeta> = ["a", "b", "c"]
            .iter()
            .map(|n| KeyMeta {
                name: n.to_string(),
                dtype: if *n == "b" { DType::Bf16 } else { DType::F32 },
                shape: vec![2],
            })
            .collect();
        let settings = |f: &dyn Fn(&mut WeightSyncerConfig)| {
            let mut cfg = WeightSyncerConfig::default();
            f(&mut cfg);
            WeightSyncer::from_config(&cfg, SyncOptions::default())
                .unwrap()
                .settings
        };
        let keys = |k: &[&str]| k.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        let plain = settings(&|c| c.patch.init_sync.enabled = false);
        let sel = Selection::choose(&plain, &meta, &state, &keys(&["c", "b"])).unwrap();
        assert_eq!(sel.synced_keys, keys(&["b", "c"]), "the state dict's order");
        assert_eq!(sel.synced_ordinals, vec![1, 2]);
        assert_eq!(sel.recv_dtypes, vec![DType::Bf16, DType::F32]);
        assert!(sel.boot_keys.is_empty(), "no init bootstrap");
        let boot = settings(&|c| {
            c.patch.init_sync.enabled = true;
            c.patch.init_sync.prefixes = Some(vec!["a".into()]);
        });
        let sel = Selection::choose(&boot, &meta, &state, &keys(&["b"])).unwrap();
        assert_eq!(sel.boot_keys, keys(&["a"]));
        assert_eq!(sel.ordinals.get("a"), Some(&0));
        let refusal = |settings: &Settings, meta: &[KeyMeta], k: &[&str]| {
            Selection::choose(settings, meta, &state, &keys(k)).unwrap_err()
        };
        let r = refusal(&plain, &meta, &["a", "a"]);
        assert!(
            matches!(&r, Refusal::Handshake(m) if m.contains("lists 'a' twice")),
            "{r:?}"
        );
        let missing = settings(&|c| {
            c.patch.init_sync.enabled = true;
            c.patch.init_sync.prefixes = Some(vec!["z".into()]);
        });
        let r = refusal(&missing, &meta, &["a"]);
        assert!(
            matches!(&r, Refusal::Config(m) if m.contains("'z' matches no key")),
            "{r:?}"
        );
        let mut same = plain.clone();
        same.same_keys = true;
        let r = refusal(&same, &meta[..2], &["a"]);
        assert!(
            matches!(&r, Refusal::Handshake(m) if m.contains("key 'c' is in the sender's state dict but not the receiver's")),
            "{r:?}"
        );
        assert!(
            r.reason()
                .starts_with("trainer and rollout state dicts differ")
        );
    }
}
