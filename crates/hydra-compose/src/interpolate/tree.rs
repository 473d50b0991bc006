//! The mutable, parent-linked working copy of a config that interpolation resolves against.
//!
//! OmegaConf resolves relative keys (`${..a}`) by walking parent links, lets resolvers create containers
//! that point at a parent without being its child (`oc.create`), and `OmegaConf.resolve` rewrites nodes in
//! place. An arena of slots with parent ids models all three without reference counting.

use indexmap::IndexMap;

use crate::node::{Key, Node, Origin, Value};
use crate::scalar::Scalar;

pub type Id = usize;

#[derive(Debug, Clone)]
pub enum Body {
    /// A leaf: any [`Value`] but a list or dict (a container's children are slots of their own, so the
    /// tree builds every container as [`Body::List`] / [`Body::Dict`]). Strings containing `${` are
    /// interpolations.
    Leaf(Value),
    Dict(IndexMap<Key, Id>),
    List(Vec<Id>),
}

/// Where a slot sits in its parent.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotKey {
    Key(Key),
    Index(usize),
}

#[derive(Debug, Clone)]
pub struct Slot {
    pub parent: Option<Id>,
    pub key: Option<SlotKey>,
    pub body: Body,
    pub origin: Option<Origin>,
}

#[derive(Debug, Default)]
pub struct Tree {
    slots: Vec<Slot>,
}

impl Tree {
    pub fn slot(&self, id: Id) -> &Slot {
        &self.slots[id]
    }

    fn slot_mut(&mut self, id: Id) -> &mut Slot {
        &mut self.slots[id]
    }

    pub fn body(&self, id: Id) -> &Body {
        &self.slots[id].body
    }

    pub fn parent(&self, id: Id) -> Option<Id> {
        self.slots[id].parent
    }

    pub fn add(
        &mut self,
        parent: Option<Id>,
        key: Option<SlotKey>,
        body: Body,
        origin: Option<Origin>,
    ) -> Id {
        self.slots.push(Slot {
            parent,
            key,
            body,
            origin,
        });
        self.slots.len() - 1
    }

    /// Copy a [`Node`] tree in, under `parent`.
    pub fn insert_node(&mut self, node: &Node, parent: Option<Id>, key: Option<SlotKey>) -> Id {
        let origin = node.origin.clone();
        let body = match &node.value {
            Value::List(_) => Body::List(Vec::new()),
            Value::Dict(_) => Body::Dict(IndexMap::new()),
            leaf => Body::Leaf(leaf.clone()),
        };
        let id = self.add(parent, key, body, origin);
        match &node.value {
            Value::List(items) => {
                let ids = items
                    .iter()
                    .enumerate()
                    .map(|(i, n)| self.insert_node(n, Some(id), Some(SlotKey::Index(i))))
                    .collect();
                self.slot_mut(id).body = Body::List(ids);
            }
            Value::Dict(d) => {
                let ids = d
                    .iter()
                    .map(|(k, n)| {
                        (
                            k.clone(),
                            self.insert_node(n, Some(id), Some(SlotKey::Key(k.clone()))),
                        )
                    })
                    .collect();
                self.slot_mut(id).body = Body::Dict(ids);
            }
            _ => {}
        }
        id
    }

    /// Read a subtree back out as a [`Node`], without resolving anything.
    pub fn to_node(&self, id: Id) -> Node {
        let slot = self.slot(id);
        let value = match &slot.body {
            Body::Leaf(v) => v.clone(),
            Body::List(items) => Value::List(items.iter().map(|&c| self.to_node(c)).collect()),
            Body::Dict(d) => Value::Dict(
                d.iter()
                    .map(|(k, &c)| (k.clone(), self.to_node(c)))
                    .collect(),
            ),
        };
        Node::with_origin(value, slot.origin.clone())
    }

