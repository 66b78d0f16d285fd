//! Limits that the API server makes exact: a LeasedQueue's `maxLeased` and `maxLeasedPerKey`
//! ([`crate::queue`]) are kept by **slots**, `coordination.k8s.io/v1` Leases, M of them per
//! scope (the queue, or one concurrency key of it). A claim of a limited job first takes a
//! free slot of each scope it falls in, by a conditional write of the slot, then makes its
//! usual claim write; so at every instant the Leased jobs of a scope are at most its slots.
//! docs/protocol.md, "Limits", has the whole argument; this module holds its rules, pure.
//!
//! **What a slot says.** Its holderIdentity names one claim: `<job>@<resourceVersion>#<attempt>`,
//! the job, the resourceVersion of the copy the claim is guarded by (R0), and the attempt the
//! claim makes. The slot is **busy** while that claim may hold the job or may still be made:
//! - the job is still at R0 (the claim is in flight, or its claimer died before writing it:
//!   the write, guarded by R0, could still succeed), or
//! - the job is Leased at that attempt by one of the slot's claims: its status.token is one the
//!   slot is marked with ([`CLAIMS_ANNOTATION`]: each claim of that copy that took or reused
//!   the slot marks it with a digest of its token before its claim write). A slot without
//!   marks (written by an older leasehold) counts the job Leased at that attempt whoever
//!   claimed it, which only over-counts.
//!
//! Otherwise it is **free**: the job moved past R0 without being Leased at that attempt by a
//! claim the slot marks (the claim failed, or another copy's claim won, or the attempt ended),
//! or the job is gone. A free slot stays free: a resourceVersion never comes back, so no write
//! guarded by R0 can succeed once the job moved past it, an attempt that ended never
//! restarts, and a token is written by one claim only. That is why a copy read at any
//! resourceVersion not older than R0 is enough to judge it ([`state_of`]), and why taking a
//! free slot, conditional on the slot's own resourceVersion, can never make two Leased jobs
//! share one slot.
//!
//! Pure: the sidecar lists the slots, reads the jobs they name, and writes; these functions
//! decide.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::crd::{LeasedJob, Phase};
use crate::queue::LeasedQueue;

/// Label of every slot Lease: the queue's name.
pub const SLOT_OF_LABEL: &str = "leasehold.dev/slot-of";
/// Label of every slot Lease: its scope ([`Scope::label`]).
pub const SLOT_SCOPE_LABEL: &str = "leasehold.dev/slot-scope";
/// Annotation of a slot Lease: the pod that took it last (for people; nothing reads it).
pub const TAKEN_BY_ANNOTATION: &str = "leasehold.dev/taken-by";
/// Annotation of a slot Lease: the claims that may use it, `<holderIdentity> <mark>,<mark>...`
/// ([`Named::annotation`]). Read only while its first word is the slot's holderIdentity, so
/// that a slot taken by a writer that kept an older annotation is read without marks.
pub const CLAIMS_ANNOTATION: &str = "leasehold.dev/slot-claims";
/// The most marks a slot carries: a reuse past them writes the slot without marks (read as
/// counting any claim of its attempt: an over-count, never an under-count).
pub const MAX_MARKS: usize = 16;
/// Prefix of every slot Lease's name.
pub const SLOT_PREFIX: &str = "lhq-";
/// The largest limit a LeasedQueue may set: each unit of a limit is one Lease object, and a
/// claim that finds its scope full has read the jobs of the slots it looked at.
pub const MAX_LIMIT: i32 = 1000;

/// Where a limit applies.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// Every job of the queue (`maxLeased`).
    Queue,
    /// The jobs of one concurrency key (`maxLeasedPerKey`).
    Key(String),
}

impl Scope {
    /// The scope as a label value and a part of slot names: `q`, or `k` and the first 12 hex
    /// digits of the key's SHA-256 (keys may hold any character; 48 bits make two keys of one
    /// queue share slots only by a collision, which would only make both stricter).
    pub fn label(&self) -> String {
        match self {
            Scope::Queue => "q".into(),
            Scope::Key(key) => {
                let digest = Sha256::digest(key.as_bytes());
                let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
                format!("k{hex}")
            }
        }
    }
}

