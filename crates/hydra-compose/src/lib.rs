//! hydra-compose: Hydra 1.3 (`version_base="1.1"`) / OmegaConf 2.3 configuration composition in Rust.
//!
//! Data flow: the [`search_path`] finds the primary config; [`defaults`] expands defaults lists into the
//! ordered configs to merge; [`compose`] loads each through [`yaml`] (OmegaConf's scalar typing, file:line:col
//! on every node), merges them into one [`node::Node`] tree and applies the command line's [`overrides`];
//! [`interpolate`] resolves `${…}`; [`emit`] writes a tree back as YAML. Every stage's Python values
//! hold their scalars as one [`scalar::Scalar`], where Python's rules for them live. [`hydra::app`] is Hydra's front end
//! after argv (`--cfg`, `--info`, help, run and multirun jobs with their output directories).
//!
//! The crate knows nothing of the program that uses it: a program hands in its own config tree and name (an
//! [`search_path::EmbeddedTree`] compiled into it) and reads the composed tree into its own types.

mod antlr_text;
pub mod compose;
pub mod defaults;
pub mod did_you_mean;
pub mod emit;
pub mod hydra;
pub mod interpolate;
#[cfg(test)]
mod kit;
pub mod node;
pub mod overrides;
pub mod scalar;
pub mod search_path;
pub mod stdio;
pub mod yaml;
