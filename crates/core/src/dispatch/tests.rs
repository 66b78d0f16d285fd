//! The dispatcher's decisions, case by case.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;
use crate::crd::{LeasedJobSpec, LeasedJobStatus, Phase};
use crate::slots::Preferred;

fn at_ms(ms: i64) -> Timestamp {
    Timestamp::from_millisecond(1_800_000_000_000 + ms).unwrap()
}

fn job(ns: &str, name: &str, priority: i32, created_s: i64, phase: Phase) -> LeasedJob {
    let mut j = LeasedJob::new(
        name,
        LeasedJobSpec {
            queue: "q".into(),
            priority,
            ..LeasedJobSpec::default()
        },
    );
    j.metadata.namespace = Some(ns.into());
    j.metadata.creation_timestamp = Some(Time(at_ms(created_s * 1000)));
    j.metadata.resource_version = Some(format!("rv-{name}-{phase:?}"));
    j.status = Some(LeasedJobStatus {
        phase: Some(phase),
        ..LeasedJobStatus::default()
    });
    j
}

fn q(ns: &str) -> QueueKey {
    QueueKey {
        namespace: ns.into(),
        queue: "q".into(),
    }
}

fn names(hint: Option<Hint>) -> Option<String> {
    hint.map(|h| h.name)
}

#[test]
fn offers_go_in_claim_order_and_never_twice_while_they_stand() {
    let mut d = Dispatch::new();
    d.observe(Change::Applied(&job("ns", "old", 0, 1, Phase::Queued)));
    d.observe(Change::Applied(&job("ns", "new", 0, 2, Phase::Queued)));
    d.observe(Change::Applied(&job("ns", "urgent", 5, 3, Phase::Queued)));
    let now = at_ms(10_000);
    assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("urgent".into()));
    assert_eq!(names(d.offer(&q("ns"), "w2", now)), Some("old".into()));
    assert_eq!(names(d.offer(&q("ns"), "w3", now)), Some("new".into()));
    // Every job stands offered.
    assert_eq!(d.offer(&q("ns"), "w4", now), None);
    // Not even to the worker it stands offered to: it asks again right after its claim,
    // before the claim has come through the watch.
    assert_eq!(d.offer(&q("ns"), "w2", now), None);
    assert_eq!(d.next_offer_at(&q("ns"), now), Some(at_ms(12_000)));
}

fn keyed(name: &str, key: &str, created_s: i64) -> LeasedJob {
    let mut j = job("ns", name, 0, created_s, Phase::Queued);
    j.spec.concurrency_key = Some(key.into());
    j
}

/// Offers `n` times to distinct workers, each claim arriving before the next offer.
fn offer_all(d: &mut Dispatch, n: usize, now: Timestamp) -> Vec<String> {
    (0..n)
        .map_while(|i| {
            let hint = d.offer(&q("ns"), &format!("w{i}"), now)?;
            let mut claimed = keyed(&hint.name, "", 0);
            claimed.status.as_mut().unwrap().phase = Some(Phase::Leased);
            // The claim's watch event: its key routes it, so set the job's own.
            claimed.spec.concurrency_key = Some(hint.name[..1].to_string());
            d.observe(Change::Applied(&claimed));
            Some(hint.name)
        })
        .collect()
}

#[test]
fn keys_take_turns_so_a_small_key_is_not_stuck_behind_a_large_one() {
    let mut d = Dispatch::new();
    // Key a: 6 jobs, all older than key b's 2.
    for i in 0..6 {
        d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
    }
    for i in 0..2 {
        d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", 100 + i)));
    }
    let got = offer_all(&mut d, 8, at_ms(1_000_000));
    assert_eq!(got, ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]);
}

