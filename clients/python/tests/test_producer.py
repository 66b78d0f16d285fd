"""leasehold.Producer against the real API server and controller: idempotent submit (also
across producers: `kubectl leasehold submit` with the same key finds the same job), await of
results and failures (sync and async), cancel, retry, list, bad input."""

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest

import leasehold
from conftest import HERE, NAMESPACE, env, status, wait_until


@pytest.fixture
def producer():
    return leasehold.Producer(NAMESPACE)


def work(procs, queue, identity, handler, jobs=1):
    """Runs a worker for ``jobs`` jobs of ``queue`` in a thread; returns the thread."""
    sidecar = procs.sidecar(queue, identity)
    worker = leasehold.Worker(handler, client=leasehold.Client(sidecar.base), wait=10, max_jobs=jobs, handle_signals=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def test_the_same_key_is_one_job_from_any_producer_and_another_spec_is_refused(producer, queue):
    first = producer.submit(queue, {"url": "s3://media/a.wav", "n": 3}, key="upload-1", priority=5)
    assert first.created and first.name == leasehold.producer.name_for_key(queue, "upload-1")
    again = producer.submit(queue, {"n": 3, "url": "s3://media/a.wav"}, key="upload-1", priority=5)
    assert (again.name, again.created) == (first.name, False)
    with pytest.raises(leasehold.IdempotencyConflict) as refused:
        producer.submit(queue, {"url": "s3://media/b.wav", "n": 3}, key="upload-1")
    # The fields given whose values differ, and those the job sets that were left out.
    assert refused.value.differs == ["spec.payload", "spec.priority (not given now)"], refused.value
    assert first.name in str(refused.value)
    # kubectl leasehold submit follows the same rule: the same job, found by its key and spec.
    cli = subprocess.run(
        [env("LEASEHOLD_BIN"), "submit", queue, "-n", NAMESPACE, "--key", "upload-1", "--priority", "5",
         "--payload", json.dumps({"url": "s3://media/a.wav", "n": 3}), "-o", "name"],
        capture_output=True, text=True, timeout=30,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert cli.stdout.strip() == first.name
    # And the other way round.
    cli = subprocess.run(
        [env("LEASEHOLD_BIN"), "submit", queue, "-n", NAMESPACE, "--key", "from-cli", "--payload", '{"ü": [1, 2]}',
         "--max-attempts", "2", "-o", "name"],
        capture_output=True, text=True, timeout=30,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert producer.submit(queue, {"ü": [1, 2]}, key="from-cli", max_attempts=2).created is False
    assert [j.name for j in producer.list(queue=queue)] == sorted([first.name, cli.stdout.strip()])


def test_wait_returns_the_workers_result_sync_and_async(producer, procs, queue):
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    job = producer.submit(queue, {"words": ["a", "b", "c"]}, key="count-1", lease_duration=10, traceparent=parent)
    seen = []

    def count(j):
        seen.append(j.traceparent)
        return {"count": len(j.payload["words"])}

    work(procs, queue, "counter", count, jobs=2)
    assert producer.wait(job.name, timeout=30) == {"count": 3}
    second = producer.submit(queue, {"words": ["x"]}, lease_duration=10)
    assert second.name.startswith(queue + "-") and second.created
    assert asyncio.run(producer.wait_async(second.name, timeout=30)) == {"count": 1}
    assert seen[0] == parent  # the worker was handed the producer's trace context
    assert producer.get(second.name).phase == "Succeeded"
    assert [j.name for j in producer.list(queue=queue, phase="Succeeded")] == sorted([job.name, second.name])


def test_wait_raises_with_the_failure_history_and_retry_gives_a_new_attempt(producer, procs, queue):
    job = producer.submit(queue, {"codec": "opus"}, max_attempts=1, lease_duration=10)
    seen = []

    def handle(j):
        seen.append(j.attempt)
        if j.attempt == 1:
            raise leasehold.Fail("BadAudio", "no audio stream", retryable=True)
        return {"ok": True}

    work(procs, queue, "transcoder", handle, jobs=2)
    with pytest.raises(leasehold.JobFailed) as failed:
        producer.wait(job.name, timeout=30)
    assert [(f["attempt"], f["reason"]) for f in failed.value.failures] == [(1, "BadAudio")]
    assert "no audio stream" in str(failed.value) and failed.value.job.phase == "Failed"
    retried = producer.retry(job.name)
    assert retried.phase == "Queued" and retried.raw["spec"]["maxAttempts"] == 2
    assert producer.wait(job.name, timeout=30) == {"ok": True}
    assert seen == [1, 2]
    s = status(job.name)
    assert [(f["attempt"], f["reason"]) for f in s["failures"]] == [(1, "BadAudio")]
    with pytest.raises(leasehold.InvalidRequest, match="only a Failed or Cancelled job"):
        producer.retry(job.name)


def test_cancel_ends_the_wait_and_timeouts_and_bad_input_are_clear(producer, queue):
    job = producer.submit(queue, {"n": 1})
    with pytest.raises(leasehold.WaitTimeout, match="did not finish within 1s"):
        producer.wait(job.name, timeout=1)
    waiter_error = []

    def waiter():
        try:
            producer.wait(job.name, timeout=30)
        except leasehold.LeaseholdError as err:
            waiter_error.append(err)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert producer.cancel(job.name).raw["spec"]["cancel"] is True
    thread.join(30)
    assert isinstance(waiter_error[0], leasehold.JobCancelled), waiter_error
    assert producer.cancel(job.name).phase == "Cancelled"  # again: as it is
    with pytest.raises(leasehold.JobNotFound):
        producer.get("no-such-job")
    # Bad input: refused here or by the API server, naming the field; nothing is created.
    for call, says in [
        (lambda: producer.submit("Bad_Queue"), "is not a DNS label"),
        (lambda: producer.submit(queue, key=""), "idempotency key '' is empty"),
        (lambda: producer.submit(queue, name="Bad"), "is not a valid LeasedJob name"),
        (lambda: producer.submit(queue, {"x": float("nan")}), "not JSON"),
        (lambda: producer.submit(queue, lease_duration=1), "leaseDurationSeconds"),
        (lambda: producer.list(phase="Done"), "phase 'Done' is not one of"),
    ]:
        with pytest.raises(leasehold.InvalidRequest) as refused:
            call()
        assert says in str(refused.value), refused.value
    with pytest.raises(leasehold.InvalidRequest, match="traceparent"):
        producer.submit(queue, traceparent="00-XYZ")
    assert [j.name for j in producer.list(queue=queue)] == [job.name]
    wait_until("the job Cancelled", 10, lambda: status(job.name).get("phase") == "Cancelled")


def test_the_readme_submit_example_runs_and_is_idempotent(procs, queue):
    example = os.path.join(HERE, "..", "examples", "submit.py")
    env_vars = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))

    def submit(order):
        return subprocess.run(
            [sys.executable, example, queue, "s3://media/talk.wav", order, NAMESPACE],
            capture_output=True, text=True, timeout=60, env=env_vars,
        )

    seen = []

    def transcribe(job):
        seen.append(job.payload)
        return {"words": 5644, "audio": job.payload["audio"]}

    work(procs, queue, "transcriber", transcribe, jobs=1)
    first = submit("8812")
    assert first.returncode == 0, first.stdout + first.stderr
    assert json.loads(first.stdout) == {"words": 5644, "audio": "s3://media/talk.wav"}
    assert "submitted " in first.stderr
    again = submit("8812")  # the same key: the same job, its result, no new work
    assert again.returncode == 0 and again.stdout == first.stdout, again.stdout + again.stderr
    assert "already submitted" in again.stderr
    assert len(seen) == 1
