//! rlsync's typed run configuration: stage two after the Hydra engine (`hydra_compose`) composed and resolved
//! the tree.
//!
//! Data flow: `hydra_compose` (search path → defaults tree → merged tree → CLI overrides → interpolation) →
//! [`typed`] reads the resolved tree into [`schema::RunConfig`] with full key paths, origins and "did you
//! mean", checks cross-field rules, and [`placement`] maps `cluster.component_placement` onto nodes;
//! [`EMBEDDED`] is the `config/` tree compiled into the binary. This
//! module knows nothing of processes, tensors or tch; workers receive the typed config and never re-compose.

pub mod placement;
pub mod schema;
pub mod typed;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded_configs.rs"));
}

/// rlsync's `config/` tree compiled into the binary: the primary config source without `--config-path`.
pub static EMBEDDED: hydra_compose::search_path::EmbeddedTree =
    hydra_compose::search_path::EmbeddedTree {
        program: "rlsync",
        module: "rlsync.config",
        files: embedded::MAIN,
    };
