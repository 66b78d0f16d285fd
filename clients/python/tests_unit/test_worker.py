"""The client (Worker, Job, Client) against the fake sidecar: how a handler's outcome ends
the attempt, lease loss, cancellation, resume, the attempt history, a slow or draining
sidecar, async handlers and the checks the client makes before sending."""

import asyncio
import logging
import threading
import time

import pytest

import leasehold
from leasehold import testing


def worker_for(fake, handler, **kwargs):
    options = dict(wait=0, max_jobs=1, exit_when_idle=True, handle_signals=False)
    options.update(kwargs)
    return leasehold.Worker(handler, client=fake.client(), **options)


def work_until_stopped(job, steps=200, pause=0.05):
    """A handler's loop: saves a checkpoint per step and checks between steps."""
    for i in range(job.checkpoint or 0, steps):
        job.save(i + 1)
        job.sleep(pause)
    return {"steps": steps}


# ---- how the attempt ends


def test_a_returned_value_completes_the_job_with_it_as_the_result():
    outcome = testing.run(lambda job: {"echo": job.payload, "attempt": job.attempt}, {"n": 1})
    assert (outcome.status, outcome.phase) == ("succeeded", "Succeeded")
    assert outcome.result == {"echo": {"n": 1}, "attempt": 1}
    assert outcome.calls == [("complete", 200, None)]


def test_none_is_a_result_too():
    outcome = testing.run(lambda job: None)
    assert (outcome.status, outcome.result) == ("succeeded", None)


def test_fail_with_retry_after_is_sent_as_whole_seconds_rounded_up(fake):
    answers = []

    def handle(job):
        answers.append(job.fail("RateLimited", "the vendor said wait", retryable=True, retry_after=2.2))

    fake.add_job("j")
    worker_for(fake, handle).run()
    outcome = fake.outcome("j")
    assert (outcome.status, outcome.reason, outcome.retryable) == ("failed", "RateLimited", True)
    assert outcome.retry_after_seconds == 3
    assert [r.body["retryAfterSeconds"] for r in fake.requests if r.route == "fail"] == [3]
    assert answers[0]["phase"] == "Queued" and answers[0]["retryAfter"].endswith("Z")
    assert fake.job("j").retry_after == answers[0]["retryAfter"]


def test_raising_fail_with_retry_after_sends_it_too():
    def handle(job):
        raise leasehold.Fail("RateLimited", "later", retryable=True, retry_after=0.5)

    outcome = testing.run(handle)
    assert (outcome.reason, outcome.retryable, outcome.retry_after_seconds) == ("RateLimited", True, 1)


def test_retry_after_without_retryable_is_refused_before_anything_is_sent():
    refused = []

    def handle(job):
        with pytest.raises(leasehold.InvalidRequest) as err:
            job.fail("BadInput", "no", retryable=False, retry_after=5)
        refused.append(str(err.value))
        with pytest.raises(leasehold.InvalidRequest):
            job.fail("RateLimited", "too long", retryable=True, retry_after=86401)
        return "carried on"

    outcome = testing.run(handle)
    assert "not retryable" in refused[0]
    assert outcome.calls == [("complete", 200, None)]  # no fail reached the sidecar
    assert outcome.result == "carried on"


def test_fail_not_retryable_ends_the_job_failed():
    def handle(job):
        raise leasehold.Fail("BadPayload", "no 'images' in the payload")

    outcome = testing.run(handle)
    assert (outcome.status, outcome.reason, outcome.retryable, outcome.phase) == (
        "failed",
        "BadPayload",
        False,
        "Failed",
    )
    assert outcome.retry_after_seconds is None


def test_an_exception_fails_the_attempt_as_retryable_worker_error():
    def handle(job):
        raise KeyError("images")

    outcome = testing.run(handle)
    assert (outcome.reason, outcome.retryable, outcome.phase) == ("WorkerError", True, "Queued")
    assert outcome.message == "KeyError: 'images'"