#[test]
fn weights_share_offers_in_proportion() {
    let mut d = Dispatch::new();
    for i in 0..6 {
        d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
        d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", i)));
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            weights: [("a".to_string(), 2)].into(),
            ..Policy::default()
        }),
    );
    let got = offer_all(&mut d, 9, at_ms(1_000_000));
    let a = got.iter().filter(|n| n.starts_with('a')).count();
    assert_eq!(a, 6, "a has twice b's share: {got:?}");
    assert_eq!(&got[..3].iter().filter(|n| n.starts_with('a')).count(), &2);
}

#[test]
fn a_key_refilled_one_job_at_a_time_gets_its_weight_not_more() {
    let mut d = Dispatch::new();
    for i in 0..40 {
        d.observe(Change::Applied(&keyed(&format!("a{i:02}"), "a", i)));
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            weights: [("a".to_string(), 3)].into(),
            ..Policy::default()
        }),
    );
    let now = at_ms(1_000_000);
    let mut got = String::new();
    let mut next_b = 0;
    d.observe(Change::Applied(&keyed("b000", "b", 100)));
    for i in 0..16 {
        let hint = d.offer(&q("ns"), &format!("w{i}"), now).unwrap();
        let mut claimed = keyed(&hint.name, &hint.name[..1], 0);
        claimed.status.as_mut().unwrap().phase = Some(Phase::Leased);
        d.observe(Change::Applied(&claimed));
        got.push_str(&hint.name[..1]);
        if hint.name.starts_with('b') {
            // Key b submits its next job once its last one is claimed.
            next_b += 1;
            d.observe(Change::Applied(&keyed(
                &format!("b{next_b:03}"),
                "b",
                100 + next_b,
            )));
        }
    }
    assert_eq!(got.matches('b').count(), 4, "3:1 for a: {got}");
}

#[test]
fn a_key_back_from_idle_takes_its_turn_without_bursting() {
    let mut d = Dispatch::new();
    for i in 0..8 {
        d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
    }
    let now = at_ms(1_000_000);
    assert_eq!(offer_all(&mut d, 4, now), ["a0", "a1", "a2", "a3"]);
    // Key b arrives after a had the queue to itself for four offers: it alternates
    // with a from now on, it is not owed those four.
    for i in 0..3 {
        d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", 100 + i)));
    }
    assert_eq!(offer_all(&mut d, 4, now), ["b0", "a4", "b1", "a5"]);
}

#[test]
fn a_scope_at_its_limit_is_not_offered_counting_standing_offers() {
    let mut d = Dispatch::new();
    for i in 0..4 {
        d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
        d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", 10 + i)));
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased_per_key: Some(1),
            max_leased: Some(3),
            ..Policy::default()
        }),
    );
    let now = at_ms(1_000_000);
    // One of each key: the standing offers count as claims to come.
    assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("a0".into()));
    assert_eq!(names(d.offer(&q("ns"), "w2", now)), Some("b0".into()));
    assert_eq!(d.offer(&q("ns"), "w3", now), None, "each key at its limit");
    // a0 claimed (Leased), b0's offer declined: b has room again, a has none.
    let mut a0 = keyed("a0", "a", 0);
    a0.status.as_mut().unwrap().phase = Some(Phase::Leased);
    d.observe(Change::Applied(&a0));
    d.declined(&q("ns"), "b0", "w2");
    assert_eq!(names(d.offer(&q("ns"), "w3", now)), Some("b0".into()));
    assert_eq!(d.offer(&q("ns"), "w4", now), None);
    // a0 ends: a has room.
    a0.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
    d.observe(Change::Applied(&a0));
    assert_eq!(names(d.offer(&q("ns"), "w4", now)), Some("a1".into()));
    // The queue-wide limit: 3 Leased jobs of keys without a per-key limit.
    let mut d = Dispatch::new();
    for i in 0..5 {
        d.observe(Change::Applied(&job(
            "ns",
            &format!("j{i}"),
            0,
            i,
            Phase::Queued,
        )));
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased: Some(3),
            ..Policy::default()
        }),
    );
    let got: Vec<_> = (0..5)
        .filter_map(|i| d.offer(&q("ns"), &format!("w{i}"), now))
        .collect();
    assert_eq!(got.len(), 3);
}

