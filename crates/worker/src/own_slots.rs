//! The slots of a limited queue this claimer took itself ([`leasehold_kube::slots::Own`]):
//! kept with the attempt they were taken for while it runs, and remembered as free once this
//! claimer ended that attempt by a write the API server answered. The next claim in the same
//! scope swaps such a slot instead of listing the scope and judging a slot by a read, when
//! the dispatcher's offer suggests that very slot as this claimer's own, which it does when
//! the poll names it ([`OwnSlots::advertised`]) and the dispatcher saw nobody else take it
//! since. docs/protocol.md, "Limits": swapping one's own slot.
//!
//! Only advice about which slot to write: the swap is a replace conditional on the
//! resourceVersion this claimer's own write left, so a slot written by anyone since is not
//! swapped (409), and the scope is taken as usual.

use std::collections::HashMap;
use std::sync::Mutex;

use leasehold_core::slots::{Preferred, Scope, MAX_CHAIN_AGE};
use leasehold_kube::slots::Taken;

/// At most this many attempts' slots are kept (the attempts this claimer holds, and those it
/// lost without ending them, whose slots it forgets); past it they are forgotten at once.
pub(crate) const MAX_HELD: usize = 4096;

/// At most this many free slots are remembered, one per scope; past it the oldest is
/// forgotten (a forgotten slot is free to anyone, and is taken as any other).
pub(crate) const MAX_FREE: usize = 64;

/// At most this many free slots are named in a poll (the newest).
pub(crate) const MAX_ADVERTISED: usize = 16;

/// The slots of the attempts this claimer holds, and those of attempts it ended.
#[derive(Default)]
pub(crate) struct OwnSlots {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Job name -> the token of the attempt holding them, and the slots (each with its
    /// [`leasehold_kube::slots::Own`]).
    held: HashMap<String, (String, Vec<Taken>)>,
    /// Free slots, oldest first, at most one per scope.
    free: Vec<Taken>,
}

impl OwnSlots {
    /// Attempt `token` of job `job` holds `taken` (its claim landed): those this claimer
    /// wrote itself are kept with it.
    pub(crate) fn held(&self, job: &str, token: &str, taken: &[Taken]) {
        let own: Vec<Taken> = taken.iter().filter(|t| t.own.is_some()).cloned().collect();
        if own.is_empty() {
            return;
        }
        let mut state = self.state.lock().unwrap();
        // A slot remembered free and now taken again (by a take, not a swap of it): no longer
        // free, and its remembered version is stale.
        state.free.retain(|f| !own.iter().any(|t| t.name == f.name));
        if state.held.len() >= MAX_HELD && !state.held.contains_key(job) {
            state.held.clear();
        }
        state.held.insert(job.to_string(), (token.to_string(), own));
    }

    /// Attempt `token` of job `job` ended by this claimer's write, answered by the API server:
    /// its slots are free (by the busy rule: the job moved past the version they name, and
    /// is not Leased with a token they mark), and remembered so.
    pub(crate) fn ended(&self, job: &str, token: &str) {
        let mut state = self.state.lock().unwrap();
        let Some((held_token, own)) = state.held.remove(job) else {
            return;
        };
        if held_token != token {
            // Another attempt's slots (this one's were never kept): not known free.
            state.held.insert(job.to_string(), (held_token, own));
            return;
        }
        for slot in own {
            state.free.retain(|f| f.scope != slot.scope);
            if state.free.len() >= MAX_FREE {
                state.free.remove(0);
            }
            state.free.push(slot);
        }
    }

    /// Takes out the free slots of the scopes `scopes` that the dispatcher's offer suggested
    /// swapping (`swap`), for a claim to swap; the others stay.
    pub(crate) fn take(&self, scopes: &[Scope], swap: Preferred) -> Vec<Taken> {
        let mut state = self.state.lock().unwrap();
        state.free.retain(swappable);
        let (mine, rest) = std::mem::take(&mut state.free)
            .into_iter()
            .partition(|f| scopes.contains(&f.scope) && swap.of(&f.scope) == Some(f.index));
        state.free = rest;
        mine
    }