def test_a_result_that_is_not_json_fails_the_attempt_as_not_retryable():
    class Transcript:
        pass

    outcome = testing.run(lambda job: Transcript())
    assert (outcome.status, outcome.reason, outcome.retryable, outcome.phase) == (
        "failed",
        "ResultNotJSON",
        False,
        "Failed",
    )
    assert "result of type Transcript is not JSON" in outcome.message
    assert [c.route for c in outcome.calls] == ["fail"]


def test_a_handler_that_ends_nothing_has_its_job_released(fake):
    def handle(job):
        job.release()

    outcome = testing.run(handle)
    assert (outcome.status, outcome.phase) == ("released", "Queued")


# ---- lease loss and cancellation


def test_a_lease_lost_mid_job_stops_the_handler_and_nothing_is_sent_after():
    seen = []

    def handle(job):
        try:
            return work_until_stopped(job)
        except leasehold.JobLost as err:
            seen.append(err)
            raise

    outcome = testing.run(handle, lease_duration=0.6, setup=lambda fake: fake.lose_lease("job", after_heartbeats=2))
    assert outcome.status == "lost" and outcome.reason == "LeaseExpired"
    assert isinstance(seen[0], leasehold.LeaseLost)
    assert outcome.heartbeats == 2
    assert outcome.calls == [("heartbeat", 200, None)] * 2 + [("heartbeat", 409, "lease_lost")]
    assert outcome.phase == "Queued"  # requeued for another attempt, with the checkpoint last accepted


def test_a_handler_that_never_checks_sends_no_result_once_its_lease_is_lost():
    def handle(job):
        deadline = time.monotonic() + 5
        while not job.interrupted.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)  # blocking work, no check()
        return {"late": True}

    outcome = testing.run(handle, lease_duration=0.6, setup=lambda fake: fake.lose_lease("job", after_heartbeats=1))
    assert outcome.status == "lost"
    assert [c.route for c in outcome.calls] == ["heartbeat", "heartbeat"]  # no complete
    assert outcome.result is None


def test_the_lease_can_be_lost_when_a_given_checkpoint_was_sent(fake):
    def handle(job):
        for i in range(50):
            job.save(i + 1)
            job.heartbeat()  # every checkpoint is sent
        return "all done"

    fake.add_job("j", {"steps": 50})
    fake.lose_lease("j", at_checkpoint=3)
    worker_for(fake, handle).run()
    outcome = fake.outcome("j")
    assert outcome.status == "lost"
    assert outcome.checkpoints == [1, 2, 3]
    assert outcome.calls[-1] == ("heartbeat", 409, "lease_lost")
    assert fake.job("j").checkpoint == 3  # the next attempt resumes from it


def test_the_lease_can_be_lost_when_a_condition_on_a_heartbeat_holds(fake):
    fake.add_job("j", lease_duration=0.3)
    fake.lose_lease("j", when=lambda beat: beat.checkpoint is not None and beat.checkpoint >= 5)
    worker_for(fake, lambda job: work_until_stopped(job, pause=0.02)).run()
    outcome = fake.outcome("j")
    assert outcome.status == "lost"
    assert outcome.checkpoints[-1] >= 5 and all(c < 5 for c in outcome.checkpoints[:-1])


def test_cancellation_reaches_the_handler_at_its_next_check():
    seen = []

    def handle(job):
        try:
            return work_until_stopped(job)
        except leasehold.JobLost as err:
            seen.append(err)
            raise

    outcome = testing.run(handle, lease_duration=0.6, setup=lambda fake: fake.cancel("job", after_heartbeats=1))
    assert (outcome.status, outcome.phase) == ("cancelled", "Cancelled")
    assert isinstance(seen[0], leasehold.Cancelled)
    assert outcome.calls[-1] == ("heartbeat", 409, "cancelled")
    assert [c.route for c in outcome.calls].count("complete") == 0


# ---- resume and the attempt history


