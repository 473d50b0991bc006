//! The Hydra 1.3 compatible configuration engine (`version_base="1.1"`), and the typed run configuration.
//!
//! Data flow: search path → defaults tree → merged [`node::Node`] tree → CLI overrides → interpolation
//! → typed [`schema::RunConfig`]. This module knows nothing of processes, tensors or tch.

mod antlr_text;
pub mod bigint;
pub mod compose;
pub mod defaults;
pub mod emit;
pub mod hydra;
pub mod interpolate;
#[cfg(test)]
mod kit;
pub mod node;
pub mod overrides;
pub mod schema;
pub mod search_path;
pub mod typed;
pub mod yaml;
