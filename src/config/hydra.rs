//! the built-in hydra/ config group, the run directory and its .hydra/ files, and --info output.
