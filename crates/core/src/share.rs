//! How the claimers of one queue share it without talking to each other: which job a claimer
//! tries, given the jobs and the other claimers it sees in its watch.
//!
//! Each claimer sees the same candidates (the oldest claimable jobs, [`crate::claim_index`])
//! and the same claimers (the holders of recent claims, [`crate::claim::recent_claimers`]),
//! give or take what is still on its way through the watches. From those alone every claimer
//! computes the same answer to "whose job is this?":
//! - every job has an **owner**, the claimer ranked first for it by rendezvous hashing
//!   ([`rendezvous_rank`]; Thaler and Ravishankar, "Using name-based mappings to increase hit
//!   rates", 1998): no two claimers that agree on who is claiming ever think the same job theirs;
//! - an owner that is **active** (a claim or an end of attempt of its was seen within the last
//!   [`ACTIVE_MS`]) takes its own jobs oldest first, and its first [`RESERVED_PER_CLAIMER`] are
//!   left to it: nobody else tries them, however slow the watches are;
//! - an active owner's other jobs stay its own too, but for its [`STEALABLE_PER_OWNER`]
//!   newest; those, and every job of an owner that is not active, are **open**: the claimers
//!   take turns at them on the wall clock
//!   ([`rendezvous_turn`]), one at a time. A claimer with no job of its own steals one of
//!   the [`STEALABLE_PER_OWNER`] newest jobs of the owner with the most, the far end from
//!   where that owner takes its own (work stealing, as in Blumofe and Leiserson's scheduler),
//!   so the owner and the thief meet only when the owner has almost nothing left, and an
//!   owner that has that little left reads its job afresh first ([`Choice::Contested`]). A
//!   turn is answered as
//!   [`Choice::Turn`], which the worker reads afresh before its claim write: the watch may not
//!   show yet what the claimer whose turn came before did;
//! - an owner busy with a long job, or gone, stops being active after [`ACTIVE_MS`], and its
//!   jobs open to the others' turns.
//!
//! Everything here is a plain function of names, ranks and times (milliseconds since the Unix
//! epoch): the worker library (`leasehold-worker`) feeds it from the watch cache and acts on the answer.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// Where `me` stands among `claimers` for `job` (0 = first), by rendezvous hashing (Thaler and
/// Ravishankar's highest random weight): every claimer ranks the same claimers the same way for
/// a given job, without talking to the others, and each job puts a different claimer first.
/// Rank 0 is the job's owner ([`choose`]); the ranks order the turns at an open job
/// ([`rendezvous_turn`]).
pub fn rendezvous_rank(job: &str, me: &str, claimers: &HashSet<&str>) -> usize {
    let job = name_hash(job);
    let mine = rendezvous_weight(job, Named::new(me));
    claimers
        .iter()
        .filter(|c| rendezvous_weight(job, Named::new(c)) > mine)
        .count()
}

/// True when `me` ranks first among `claimers` for `job` ([`rendezvous_rank`] 0). Stops at
/// the first claimer that outranks `me`: about two weights for a job that is not `me`'s, where
/// the rank costs one per claimer.
///
/// An active claimer takes the oldest job it ranks first for ([`choose`]), so that claimers who
/// agree on who is claiming never pick the same job; they disagree only while a claimer's first
/// claims are reaching the others' watches.
pub fn rendezvous_first(job: &str, me: &str, claimers: &HashSet<&str>) -> bool {
    let claimers: Vec<Named> = claimers.iter().map(|c| Named::new(c)).collect();
    first_for(name_hash(job), Named::new(me), &claimers)
}

/// [`rendezvous_first`] over names already hashed.
fn first_for(job: u64, me: Named, claimers: &[Named]) -> bool {
    let mine = rendezvous_weight(job, me);
    claimers.iter().all(|&c| rendezvous_weight(job, c) <= mine)
}

/// A claimer's name with its [`name_hash`], computed once per [`choose`] rather than once per
/// job and claimer (at 32 claimers a window holds 1,024 jobs: 32,768 weights for a claimer
/// with no job of its own).
#[derive(Clone, Copy)]
struct Named<'a> {
    hash: u64,
    name: &'a str,
}

