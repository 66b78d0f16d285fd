//! Adoption: how the jobs Leased before a limit existed come to be counted by slots
//! ([`crate::slots`]), pure. The leading controller gives each such job a slot naming its
//! attempt ([`adopting`]) when no slot counts it ([`counts`]), then confirms the limits in the
//! LeasedQueue's status ([`adoption_of`]); claimers make no claim under limits not confirmed
//! ([`adopted`]). docs/protocol.md, "Limits", has the argument.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::crd::{LeasedJob, Phase};
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

/// What a claim under `queue`'s limits records in the job's `status.limits`: the LeasedQueue's
/// uid and each limit it sets with its value, `<metadata.uid>:maxLeased=<n>,maxLeasedPerKey=<m>`
/// (those set, in that order); `None` when it sets neither. The chart's admission policy
/// compares it with the same string built from the API server's own copy of the LeasedQueue
/// (rule `limits-obeyed`, docs/security.md), so a claim decided under another object, another
/// set of limits or other values (a limit lowered since) is refused.
pub fn obeyed(queue: &LeasedQueue) -> Option<String> {
    let mut limits = Vec::new();
    if let Some(n) = queue.spec.max_leased {
        limits.push(format!("maxLeased={n}"));
    }
    if let Some(m) = queue.spec.max_leased_per_key {
        limits.push(format!("maxLeasedPerKey={m}"));
    }
    if limits.is_empty() {
        return None;
    }
    let uid = queue.metadata.uid.as_deref().unwrap_or_default();
    Some(format!("{uid}:{}", limits.join(",")))
}

