//! load YAML with OmegaConf's scalar typing; every node keeps file:line:col.