impl<'a> Named<'a> {
    fn new(name: &'a str) -> Self {
        Named {
            hash: name_hash(name),
            name,
        }
    }
}

/// The 64-bit hash of a job's or claimer's name that ranks and turns are computed from:
/// FNV-1a (Fowler, Noll and Vo) over its UTF-8 bytes, finished with `mix`.
///
/// Fixed here, not `std`'s `DefaultHasher`, whose algorithm may change between Rust releases:
/// sidecars built apart (a rolling upgrade) must still agree on every job's owner and turns.
pub fn name_hash(name: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let fnv = name
        .bytes()
        .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME));
    mix(fnv)
}

/// splitmix64's finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014): a bijection of 64-bit values in which every input bit moves
/// about half the output bits.
fn mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The highest-random-weight score of `claimer` for `job` (both [`name_hash`]ed): the mix of
/// the two, the claimer's name breaking the (unlikely) ties so that the order is total.
fn rendezvous_weight<'a>(job: u64, claimer: Named<'a>) -> (u64, &'a str) {
    (mix(job ^ claimer.hash), claimer.name)
}

/// Length of one turn at a job ([`rendezvous_turn`]), in milliseconds.
pub const RENDEZVOUS_SLOT_MS: u64 = 400;

/// The least and the most of a turn a claimer leaves unused at its end
/// ([`rendezvous_guard_ms`]), in milliseconds.
pub const RENDEZVOUS_GUARD_MS: (u64, u64) = (40, RENDEZVOUS_SLOT_MS * 3 / 4);

/// How much of its turn a claimer leaves unused at its end, in milliseconds, given how long
/// its claim writes have been taking (`claim_write_ms`, a moving average): three times that
/// plus 20 ms, within [`RENDEZVOUS_GUARD_MS`] (the watch event that shows the claim to the
/// others comes after the write's answer, and a loaded API server's slow writes run well past
/// its average). A try started later could still be on its way, or
/// its watch event not yet delivered, when the next claimer's turn begins, and that claimer's
/// write would meet it (409). A busy API server (100 ms writes) thus closes most of each
/// turn; an idle one (10 ms) little.
pub fn rendezvous_guard_ms(claim_write_ms: u64) -> u64 {
    let (least, most) = RENDEZVOUS_GUARD_MS;
    claim_write_ms
        .saturating_mul(3)
        .saturating_add(20)
        .clamp(least, most)
}

/// What [`rendezvous_turn`] says about one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// This claimer's turn: it may try the job now; `left` of the turn remains.
    Now {
        /// Time left in the turn.
        left: std::time::Duration,
    },
    /// Another claimer's turn; this claimer's next one starts after this long.
    In(std::time::Duration),
}

/// Whose turn it is at `job` at wall-clock time `now_ms` (milliseconds since the Unix epoch),
/// for the claimer ranked `rank` ([`rendezvous_rank`]) among `claimers`, which leaves the last
/// `guard_ms` of its turns unused ([`rendezvous_guard_ms`]).
///
/// Turns are slots of [`RENDEZVOUS_SLOT_MS`] on the wall clock, shifted for each job by a
/// phase taken from its name; slot m of a job belongs to the claimer ranked m mod `claimers`
/// for it. Every claimer computes the same owner from the same clock, so at any instant
/// exactly one claimer may try a job, and a claimer that comes back late from its previous job
/// does not race the one whose turn it is now. A claimer starts a try only while more than
/// `guard_ms` of its turn is left, so that the try has landed and been seen when the turn passes
/// on; the guard also absorbs clock skew between nodes (NTP keeps it to milliseconds). The
/// phases keep the jobs' turns from all closing at the same instant, which would leave every
/// claimer waiting at once.
///
/// Turns are counted from the clock, not from when a job appeared: claimers see a job appear
/// at different moments (a sidecar started later lists it seconds after the others watched it
/// arrive), and turns counted from those moments would overlap.
pub fn rendezvous_turn(
    job: &str,
    rank: usize,
    claimers: usize,
    now_ms: u64,
    guard_ms: u64,
) -> Turn {
    use std::time::Duration;
    let slot = RENDEZVOUS_SLOT_MS;
    let claimers = claimers.max(1) as u64;
    let rank = rank as u64 % claimers;
    let phase = name_hash(job) % slot;
    let t = now_ms.saturating_add(phase);
    let (m, into) = (t / slot, t % slot);
    if m % claimers == rank && slot - into > guard_ms.min(slot - 1) {
        return Turn::Now {
            left: Duration::from_millis(slot - into),
        };
    }
    let next = m + 1 + (rank + claimers - (m + 1) % claimers) % claimers;
    Turn::In(Duration::from_millis(next * slot - t))
}