def test_a_job_resumes_from_its_checkpoint():
    seen = []

    def handle(job):
        seen.append((job.attempt, job.checkpoint, job.saved))
        return work_until_stopped(job, steps=7, pause=0)

    outcome = testing.run(handle, checkpoint=5, attempt=2)
    assert seen == [(2, 5, 5)]
    assert (outcome.attempt, outcome.resumed_from, outcome.result) == (2, 5, {"steps": 7})


def test_a_released_job_is_resumed_by_the_next_attempt_with_its_latest_checkpoint(fake):
    def handle(job):
        if job.attempt == 1:
            job.save({"offset": 4096})
            return job.release()  # sends the checkpoint first
        return {"from": job.checkpoint}

    fake.add_job("j")
    assert worker_for(fake, handle, max_jobs=2).run() == 2
    first, second = fake.outcomes("j")
    assert [c.route for c in first.calls] == ["heartbeat", "release"]
    assert first.checkpoints == [{"offset": 4096}]
    assert (second.attempt, second.result) == (2, {"from": {"offset": 4096}})


def test_the_last_attempt_and_the_earlier_failures_are_visible_to_the_handler():
    seen = []

    def handle(job):
        seen.append((job.attempt, job.max_attempts, job.last_attempt, [f["reason"] for f in job.failures]))

    testing.run(handle, max_attempts=3, failures=["Timeout", {"reason": "LeaseExpired", "message": "frozen"}])
    testing.run(handle, max_attempts=3, failures=["Timeout"])
    testing.run(handle, max_attempts=1)
    assert seen == [
        (3, 3, True, ["Timeout", "LeaseExpired"]),
        (2, 3, False, ["Timeout"]),
        (1, 1, True, []),
    ]


def test_a_failure_history_entry_has_the_documented_shape():
    seen = []
    testing.run(lambda job: seen.append(job.failures), failures=["Timeout"])
    (entry,) = seen[0]
    assert set(entry) == {"attempt", "holder", "reason", "message", "time"}
    assert (entry["attempt"], entry["reason"]) == (1, "Timeout")


def test_a_retryable_failure_on_the_last_attempt_ends_the_job_failed(fake):
    fake.add_job("j", max_attempts=2)

    def handle(job):
        raise leasehold.Fail("Flaky", "attempt %d" % job.attempt, retryable=True)

    assert worker_for(fake, handle, max_jobs=5).run() == 2
    assert [(o.attempt, o.phase) for o in fake.outcomes("j")] == [(1, "Queued"), (2, "Failed")]
    assert [f["reason"] for f in fake.job("j").failures] == ["Flaky", "Flaky"]


# ---- a slow sidecar


def test_heartbeats_answered_unavailable_for_a_while_are_retried_and_the_job_completes():
    def setup(fake):
        fake.at("job", lambda: fake.unavailable("heartbeat", seconds=0.8), after_heartbeats=1)

    outcome = testing.run(lambda job: work_until_stopped(job, steps=50), lease_duration=1.5, setup=setup)
    assert outcome.status == "succeeded"
    routes = [(c.route, c.status) for c in outcome.calls]
    assert ("heartbeat", 503) in routes
    assert routes[routes.index(("heartbeat", 503)) :].count(("heartbeat", 200)) >= 1  # recovered


def test_heartbeats_answered_late_still_keep_the_job():
    def setup(fake):
        fake.delay(0.3, "heartbeat")

    outcome = testing.run(lambda job: work_until_stopped(job, steps=25), lease_duration=1.2, setup=setup)
    assert outcome.status == "succeeded"
    assert outcome.heartbeats >= 2


def test_a_lease_with_no_confirmed_heartbeat_for_a_whole_lease_is_given_up():
    seen = []

    def handle(job):
        try:
            return work_until_stopped(job)
        except leasehold.LeaseUnconfirmed as err:
            seen.append(err)
            raise

    def setup(fake):
        fake.at("job", lambda: fake.unavailable("heartbeat"), after_heartbeats=1)

    started = time.monotonic()
    outcome = testing.run(handle, lease_duration=1, setup=setup)
    assert seen and "whole lease" in str(seen[0])
    assert time.monotonic() - started < 5
    routes = [c.route for c in outcome.calls]
    assert "complete" not in routes and "fail" not in routes
    # The client gives the job back (the sidecar might still hold it), sending no result.
    assert (outcome.status, outcome.calls[-1]) == ("released", ("release", 200, None))
    assert outcome.calls[-2] == ("heartbeat", 503, "unavailable")


