//! write a config tree as YAML that OmegaConf reads back to the same typed values.