#[test]
fn offers_suggest_slots_no_standing_offer_or_job_leased_from_one_was_suggested() {
    let two_keys = || {
        let mut d = Dispatch::new();
        for i in 0..6 {
            d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
            d.observe(Change::Applied(&keyed(&format!("b{i}"), "b", 10 + i)));
        }
        d
    };
    let now = at_ms(1_000_000);
    // No LeasedQueue: no slot to suggest.
    let hint = two_keys().offer(&q("ns"), "w0", now).unwrap();
    assert_eq!(hint.slots, Preferred::NONE);
    let mut d = two_keys();
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased_per_key: Some(3),
            max_leased: Some(5),
            ..Policy::default()
        }),
    );
    let hints: Vec<Hint> = (1..=4)
        .map(|i| d.offer(&q("ns"), &format!("w{i}"), now).unwrap())
        .collect();
    let slots = |hints: &[Hint]| -> Vec<(String, Option<u32>, Option<u32>)> {
        hints
            .iter()
            .map(|h| (h.name.clone(), h.slots.queue, h.slots.key))
            .collect()
    };
    // Keys take turns; each key's offers get distinct key slots, all distinct queue slots.
    assert_eq!(
        slots(&hints),
        vec![
            ("a0".into(), Some(0), Some(0)),
            ("b0".into(), Some(1), Some(0)),
            ("a1".into(), Some(2), Some(1)),
            ("b1".into(), Some(3), Some(1)),
        ]
    );
    // a0 is claimed: its slots stay taken while it is Leased, after its offer is gone.
    let mut a0 = keyed("a0", "a", 0);
    a0.status.as_mut().unwrap().phase = Some(Phase::Leased);
    d.observe(Change::Applied(&a0));
    // b0's offer is declined: its slots are free again, and a0's are not. a2's turn.
    d.declined(&q("ns"), "b0", "w2");
    let next = d.offer(&q("ns"), "w5", now).unwrap();
    let got = |h: &Hint| (h.name.clone(), h.slots.queue, h.slots.key);
    assert_eq!(got(&next), ("a2".into(), Some(1), Some(2)));
    // a0 ends: its slots go back, and are suggested to others after those no claim from an
    // offer took (w1, a0's claimer, may name them in its next poll to swap them).
    a0.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
    d.observe(Change::Applied(&a0));
    let next = d.offer(&q("ns"), "w6", now).unwrap();
    assert_eq!(got(&next), ("b0".into(), Some(4), Some(0)));
    let next = d.offer(&q("ns"), "w1", now).unwrap();
    assert_eq!(got(&next), ("a3".into(), Some(0), Some(0)), "w1's own");
    // A job Leased without an offer counts against the limits, but holds no known slot.
    let mut d = Dispatch::new();
    let mut other = keyed("x", "a", 0);
    other.status.as_mut().unwrap().phase = Some(Phase::Leased);
    d.observe(Change::Applied(&other));
    d.observe(Change::Applied(&keyed("a9", "a", 9)));
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased_per_key: Some(2),
            ..Policy::default()
        }),
    );
    let hint = d.offer(&q("ns"), "w", now).unwrap();
    assert_eq!(
        hint.slots,
        Preferred {
            queue: None,
            key: Some(0)
        }
    );
    // a9 is claimed from that offer (slot 0), then seen Leased again at a later attempt with
    // no change seen in between (a re-list spanned it): that attempt came from no offer, so
    // slot 0 is no longer taken to be a9's.
    let mut a9 = keyed("a9", "a", 9);
    a9.status.as_mut().unwrap().phase = Some(Phase::Leased);
    a9.status.as_mut().unwrap().attempt = 1;
    d.observe(Change::Applied(&a9));
    other.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
    d.observe(Change::Applied(&other));
    d.observe(Change::Applied(&keyed("a8", "a", 8)));
    assert_eq!(d.offer(&q("ns"), "w", now).unwrap().slots.key, Some(1));
    d.declined(&q("ns"), "a8", "w");
    a9.status.as_mut().unwrap().attempt = 2;
    d.observe(Change::Applied(&a9));
    assert_eq!(d.offer(&q("ns"), "w", now).unwrap().slots.key, Some(0));
}

