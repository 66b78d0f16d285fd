//! Adoption: how the jobs Leased before a limit existed come to be counted by slots
//! ([`crate::slots`]), pure. The leading controller gives each such job a slot naming its
//! attempt ([`adopting`]) when no slot counts it ([`counts`]), then confirms the limits in the
//! LeasedQueue's status ([`adoption_of`]); claimers make no claim under limits not confirmed
//! ([`adopted`]). docs/protocol.md, "Limits", has the argument.

use crate::crd::LeasedJob;
use crate::queue::LeasedQueue;
use crate::slots::{state_of, Named, SlotHolder, SlotState};

/// What the limits of `queue` are, as its status' `slotsAdopted` names them once the jobs
/// Leased before they existed hold slots: `<metadata.uid>:<fields>`, the fields the spec sets
/// of `maxLeased` and `maxLeasedPerKey`, comma-separated. `None` when it sets neither.
///
/// Only which scopes are limited counts, not their values: a Leased job holds a slot of each
/// limited scope whatever the limit, and a lowered limit is kept by the slots above it. The
/// uid makes a LeasedQueue deleted and made again (whose jobs ran unlimited meanwhile) wait for
/// an adoption of its own.
pub fn adoption_of(queue: &LeasedQueue) -> Option<String> {
    let mut fields = Vec::new();
    if queue.spec.max_leased.is_some() {
        fields.push("maxLeased");
    }
    if queue.spec.max_leased_per_key.is_some() {
        fields.push("maxLeasedPerKey");
    }
    if fields.is_empty() {
        return None;
    }
    let uid = queue.metadata.uid.as_deref().unwrap_or_default();
    Some(format!("{uid}:{}", fields.join(",")))
}

/// Whether claims under `queue`'s limits may be made: it sets none, or its status says every
/// job Leased before they existed holds a slot ([`adoption_of`]). Until then a claimer makes
/// no claim of the queue (docs/protocol.md, "Limits": jobs Leased before a limit).
pub fn adopted(queue: &LeasedQueue) -> bool {
    match adoption_of(queue) {
        None => true,
        Some(wanted) => {
            queue
                .status
                .as_ref()
                .and_then(|s| s.slots_adopted.as_deref())
                == Some(&*wanted)
        }
    }
}

/// Whether the slot naming `named` counts `job` (a Leased copy) as it is: the slot names that
/// job's attempt and is [`SlotState::Busy`] judged from it. A Leased job no slot of a limited
/// scope counts is one to adopt.
pub fn counts(named: &Named, job: &LeasedJob) -> bool {
    job.metadata.name.as_deref() == Some(&named.holder.job)
        && named.holder.attempt == job.attempt()
        && state_of(named, Some(job)) == SlotState::Busy
}

/// The holder a slot adopting `job` (Leased, as read) names: the job at the version read, at
/// its attempt. Marked with its token's mark, such a slot is busy exactly while that attempt
/// lasts ([`state_of`]).
pub fn adopting(job: &LeasedJob) -> Option<SlotHolder> {
    Some(SlotHolder {
        job: job.metadata.name.clone()?,
        resource_version: job.metadata.resource_version.clone()?,
        attempt: job.attempt(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::Phase;
    use crate::queue::LeasedQueueSpec;
    use crate::slots::mark_of;
    use crate::slots::tests::{holder, job, with_token};

    #[test]
    fn limits_are_adopted_once_the_status_names_the_limited_fields_of_this_object() {
        let mut q = LeasedQueue::new("q", LeasedQueueSpec::default());
        q.metadata.uid = Some("u1".into());
        assert_eq!(adoption_of(&q), None);
        assert!(adopted(&q), "no limit: nothing to adopt");
        q.spec.max_leased_per_key = Some(2);
        assert_eq!(adoption_of(&q).as_deref(), Some("u1:maxLeasedPerKey"));
        assert!(!adopted(&q), "no status yet");
        let mut status = crate::queue::LeasedQueueStatus {
            slots_adopted: Some("u1:maxLeasedPerKey".into()),
            ..Default::default()
        };
        q.status = Some(status.clone());
        assert!(adopted(&q));
        q.spec.max_leased_per_key = Some(5);
        assert!(adopted(&q), "a changed value needs no adoption");
        q.spec.max_leased = Some(9);
        assert_eq!(
            adoption_of(&q).as_deref(),
            Some("u1:maxLeased,maxLeasedPerKey")
        );
        assert!(!adopted(&q), "a newly limited scope does");
        status.slots_adopted = Some("u0:maxLeased,maxLeasedPerKey".into());
        q.status = Some(status);
        assert!(!adopted(&q), "adopted for an earlier object of the name");
    }

    #[test]
    fn an_adopting_slot_counts_the_attempt_it_names_while_it_lasts() {
        let leased = with_token(job("40", Phase::Leased, 2), "2.aaaa");
        let mine = adopting(&leased).unwrap();
        assert_eq!(mine.render(), "j@40#2");
        let slot = Named::taken(mine, mark_of("2.aaaa"));
        assert!(counts(&slot, &leased));
        // A heartbeat's checkpoint moved the job on: still its attempt, still its token.
        let later = with_token(job("41", Phase::Leased, 2), "2.aaaa");
        assert!(counts(&slot, &later));
        // Ended, requeued, or leased again: no longer.
        assert!(!counts(&slot, &job("42", Phase::Queued, 2)));
        assert!(!counts(
            &slot,
            &with_token(job("43", Phase::Leased, 3), "3.bbbb")
        ));
        assert_eq!(
            state_of(
                &slot,
                Some(&with_token(job("43", Phase::Leased, 3), "3.bbbb"))
            ),
            SlotState::Free
        );
        // A claim's slot counts its claim once Leased; another job's slot never.
        let claim = Named::taken(holder("39", 2), mark_of("2.aaaa"));
        assert!(counts(&claim, &later));
        let mut other = later.clone();
        other.metadata.name = Some("k".into());
        assert!(!counts(&claim, &other));
    }
}