    /// The free slots, as a poll names them to the dispatcher: (concurrency key, or none for
    /// the queue's scope; index), the newest [`MAX_ADVERTISED`] (a poll's body stays small).
    pub(crate) fn advertised(&self) -> Vec<(Option<String>, u32)> {
        let mut state = self.state.lock().unwrap();
        state.free.retain(swappable);
        let skip = state.free.len().saturating_sub(MAX_ADVERTISED);
        state
            .free
            .iter()
            .skip(skip)
            .map(|f| match &f.scope {
                Scope::Queue => (None, f.index),
                Scope::Key(k) => (Some(k.clone()), f.index),
            })
            .collect()
    }
}

/// Whether a free slot may still be swapped as far as its age goes: its chain's list is less
/// than [`MAX_CHAIN_AGE`] old ([`leasehold_core::slots::may_swap`] refuses it after that, so
/// it is neither named to the dispatcher nor kept).
fn swappable(free: &Taken) -> bool {
    free.own
        .as_ref()
        .is_some_and(|o| o.listed_at.elapsed() < MAX_CHAIN_AGE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::slots::Chain;
    use leasehold_kube::slots::Own;

    fn taken(scope: Scope, index: u32) -> Taken {
        Taken {
            name: format!("slot-{scope:?}-{index}"),
            written: Some("1".into()),
            scope: scope.clone(),
            index,
            own: Some(Own {
                lease: Box::default(),
                chain: Chain {
                    queue_uid: "u".into(),
                    generation: 1,
                },
                listed_at: std::time::Instant::now(),
            }),
            swapped: false,
        }
    }

    #[test]
    fn a_slot_is_free_once_its_own_attempt_ended_and_taken_once() {
        let own = OwnSlots::default();
        let key = Scope::Key("a".into());
        own.held(
            "j1",
            "1.aa",
            &[taken(key.clone(), 2), taken(Scope::Queue, 0)],
        );
        assert!(own.advertised().is_empty(), "held, not free");
        own.ended("j1", "2.bb");
        assert!(own.advertised().is_empty(), "another attempt ended");
        own.ended("j1", "1.aa");
        assert_eq!(own.advertised(), vec![(Some("a".into()), 2), (None, 0)]);
        let swap = |key: Option<u32>| Preferred { queue: None, key };
        let scopes = std::slice::from_ref(&key);
        assert!(own.take(scopes, swap(None)).is_empty(), "not to swap");
        assert!(
            own.take(scopes, swap(Some(1))).is_empty(),
            "another slot to swap"
        );
        let got = own.take(scopes, swap(Some(2)));
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].index, 2);
        assert!(own.take(&[key], swap(Some(2))).is_empty(), "taken once");
        assert_eq!(own.advertised(), vec![(None, 0)]);
    }

    #[test]
    fn one_free_slot_per_scope_and_a_reuse_is_not_kept() {
        let own = OwnSlots::default();
        let key = Scope::Key("a".into());
        own.held("j1", "1.aa", &[taken(key.clone(), 1)]);
        own.held("j2", "1.cc", &[taken(key.clone(), 3)]);
        let mut reused = taken(key.clone(), 0);
        reused.own = None;
        own.held("j3", "1.dd", &[reused]);
        own.ended("j1", "1.aa");
        own.ended("j2", "1.cc");
        own.ended("j3", "1.dd");
        assert_eq!(own.advertised(), vec![(Some("a".into()), 3)]);
    }

    #[test]
    fn a_free_slot_taken_again_or_past_its_chain_age_is_no_longer_named() {
        let own = OwnSlots::default();
        let key = Scope::Key("a".into());
        own.held("j1", "1.aa", &[taken(key.clone(), 1)]);
        own.ended("j1", "1.aa");
        assert_eq!(own.advertised(), vec![(Some("a".into()), 1)]);
        // Taken again by a take (its version is new): held, not free.
        own.held("j2", "1.bb", &[taken(key.clone(), 1)]);
        assert!(own.advertised().is_empty());
        own.ended("j2", "1.bb");
        assert_eq!(own.advertised(), vec![(Some("a".into()), 1)]);
        // A chain whose list is MAX_CHAIN_AGE old cannot swap: forgotten.
        let mut old = taken(key.clone(), 2);
        if let Some(o) = old.own.as_mut() {
            o.listed_at = std::time::Instant::now()
                .checked_sub(MAX_CHAIN_AGE)
                .expect("an instant 5 s back");
        }
        own.held("j3", "1.cc", &[old]);
        own.ended("j3", "1.cc");
        assert!(
            own.advertised().is_empty(),
            "one per scope, and that one too old"
        );
        let swap = Preferred {
            queue: None,
            key: Some(2),
        };
        assert!(own.take(&[key], swap).is_empty());
    }

    #[test]
    fn free_slots_are_bounded() {
        let own = OwnSlots::default();
        for i in 0..(MAX_FREE as u32 + 5) {
            let job = format!("j{i}");
            own.held(&job, "1.aa", &[taken(Scope::Key(format!("k{i}")), 0)]);
            own.ended(&job, "1.aa");
        }
        assert_eq!(own.state.lock().unwrap().free.len(), MAX_FREE);
        let told = own.advertised();
        assert_eq!(told.len(), MAX_ADVERTISED, "the newest told");
        let newest = format!("k{}", MAX_FREE + 4);
        assert_eq!(told.last().unwrap().0.as_deref(), Some(newest.as_str()));
        let key = |i: usize| Scope::Key(format!("k{i}"));
        let swap = Preferred {
            queue: None,
            key: Some(0),
        };
        assert!(
            own.take(&[key(4)], swap).is_empty(),
            "the oldest went first"
        );
        assert_eq!(own.take(&[key(5)], swap).len(), 1);
    }
}