/// How long a claimer counts as active after the last claim or end of attempt of its seen in
/// the watch, in milliseconds. Claimers of quick jobs come back within a few hundred
/// milliseconds (benchmark row 2: about 200 ms a job at 32 claimers on an idle machine, 800 ms
/// on a loaded one); one that has been silent for longer is busy with a long job or gone, and
/// its jobs open to the others' turns, so a job whose owner is busy waits this long at most
/// before the turns begin.
pub const ACTIVE_MS: u64 = 2_000;

/// How many of an active owner's jobs (its oldest) nobody else tries. The others' watches
/// trail the owner's claims (by 200 to 400 ms on a loaded API server, benchmark row 2), so in
/// their eyes the owner's next job may be its second or third already; a thief that took the
/// owner's third job met the owner's claim of it (409) on a loaded machine. With four, the
/// owner reaches a stolen job only four claims later, long after the theft is in its watch.
pub const RESERVED_PER_CLAIMER: usize = 4;

/// How many of an active owner's jobs are open to thieves at once: its newest, beyond the
/// [`RESERVED_PER_CLAIMER`]. A thief's watch trails the owner's claims, so the places it counts
/// are too far back by the jobs the owner claimed meanwhile: a theft from just behind the
/// reserve met the owner's own claim of the same job 240 ms later (benchmark row 2 at 32
/// claimers, while 27 other jobs of the queue were claimed). The newest jobs stay the newest
/// however stale the watch is, and the next ones open as they go.
pub const STEALABLE_PER_OWNER: usize = 2;

/// An active owner that sees this many jobs of its own or fewer reads each afresh before its
/// claim write ([`Choice::Contested`]): a thief's watch counts the owner's jobs from a view
/// that trails the owner's claims, so when the owner is down to its last few, the newest
/// that a thief took may be the oldest the owner sees.
pub const READ_OWN_AT_MOST: usize = 3;

/// What [`choose`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Try the candidate at this index: this claimer's own, reserved for it.
    Own(usize),
    /// Try the candidate at this index, this claimer's own, but read it afresh first: the
    /// owner has so few jobs left that thieves may have taken this one in their turns, and
    /// its watch may not show that yet (benchmark row 2 at 32 claimers: an owner met a theft
    /// 150 ms old on its last jobs).
    Contested(usize),
    /// Try the candidate at this index, in this claimer's turn at it: another's job (stolen),
    /// or one whose owner is not active. The claimer's watch may not show the claim of the
    /// claimer whose turn came before (a loaded API server's watch events trailed its writes
    /// by over a second in benchmark row 2), so the job is best read afresh before the try.
    Turn(usize),
    /// Nothing to try now; look again after this long (a turn comes, or an owner stops being
    /// active), or sooner if the watch brings a change.
    Defer(Duration),
    /// Nothing to try, and nothing will open by itself: wait for a change.
    Nothing,
}

