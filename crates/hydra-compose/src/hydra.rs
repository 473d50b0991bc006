//! Hydra's own side of composition: the runtime part of the `hydra` node, `--info` output, and the run
//! directory with its `.hydra/` files.

pub mod app;
pub mod completion;
pub mod conf;

use indexmap::IndexMap;

use crate::defaults::{Child, DefaultsList, TreeNode};
use crate::node::{Dict, Key, Node, Value};
use crate::scalar::Scalar;
use crate::search_path::Source;

/// The Hydra version this engine reports (`hydra.runtime.version`): the semantics it reproduces.
pub const HYDRA_VERSION: &str = "1.3.8";
/// The version_base this engine composes with.
pub(crate) const VERSION_BASE: &str = "1.1";

/// What composition learned that goes into `hydra.runtime`, `hydra.job` and `hydra.overrides`.
#[derive(Debug)]
pub(crate) struct RuntimeInfo<'a> {
    pub job_name: &'a str,
    pub config_name: &'a str,
    pub hydra_overrides: Vec<String>,
    /// `(key_or_group, override as typed)`.
    pub task_overrides: Vec<(String, String)>,
    pub choices: &'a IndexMap<String, Option<String>>,
    pub sources: &'a [Source],
}

/// The strings of the list at dotted `path` (other elements skipped; none when it is absent or not a list).
fn strings_at(cfg: &Node, path: &str) -> Vec<String> {
    cfg.get_path(path)
        .and_then(Node::as_list)
        .map(|l| {
            l.iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn dict_at<'n>(root: &'n mut Node, path: &[&str]) -> Option<&'n mut Dict> {
    let mut cur = root;
    for part in path {
        let dict = cur.as_dict_mut()?;
        cur = dict
            .entry(Key::from(*part))
            .or_insert_with(Node::empty_dict);
        if !cur.value.is_container() {
            *cur = Node::empty_dict();
        }
    }
    cur.as_dict_mut()
}

fn set(root: &mut Node, path: &[&str], key: &str, value: Value) {
    if let Some(dict) = dict_at(root, path) {
        dict.insert(Key::from(key), Node::new(value));
    }
}

fn str_list(items: impl IntoIterator<Item = String>) -> Value {
    Value::List(items.into_iter().map(Node::str).collect())
}

/// Fill the runtime fields of `cfg.hydra` as Hydra's config loader does after merging.
pub(crate) fn fill_runtime(cfg: &mut Node, info: &RuntimeInfo<'_>) {
    let append = |cfg: &mut Node, which: &str, items: Vec<String>| {
        if let Some(dict) = dict_at(cfg, &["hydra", "overrides"]) {
            let slot = dict
                .entry(Key::from(which))
                .or_insert_with(|| Node::new(Value::List(Vec::new())));
            if let Value::List(list) = &mut slot.value {
                list.extend(items.into_iter().map(Node::str));
            } else {
                *slot = Node::new(str_list(items));
            }
        }
    };
    append(cfg, "hydra", info.hydra_overrides.clone());
    append(
        cfg,
        "task",
        info.task_overrides
            .iter()
            .map(|(_, input)| input.clone())
            .collect(),
    );

    if let Some(choices) = dict_at(cfg, &["hydra", "runtime", "choices"]) {
        for (key, value) in info.choices {
            let value = value.clone().map_or(Value::NULL, Value::str);
            choices.insert(Key::from(key.as_str()), Node::new(value));
        }
    }
    let env_copy = strings_at(cfg, "hydra.job.env_copy");
    if let Some(env_set) = dict_at(cfg, &["hydra", "job", "env_set"]) {
        for key in env_copy {
            if let Ok(value) = std::env::var(&key) {
                env_set.insert(Key::from(key.as_str()), Node::str(value));
            }
        }
    }
    set(
        cfg,
        &["hydra", "runtime"],
        "version",
        Value::Scalar(Scalar::Str(HYDRA_VERSION.into())),
    );
    set(
        cfg,
        &["hydra", "runtime"],
        "version_base",
        Value::Scalar(Scalar::Str(VERSION_BASE.into())),
    );
    let cwd = std::env::current_dir()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    set(cfg, &["hydra", "runtime"], "cwd", Value::str(cwd));
    let sources = info
        .sources
        .iter()
        .map(|s| {
            let mut d = Dict::new();
            d.insert(Key::from("path"), Node::str(s.path.clone()));
            d.insert(Key::from("schema"), Node::str(s.scheme));
            d.insert(Key::from("provider"), Node::str(s.provider.clone()));
            Node::new(Value::Dict(d))
        })
        .collect();
    set(
        cfg,
        &["hydra", "runtime"],
        "config_sources",
        Value::List(sources),
    );

    let name_missing = cfg
        .get_path("hydra.job.name")
        .is_none_or(|n| matches!(n.value, Value::Missing));
    if name_missing {
        set(
            cfg,
            &["hydra", "job"],
            "name",
            Value::Scalar(Scalar::Str(info.job_name.into())),
        );
    }
    let dirname = override_dirname(cfg, &info.task_overrides);
    set(
        cfg,
        &["hydra", "job"],
        "override_dirname",
        Value::str(dirname),
    );
    set(
        cfg,
        &["hydra", "job"],
        "config_name",
        Value::Scalar(Scalar::Str(info.config_name.into())),
    );
}

/// `hydra.job.override_dirname`: sorted task overrides minus excluded keys, joined with the configured separators.
fn override_dirname(cfg: &Node, task_overrides: &[(String, String)]) -> String {
    let sep = |key: &str, default: &str| {
        cfg.get_path(&format!("hydra.job.config.override_dirname.{key}"))
            .and_then(Node::as_str)
            .unwrap_or(default)
            .to_owned()
    };
    let kv_sep = sep("kv_sep", "=");
    let item_sep = sep("item_sep", ",");
    let exclude = strings_at(cfg, "hydra.job.config.override_dirname.exclude_keys");
    let mut lines: Vec<&str> = task_overrides
        .iter()
        .filter(|(key, _)| !exclude.contains(key))
        .map(|(_, input)| input.as_str())
        .collect();
    lines.sort_unstable();
    lines.join(&item_sep).replace('=', &kv_sep)
}

/// `--info defaults`: Hydra's "Defaults List" table.
pub(crate) fn format_defaults_table(list: &DefaultsList) -> String {
    let mut rows: Vec<[String; 4]> = vec![[
        "Config path".into(),
        "Package".into(),
        "_self_".into(),
        "Parent".into(),
    ]];
    for d in &list.defaults {
        rows.push([
            d.config_path.clone(),
            d.package.clone(),
            if d.is_self {
                "True".into()
            } else {
                "False".into()
            },
            d.parent.clone().unwrap_or_default(),
        ]);
    }
    let widths: Vec<usize> = (0..4)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
    let mut out = String::from("\n");
    out.push_str(&header_lines("Defaults List", '*'));
    let mut iter = rows.iter();
    let header = iter
        .next()
        .map(|h| {
            format!(
                "| {} | {} | {} | {} | ",
                pad(&h[0], widths[0]),
                pad(&h[1], widths[1]),
                pad(&h[2], widths[2]),
                pad(&h[3], widths[3])
            )
        })
        .unwrap_or_default();
    out.push_str(&header_lines(&header, '-'));
    for r in iter {
        out.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            pad(&r[0], widths[0]),
            pad(&r[1], widths[1]),
            pad(&r[2], widths[2]),
            pad(&r[3], widths[3])
        ));
    }
    out.push_str(&"-".repeat(header.chars().count()));
    out.push('\n');
    out
}