/// What a claim that swapped a slot ([`crate::slots::may_swap`]) records in `status.limits`:
/// [`obeyed`] with the LeasedQueue's generation after its uid,
/// `<metadata.uid>/<metadata.generation>:maxLeased=<n>,...`; `None` when it sets no limit or
/// the copy has no generation. The chart's admission policy accepts it only while its own copy
/// of the LeasedQueue is at that generation (rule `limits-obeyed`): a swap skips the list of
/// the scope's slots, so it must not outlive the limits its chain's first take listed under,
/// even when they were changed and changed back.
pub fn obeyed_at_generation(queue: &LeasedQueue) -> Option<String> {
    let obeyed = obeyed(queue)?;
    let generation = queue.metadata.generation?;
    let (uid, limits) = obeyed.split_once(':')?;
    Some(format!("{uid}/{generation}:{limits}"))
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
/// lasts ([`state_of`]). None for a copy without a name or a resourceVersion.
pub fn adopting(job: &LeasedJob) -> Option<SlotHolder> {
    Some(SlotHolder {
        job: job.metadata.name.clone()?,
        resource_version: job.guarding_version()?.to_string(),
        attempt: job.attempt(),
    })
}

/// Whether the slot naming `named`, of the scope labelled `scope` in `queue`, waits for a
/// claim that was never written: `job` (a copy of the job it names) is a job of that queue and
/// scope, still at the version the slot names, Queued, one attempt before the slot's. Its claimer took the slot and has not made its claim write yet: in flight (a few
/// milliseconds), or never, if it died or stalled in between (or its write failed without
/// landing). Such a slot holds a unit of its scope until the job moves past that version.
///
/// A slot a controller wrote for a Leased job ([`adopting`]) names the job's own attempt, so
/// it is never pending: it is busy while that attempt lasts. A slot naming a job of another
/// queue or scope was written by no claim of this one (workers may write slot Leases): it is
/// never judged pending, so that it cannot make the controller write to that job.
pub fn pending_claim(queue: &LeasedQueue, scope: &str, named: &Named, job: &LeasedJob) -> bool {
    let holder = &named.holder;
    let in_scope = queue.metadata.name.as_deref() == Some(&job.spec.queue)
        && crate::slots::scopes(queue, job)
            .iter()
            .any(|(s, _)| s.label() == scope);
    in_scope
        && job.metadata.name.as_deref() == Some(&holder.job)
        && job.metadata.resource_version.as_deref() == Some(&holder.resource_version)
        && job.phase() == Phase::Queued
        && job.attempt() + 1 == holder.attempt
}

/// How long a slot must be seen pending ([`pending_claim`]), by the controller's own clock,
/// before the controller frees it: far longer than a claim's two writes take (milliseconds),
/// so that it only ever withdraws a claim whose claimer died or stalled. Freeing one early
/// would only cost that claimer a 409 and one more pick.
pub const PENDING_GRACE: Duration = Duration::from_secs(10);

/// The slots seen pending, per queue, and since when (the controller's clock): which of them
/// have waited [`PENDING_GRACE`]. Advice only: the write that frees a slot is guarded by the
/// resourceVersion the slot names, so a slot whose claim landed meanwhile is left alone by the
/// API server.
#[derive(Debug, Default)]
pub struct Stalled {
    /// Per queue (`<namespace>/<name>`): slot Lease name -> (the claim it names, first seen
    /// pending).
    seen: HashMap<String, HashMap<String, (String, Instant)>>,
}

impl Stalled {
    /// Notes that the slots `pending` (slot name, what it names: the claim as rendered and the
    /// slot's resourceVersion, which a reuse or a new take changes) of `queue` were seen pending
    /// at `now`, and forgets its other slots; returns the slots of `pending` seen pending,
    /// naming the same thing, since [`PENDING_GRACE`] or longer.
    pub fn observe(
        &mut self,
        queue: &str,
        pending: &[(String, String)],
        now: Instant,
    ) -> Vec<String> {
        let before = self.seen.remove(queue).unwrap_or_default();
        let mut kept = HashMap::new();
        let mut due = Vec::new();
        for (slot, claim) in pending {
            let since = match before.get(slot) {
                Some((named, since)) if named == claim => *since,
                _ => now,
            };
            if now.saturating_duration_since(since) >= PENDING_GRACE {
                due.push(slot.clone());
            }
            kept.insert(slot.clone(), (claim.clone(), since));
        }
        if !kept.is_empty() {
            self.seen.insert(queue.to_string(), kept);
        }
        due
    }

    /// Forgets every queue not in `queues` (deleted LeasedQueues, or queues without limits).
    pub fn retain(&mut self, queues: &std::collections::HashSet<String>) {
        self.seen.retain(|q, _| queues.contains(q));
    }

    /// Forgets everything (this replica stopped leading: its next leadership starts afresh).
    pub fn clear(&mut self) {
        self.seen.clear();
    }
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
    fn a_claim_obeys_the_limits_with_their_values() {
        let mut q = LeasedQueue::new("q", LeasedQueueSpec::default());
        q.metadata.uid = Some("u1".into());
        assert_eq!(obeyed(&q), None);
        q.spec.max_leased_per_key = Some(2);
        assert_eq!(obeyed(&q).as_deref(), Some("u1:maxLeasedPerKey=2"));
        q.spec.max_leased = Some(10);
        assert_eq!(
            obeyed(&q).as_deref(),
            Some("u1:maxLeased=10,maxLeasedPerKey=2")
        );
        assert_eq!(
            obeyed_at_generation(&q),
            None,
            "a copy without a generation"
        );
        q.metadata.generation = Some(7);
        assert_eq!(
            obeyed_at_generation(&q).as_deref(),
            Some("u1/7:maxLeased=10,maxLeasedPerKey=2")
        );
    }

    #[test]
    fn a_slot_is_pending_while_its_job_waits_at_the_version_it_names() {
        let mut queue = LeasedQueue::new("q", LeasedQueueSpec::default());
        queue.spec.max_leased = Some(4);
        let pending_claim = |slot: &Named, job: &LeasedJob| {
            let mut job = job.clone();
            job.spec.queue = "q".into();
            pending_claim(&queue, "q", slot, &job)
        };
        let slot = Named::taken(holder("40", 3), mark_of("3.aaaa"));
        assert!(pending_claim(&slot, &job("40", Phase::Queued, 2)));
        // A slot naming a job of another queue, or of a scope the queue does not limit it in.
        let mut elsewhere = job("40", Phase::Queued, 2);
        elsewhere.spec.queue = "other".into();
        assert!(!super::pending_claim(&queue, "q", &slot, &elsewhere));
        let mut here = job("40", Phase::Queued, 2);
        here.spec.queue = "q".into();
        let key_scope = crate::slots::Scope::Key("a".into()).label();
        assert!(!super::pending_claim(&queue, &key_scope, &slot, &here));
        // The claim landed, the job moved on, or the slot names another attempt or job.
        assert!(!pending_claim(
            &slot,
            &with_token(job("41", Phase::Leased, 3), "3.aaaa")
        ));
        assert!(!pending_claim(&slot, &job("41", Phase::Queued, 2)));
        assert!(!pending_claim(&slot, &job("40", Phase::Queued, 1)));
        let mut other = job("40", Phase::Queued, 2);
        other.metadata.name = Some("k".into());
        assert!(!pending_claim(&slot, &other));
        // A slot adopting a Leased job names its own attempt: held, never pending.
        let leased = with_token(job("40", Phase::Leased, 3), "3.aaaa");
        let adopted = Named::taken(adopting(&leased).unwrap(), mark_of("3.aaaa"));
        assert!(!pending_claim(&adopted, &leased));
    }

    #[test]
    fn a_slot_is_due_to_be_freed_once_seen_pending_for_the_grace_naming_one_claim() {
        let mut stalled = Stalled::default();
        let t0 = Instant::now();
        let pending = |claim: &str| vec![("s-0".to_string(), claim.to_string())];
        assert!(stalled.observe("ns/q", &pending("j@1#1"), t0).is_empty());
        let almost = t0 + PENDING_GRACE - Duration::from_millis(1);
        assert!(stalled
            .observe("ns/q", &pending("j@1#1"), almost)
            .is_empty());
        assert_eq!(
            stalled.observe("ns/q", &pending("j@1#1"), t0 + PENDING_GRACE),
            vec!["s-0".to_string()]
        );
        // Another claim in the same slot starts again; so does one no longer seen pending.
        let later = t0 + 2 * PENDING_GRACE;
        assert!(stalled.observe("ns/q", &pending("k@5#1"), later).is_empty());
        assert!(stalled.observe("ns/q", &[], later).is_empty());
        assert!(stalled
            .observe("ns/q", &pending("k@5#1"), later + PENDING_GRACE)
            .is_empty());
        // Another queue's slots are its own; a queue forgotten starts again.
        assert!(stalled.observe("ns/r", &pending("j@1#1"), t0).is_empty());
        stalled.retain(&["ns/q".to_string()].into());
        assert!(stalled
            .observe("ns/r", &pending("j@1#1"), t0 + PENDING_GRACE)
            .is_empty());
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