/// The name of slot `index` of the scope labelled `scope` ([`Scope::label`]) in queue
/// `queue`: `lhq-<queue>-<scope>-<index>` (at most 4 + 63 + 1 + 13 + 1 + 10 characters: a
/// valid Lease name).
pub fn slot_name(queue: &str, scope: &str, index: u32) -> String {
    format!("{SLOT_PREFIX}{queue}-{scope}-{index}")
}

/// The index a slot's name ends with, if it is one of `queue`'s slots of the scope labelled
/// `scope` ([`Scope::label`]).
pub fn index_of(name: &str, queue: &str, scope: &str) -> Option<u32> {
    let prefix = format!("{SLOT_PREFIX}{queue}-{scope}-");
    name.strip_prefix(&prefix)?.parse().ok()
}

/// The limit `queue` sets on the scope labelled `scope` ([`Scope::label`]): `maxLeased` for
/// `q`, `maxLeasedPerKey` for a key's; `None` when it sets none.
pub fn limit_of(queue: &LeasedQueue, scope: &str) -> Option<u32> {
    let limit = if scope == "q" {
        queue.spec.max_leased
    } else {
        queue.spec.max_leased_per_key
    };
    limit.and_then(|l| u32::try_from(l.clamp(1, MAX_LIMIT)).ok())
}

/// The limits that apply to a claim of `job` in the queue `queue` describes: the queue's
/// `maxLeased`, and `maxLeasedPerKey` when the job has a concurrency key (a job without one is
/// limited by `maxLeased` only). Empty when none applies: such a claim takes no slot and costs
/// no extra write.
pub fn scopes(queue: &LeasedQueue, job: &LeasedJob) -> Vec<(Scope, u32)> {
    let limit = |l: Option<i32>| l.and_then(|l| u32::try_from(l.clamp(1, MAX_LIMIT)).ok());
    let mut out = Vec::new();
    if let Some(m) = limit(queue.spec.max_leased) {
        out.push((Scope::Queue, m));
    }
    if let (Some(m), Some(key)) = (
        limit(queue.spec.max_leased_per_key),
        job.spec.concurrency_key.as_deref(),
    ) {
        out.push((Scope::Key(key.to_string()), m));
    }
    out
}

/// The claim a slot names (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotHolder {
    /// The job's name.
    pub job: String,
    /// The resourceVersion the claim is guarded by (R0).
    pub resource_version: String,
    /// The attempt the claim makes.
    pub attempt: i32,
}

impl SlotHolder {
    /// The holder a claim of `job` (the copy it is guarded by) puts in its slots; None for a
    /// copy without a name or a resourceVersion, which is never claimed.
    pub fn of_claim(job: &LeasedJob) -> Option<SlotHolder> {
        Some(SlotHolder {
            job: job.metadata.name.clone()?,
            resource_version: job.guarding_version()?.to_string(),
            attempt: job.attempt() + 1,
        })
    }

    /// As a holderIdentity: `<job>@<resourceVersion>#<attempt>`.
    pub fn render(&self) -> String {
        format!("{}@{}#{}", self.job, self.resource_version, self.attempt)
    }

    /// Reads a holderIdentity written by [`SlotHolder::render`]; `None` for anything else
    /// (such a slot names no claim, so it is free).
    pub fn parse(text: &str) -> Option<SlotHolder> {
        let (job, rest) = text.split_once('@')?;
        let (rv, attempt) = rest.split_once('#')?;
        if job.is_empty() || rv.is_empty() {
            return None;
        }
        Some(SlotHolder {
            job: job.to_string(),
            resource_version: rv.to_string(),
            attempt: attempt.parse().ok()?,
        })
    }
}

/// The mark of a claim whose token is `token` in the slots it takes: the first 16 hex digits
/// of the token's SHA-256. Unique to the claim but for a collision, which only over-counts; the
/// token itself stays out of the slot.
pub fn mark_of(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// What a slot Lease names: the claim ([`SlotHolder`], its holderIdentity) and the marks of the
/// claims of that copy that took or reused it (`None`: a slot written without marks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named {
    /// The claim of its holderIdentity.
    pub holder: SlotHolder,
    /// The marks ([`mark_of`]) of the claims that may use it; `None` when not known.
    pub marks: Option<Vec<String>>,
}

