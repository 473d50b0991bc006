//! Hydra defaults lists: build the defaults tree and the flat, ordered defaults list.