#[test]
fn a_worker_naming_its_free_slot_gets_a_job_of_its_key_when_that_key_s_turn_ties() {
    let mut d = Dispatch::new();
    for (i, key) in ["a", "b", "c"].iter().enumerate() {
        for n in 0..3 {
            let name = format!("{key}{n}");
            d.observe(Change::Applied(&keyed(&name, key, 10 * n + i as i64)));
        }
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased_per_key: Some(4),
            ..Policy::default()
        }),
    );
    let now = at_ms(1_000_000);
    let own = |key: &str, index: u32| OwnSlot {
        key: Some(key.into()),
        index,
    };
    let set = |d: &mut Dispatch, name: &str, phase: Phase| {
        let mut job = keyed(name, &name[..1], 0);
        job.status.as_mut().unwrap().phase = Some(phase);
        d.observe(Change::Applied(&job));
    };
    let got = |h: Hint| (h.name, h.slots.key);
    // The first round, in claim order: each key's slot 0, each claimed.
    for (worker, want) in [("w1", "a0"), ("w2", "b0"), ("w3", "c0")] {
        let hint = d.offer_fitting(&q("ns"), worker, now, &[]).unwrap();
        assert_eq!(got(hint), (want.to_string(), Some(0)));
        set(&mut d, want, Phase::Leased);
    }
    // w3 ended c0 (the view has not seen it yet) and names its slot: all three keys' turns
    // tie, so it gets c1 ahead of a1, the oldest, with its slot suggested.
    let hint = d
        .offer_fitting(&q("ns"), "w3", now, &[own("c", 0)])
        .unwrap();
    assert_eq!(hint.swaps.key, Some(0), "to swap");
    assert_eq!(got(hint), ("c1".to_string(), Some(0)));
    // A worker naming a slot it was not the last to be suggested (another claimer took it
    // since, as far as the view knows) is not suggested it; the round goes on in claim order.
    let hint = d
        .offer_fitting(&q("ns"), "w2", now, &[own("a", 0)])
        .unwrap();
    assert_eq!(hint.swaps, Preferred::NONE);
    assert_eq!(got(hint), ("a1".to_string(), Some(1)), "a0 holds slot 0");
    // c's turn in this round is taken (c1): even its slot's owner gets b1, whose turn it is;
    // shares stay one each per round.
    let hint = d
        .offer_fitting(&q("ns"), "w3", now, &[own("c", 0)])
        .unwrap();
    assert_eq!((hint.name.as_str(), hint.swaps.key), ("b1", None));
    // c0 and c1 end, as the view sees it: c's slot 0 (w3's) is free, and another worker is
    // suggested a slot nobody was suggested first, so w3's stays its own.
    set(&mut d, "c0", Phase::Succeeded);
    set(&mut d, "c1", Phase::Leased);
    set(&mut d, "c1", Phase::Succeeded);
    let c2 = (0..3)
        .filter_map(|_| d.offer_fitting(&q("ns"), "w4", now, &[]))
        .find(|h| h.name == "c2")
        .unwrap();
    assert_eq!(c2.slots.key, Some(1), "not w3's slot 0");
    // A higher priority is never passed over for an owned slot, nor is a slot at or above
    // the limit suggested or preferred: w1 owns c's slots 0 and 9 (the latter taken under a
    // higher limit, as the claim recorded).
    let setup = || {
        let mut d = Dispatch::new();
        d.set_policy(
            &q("ns"),
            Some(Policy {
                max_leased_per_key: Some(4),
                ..Policy::default()
            }),
        );
        for (name, recorded) in [("c0", 0), ("c1", 9)] {
            d.observe(Change::Applied(&keyed(name, "c", 0)));
            let hint = d.offer_fitting(&q("ns"), "w1", now, &[]).unwrap();
            assert_eq!(hint.name, name);
            let mut job = keyed(name, "c", 0);
            let status = job.status.as_mut().unwrap();
            status.phase = Some(Phase::Leased);
            status.key_slot = Some(recorded);
            d.observe(Change::Applied(&job));
            job.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
            d.observe(Change::Applied(&job));
        }
        let mut urgent = keyed("a-urgent", "a", 99);
        urgent.spec.priority = 5;
        d.observe(Change::Applied(&urgent));
        for (name, key) in [("b8", "b"), ("b9", "b"), ("c9", "c")] {
            d.observe(Change::Applied(&keyed(name, key, 1)));
        }
        d
    };
    let mut d = setup();
    let hint = d
        .offer_fitting(&q("ns"), "w1", now, &[own("c", 0)])
        .unwrap();
    assert_eq!(hint.name, "a-urgent", "priority first");
    // c's turn is behind (two offers of c): b8 first; then b's and c's turns tie, b9 ahead in
    // claim order.
    let tied = |d: &mut Dispatch| {
        assert_eq!(d.offer(&q("ns"), "w8", now).unwrap().name, "a-urgent");
        assert_eq!(d.offer(&q("ns"), "w9", now).unwrap().name, "b8");
    };
    let mut d = setup();
    tied(&mut d);
    assert_eq!(d.offer(&q("ns"), "w7", now).unwrap().name, "b9");
    // w1's slot 9 of c is above the limit: no preference, no swap.
    let mut d = setup();
    tied(&mut d);
    let hint = d
        .offer_fitting(&q("ns"), "w1", now, &[own("c", 9)])
        .unwrap();
    assert_eq!((hint.name.as_str(), hint.swaps.key), ("b9", None));
    // With its slot 0 named, c9 comes first, and slot 0 is w1's to swap.
    let mut d = setup();
    tied(&mut d);
    let hint = d
        .offer_fitting(&q("ns"), "w1", now, &[own("c", 9), own("c", 0)])
        .unwrap();
    assert_eq!((hint.name.as_str(), hint.swaps.key), ("c9", Some(0)));
}