impl Named {
    /// Reads a slot from its holderIdentity and its [`CLAIMS_ANNOTATION`]; `None` when the
    /// holderIdentity names no claim (the slot is free). Marks whose annotation names another
    /// holderIdentity, or that are malformed or too many, are not known.
    pub fn read(identity: Option<&str>, claims: Option<&str>) -> Option<Named> {
        let identity = identity?;
        let holder = SlotHolder::parse(identity)?;
        let marks = claims
            .and_then(|text| text.split_once(' '))
            .filter(|(named, _)| *named == identity)
            .map(|(_, list)| list.split(',').map(str::to_string).collect::<Vec<_>>())
            .filter(|marks| {
                !marks.is_empty()
                    && marks.len() <= MAX_MARKS
                    && marks
                        .iter()
                        .all(|m| m.len() == 16 && m.bytes().all(|b| b.is_ascii_hexdigit()))
            });
        Some(Named { holder, marks })
    }

    /// A slot taken by a claim: `holder`, marked with `mark` alone.
    pub fn taken(holder: SlotHolder, mark: String) -> Named {
        Named {
            holder,
            marks: Some(vec![mark]),
        }
    }

    /// This slot reused by one more claim of its copy, marked `mark`: `None` when nothing
    /// needs writing (marked already, or not known: any claim of the attempt counts).
    /// Past [`MAX_MARKS`] the marks become not known.
    pub fn reused_by(&self, mark: &str) -> Option<Named> {
        let marks = self.marks.as_ref()?;
        if marks.iter().any(|m| m == mark) {
            return None;
        }
        let mut more = marks.clone();
        more.push(mark.to_string());
        Some(Named {
            holder: self.holder.clone(),
            marks: (more.len() <= MAX_MARKS).then_some(more),
        })
    }

    /// The [`CLAIMS_ANNOTATION`] value, `None` without marks.
    pub fn annotation(&self) -> Option<String> {
        let marks = self.marks.as_ref()?;
        Some(format!("{} {}", self.holder.render(), marks.join(",")))
    }
}

/// Whether a slot holds a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// It may be taken.
    Free,
    /// Its claim holds the job, or may still be made.
    Busy,
}

/// The state of a slot naming `named`, judged from `job`: a copy of the job it names read not
/// older than `named.holder.resource_version` (`None`: the job does not exist).
pub fn state_of(named: &Named, job: Option<&LeasedJob>) -> SlotState {
    let Some(job) = job else {
        return SlotState::Free;
    };
    let holder = &named.holder;
    let pending = job.metadata.resource_version.as_deref() == Some(&holder.resource_version);
    let marked = match &named.marks {
        Some(marks) => job.token().is_some_and(|t| marks.contains(&mark_of(t))),
        None => true,
    };
    let holds = job.phase() == Phase::Leased && job.attempt() == holder.attempt && marked;
    if pending || holds {
        SlotState::Busy
    } else {
        SlotState::Free
    }
}

/// One slot Lease as the claimer listed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// Its index.
    pub index: u32,
    /// The claim it names, if any.
    pub holder: Option<Named>,
}

/// What a claimer does in one scope, given the scope's slots as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// A slot already naming this very claim (a claimer of the same copy took it, and may have
    /// died before its claim write): the claim uses it, marking it too ([`Named::reused_by`]).
    pub reuse: Option<(u32, Named)>,
    /// Slots at or above the limit (left by a higher limit) naming a claim: each must be
    /// judged free before any slot is taken, so that a lowered limit holds.
    pub above: Vec<(u32, Named)>,
    /// The slots below the limit to try, in order: those naming no claim (empty, or missing:
    /// to be created) first, then those naming one, to be judged. Each group starts at a
    /// place of its own for each job ([`spread_of`]) and wraps around, so that claimers of
    /// different jobs of one scope, racing, try different slots instead of all writing the
    /// lowest free one (benchmark row 2k: 0.52 slot writes per job answered 409 at 32 claimers
    /// when every claimer tried the same order).
    pub candidates: Vec<(u32, Option<Named>)>,
}

