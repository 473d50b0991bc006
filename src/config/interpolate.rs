//! OmegaConf ${...} interpolation: grammar, resolution and resolvers.