#[test]
fn the_slots_a_claim_recorded_count_over_those_its_offer_suggested() {
    let mut d = Dispatch::new();
    for i in 0..4 {
        d.observe(Change::Applied(&keyed(&format!("a{i}"), "a", i)));
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased_per_key: Some(3),
            ..Policy::default()
        }),
    );
    let now = at_ms(1_000_000);
    let leased = |name: &str, key_slot: i32| {
        let mut job = keyed(name, "a", 0);
        let status = job.status.as_mut().unwrap();
        status.phase = Some(Phase::Leased);
        status.key_slot = Some(key_slot);
        job
    };
    // Offered with slot 0, a0's claim took slot 2 (0 was busy): 2 is a0's, 0 is free.
    let hint = d.offer(&q("ns"), "w1", now).unwrap();
    assert_eq!((hint.name.as_str(), hint.slots.key), ("a0", Some(0)));
    d.observe(Change::Applied(&leased("a0", 2)));
    let hint = d.offer(&q("ns"), "w2", now).unwrap();
    assert_eq!((hint.name.as_str(), hint.slots.key), ("a1", Some(0)));
    d.declined(&q("ns"), "a1", "w2");
    // A job claimed without an offer, in slot 1: nobody's to swap, and suggested to no one
    // while it is Leased.
    d.observe(Change::Applied(&leased("a3", 1)));
    let own = [OwnSlot {
        key: Some("a".into()),
        index: 1,
    }];
    let hint = d.offer_fitting(&q("ns"), "w3", now, &own).unwrap();
    assert_eq!((hint.name.as_str(), hint.slots.key), ("a1", Some(0)));
    // a3 ends: slot 1 is free, last taken without an offer, so w3 naming it is still not
    // suggested it (its swap would be refused), and w1, whose a0 holds slot 2, is.
    let mut ended = leased("a3", 1);
    ended.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
    d.observe(Change::Applied(&ended));
    d.declined(&q("ns"), "a1", "w3");
    let hint = d.offer_fitting(&q("ns"), "w3", now, &own).unwrap();
    assert_eq!(hint.slots.key, Some(0), "{hint:?}");
    d.declined(&q("ns"), "a1", "w3");
    // When it is the only free one, it is suggested, but not as w3's own: w3 takes it as
    // usual (a swap would be refused).
    let mut a9 = keyed("a9", "a", 0);
    a9.status.as_mut().unwrap().phase = Some(Phase::Leased);
    a9.status.as_mut().unwrap().key_slot = Some(0);
    d.observe(Change::Applied(&a9));
    let hint = d.offer_fitting(&q("ns"), "w3", now, &own).unwrap();
    assert_eq!(
        (hint.slots.key, hint.swaps.key),
        (Some(1), None),
        "{hint:?}"
    );
    d.declined(&q("ns"), "a1", "w3");
    a9.status.as_mut().unwrap().phase = Some(Phase::Succeeded);
    d.observe(Change::Applied(&a9));
    let mine = [OwnSlot {
        key: Some("a".into()),
        index: 2,
    }];
    let hint = d.offer_fitting(&q("ns"), "w1", now, &mine).unwrap();
    let own = (hint.slots.key, hint.swaps.key);
    assert_eq!(
        own,
        (Some(2), Some(2)),
        "w1's own, its a0 still Leased in the view"
    );
}

