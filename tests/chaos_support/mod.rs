//! The parts of the chaos test (tests/chaos.rs): fault injection, the liveness probes, and
//! the final invariants, each an `impl Chaos` over the state the test root defines.

mod inject;
mod invariants;
mod probes;

pub(crate) use invariants::expected_result;
