//! Cross-crate integration tests of the kvroute workspace live in `tests/`; this library is
//! empty. What they check is the contracts between crates: for now, that the CLI's JSON is
//! the cost model's own serde types and that the CLI computes what the library computes.