#[test]
fn an_offer_lapses_after_its_ttl_and_ends_with_a_claim_or_a_decline() {
    let mut d = Dispatch::new();
    d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
    d.observe(Change::Applied(&job("ns", "b", 0, 2, Phase::Queued)));
    let now = at_ms(0);
    assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("a".into()));
    // w1 vanished with its hint: a lapses after the TTL and goes to the next worker.
    let later = now + SignedDuration::from_millis(OFFER_TTL_MS - 1);
    assert_eq!(names(d.offer(&q("ns"), "w2", later)), Some("b".into()));
    let lapsed = now + SignedDuration::from_millis(OFFER_TTL_MS);
    assert_eq!(names(d.offer(&q("ns"), "w3", lapsed)), Some("a".into()));
    // w3 says it could not claim a: it is offered at once to the next one.
    d.declined(&q("ns"), "a", "w3");
    assert_eq!(names(d.offer(&q("ns"), "w4", lapsed)), Some("a".into()));
    // Another worker cannot end w4's offer.
    d.declined(&q("ns"), "a", "w3");
    assert_eq!(d.offer(&q("ns"), "w5", lapsed), None);
    // w4's claim arrives in the watch: a is no longer claimable, its offer is gone.
    d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Leased)));
    assert_eq!(d.offers(), 1, "only b's offer stands");
    assert_eq!(d.queued(&q("ns")), 1);
}

#[test]
fn queues_and_namespaces_are_kept_apart() {
    let mut d = Dispatch::new();
    d.observe(Change::Applied(&job("team-a", "a1", 0, 1, Phase::Queued)));
    let mut other = job("team-a", "x1", 0, 0, Phase::Queued);
    other.spec.queue = "other".into();
    d.observe(Change::Applied(&other));
    let now = at_ms(5_000);
    assert_eq!(d.offer(&q("team-b"), "w", now), None);
    assert_eq!(names(d.offer(&q("team-a"), "w", now)), Some("a1".into()));
    assert_eq!(d.queued(&q("team-a")), 1);
}

