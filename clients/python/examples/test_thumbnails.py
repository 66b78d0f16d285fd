"""Tests of the example handler (thumbnails.py) against the in-process fake sidecar of
leasehold.testing: no cluster, no sidecar process. Run: python -m pytest examples/"""

import leasehold
from leasehold import testing

from thumbnails import handle


def test_makes_every_thumbnail_and_completes():
    outcome = testing.run(handle, {"images": ["a", "b", "c"]})
    assert outcome.status == "succeeded"
    assert outcome.result == {"thumbnails": 3}


def test_resumes_from_the_checkpoint_of_an_earlier_attempt():
    outcome = testing.run(handle, {"images": ["a", "b", "c"]}, checkpoint=2, attempt=2)
    assert outcome.status == "succeeded"
    assert outcome.result == {"thumbnails": 1}  # only "c" was left


def test_a_rate_limit_fails_the_attempt_as_retryable_with_the_stores_delay():
    outcome = testing.run(handle, {"images": ["a", "limited:2.5"]})
    assert (outcome.status, outcome.reason, outcome.retryable) == ("failed", "RateLimited", True)
    assert outcome.retry_after_seconds == 3  # sent in whole seconds, rounded up
    assert outcome.phase == "Queued"  # attempts are left: it is retried
    assert "last attempt" not in outcome.message


def test_on_the_last_attempt_the_failure_says_so():
    outcome = testing.run(handle, {"images": ["limited:1"]}, max_attempts=3, failures=["RateLimited"] * 2)
    assert (outcome.reason, outcome.retryable, outcome.phase) == ("RateLimited", True, "Failed")
    assert outcome.message.endswith("(last attempt: the job now fails)")


def test_a_lost_lease_stops_the_work_and_the_next_attempt_resumes():
    images = ["img%d" % i for i in range(12)]
    with testing.FakeSidecar() as fake:
        fake.add_job("thumbs", {"images": images}, lease_duration=0.6)  # a heartbeat every 0.2 s
        fake.lose_lease("thumbs", after_heartbeats=2)
        worker = leasehold.Worker(
            handle, client=fake.client(), wait=0, max_jobs=2, exit_when_idle=True, handle_signals=False
        )
        assert worker.run() == 2
        first, second = fake.outcomes("thumbs")
    assert first.status == "lost"
    assert first.calls[-1] == ("heartbeat", 409, "lease_lost")  # nothing was sent after it
    assert second.resumed_from == first.checkpoints[-1] > 0
    assert second.result == {"thumbnails": 12 - second.resumed_from}