/// Which of `candidates` (the oldest claimable jobs, oldest first) the claimer `me` tries at
/// `now_ms`, sharing them with `claimers` (the claimers seen lately, `me` among them), where
/// `active_until_ms` says until when each claimer counts as active ([`ACTIVE_MS`] after its
/// last claim or end seen; `None` if never seen) and `guard_ms` is the unused end of each turn
/// ([`rendezvous_guard_ms`]). The rules are the module's.
///
/// Costs one name hash per candidate and per claimer, and about two weights (a multiply-xor
/// mix each) per candidate for an active claimer with jobs of its own, one per candidate and
/// claimer otherwise.
pub fn choose(
    candidates: &[&str],
    me: &str,
    claimers: &HashSet<&str>,
    active_until_ms: impl Fn(&str) -> Option<u64>,
    now_ms: u64,
    guard_ms: u64,
) -> Choice {
    let active = |c: &str| active_until_ms(c).is_some_and(|t| t > now_ms);
    let me = Named::new(me);
    let others: Vec<Named> = claimers.iter().map(|c| Named::new(c)).collect();
    if active(me.name) {
        let mut mine = candidates
            .iter()
            .enumerate()
            .filter(|(_, job)| first_for(name_hash(job), me, &others))
            .map(|(i, _)| i);
        if let Some(i) = mine.next() {
            // With few jobs left, the thieves' turns reach this one soon: read it first.
            let few = mine.take(READ_OWN_AT_MOST).count() < READ_OWN_AT_MOST;
            return if few {
                Choice::Contested(i)
            } else {
                Choice::Own(i)
            };
        }
    }
    // No job of its own to take: find each candidate's owner, its place among that owner's
    // jobs, and this claimer's rank for it.
    struct Seat<'a> {
        owner: &'a str,
        place: usize,
        rank: usize,
    }
    let mut owned: HashMap<&str, usize> = HashMap::new();
    let seats: Vec<Seat> = candidates
        .iter()
        .map(|job| {
            let job = name_hash(job);
            let mine = rendezvous_weight(job, me);
            let mut owner = mine;
            let mut rank = 0;
            for &c in &others {
                let w = rendezvous_weight(job, c);
                if w > mine {
                    rank += 1;
                }
                if w > owner {
                    owner = w;
                }
            }
            let count = owned.entry(owner.1).or_insert(0);
            *count += 1;
            Seat {
                owner: owner.1,
                place: *count - 1,
                rank,
            }
        })
        .collect();
    // The soonest a reserved job opens, or this claimer's turn at an open one comes.
    let mut next: Option<Duration> = None;
    let mut open: Vec<usize> = Vec::new();
    for (i, seat) in seats.iter().enumerate() {
        let count = owned[seat.owner];
        let kept = seat.place < RESERVED_PER_CLAIMER || seat.place + STEALABLE_PER_OWNER < count;
        let reserved_until = kept
            .then(|| active_until_ms(seat.owner))
            .flatten()
            .filter(|t| *t > now_ms);
        match reserved_until {
            Some(until) => next = soonest(next, Duration::from_millis(until - now_ms)),
            None => open.push(i),
        }
    }
    // Steal from the owner with the most jobs first: an active owner's newest (the far end
    // from where it takes its own), an inactive owner's oldest (nobody takes its front).
    open.sort_by_key(|&i| {
        let seat = &seats[i];
        let place = i64::try_from(seat.place).unwrap_or(i64::MAX);
        let order = if active(seat.owner) { -place } else { place };
        (std::cmp::Reverse(owned[seat.owner]), order, i)
    });
    for i in open {
        match rendezvous_turn(
            candidates[i],
            seats[i].rank,
            claimers.len(),
            now_ms,
            guard_ms,
        ) {
            Turn::Now { .. } => return Choice::Turn(i),
            Turn::In(wait) => next = soonest(next, wait),
        }
    }
    next.map_or(Choice::Nothing, Choice::Defer)
}

