//! The worker's pure decisions, from tables: when background renewal must stop, when it
//! renews next, how the claim window moves, whether a first renewal may still be made, and
//! what a call with the token of an ended attempt is answered.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use leasehold_core::crd::Phase;
use leasehold_core::fence::Refusal;
use leasehold_core::progress::Progress;
use leasehold_core::token::Token;
use leasehold_core::Category;

use super::job;
use crate::end::{remember_ended, MAX_ENDED};
use crate::heartbeat::{ended_code, ended_refusal_in, first_renewal_allowed, moved_on};
use crate::renew::{on_wake, outlived, renewal_interval, retry_delay, silence_limit, Wake};
use crate::window::{claim_write_average, may_widen, narrowed_window, widened_window};
use crate::HeldState;

const fn s(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

const fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

#[test]
fn renewal_comes_every_third_of_the_lease() {
    for (lease, every) in [
        (s(60), s(20)),
        (s(5), Duration::from_nanos(1_666_666_666)),
        (s(3), s(1)),
        (s(86_400), s(28_800)),
    ] {
        assert_eq!(renewal_interval(lease), every, "lease {lease:?}");
    }
}

#[test]
fn a_failed_renewal_is_retried_after_a_second_or_the_interval_if_shorter() {
    for (interval, retry) in [(s(20), s(1)), (s(1), s(1)), (ms(400), ms(400))] {
        assert_eq!(retry_delay(interval), retry, "interval {interval:?}");
    }
}

#[test]
fn a_silent_worker_keeps_its_lease_for_the_longer_of_its_timeout_and_the_lease() {
    for (timeout, lease, limit) in [
        (s(300), s(60), s(300)),
        (s(10), s(60), s(60)),
        (s(60), s(60), s(60)),
    ] {
        assert_eq!(
            silence_limit(timeout, lease),
            limit,
            "{timeout:?} {lease:?}"
        );
    }
}

#[test]
fn a_lease_is_lost_after_a_whole_duration_without_a_confirmed_renewal() {
    for (since, lease, lost) in [
        (s(0), s(30), false),
        (ms(29_999), s(30), false),
        (s(30), s(30), true),
        (s(31), s(30), true),
        (s(3600), s(30), true),
    ] {
        assert_eq!(outlived(since, lease), lost, "{since:?} of {lease:?}");
    }
}

#[test]
fn a_first_renewal_is_made_only_within_a_lease_of_the_claim() {
    for (since_claim, lease, allowed) in [
        (s(0), s(30), true),
        (s(10), s(30), true),
        (ms(29_999), s(30), true),
        (s(30), s(30), false),
        (s(600), s(30), false),
    ] {
        assert_eq!(
            first_renewal_allowed(since_claim, lease),
            allowed,
            "{since_claim:?} after the claim, lease {lease:?}"
        );
    }
}

fn state(t0: Instant, ended: bool, lost: bool) -> HeldState {
    HeldState {
        last_renewed: t0,
        renew_time: Timestamp::now(),
        lease_taken: true,
        first_renewal_sent: true,
        last_contact: t0,
        checkpoint: None,
        progress: Progress::default(),
        lost: lost.then(|| ("lease_lost", "lost".to_string())),
        ended,
    }
}

#[test]
fn the_renewer_stops_waits_gives_up_or_renews() {
    // Renewed and last called at t0; a 30 s lease renewed every 10 s, a 300 s silence limit.
    let t0 = Instant::now();
    let (interval, silence) = (s(10), s(300));
    for (ended, lost, now, wake) in [
        (true, false, s(10), Wake::Stop),
        (false, true, s(10), Wake::Stop),
        // Woken early (a heartbeat renewed at t0): sleep until the interval has passed.
        (false, false, s(3), Wake::Later(t0 + s(10))),
        (false, false, s(10), Wake::Renew),
        (false, false, s(299), Wake::Renew),
        (false, false, s(300), Wake::Silent),
        (false, false, s(301), Wake::Silent),
        // An ended attempt stops even past the silence limit.
        (true, false, s(400), Wake::Stop),
    ] {
        let st = state(t0, ended, lost);
        assert_eq!(
            on_wake(&st, t0 + now, interval, silence),
            wake,
            "ended {ended}, lost {lost}, at t0 + {now:?}"
        );
    }
}

#[test]
fn a_conflict_widens_the_window_fourfold_only_while_more_jobs_are_claimable() {
    for (window, spread, more, wider) in [
        (16, 16, true, Some(64)),
        (64, 16, true, Some(256)),
        (512, 16, true, Some(1024)),
        (16, 16, false, None),
        (4, 2, true, Some(16)),
        (100, 2, true, Some(128)),
    ] {
        assert_eq!(
            widened_window(window, spread, more),
            wider,
            "window {window}, spread {spread}, more claimable {more}"
        );
    }
    for (window, spread, may) in [
        (16, 16, true),
        (1023, 16, true),
        (1024, 16, false),
        (1, 1, false),
        (2, 2, true),
    ] {
        assert_eq!(
            may_widen(window, spread),
            may,
            "window {window}, spread {spread}"
        );
    }
}

#[test]
fn a_successful_claim_narrows_the_window_by_a_32nd_back_to_spread() {
    for (window, spread, narrower) in [
        (1024, 16, Some(992)),
        (64, 16, Some(62)),
        (20, 16, Some(19)),
        (17, 16, Some(16)),
        (16, 16, None),
        (1, 1, None),
    ] {
        assert_eq!(narrowed_window(window, spread), narrower, "window {window}");
    }
}

#[test]
fn the_window_widens_to_its_cap_under_conflicts_and_settles_back_at_spread() {
    let spread = 16;
    let mut window = spread;
    let mut seen = vec![window];
    for _ in 0..5 {
        if may_widen(window, spread) {
            window = widened_window(window, spread, true).unwrap();
        }
        seen.push(window);
    }
    assert_eq!(seen, [16, 64, 256, 1024, 1024, 1024]);
    let mut claims = 0;
    while let Some(narrower) = narrowed_window(window, spread) {
        assert!(narrower < window && narrower >= spread);
        window = narrower;
        claims += 1;
    }
    assert_eq!(window, spread);
    // 1/32 per claim: a few hundred claims without a conflict bring it back.
    assert!((100..400).contains(&claims), "{claims} claims");
}

#[test]
fn claim_write_times_average_a_quarter_of_each_new_one() {
    for (was, took, now) in [
        (0, 100, 100),
        (100, 100, 100),
        (100, 200, 125),
        (400, 0, 300),
    ] {
        assert_eq!(claim_write_average(was, took), now, "{was} then {took}");
    }
}

#[test]
fn the_held_jobs_cache_tells_when_an_attempt_moved_on() {
    let t1 = Token::issue(1);
    let t2 = Token::issue(2);
    let other1 = Token::issue(1);
    for (phase, attempt, holder_token, code) in [
        (Phase::Leased, 1, Some(&t1), None),
        (Phase::Leased, 2, Some(&t2), Some("lease_lost")),
        (Phase::Queued, 2, Some(&t2), Some("lease_lost")),
        (Phase::Queued, 1, Some(&t1), Some("lease_lost")),
        (Phase::Succeeded, 1, Some(&t1), Some("lease_lost")),
        (Phase::Failed, 1, Some(&t1), Some("lease_lost")),
        (Phase::Cancelled, 1, Some(&t1), Some("cancelled")),
        // Another token on the same attempt is not this cache's to judge: the Lease and a
        // fresh read decide.
        (Phase::Leased, 1, Some(&other1), None),
    ] {
        let j = job("j", phase, attempt, holder_token);
        let got = moved_on(&j, &t1);
        assert_eq!(
            got.as_ref().map(|(c, _)| *c),
            code,
            "{phase} on attempt {attempt}: {got:?}"
        );
        if let Some((_, why)) = got {
            assert!(!why.contains(t2.as_str()), "names another token: {why}");
        }
    }
}

#[test]
fn a_first_renewal_of_an_ended_attempt_answers_cancelled_or_lease_lost() {
    let job = || "default/j".to_string();
    for (refusal, code) in [
        (Refusal::Cancelled { job: job() }, "cancelled"),
        (Refusal::NotFound { job: job() }, "lease_lost"),
        (
            Refusal::Finished {
                job: job(),
                phase: Phase::Succeeded,
                attempt: 1,
            },
            "lease_lost",
        ),
        (
            Refusal::LeaseLost {
                job: job(),
                detail: "is on attempt 2".into(),
            },
            "lease_lost",
        ),
    ] {
        assert_eq!(ended_code(&refusal), code, "{refusal}");
    }
}

#[test]
fn a_token_whose_attempt_ended_here_is_refused_with_the_ends_refusal() {
    let t1 = Token::issue(1);
    let t2 = Token::issue(2);
    // The job as each end of attempt 1 leaves it, and what a later heartbeat with t1 gets.
    for (left, category) in [
        (job("j", Phase::Succeeded, 1, Some(&t1)), "job_finished"),
        (job("j", Phase::Failed, 1, Some(&t1)), "job_finished"),
        (job("j", Phase::Queued, 1, Some(&t1)), "lease_lost"),
    ] {
        let mut ended = HashMap::new();
        remember_ended(&mut ended, "j", &t1, "default/j", &left);
        let r = ended_refusal_in(&ended, "j", &t1);
        assert_eq!(
            r.as_ref().map(Category::category),
            Some(category),
            "{left:?}"
        );
        // The next attempt's token, and another job's name, are not this memory's to refuse.
        assert!(ended_refusal_in(&ended, "j", &t2).is_none());
        assert!(ended_refusal_in(&ended, "k", &t1).is_none());
    }
    // A job still Leased to the token refuses nothing, so nothing is remembered.
    let mut ended = HashMap::new();
    remember_ended(
        &mut ended,
        "j",
        &t1,
        "default/j",
        &job("j", Phase::Leased, 1, Some(&t1)),
    );
    assert!(ended.is_empty());
}

#[test]
fn the_memory_of_ended_attempts_starts_over_past_its_bound() {
    let t = Token::issue(1);
    let done = job("j", Phase::Succeeded, 1, Some(&t));
    let mut ended = HashMap::new();
    for i in 0..MAX_ENDED {
        remember_ended(&mut ended, &format!("j{i}"), &t, "default/j", &done);
    }
    assert_eq!(ended.len(), MAX_ENDED);
    remember_ended(&mut ended, "one-more", &t, "default/j", &done);
    assert_eq!(ended.len(), 1);
    assert!(ended_refusal_in(&ended, "one-more", &t).is_some());
    assert!(ended_refusal_in(&ended, "j0", &t).is_none());
}
