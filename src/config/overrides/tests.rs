//! Tests of the override grammar: data-driven cases, the conformance kit's values, and fuzzing.