#[test]
fn not_before_and_retry_after_hold_a_job_back_until_their_time() {
    let mut d = Dispatch::new();
    let mut later = job("ns", "later", 9, 1, Phase::Queued);
    later.spec.not_before = Some(Time(at_ms(60_000)));
    d.observe(Change::Applied(&later));
    d.observe(Change::Applied(&job("ns", "now", 0, 2, Phase::Queued)));
    let now = at_ms(10_000);
    assert_eq!(names(d.offer(&q("ns"), "w", now)), Some("now".into()));
    assert_eq!(d.offer(&q("ns"), "w2", now), None);
    assert_eq!(d.next_offer_at(&q("ns"), now), Some(at_ms(12_000)));
    let due = at_ms(60_000);
    assert_eq!(names(d.offer(&q("ns"), "w2", due)), Some("later".into()));
}

#[test]
fn a_job_not_initialised_yet_is_offered_at_once_and_its_offer_outlives_its_initialisation() {
    let mut d = Dispatch::new();
    let mut fresh = job("ns", "fresh", 0, 1, Phase::Queued);
    fresh.status = None;
    d.observe(Change::Applied(&fresh));
    let now = at_ms(10_000);
    assert!(!d.offered(&q("ns"), "fresh", now));
    assert_eq!(names(d.offer(&q("ns"), "w", now)), Some("fresh".into()));
    assert!(d.offered(&q("ns"), "fresh", now));
    // The controller's initial status, should it come, leaves the offer standing...
    d.observe(Change::Applied(&job("ns", "fresh", 0, 1, Phase::Queued)));
    assert!(d.offered(&q("ns"), "fresh", now));
    assert_eq!(d.offer(&q("ns"), "w2", now), None, "offered to w already");
    // ...until it lapses.
    let lapsed = now + SignedDuration::from_millis(OFFER_TTL_MS);
    assert!(!d.offered(&q("ns"), "fresh", lapsed));
    // A claim ends it.
    assert_eq!(names(d.offer(&q("ns"), "w2", lapsed)), Some("fresh".into()));
    d.observe(Change::Applied(&job("ns", "fresh", 0, 1, Phase::Leased)));
    assert!(!d.offered(&q("ns"), "fresh", lapsed));
}

#[test]
fn the_view_counts_as_listed_from_its_first_lists_end_on() {
    let mut d = Dispatch::new();
    assert!(!d.has_listed(), "a new view is empty, not the queue");
    d.observe(Change::RelistBegan);
    d.observe(Change::Relisted(&job("ns", "a", 0, 1, Phase::Queued)));
    assert!(!d.has_listed(), "not while the first list runs");
    d.observe(Change::RelistDone);
    assert!(d.has_listed());
    d.observe(Change::RelistBegan);
    assert!(d.has_listed(), "a re-list keeps the old view answering");
}

#[test]
fn a_relist_replaces_the_view_and_forgets_offers_on_jobs_gone_meanwhile() {
    let mut d = Dispatch::new();
    d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
    d.observe(Change::Applied(&job("ns", "b", 0, 2, Phase::Queued)));
    let now = at_ms(10_000);
    assert_eq!(names(d.offer(&q("ns"), "w1", now)), Some("a".into()));
    assert_eq!(names(d.offer(&q("ns"), "w2", now)), Some("b".into()));
    // The watch expired (410) and re-listed: a was claimed meanwhile, c is new, and a
    // queue of another namespace appears during the list.
    d.observe(Change::RelistBegan);
    d.observe(Change::Relisted(&job("ns", "a", 0, 1, Phase::Leased)));
    d.observe(Change::Relisted(&job("ns", "b", 0, 2, Phase::Queued)));
    d.observe(Change::Relisted(&job("ns", "c", 0, 3, Phase::Queued)));
    d.observe(Change::Relisted(&job("ns2", "z", 0, 3, Phase::Queued)));
    // Until the list ends, the old view answers.
    assert_eq!(d.queued(&q("ns")), 2);
    d.observe(Change::RelistDone);
    assert_eq!(d.queued(&q("ns")), 2);
    assert_eq!(d.queued(&q("ns2")), 1);
    assert_eq!(d.offers(), 1, "b's offer stands, a's went with it");
    assert_eq!(names(d.offer(&q("ns"), "w3", now)), Some("c".into()));
    assert_eq!(names(d.offer(&q("ns2"), "w3", now)), Some("z".into()));
}

