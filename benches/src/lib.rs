//! Cross-crate criterion benches live in benches/benches/.