def test_an_attempt_unconfirmed_for_longer_than_a_lease_is_fenced(fake):
    fake.add_job("j", lease_duration=0.5)
    client = fake.client()
    job = leasehold.Job.claim(client, wait=0)
    fake.unavailable("heartbeat")
    with pytest.raises(leasehold.Unavailable) as err:
        client.heartbeat("j", job.token)
    assert err.value.expires_at is not None
    time.sleep(0.8)  # a lease and the fake's grace (min(1 s, lease / 2))
    with pytest.raises(leasehold.LeaseLost):
        client.release("j", job.token)
    assert fake.outcome("j").status == "lost"
    assert [f["reason"] for f in fake.job("j").failures] == ["LeaseExpired"]


def test_an_unavailable_completion_is_repeated_until_it_lands(fake):
    fake.add_job("j")
    fake.unavailable("complete", times=2)
    worker_for(fake, lambda job: "done").run()
    outcome = fake.outcome("j")
    assert outcome.calls == [("complete", 503, "unavailable")] * 2 + [("complete", 200, None)]
    assert outcome.result == "done"


# ---- stopping


def test_a_sidecar_shutting_down_ends_the_worker_with_one_line(fake, caplog):
    fake.add_job("j")
    fake.shut_down()
    worker = worker_for(fake, lambda job: None, wait=1, exit_when_idle=False, max_jobs=0)
    with caplog.at_level(logging.INFO, logger="leasehold"):
        started = time.monotonic()
        assert worker.run() == 0
    assert time.monotonic() - started < 1.0
    lines = [r.getMessage() for r in caplog.records if "shutting" in r.getMessage()]
    assert lines == ["The sidecar is shutting down: claiming nothing more; handled 0 job(s)"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert fake.outcome("j") is None


def test_a_sidecar_that_starts_shutting_down_while_a_job_runs_lets_it_finish(fake):
    fake.add_job("j", lease_duration=0.6)
    fake.at("j", fake.shut_down, after_heartbeats=0)
    worker = worker_for(fake, lambda job: work_until_stopped(job, steps=6), wait=1, exit_when_idle=False, max_jobs=0)
    assert worker.run() == 1
    assert fake.outcome("j").status == "succeeded"  # heartbeats and the completion still worked
    assert [r.error for r in fake.requests if r.route == "claim"][-1] == "shutting_down"


def test_a_stop_request_releases_the_running_job_with_its_latest_checkpoint(fake):
    fake.add_job("j", lease_duration=0.6)
    worker = worker_for(fake, lambda job: work_until_stopped(job))
    fake.at("j", worker.stop, after_heartbeats=1)
    worker.run()
    outcome = fake.outcome("j")
    assert (outcome.status, outcome.phase) == ("released", "Queued")
    assert fake.job("j").checkpoint == outcome.checkpoints[-1]
    assert outcome.calls[-1] == ("release", 200, None)


# ---- async handlers


def test_an_async_handler_runs_its_job_to_the_end():
    async def handle(job):
        for i in range(job.checkpoint or 0, 8):
            await asyncio.sleep(0.05)
            job.save(i + 1)
            job.check()
        return {"async": True}

    outcome = testing.run(handle, lease_duration=0.6)
    assert (outcome.status, outcome.result) == ("succeeded", {"async": True})
    assert outcome.heartbeats >= 1


def test_an_async_handler_learns_of_a_lost_lease_between_awaits():
    async def handle(job):
        while True:
            await asyncio.sleep(0.05)
            job.check()

    outcome = testing.run(handle, lease_duration=0.6, setup=lambda fake: fake.lose_lease("job", after_heartbeats=1))
    assert outcome.status == "lost"
    assert outcome.calls[-1] == ("heartbeat", 409, "lease_lost")


def test_an_async_handler_runs_when_the_caller_already_runs_an_event_loop():
    async def handle(job):
        await asyncio.sleep(0)
        return "from a loop"

    async def caller():
        return testing.run(handle)

    assert asyncio.run(caller()).result == "from a loop"


def test_a_handler_that_cannot_be_run_is_refused_when_the_worker_is_made(fake):
    def steps(job):
        yield job

    async def agen(job):
        yield job

    class Steps:
        def __call__(self, job):
            yield job

    for handler, says in [
        (Steps(), "is a generator function"),
        (42, "handler must be a function"),
        ("handle", "handler must be a function"),
        (steps, "is a generator function"),
        (agen, "is a generator function"),
    ]:
        with pytest.raises(TypeError) as refused:
            leasehold.Worker(handler, client=fake.client())
        assert says in str(refused.value)


# ---- progress


def test_progress_rides_on_the_heartbeats():
    def handle(job):
        job.progress(0.25, "a quarter")
        job.heartbeat()
        job.progress(0.5)
        job.heartbeat()
        job.progress(message="half, and more")
        job.heartbeat()

    outcome = testing.run(handle)
    assert outcome.progress == [(0.25, "a quarter"), (0.5, "a quarter"), (0.5, "half, and more")]
    assert outcome.latest_progress == (0.5, "half, and more")


@pytest.mark.parametrize(
    "fraction, message, says",
    [
        (1.5, None, "out of range"),
        (-0.1, None, "out of range"),
        (True, None, "out of range"),
        ("half", None, "out of range"),
        (None, "line\nbreak", "control character"),
        (None, "tab\there", "control character"),
        (None, "é" * 129, "258 bytes"),
        (None, 7, "not a string"),
    ],
)
def test_bad_progress_is_refused_at_once_and_never_sent(fraction, message, says):
    refused = []

    def handle(job):
        with pytest.raises(leasehold.InvalidRequest) as err:
            job.progress(fraction, message)
        refused.append(str(err.value))
        job.heartbeat()

    outcome = testing.run(handle)
    assert says in refused[0]
    assert outcome.progress == []  # the heartbeat carried none
    assert outcome.calls[0] == ("heartbeat", 200, None)


def test_a_checkpoint_over_64_kib_is_refused_before_it_is_sent():
    def handle(job):
        with pytest.raises(leasehold.TooLarge):
            job.save("x" * (64 * 1024))
        job.save("x" * 100)

    outcome = testing.run(handle)
    assert outcome.status == "succeeded"


def test_an_async_handler_that_swallows_its_cancellation_keeps_its_slot_until_it_ends(fake):
    # Two jobs, one slot: the first is cancelled, its handler catches the CancelledError and
    # goes on for a while. The second must not start before the first handler has ended.
    fake.add_job("stubborn", lease_duration=0.6)
    fake.add_job("next", lease_duration=0.6)
    fake.cancel("stubborn", after_heartbeats=1)
    timeline = []

    async def handle(job):
        timeline.append(("start", job.name, time.monotonic()))
        if job.name == "stubborn":
            for _ in range(40):
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    timeline.append(("swallowed", job.name, time.monotonic()))
                    await asyncio.sleep(0.5)  # keeps running after its cancellation
                    break
        timeline.append(("end", job.name, time.monotonic()))
        return {"done": job.name}

    worker = worker_for(fake, handle, max_jobs=2, concurrency=1, heartbeat_interval=0.1)
    assert worker.run() == 2
    events = [(kind, name) for kind, name, _ in timeline]
    assert events == [
        ("start", "stubborn"),
        ("swallowed", "stubborn"),
        ("end", "stubborn"),
        ("start", "next"),
        ("end", "next"),
    ], events
    assert fake.outcome("stubborn").status == "cancelled"  # nothing sent after the loss
    assert fake.outcome("next").status == "succeeded"