#[test]
fn a_queue_emptied_by_a_relist_is_forgotten() {
    let mut d = Dispatch::new();
    d.observe(Change::Applied(&job("ns", "a", 0, 1, Phase::Queued)));
    d.observe(Change::RelistBegan);
    d.observe(Change::RelistDone);
    assert_eq!(d.queued(&q("ns")), 0);
    assert!(d.queues.is_empty());
}

#[test]
fn the_next_offers_are_told_without_being_made() {
    let mut d = Dispatch::new();
    let now = at_ms(1_000_000);
    d.observe(Change::Applied(&keyed("a0", "a", 1)));
    d.observe(Change::Applied(&keyed("a1", "a", 2)));
    d.observe(Change::Applied(&keyed("a2", "a", 3)));
    assert!(d.offers_within(&q("ns"), "a0", now, 1));
    assert!(!d.offers_within(&q("ns"), "a1", now, 1), "behind a0");
    assert!(d.offers_within(&q("ns"), "a1", now, 2));
    assert!(!d.offers_within(&q("ns"), "a2", now, 2));
    assert!(!d.offers_within(&q("ns"), "a0", now, 0), "no poll waits");
    assert!(
        d.offers_within(&q("ns"), "a0", now, 1),
        "telling recorded nothing"
    );
    assert_eq!(names(d.offer(&q("ns"), "w", now)), Some("a0".into()));
    assert!(d.offers_within(&q("ns"), "a1", now, 1));
    // A key at its limit offers nothing, so nothing of it is next.
    d.set_policy(
        &q("ns"),
        Some(Policy {
            max_leased_per_key: Some(2),
            ..Policy::default()
        }),
    );
    assert!(d.offers_within(&q("ns"), "a1", now, 3));
    assert!(
        !d.offers_within(&q("ns"), "a2", now, 3),
        "a0's offer and a1's fill the key"
    );
    assert!(!d.offers_within(&q("other"), "a1", now, 3), "no such queue");
}

/// A queue with three keys of unequal weights, two priorities and a limit per key, seen the
/// same way by every dispatcher this makes.
fn mixed() -> Dispatch {
    let mut d = Dispatch::new();
    for i in 0..30 {
        let key = ["a", "b", "c"][i % 3];
        let mut j = keyed(&format!("{key}{i:02}"), key, i as i64);
        j.spec.priority = i32::from(i % 7 == 0);
        d.observe(Change::Applied(&j));
    }
    d.set_policy(
        &q("ns"),
        Some(Policy {
            weights: [("a".to_string(), 3), ("b".to_string(), 2)].into(),
            max_leased_per_key: Some(6),
            ..Policy::default()
        }),
    );
    d
}

#[test]
fn the_next_offers_told_are_the_offers_then_made() {
    let now = at_ms(1_000_000);
    for made_first in [0, 1, 5] {
        let (mut told, mut made) = (mixed(), mixed());
        for d in [&mut told, &mut made] {
            for w in 0..made_first {
                d.offer(&q("ns"), &format!("early{w}"), now).unwrap();
            }
        }
        let expected: Vec<String> = (0..20)
            .map_while(|w| made.offer(&q("ns"), &format!("w{w}"), now))
            .map(|h| h.name)
            .collect();
        let got: Vec<String> = told
            .next_offers(&q("ns"), now, 20, None, ("", &[]))
            .into_iter()
            .map(|(_, name, _)| name)
            .collect();
        assert_eq!(got, expected, "after {made_first} offers");
        assert!(
            expected.len() < 20,
            "the limits end the offers: {expected:?}"
        );
        let last = expected.last().unwrap();
        assert!(told.offers_within(&q("ns"), last, now, expected.len()));
        assert!(!told.offers_within(&q("ns"), last, now, expected.len() - 1));
    }
}