/// Where the claim `mine` starts in each group of candidate slots: a hash of its job's name
/// (the first 4 bytes of its SHA-256), so that two claims of one job start at one place (and
/// one of them finds the other's slot to reuse) while claims of different jobs spread.
pub fn spread_of(mine: &SlotHolder) -> usize {
    let digest = Sha256::digest(mine.job.as_bytes());
    let bytes = [digest[0], digest[1], digest[2], digest[3]];
    usize::try_from(u32::from_be_bytes(bytes)).unwrap_or(0)
}

/// The slot of each scope a claim tries first, as the dispatcher suggested with its offer
/// ([`crate::dispatch::Hint::slots`]): one it believes free and suggested to no other offer
/// standing, so that claimers of one scope, racing, write different slots instead of meeting
/// at one (benchmark row 2k). Advice only: the claimer judges the slot as any other, from
/// its own reads, and an index at or above the limit, or a slot that is busy, is passed
/// over; a wrong suggestion costs at most one more read or one refused write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Preferred {
    /// The slot of the queue's scope (`maxLeased`) to try first.
    pub queue: Option<u32>,
    /// The slot of the job's concurrency key's scope (`maxLeasedPerKey`) to try first.
    pub key: Option<u32>,
}

impl Preferred {
    /// No slot preferred: the claimer's own order ([`plan`]).
    pub const NONE: Preferred = Preferred {
        queue: None,
        key: None,
    };

    /// The slot preferred in `scope`, if any.
    pub fn of(&self, scope: &Scope) -> Option<u32> {
        match scope {
            Scope::Queue => self.queue,
            Scope::Key(_) => self.key,
        }
    }
}

/// The slots a claim took under its queue's limits, as its write records them
/// (`status.queueSlot`, `status.keySlot`), and whether it swapped one ([`may_swap`]: the
/// write then records the LeasedQueue's generation with its limits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotsTaken {
    /// The index of the slot of the queue's scope (`maxLeased`), if it took one.
    pub queue: Option<u32>,
    /// The index of the slot of the job's key's scope (`maxLeasedPerKey`), if it took one.
    pub key: Option<u32>,
    /// Whether any of them was swapped.
    pub swapped: bool,
}

/// Where a chain of swaps of one slot began: the LeasedQueue object (its uid) and the
/// `metadata.generation` under which its first take listed the scope (docs/protocol.md,
/// "Limits": swapping one's own slot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// metadata.uid of the LeasedQueue.
    pub queue_uid: String,
    /// Its metadata.generation as the claimer's copy had it.
    pub generation: i64,
}

impl Chain {
    /// The chain a take under `queue` (the claimer's copy) begins; `None` for a copy without a
    /// uid or generation (never one read from the API server).
    pub fn of(queue: &LeasedQueue) -> Option<Chain> {
        Some(Chain {
            queue_uid: queue.metadata.uid.clone()?,
            generation: queue.metadata.generation?,
        })
    }
}

/// The longest a chain of swaps goes on from the list its first take made: past it, the
/// claimer's next claim in the scope takes a slot as usual, listing the scope. Within one
/// generation of the LeasedQueue a slot at or above the limit can still become busy (a claim
/// reusing its own pending slot above a lowered limit, the controller adopting a job claimed
/// without a slot); takes stop at once while one is, and swaps within this.
pub const MAX_CHAIN_AGE: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether a claimer may swap its own free slot `index` of a scope limited to `limit` under
/// `queue` (its copy now), the slot's chain having begun under `chain` `listed_ago` ago
/// (less than [`MAX_CHAIN_AGE`]), the dispatcher's
/// offer suggesting `suggested` for that scope as the claimer's own to swap: the same
/// LeasedQueue object at the same generation (so the same limits, and the same object the
/// chain's first take judged the scope under), an index below the limit, and the very slot
/// the offer suggests swapping (the dispatcher's view holds it for no other offer, and saw
/// nobody else take it; a claimer choosing on its own never swaps).
/// docs/protocol.md, "Limits": swapping one's own slot.
pub fn may_swap(
    (chain, listed_ago): (&Chain, std::time::Duration),
    index: u32,
    limit: u32,
    queue: &LeasedQueue,
    suggested: Option<u32>,
) -> bool {
    Chain::of(queue).as_ref() == Some(chain)
        && listed_ago < MAX_CHAIN_AGE
        && index < limit
        && suggested == Some(index)
}