fn soonest(next: Option<Duration>, wait: Duration) -> Option<Duration> {
    Some(next.map_or(wait, |n| n.min(wait)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_hash_to_published_values_whatever_the_build() {
        // Published test vectors: FNV-1a 64 of "" and "a", and splitmix64's first output from
        // seed 0 (its state after one step is the golden gamma 0x9e3779b97f4a7c15).
        assert_eq!(name_hash(""), mix(0xcbf2_9ce4_8422_2325));
        assert_eq!(name_hash("a"), mix(0xaf63_dc4c_8601_ec8c));
        assert_eq!(mix(0x9e37_79b9_7f4a_7c15), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn rendezvous_puts_exactly_one_claimer_first_for_each_job_and_spreads_them() {
        let claimers: HashSet<&str> = (0..8)
            .map(|i| &*Box::leak(format!("pod-{i}").into_boxed_str()))
            .collect();
        let mut firsts = std::collections::HashMap::new();
        for n in 0..400 {
            let job = format!("job-{n}");
            let mut ranks: Vec<usize> = claimers
                .iter()
                .map(|c| rendezvous_rank(&job, c, &claimers))
                .collect();
            ranks.sort_unstable();
            assert_eq!(ranks, (0..8).collect::<Vec<_>>(), "{job}: a permutation");
            let first = claimers
                .iter()
                .find(|c| rendezvous_rank(&job, c, &claimers) == 0)
                .unwrap();
            *firsts.entry(*first).or_insert(0) += 1;
            for c in &claimers {
                assert_eq!(
                    rendezvous_first(&job, c, &claimers),
                    c == first,
                    "{job}: only {first} is first"
                );
            }
        }
        // Each of the 8 claimers is first for some jobs (50 each on average).
        assert_eq!(firsts.len(), 8);
        assert!(firsts.values().all(|n| (20..=90).contains(n)), "{firsts:?}");
    }

    #[test]
    fn rendezvous_turns_are_exclusive_go_round_and_say_when_they_come() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        let base = 1_796_000_000_000u64;
        for (claimers, guard) in [(1usize, 40), (2, 40), (3, 300), (8, 100), (32, 250)] {
            for n in 0..12 {
                let job = format!("job-{n}");
                let mut had_turn = vec![false; claimers];
                // Every 11 ms over three rounds of turns.
                let horizon = (claimers as u64 + 2) * RENDEZVOUS_SLOT_MS * 3;
                for now in (base..base + horizon).step_by(11) {
                    let turns: Vec<Turn> = (0..claimers)
                        .map(|r| rendezvous_turn(&job, r, claimers, now, guard))
                        .collect();
                    let open = turns
                        .iter()
                        .filter(|t| matches!(t, Turn::Now { .. }))
                        .count();
                    assert!(open <= 1, "{job} at {now}: {open} turns at once");
                    for (r, turn) in turns.iter().enumerate() {
                        match *turn {
                            Turn::Now { left } => {
                                assert!(left > ms(guard), "{job} {now} {left:?}");
                                assert!(left <= ms(RENDEZVOUS_SLOT_MS));
                                had_turn[r] = true;
                            }
                            Turn::In(wait) => {
                                assert!(wait > Duration::ZERO);
                                // The turn announced does come, and not before.
                                let at = now + u64::try_from(wait.as_millis()).unwrap();
                                assert!(matches!(
                                    rendezvous_turn(&job, r, claimers, at, guard),
                                    Turn::Now { .. }
                                ));
                                assert!(matches!(
                                    rendezvous_turn(&job, r, claimers, at - 1, guard),
                                    Turn::In(_)
                                ));
                                // Every claimer's turn comes within a round.
                                let round = claimers as u64 * RENDEZVOUS_SLOT_MS;
                                assert!(wait <= ms(round), "{job} {r}/{claimers}: {wait:?}");
                            }
                        }
                    }
                }
                assert!(had_turn.iter().all(|t| *t), "{job}: {had_turn:?}");
            }
        }
        // The jobs' turns do not all change hands at the same instant.
        let edges: std::collections::HashSet<u64> = (0..20)
            .map(
                |n| match rendezvous_turn(&format!("job-{n}"), 0, 1, base, 40) {
                    Turn::Now { left } => u64::try_from(left.as_millis()).unwrap(),
                    Turn::In(wait) => u64::try_from(wait.as_millis()).unwrap(),
                },
            )
            .collect();
        assert!(edges.len() > 10, "{edges:?}");
        // The guard follows the claim writes' latency, within its bounds.
        assert_eq!(rendezvous_guard_ms(0), RENDEZVOUS_GUARD_MS.0);
        assert_eq!(rendezvous_guard_ms(50), 170);
        assert_eq!(rendezvous_guard_ms(10_000), RENDEZVOUS_GUARD_MS.1);
    }

    fn names(prefix: &str, n: usize) -> Vec<String> {
        (0..n).map(|i| format!("{prefix}-{i}")).collect()
    }

    fn owner_of<'a>(job: &str, claimers: &HashSet<&'a str>) -> &'a str {
        claimers
            .iter()
            .copied()
            .find(|c| rendezvous_first(job, c, claimers))
            .unwrap()
    }

    const T0: u64 = 1_796_000_000_000;

    #[test]
    fn an_active_owner_takes_its_oldest_job_and_nobody_else_does() {
        let pods = names("pod", 8);
        let claimers: HashSet<&str> = pods.iter().map(String::as_str).collect();
        let jobs = names("job", 40);
        let candidates: Vec<&str> = jobs.iter().map(String::as_str).collect();
        let all_active = |_: &str| Some(T0 + 10 * ACTIVE_MS);
        for me in &claimers {
            let oldest = candidates
                .iter()
                .position(|j| owner_of(j, &claimers) == *me);
            let got = choose(&candidates, me, &claimers, all_active, T0, 40);
            match oldest {
                Some(i) => assert!(
                    matches!(got, Choice::Own(j) | Choice::Contested(j) if i == j),
                    "{me}: {got:?}"
                ),
                None => assert!(
                    !matches!(
                        got,
                        Choice::Own(_)
                            | Choice::Contested(_)
                            | Choice::Turn(0..RESERVED_PER_CLAIMER)
                    ),
                    "{me}"
                ),
            }
        }
        // A thief (no job of its own) never takes an active owner's first two jobs.
        let few = &candidates[..3];
        for step in 0..200u64 {
            let now = T0 + step * 7;
            for me in &claimers {
                if few.iter().any(|j| owner_of(j, &claimers) == *me) {
                    continue;
                }
                if let Choice::Turn(i) = choose(few, me, &claimers, all_active, now, 40) {
                    let owner = owner_of(few[i], &claimers);
                    let place = few[..i]
                        .iter()
                        .filter(|j| owner_of(j, &claimers) == owner)
                        .count();
                    assert!(
                        place >= RESERVED_PER_CLAIMER,
                        "{me} took {} at {now}",
                        few[i]
                    );
                }
            }
        }
    }

    #[test]
    fn claimers_that_agree_never_choose_the_same_job_at_once() {
        // Random queues, claimer sets and activities; every 13 ms over several rounds of
        // turns, no two claimers choose the same job.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for case in 0..20 {
            let c = rng.random_range(2..=12usize);
            let pods = names(&format!("c{case}-pod"), c);
            let claimers: HashSet<&str> = pods.iter().map(String::as_str).collect();
            let jobs = names(&format!("c{case}-job"), rng.random_range(1..=40usize));
            let candidates: Vec<&str> = jobs.iter().map(String::as_str).collect();
            // Some claimers active for a while, some never seen at work.
            let mut until: HashMap<&str, u64> = HashMap::new();
            for p in &pods {
                if rng.random_bool(0.7) {
                    until.insert(p, T0 + rng.random_range(0..3 * ACTIVE_MS));
                }
            }
            let active_until = |p: &str| until.get(p).copied();
            let guard = rng.random_range(40..=300u64);
            let mut taken = 0;
            let horizon = 4 * ACTIVE_MS + 2 * c as u64 * RENDEZVOUS_SLOT_MS;
            for now in (T0..T0 + horizon).step_by(37) {
                let mut chosen = HashMap::new();
                for me in &claimers {
                    let got = choose(&candidates, me, &claimers, active_until, now, guard);
                    if let Choice::Own(i) | Choice::Contested(i) | Choice::Turn(i) = got {
                        taken += 1;
                        if let Some(other) = chosen.insert(i, *me) {
                            panic!("case {case}: {me} and {other} both chose {}", candidates[i]);
                        }
                    }
                }
            }
            assert!(taken > 0, "case {case}: nobody ever chose anything");
        }
    }

    #[test]
    fn a_thief_steals_the_newest_job_of_the_busiest_owner_in_its_turn() {
        let pods = names("pod", 4);
        let claimers: HashSet<&str> = pods.iter().map(String::as_str).collect();
        let jobs = names("job", 60);
        let all: Vec<&str> = jobs.iter().map(String::as_str).collect();
        let thief = pods[0].as_str();
        // A queue where the thief owns nothing, and one owner owns the most.
        let candidates: Vec<&str> = all
            .iter()
            .copied()
            .filter(|j| owner_of(j, &claimers) != thief)
            .collect();
        let count = |o: &str| {
            candidates
                .iter()
                .filter(|j| owner_of(j, &claimers) == o)
                .count()
        };
        let place = |i: usize| {
            let owner = owner_of(candidates[i], &claimers);
            candidates[..i]
                .iter()
                .filter(|j| owner_of(j, &claimers) == owner)
                .count()
        };
        let all_active = |_: &str| Some(T0 + 10 * ACTIVE_MS);
        let mut stole = 0;
        for now in (T0..T0 + 4 * RENDEZVOUS_SLOT_MS).step_by(5) {
            // The jobs whose turn the thief has now, open to it: not reserved, and among their
            // owner's newest.
            let turns: Vec<usize> = (0..candidates.len())
                .filter(|&i| place(i) >= RESERVED_PER_CLAIMER)
                .filter(|&i| {
                    place(i) + STEALABLE_PER_OWNER >= count(owner_of(candidates[i], &claimers))
                })
                .filter(|&i| {
                    let rank = rendezvous_rank(candidates[i], thief, &claimers);
                    let turn = rendezvous_turn(candidates[i], rank, 4, now, 40);
                    matches!(turn, Turn::Now { .. })
                })
                .collect();
            match choose(&candidates, thief, &claimers, all_active, now, 40) {
                Choice::Own(i) | Choice::Contested(i) => {
                    panic!("it owns nothing, yet took {}", candidates[i])
                }
                Choice::Turn(i) => {
                    stole += 1;
                    assert!(
                        turns.contains(&i),
                        "{now}: {} is not its turn",
                        candidates[i]
                    );
                    // The busiest owner's newest among them.
                    let key = |i: usize| (count(owner_of(candidates[i], &claimers)), place(i));
                    assert_eq!(turns.iter().map(|&t| key(t)).max(), Some(key(i)), "{now}");
                }
                Choice::Defer(wait) => {
                    assert!(turns.is_empty(), "{now}: a turn, yet deferred");
                    assert!(wait <= Duration::from_millis(4 * RENDEZVOUS_SLOT_MS));
                }
                Choice::Nothing => panic!("open jobs, yet nothing"),
            }
        }
        assert!(stole > 0);
    }

    #[test]
    fn a_busy_owners_job_opens_when_it_stops_being_active() {
        let pods = names("pod", 4);
        let claimers: HashSet<&str> = pods.iter().map(String::as_str).collect();
        let job = "lonely-job";
        let owner = owner_of(job, &claimers);
        let until = T0 + 600;
        let active_until = |p: &str| (p == owner).then_some(until);
        for me in &claimers {
            let got = choose(&[job], me, &claimers, active_until, T0, 40);
            if *me == owner {
                assert_eq!(got, Choice::Contested(0), "its only job");
            } else {
                assert_eq!(got, Choice::Defer(Duration::from_millis(600)), "{me}");
            }
        }
        // Once the owner is no longer active, the claimers take turns, the owner too, and the
        // first turn comes within a round.
        let mut who = HashSet::new();
        for now in (until..until + 4 * RENDEZVOUS_SLOT_MS * 2).step_by(10) {
            for me in &claimers {
                if choose(&[job], me, &claimers, active_until, now, 40) == Choice::Turn(0) {
                    who.insert(*me);
                }
            }
        }
        assert_eq!(who.len(), 4, "{who:?}");
        // An inactive claimer's own job is open even to it only in its turn.
        let never = |_: &str| None;
        let turns = (T0..T0 + 4 * RENDEZVOUS_SLOT_MS)
            .step_by(10)
            .filter(|now| choose(&[job], owner, &claimers, never, *now, 40) == Choice::Turn(0))
            .count();
        assert!(turns > 0 && turns < 4 * RENDEZVOUS_SLOT_MS as usize / 10 / 2);
        // Nothing at all to share.
        assert_eq!(
            choose(&[], owner, &claimers, active_until, T0, 40),
            Choice::Nothing
        );
    }
}