    /// Deep-copy `src` to a new subtree under `parent` (OmegaConf copies containers on assignment).
    pub fn deep_copy(&mut self, src: Id, parent: Option<Id>, key: Option<SlotKey>) -> Id {
        let origin = self.slot(src).origin.clone();
        let body = self.slot(src).body.clone();
        let id = self.add(parent, key, Body::Leaf(Value::NULL), origin);
        let body = match body {
            Body::Leaf(s) => Body::Leaf(s),
            Body::List(items) => Body::List(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| self.deep_copy(c, Some(id), Some(SlotKey::Index(i))))
                    .collect(),
            ),
            Body::Dict(d) => Body::Dict(
                d.iter()
                    .map(|(k, &c)| {
                        (
                            k.clone(),
                            self.deep_copy(c, Some(id), Some(SlotKey::Key(k.clone()))),
                        )
                    })
                    .collect(),
            ),
        };
        self.slot_mut(id).body = body;
        id
    }

    /// Replace child `key` of container `parent` with `new` (already parented there).
    pub fn replace_child(&mut self, parent: Id, key: &SlotKey, new: Id) {
        match (&mut self.slot_mut(parent).body, key) {
            (Body::Dict(d), SlotKey::Key(k)) => {
                if let Some(slot) = d.get_mut(k) {
                    *slot = new;
                }
            }
            (Body::List(l), SlotKey::Index(i)) => {
                if let Some(slot) = l.get_mut(*i) {
                    *slot = new;
                }
            }
            _ => {}
        }
    }

    pub fn replace_body(&mut self, id: Id, body: Body) {
        self.slot_mut(id).body = body;
    }

    pub fn child(&self, parent: Id, key: &SlotKey) -> Option<Id> {
        match (self.body(parent), key) {
            (Body::Dict(d), SlotKey::Key(k)) => d.get(k).copied(),
            (Body::List(l), SlotKey::Index(i)) => l.get(*i).copied(),
            _ => None,
        }
    }

    pub fn set_leaf(&mut self, id: Id, value: Value) {
        self.slot_mut(id).body = Body::Leaf(value);
    }

    pub fn leaf(&self, id: Id) -> Option<&Value> {
        match &self.slot(id).body {
            Body::Leaf(s) => Some(s),
            _ => None,
        }
    }

    pub fn is_container(&self, id: Id) -> bool {
        !matches!(self.slot(id).body, Body::Leaf(_))
    }

    /// The interpolation string of a leaf, if it is one.
    pub fn interpolation(&self, id: Id) -> Option<&str> {
        match self.leaf(id) {
            Some(Value::Scalar(Scalar::Str(s))) if s.contains("${") => Some(s),
            _ => None,
        }
    }

    pub fn root_of(&self, mut id: Id) -> Id {
        while let Some(p) = self.parent(id) {
            id = p;
        }
        id
    }

    /// OmegaConf's `_get_full_key`: `a.b`, `list[0].c`, `[1]` for a list root.
    pub fn full_key(&self, id: Id) -> String {
        let mut parts = Vec::new();
        let mut cur = id;
        while let (Some(parent), Some(key)) = (self.parent(cur), self.slot(cur).key.as_ref()) {
            parts.push(key.clone());
            cur = parent;
        }
        let mut out = String::new();
        for key in parts.iter().rev() {
            match key {
                SlotKey::Index(i) => out.push_str(&format!("[{i}]")),
                SlotKey::Key(k) => {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(&k.to_string());
                }
            }
        }
        out
    }

    /// Full key of child `key` of container `parent` (which may not exist).
    pub fn child_full_key(&self, parent: Id, key: &str) -> String {
        let base = self.full_key(parent);
        match self.slot(parent).body {
            Body::List(_) => format!("{base}[{key}]"),
            _ if base.is_empty() => key.to_owned(),
            _ => format!("{base}.{key}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Node {
        let mut inner = crate::node::Dict::new();
        inner.insert(Key::from("c"), Node::new(Value::int(1)));
        let list = Node::new(Value::List(vec![
            Node::new(Value::Dict(inner)),
            Node::str("${x}"),
        ]));
        let mut root = crate::node::Dict::new();
        root.insert(Key::from("l"), list);
        root.insert(Key::int(3), Node::new(Value::Missing));
        Node::new(Value::Dict(root))
    }

    #[test]
    fn round_trips_and_names_keys_like_omegaconf() {
        let node = sample();
        let mut t = Tree::default();
        let root = t.insert_node(&node, None, None);
        assert_eq!(t.to_node(root), node);
        let Body::Dict(d) = t.body(root) else {
            panic!("root is a dict")
        };
        let l = d[&Key::from("l")];
        let Body::List(items) = t.body(l) else {
            panic!("l is a list")
        };
        let Body::Dict(first) = t.body(items[0]) else {
            panic!("l[0] is a dict")
        };
        assert_eq!(t.full_key(first[&Key::from("c")]), "l[0].c");
        assert_eq!(t.full_key(items[1]), "l[1]");
        assert_eq!(t.interpolation(items[1]), Some("${x}"));
        assert_eq!(t.full_key(d[&Key::int(3)]), "3");
        assert_eq!(t.child_full_key(l, "7"), "l[7]");
        assert_eq!(t.root_of(first[&Key::from("c")]), root);
    }

    #[test]
    fn deep_copy_is_independent() {
        let mut t = Tree::default();
        let root = t.insert_node(&sample(), None, None);
        let copy = t.deep_copy(root, None, None);
        let Body::Dict(d) = t.body(copy).clone() else {
            panic!("dict")
        };
        t.set_leaf(d[&Key::int(3)], Value::int(9));
        assert_eq!(t.to_node(root), sample());
        assert_ne!(t.to_node(copy), sample());
    }
}