/// The plan of a claim whose slots name `mine`, in a scope limited to `limit` whose slots are
/// `listed` (any order; missing indices are slots never made). `prefer`: a slot to try before
/// the others ([`Preferred`]); ignored at or above the limit.
pub fn plan(mine: &SlotHolder, limit: u32, listed: &[Listed], prefer: Option<u32>) -> Plan {
    let reuse = listed.iter().find_map(|s| {
        let named = s.holder.as_ref().filter(|n| n.holder == *mine)?;
        Some((s.index, named.clone()))
    });
    let mut above: Vec<(u32, Named)> = listed
        .iter()
        .filter(|s| s.index >= limit)
        .filter_map(|s| Some((s.index, s.holder.clone()?)))
        .collect();
    above.sort_by_key(|(i, _)| *i);
    let by_index: BTreeMap<u32, &Option<Named>> =
        listed.iter().map(|s| (s.index, &s.holder)).collect();
    let mut empty = Vec::new();
    let mut named = Vec::new();
    for index in 0..limit {
        match by_index.get(&index) {
            None | Some(None) => empty.push((index, None)),
            Some(Some(h)) => named.push((index, Some(h.clone()))),
        }
    }
    let start = spread_of(mine);
    for group in [&mut empty, &mut named] {
        if !group.is_empty() {
            let by = start % group.len();
            group.rotate_left(by);
        }
    }
    empty.extend(named);
    if let Some(at) = prefer.and_then(|i| empty.iter().position(|(index, _)| *index == i)) {
        let preferred = empty.remove(at);
        empty.insert(0, preferred);
    }
    Plan {
        reuse,
        above,
        candidates: empty,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::crd::{LeasedJobSpec, LeasedJobStatus};
    use crate::queue::LeasedQueueSpec;

    pub(crate) fn job(rv: &str, phase: Phase, attempt: i32) -> LeasedJob {
        let mut j = LeasedJob::new("j", LeasedJobSpec::default());
        j.metadata.resource_version = Some(rv.into());
        j.status = Some(LeasedJobStatus {
            phase: Some(phase),
            attempt,
            ..LeasedJobStatus::default()
        });
        j
    }

    pub(crate) fn holder(rv: &str, attempt: i32) -> SlotHolder {
        SlotHolder {
            job: "j".into(),
            resource_version: rv.into(),
            attempt,
        }
    }

    /// A slot naming `holder(rv, attempt)` with no marks.
    fn unmarked(rv: &str, attempt: i32) -> Named {
        Named {
            holder: holder(rv, attempt),
            marks: None,
        }
    }

    pub(crate) fn with_token(mut j: LeasedJob, token: &str) -> LeasedJob {
        j.status.as_mut().unwrap().token = Some(token.into());
        j
    }

    #[test]
    fn a_holder_round_trips_and_garbage_names_no_claim() {
        let h = holder("123", 4);
        assert_eq!(h.render(), "j@123#4");
        assert_eq!(SlotHolder::parse(&h.render()), Some(h));
        for bad in ["", "j", "j@", "@1#1", "j@1", "j@1#x", "j@#1", "1.abcdef"] {
            assert_eq!(SlotHolder::parse(bad), None, "{bad}");
        }
        let claim = job("77", Phase::Queued, 2);
        assert_eq!(
            SlotHolder::of_claim(&claim),
            Some(SlotHolder {
                job: "j".into(),
                resource_version: "77".into(),
                attempt: 3,
            })
        );
    }

    #[test]
    fn marks_are_read_only_for_the_holder_they_name_and_reuse_adds_one() {
        let h = holder("10", 2);
        let id = h.render();
        let m1 = mark_of("2.aaaa");
        let m2 = mark_of("2.bbbb");
        assert_eq!(m1.len(), 16);
        assert_ne!(m1, m2);
        let taken = Named::taken(h.clone(), m1.clone());
        let text = taken.annotation().unwrap();
        assert_eq!(text, format!("j@10#2 {m1}"));
        assert_eq!(Named::read(Some(&id), Some(&text)), Some(taken.clone()));
        // Left by an earlier holder, malformed, or absent: not known.
        for other in [
            format!("j@9#2 {m1}"),
            "j@10#2 xyz".to_string(),
            "j@10#2".to_string(),
            format!("j@10#2 {m1},"),
        ] {
            assert_eq!(Named::read(Some(&id), Some(&other)).unwrap().marks, None);
        }
        assert_eq!(Named::read(Some(&id), None), Some(unmarked("10", 2)));
        assert_eq!(Named::read(None, Some(&text)), None);
        assert_eq!(Named::read(Some("garbage"), Some(&text)), None);
        // A reuse adds its mark; one already there, or no marks, needs no write.
        let reused = taken.reused_by(&m2).unwrap();
        assert_eq!(reused.marks, Some(vec![m1.clone(), m2.clone()]));
        assert_eq!(
            Named::read(Some(&id), reused.annotation().as_deref()),
            Some(reused.clone())
        );
        assert_eq!(reused.reused_by(&m1), None);
        assert_eq!(unmarked("10", 2).reused_by(&m1), None);
        // Past the bound the marks are dropped: any claim of the attempt counts.
        let mut full = taken;
        for i in 1..MAX_MARKS {
            full = full.reused_by(&mark_of(&format!("2.{i}"))).unwrap();
        }
        assert_eq!(full.marks.as_ref().map(Vec::len), Some(MAX_MARKS));
        let over = full.reused_by(&mark_of("2.last")).unwrap();
        assert_eq!(over.marks, None);
        assert_eq!(over.annotation(), None);
    }

    #[test]
    fn a_marked_slot_counts_only_the_claims_it_marks() {
        let named = Named::taken(holder("10", 2), mark_of("2.mine"));
        let cases = [
            // Pending: the claim could still be made.
            (
                with_token(job("10", Phase::Queued, 1), "1.old"),
                SlotState::Busy,
            ),
            // Made by this slot's claim.
            (
                with_token(job("11", Phase::Leased, 2), "2.mine"),
                SlotState::Busy,
            ),
            // Another copy's claim won attempt 2: this slot's claim can never be made.
            (
                with_token(job("11", Phase::Leased, 2), "2.other"),
                SlotState::Free,
            ),
        ];
        for (copy, want) in cases {
            assert_eq!(state_of(&named, Some(&copy)), want, "{copy:?}");
        }
        // Unmarked (an older writer): the other copy's claim is counted.
        let copy = with_token(job("11", Phase::Leased, 2), "2.other");
        assert_eq!(state_of(&unmarked("10", 2), Some(&copy)), SlotState::Busy);
    }

    #[test]
    fn a_slot_is_busy_while_its_claim_may_be_made_or_holds_the_job() {
        let h = unmarked("10", 2);
        let cases = [
            // The claim not written yet (or its claimer died): the write could still succeed.
            (Some(job("10", Phase::Queued, 1)), SlotState::Busy),
            // The claim made: Leased at its attempt.
            (Some(job("11", Phase::Leased, 2)), SlotState::Busy),
            // Leased at that attempt by a claim from another copy: counted here too.
            (Some(job("15", Phase::Leased, 2)), SlotState::Busy),
            // The claim lost (another took the job at attempt 2 from... no: at attempt 3) or
            // the attempt ended: free for good.
            (Some(job("12", Phase::Leased, 3)), SlotState::Free),
            (Some(job("12", Phase::Succeeded, 2)), SlotState::Free),
            (Some(job("12", Phase::Queued, 2)), SlotState::Free),
            (Some(job("12", Phase::Queued, 1)), SlotState::Free),
            // Gone.
            (None, SlotState::Free),
        ];
        for (copy, want) in cases {
            assert_eq!(state_of(&h, copy.as_ref()), want, "{copy:?}");
        }
    }

    #[test]
    fn scopes_follow_the_limits_and_the_key() {
        let queue = |max: Option<i32>, per_key: Option<i32>| {
            LeasedQueue::new(
                "q",
                LeasedQueueSpec {
                    max_leased: max,
                    max_leased_per_key: per_key,
                    ..LeasedQueueSpec::default()
                },
            )
        };
        let mut keyed = job("1", Phase::Queued, 0);
        keyed.spec.concurrency_key = Some("acme".into());
        let plain = job("1", Phase::Queued, 0);
        assert_eq!(scopes(&queue(None, None), &keyed), vec![]);
        assert_eq!(
            scopes(&queue(Some(5), None), &plain),
            vec![(Scope::Queue, 5)]
        );
        assert_eq!(scopes(&queue(None, Some(2)), &plain), vec![]);
        assert_eq!(
            scopes(&queue(Some(5), Some(2)), &keyed),
            vec![(Scope::Queue, 5), (Scope::Key("acme".into()), 2)]
        );
    }

    #[test]
    fn slot_names_are_valid_and_read_back() {
        let scope = Scope::Key("tenant/Ünïcode key".into());
        let name = slot_name(&"q".repeat(63), &scope.label(), 999);
        assert!(name.len() <= 253 && name.starts_with("lhq-"), "{name}");
        assert!(name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
        assert_eq!(index_of(&name, &"q".repeat(63), &scope.label()), Some(999));
        assert_eq!(index_of(&name, &"q".repeat(63), "q"), None);
        assert_eq!(
            slot_name("media", &Scope::Queue.label(), 0),
            "lhq-media-q-0"
        );
        assert_ne!(
            Scope::Key("a".into()).label(),
            Scope::Key("b".into()).label()
        );
    }

    #[test]
    fn a_plan_reuses_its_own_slot_judges_those_above_the_limit_and_tries_empty_ones_first() {
        let mine = SlotHolder {
            job: "mine".into(),
            resource_version: "5".into(),
            attempt: 1,
        };
        let other = |rv: &str| Some(unmarked(rv, 1));
        let listed = vec![
            Listed {
                index: 1,
                holder: other("1"),
            },
            Listed {
                index: 0,
                holder: other("2"),
            },
            Listed {
                index: 3,
                holder: None,
            },
            Listed {
                index: 4,
                holder: other("3"),
            },
            Listed {
                index: 6,
                holder: None,
            },
        ];
        let p = plan(&mine, 4, &listed, None);
        assert_eq!(p.reuse, None);
        assert_eq!(p.above, vec![(4, unmarked("3", 1))]);
        // Empty ones first, then named ones, each group rotated to the job's own start.
        let rotated = |group: Vec<(u32, Option<Named>)>| {
            let by = spread_of(&mine) % group.len();
            let mut g = group;
            g.rotate_left(by);
            g
        };
        let mut wanted = rotated(vec![(2, None), (3, None)]);
        wanted.extend(rotated(vec![(0, other("2")), (1, other("1"))]));
        assert_eq!(p.candidates, wanted);
        let mut with_mine = listed.clone();
        let mine_taken = Named::taken(mine.clone(), mark_of("1.first"));
        with_mine.push(Listed {
            index: 9,
            holder: Some(mine_taken.clone()),
        });
        assert_eq!(
            plan(&mine, 4, &with_mine, None).reuse,
            Some((9, mine_taken))
        );
        // A lowered limit: everything at or above it must be judged first.
        let p = plan(&mine, 1, &listed, None);
        assert_eq!(p.above, vec![(1, unmarked("1", 1)), (4, unmarked("3", 1))]);
        assert_eq!(p.candidates, vec![(0, other("2"))]);
    }

    #[test]
    fn a_preferred_slot_is_tried_first_and_one_past_the_limit_is_ignored() {
        let mine = holder("5", 1);
        let other = |rv: &str| Some(unmarked(rv, 1));
        let listed = vec![
            Listed {
                index: 0,
                holder: other("2"),
            },
            Listed {
                index: 1,
                holder: None,
            },
            Listed {
                index: 2,
                holder: other("3"),
            },
        ];
        let own = plan(&mine, 4, &listed, None).candidates;
        for prefer in [0, 1, 2, 3] {
            let p = plan(&mine, 4, &listed, Some(prefer)).candidates;
            assert_eq!(p[0].0, prefer, "{p:?}");
            // The others keep their own order, each tried once.
            let rest: Vec<_> = own.iter().filter(|(i, _)| *i != prefer).cloned().collect();
            assert_eq!(p[1..], rest[..]);
        }
        // At or above the limit, or with the slot above it: the claimer's own order.
        assert_eq!(plan(&mine, 4, &listed, Some(4)).candidates, own);
        assert_eq!(
            plan(&mine, 2, &listed, Some(2)).candidates,
            plan(&mine, 2, &listed, None).candidates
        );
        // A suggestion changes only the order of the candidates: the slot naming this very
        // claim is still reused, and the slots above a lowered limit still judged first.
        let mut with_mine = listed.clone();
        with_mine.push(Listed {
            index: 1,
            holder: Some(Named::taken(mine.clone(), mark_of("1.first"))),
        });
        for (limit, prefer) in [(4, Some(0)), (1, Some(0)), (2, Some(1))] {
            let with = plan(&mine, limit, &with_mine, prefer);
            let without = plan(&mine, limit, &with_mine, None);
            assert_eq!((&with.reuse, &with.above), (&without.reuse, &without.above));
            assert!(with.reuse.is_some());
        }
        assert_eq!(
            plan(&mine, 1, &listed, Some(0)).above,
            plan(&mine, 1, &listed, None).above
        );
        assert!(!plan(&mine, 1, &listed, Some(0)).above.is_empty());
        assert_eq!(Preferred::NONE.of(&Scope::Queue), None);
        let p = Preferred {
            queue: Some(1),
            key: Some(3),
        };
        assert_eq!(p.of(&Scope::Queue), Some(1));
        assert_eq!(p.of(&Scope::Key("a".into())), Some(3));
    }

    #[test]
    fn claims_of_different_jobs_start_at_different_free_slots_and_of_one_job_at_one() {
        let listed: Vec<Listed> = Vec::new();
        let first = |job: &str, rv: &str| {
            let mine = SlotHolder {
                job: job.into(),
                resource_version: rv.into(),
                attempt: 1,
            };
            plan(&mine, 8, &listed, None).candidates[0].0
        };
        let starts: std::collections::BTreeSet<u32> =
            (0..32).map(|i| first(&format!("job-{i}"), "1")).collect();
        assert!(
            starts.len() >= 6,
            "32 jobs' claims start at only {starts:?} of 8 free slots"
        );
        assert_eq!(first("job-7", "1"), first("job-7", "99"));
        // Every slot is still tried, once.
        let mine = SlotHolder {
            job: "job-3".into(),
            resource_version: "1".into(),
            attempt: 1,
        };
        let mut all: Vec<u32> = plan(&mine, 8, &listed, None)
            .candidates
            .iter()
            .map(|(i, _)| *i)
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn a_scope_s_limit_is_read_from_its_label() {
        let mut q = LeasedQueue::new("q", LeasedQueueSpec::default());
        assert_eq!(limit_of(&q, "q"), None);
        q.spec.max_leased = Some(3);
        q.spec.max_leased_per_key = Some(5000);
        assert_eq!(limit_of(&q, "q"), Some(3));
        assert_eq!(
            limit_of(&q, &Scope::Key("a".into()).label()),
            Some(MAX_LIMIT as u32)
        );
    }

    #[test]
    fn a_slot_is_swapped_only_under_its_chain_s_queue_and_generation_and_as_suggested() {
        let mut q = LeasedQueue::new("q", LeasedQueueSpec::default());
        q.spec.max_leased_per_key = Some(2);
        assert_eq!(Chain::of(&q), None, "a copy without uid and generation");
        q.metadata.uid = Some("u1".into());
        q.metadata.generation = Some(3);
        let chain = Chain::of(&q).unwrap();
        let fresh = (&chain, std::time::Duration::from_secs(1));
        assert!(may_swap(fresh, 1, 2, &q, Some(1)));
        assert!(!may_swap(fresh, 1, 2, &q, None), "choosing on its own");
        assert!(
            !may_swap(fresh, 1, 2, &q, Some(0)),
            "another slot suggested"
        );
        assert!(!may_swap(fresh, 2, 2, &q, Some(2)), "at the limit");
        let old = (&chain, MAX_CHAIN_AGE);
        assert!(!may_swap(old, 1, 2, &q, Some(1)), "listed too long ago");
        let mut later = q.clone();
        later.metadata.generation = Some(4);
        assert!(
            !may_swap(fresh, 1, 2, &later, Some(1)),
            "another generation"
        );
        let mut other = q.clone();
        other.metadata.uid = Some("u2".into());
        assert!(!may_swap(fresh, 1, 2, &other, Some(1)), "another object");
    }
}