fn header_lines(header: &str, filler: char) -> String {
    format!(
        "{header}\n{}\n",
        filler.to_string().repeat(header.chars().count())
    )
}

/// `--info defaults-tree`.
pub(crate) fn format_defaults_tree(tree: &TreeNode) -> String {
    let mut out = String::from("\n");
    out.push_str(&header_lines("Defaults Tree", '*'));
    tree_lines(tree, 0, &mut out);
    out
}

fn tree_lines(tree: &TreeNode, indent: usize, out: &mut String) {
    let pad = "  ".repeat(indent);
    let label = tree.node.tree_label();
    match &tree.children {
        Some(children) if !children.is_empty() => {
            out.push_str(&format!("{pad}{label}:\n"));
            for child in children {
                match child {
                    Child::Leaf(node) => out.push_str(&format!(
                        "{}{}\n",
                        "  ".repeat(indent + 1),
                        node.tree_label()
                    )),
                    Child::Tree(sub) => tree_lines(sub, indent + 1, out),
                }
            }
        }
        _ => out.push_str(&format!("{pad}{label}\n")),
    }
}

/// `--info searchpath`.
pub(crate) fn format_search_path(sources: &[Source]) -> String {
    let rows: Vec<(String, String)> = sources
        .iter()
        .map(|s| (s.provider.clone(), format!("{}://{}", s.scheme, s.path)))
        .collect();
    let w0 = rows
        .iter()
        .map(|r| r.0.chars().count())
        .chain(["Provider".len()])
        .max()
        .unwrap_or(0);
    let w1 = rows
        .iter()
        .map(|r| r.1.chars().count())
        .chain(["Search path".len()])
        .max()
        .unwrap_or(0);
    let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
    let mut out = String::from("\n");
    out.push_str(&header_lines("Config search path", '*'));
    let header = format!("| {} | {} |", pad("Provider", w0), pad("Search path", w1));
    out.push_str(&header_lines(&header, '-'));
    for (p, s) in &rows {
        out.push_str(&format!("| {} | {} |\n", pad(p, w0), pad(s, w1)));
    }
    out.push_str(&"-".repeat(header.chars().count()));
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::defaults::ResultDefault;

    #[test]
    fn defaults_table_matches_hydra_layout() {
        let list = DefaultsList {
            defaults: vec![
                ResultDefault {
                    config_path: "hydra/config".into(),
                    parent: Some("<root>".into()),
                    package: "hydra".into(),
                    is_self: true,
                    primary: false,
                    override_key: None,
                },
                ResultDefault {
                    config_path: "empty".into(),
                    parent: Some("<root>".into()),
                    package: String::new(),
                    is_self: false,
                    primary: true,
                    override_key: None,
                },
            ],
            tree: TreeNode {
                node: crate::defaults::InputDefault::group(
                    "x",
                    crate::defaults::GroupValue::Name(None),
                    None,
                    false,
                    false,
                ),
                children: None,
            },
            known_choices: IndexMap::new(),
        };
        let want = "\nDefaults List\n*************\n| Config path  | Package | _self_ | Parent | \n---------------------------------------------\n| hydra/config | hydra   | True   | <root> |\n| empty        |         | False  | <root> |\n---------------------------------------------\n";
        assert_eq!(format_defaults_table(&list), want);
    }
}
