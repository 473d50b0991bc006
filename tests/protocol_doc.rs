//! `docs/protocol.md` is exact: every `hex …` and `json …` example in it parses and re-encodes to itself.

use rlsync_core::protocol::arrays::{ChunkOrigin, decode_arrays, encode_arrays};
use rlsync_core::protocol::messages::{self, Command, Frame, Report};

const DOC: &str = include_str!("../docs/protocol.md");

/// The fenced blocks whose info string is `lang kind`, in document order.
fn examples(lang: &str, kind: &str) -> Vec<String> {
    let fence = format!("```{lang} {kind}");
    let mut out = Vec::new();
    let mut lines = DOC.lines();
    while let Some(line) = lines.next() {
        if line.trim_end() == fence {
            let block: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            out.push(block.join("\n"));
        }
    }
    out
}

fn hex(text: &str) -> Vec<u8> {
    text.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).unwrap_or_else(|_| panic!("bad hex byte {b:?}")))
        .collect()
}

fn frame_of<T: for<'de> serde::Deserialize<'de>>(bytes: &[u8]) -> Frame<T> {
    let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
    assert_eq!(len, bytes.len() - 4, "frame_len counts the bytes after it");
    messages::decode_body(bytes[4..].to_vec()).unwrap()
}

#[test]
fn hello_frame_example_decodes_and_reencodes() {
    let blocks = examples("hex", "report-frame");
    assert_eq!(blocks.len(), 1);
    let bytes = hex(&blocks[0]);
    let frame: Frame<Report> = frame_of(&bytes);
    let Report::Hello(hello) = &frame.header else {
        panic!("the example is a hello, got {:?}", frame.header);
    };
    assert_eq!(hello.protocol, messages::PROTOCOL_VERSION);
    assert_eq!(
        (hello.role.name(), hello.rank, hello.pid),
        ("rollout", 0, 4242)
    );
    messages::check_hello(hello).unwrap();
    assert_eq!(messages::encode(&frame.header, &frame.blob).unwrap(), bytes);
}

#[test]
fn command_frame_example_decodes_and_reencodes() {
    let blocks = examples("hex", "command-frame");
    assert_eq!(blocks.len(), 1);
    let bytes = hex(&blocks[0]);
    let frame: Frame<Command> = frame_of(&bytes);
    assert_eq!(frame.header, Command::Sync { version: 7 });
    assert!(frame.blob.is_empty());
    assert_eq!(messages::encode(&frame.header, &frame.blob).unwrap(), bytes);
}

#[test]
fn json_examples_roundtrip_exactly() {
    let commands = examples("json", "command");
    assert_eq!(commands.len(), 7);
    for text in commands {
        let cmd: Command = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(serde_json::to_string(&cmd).unwrap(), text);
    }
    let reports = examples("json", "report");
    assert_eq!(reports.len(), 11);
    for text in reports {
        let report: Report = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(serde_json::to_string(&report).unwrap(), text);
    }
}

#[test]
fn unknown_json_keys_are_ignored_as_documented() {
    let cmd: Command = serde_json::from_str(r#"{"cmd":"sync","version":7,"later":1}"#).unwrap();
    assert_eq!(cmd, Command::Sync { version: 7 });
}

#[test]
fn trajectory_example_decodes_and_reencodes() {
    let blocks = examples("hex", "trajectory");
    assert_eq!(blocks.len(), 1);
    let bytes = hex(&blocks[0]);
    let got = decode_arrays(&bytes).unwrap();
    assert_eq!(got.len(), 1);
    let (origin, arrays) = &got[0];
    assert_eq!(*origin, ChunkOrigin { rank: 0, chunk: 5 });
    let names: Vec<&str> = arrays.iter().map(|a| a.name).collect();
    assert_eq!(
        names,
        [
            "obs",
            "actions",
            "action_n",
            "logprobs",
            "rewards",
            "terminated",
            "truncated",
            "truncated_obs",
            "last_obs",
            "versions",
            "episodes",
            "episodes_count"
        ]
    );
    let obs = &arrays[0];
    assert_eq!((obs.dtype, obs.shape.as_slice()), ("<f4", &[1u64, 1][..]));
    assert_eq!(obs.data, 0.5f32.to_le_bytes());
    assert_eq!(encode_arrays(*origin, arrays).unwrap(), bytes);
}

#[test]
fn node_link_examples_roundtrip_exactly() {
    use rlsync::protocol::node::{NodeCommand, NodeReport};
    let commands = examples("json", "node-command");
    assert_eq!(commands.len(), 6);
    for text in commands {
        let cmd: NodeCommand =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(serde_json::to_string(&cmd).unwrap(), text);
    }
    let reports = examples("json", "node-report");
    assert_eq!(reports.len(), 8);
    for text in reports {
        let report: NodeReport =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(serde_json::to_string(&report).unwrap(), text);
    }
}
