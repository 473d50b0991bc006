//! Temporary stand-in for the YAML emitter (`config::emit::to_yaml`, branch h/yaml) until it is merged:
//! JSON, which is valid YAML that OmegaConf reads back (except NaN/inf floats and non-string keys).

pub mod emit {
    use crate::config::node::{Key, Node, Value};

    /// JSON is YAML; good enough until the real emitter lands.
    pub fn to_yaml(node: &Node) -> String {
        let mut out = serde_json::to_string_pretty(&to_json(node)).unwrap_or_default();
        out.push('\n');
        out
    }

    fn to_json(node: &Node) -> serde_json::Value {
        match &node.value {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int(i) => (*i).into(),
            Value::Float(f) => serde_json::Number::from_f64(*f).map_or_else(|| serde_json::Value::String(f.to_string()), serde_json::Value::Number),
            Value::Str(s) => s.clone().into(),
            Value::Bytes(_) => serde_json::Value::Null,
            Value::Missing => "???".into(),
            Value::List(items) => items.iter().map(to_json).collect(),
            Value::Dict(d) => d
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        Key::Str(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (key, to_json(v))
                })
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }
}
