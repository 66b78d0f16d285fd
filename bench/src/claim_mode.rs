//! What a claim run (rows 2, 2d, 2k, 2b, 2bk) is and what it counts: its [`Mode`], and the
//! [`Counts`] its claim loops share, whether they are Workers ([`crate::claims`]) or the
//! bound's bare claimers ([`crate::bound`]). Below both, so that neither imports the other
//! for them.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The counts a claim run reads, shared with its claim loops (the Workers' or the bound's).
#[derive(Clone, Default)]
pub struct Counts {
    /// Claims that landed.
    pub claimed: Arc<AtomicU64>,
    /// Jobs completed.
    pub completed: Arc<AtomicU64>,
    /// Claims and completions that failed (should be 0).
    pub errors: Arc<AtomicU64>,
}

/// How the claimers of a run find their jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Each chooses from its own copy of the queue (row 2).
    Plain,
    /// Each claims what the dispatcher offers it (row 2d).
    Dispatched,
    /// As `Dispatched`, in a queue whose LeasedQueue limits every key (row 2k).
    Limited,
    /// No Worker: the two writes of each job from one list, nothing else (row 2b).
    Bound,
    /// As `Bound`, with the write a slot costs before each claim: three writes per job,
    /// nothing else (row 2bk, the bound of row 2k).
    BoundKeyed,
}

impl Mode {
    /// The row its runs make: `2`, `2d`, `2k`, `2b`, `2bk`.
    pub fn row(self) -> &'static str {
        match self {
            Mode::Plain => "2",
            Mode::Dispatched => "2d",
            Mode::Limited => "2k",
            Mode::Bound => "2b",
            Mode::BoundKeyed => "2bk",
        }
    }

    /// Whether each claim first takes a slot (or, in the keyed bound, makes the write a take
    /// makes): rows 2k and 2bk.
    pub fn takes_slots(self) -> bool {
        matches!(self, Mode::Limited | Mode::BoundKeyed)
    }

    /// The writes each job costs the claimers: the claim and the completion, and the slot's
    /// when [`Mode::takes_slots`].
    pub fn writes_per_job(self) -> usize {
        2 + usize::from(self.takes_slots())
    }

    /// The part of the run's namespace that tells the mode: `bench-claim<part><N>-<round>`.
    pub fn part(self) -> &'static str {
        match self {
            Mode::Plain => "",
            Mode::Dispatched => "d",
            Mode::Limited => "k",
            Mode::Bound => "b",
            Mode::BoundKeyed => "bk",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Mode;

    #[test]
    fn only_the_keyed_rows_take_slots_and_write_three_times_a_job() {
        let all = [
            Mode::Plain,
            Mode::Dispatched,
            Mode::Limited,
            Mode::Bound,
            Mode::BoundKeyed,
        ];
        let writes: Vec<_> = all.iter().map(|m| (m.row(), m.writes_per_job())).collect();
        assert_eq!(
            writes,
            [("2", 2), ("2d", 2), ("2k", 3), ("2b", 2), ("2bk", 3)]
        );
        let parts: std::collections::BTreeSet<_> = all.iter().map(|m| m.part()).collect();
        assert_eq!(
            parts.len(),
            all.len(),
            "each mode has a namespace of its own"
        );
    }
}
