"""The leasehold Python client against the real sidecar and control plane."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import leasehold
from conftest import HERE, NAMESPACE, create_job, kubectl, status, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def claim_one(client, wait=10, **kwargs):
    job = leasehold.Job.claim(client, wait=wait, **kwargs)
    assert job is not None, "nothing claimed"
    return job


class EventsOf:
    """The JSON event lines a worker process prints (steps_worker.py), read in a thread."""

    def __init__(self, proc):
        self.lines = []
        self.thread = threading.Thread(target=self._read, args=(proc.popen.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        for line in stream:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                pass

    def find(self, **want):
        return [e for e in self.lines if all(e.get(k) == v for k, v in want.items())]

    def wait(self, what, timeout=20, **want):
        return wait_until(what, timeout, lambda: self.find(**want))


def steps_worker(procs, name, sidecar, on_shutdown="release", max_jobs=1, extra=()):
    proc = procs.start(
        name,
        [sys.executable, os.path.join(HERE, "steps_worker.py"), sidecar.base, on_shutdown, "--max-jobs", str(max_jobs)]
        + list(extra),
        stdout=subprocess.PIPE,
    )
    return proc, EventsOf(proc)


def test_a_job_is_claimed_checkpointed_released_and_resumed_from_its_checkpoint(procs, queue, recorder):
    create_job("resume", queue, {"n": 7}, lease=10)
    sidecar = procs.sidecar(queue, "resume-a")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    first = claim_one(client)
    assert (first.name, first.namespace, first.attempt, first.payload, first.checkpoint) == (
        "resume",
        NAMESPACE,
        1,
        {"n": 7},
        None,
    )
    assert first.lease_duration == 10.0
    with first:
        first.save({"offset": 4096})
        answer = first.heartbeat()
        assert answer["leaseDurationSeconds"] == 10 and "expiresAt" in answer
        first.save({"offset": 8192})  # not sent yet: the release sends it first
        assert first.release()["phase"] == "Queued"
    assert recorder.kinds("resume", 1)[-2:] == [("heartbeat", 200), ("release", 200)]
    assert [e.checkpoint for e in recorder.events if e.kind == "heartbeat"] == [{"offset": 4096}, {"offset": 8192}]

    second = claim_one(client)
    assert (second.attempt, second.checkpoint) == (2, {"offset": 8192})
    with second:
        second.complete({"words": 12})
    s = status("resume")
    assert (s["phase"], s["attempt"], s["result"]) == ("Succeeded", 2, {"words": 12})
    with pytest.raises(leasehold.JobEnded):
        second.complete({"again": True})


def lease_annotations(job_name):
    """The annotations of the job's Lease; none while the Lease is not written yet (the
    attempt's first renewal writes it)."""
    listed = json.loads(kubectl("get", "lease", "--field-selector", "metadata.name=ljob-" + job_name, "-o", "json"))
    if not listed["items"]:
        return {}
    return listed["items"][0]["metadata"].get("annotations") or {}


def test_progress_rides_on_the_heartbeats_and_bad_progress_is_refused(procs, queue, recorder):
    create_job("progress", queue, lease=6)
    sidecar = procs.sidecar(queue, "progress-a")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    job = claim_one(client)
    # Checked before anything is sent, with the sidecar's rules and words.
    for fraction, message in [(1.5, None), (-0.1, None), ("half", None), (0.5, "x" * 257), (0.5, "two\nlines")]:
        with pytest.raises(leasehold.InvalidRequest):
            job.progress(fraction, message)
    # The sidecar refuses the same, naming the field: nothing is renewed.
    with pytest.raises(leasehold.InvalidRequest) as refused:
        client.heartbeat(job.name, job.token, progress=2)
    assert refused.value.message.startswith("progress 2 is out of range"), refused.value.message
    with job:
        job.progress(0.25, "a quarter")
        # The next background heartbeat (every 2 s) carries it.
        wait_until(
            "progress on the Lease",
            10,
            lambda: lease_annotations("progress").get("leasehold.dev/progress") == "0.25",
        )
        job.progress(message="still a quarter")
        job.heartbeat()
        annotations = lease_annotations("progress")
        assert annotations.get("leasehold.dev/progress") == "0.25"
        assert annotations.get("leasehold.dev/progress-message") == "still a quarter"
        job.complete("done")


def test_background_heartbeats_keep_a_job_that_makes_no_calls_for_three_leases(procs, queue, recorder):
    create_job("quiet", queue, lease=5)
    # --worker-timeout 1: the sidecar stops renewing for a worker silent for max(1, 5) s.
    sidecar = procs.sidecar(queue, "quiet", ["--worker-timeout", "1"])
    client = leasehold.Client(sidecar.base, on_event=recorder)
    with claim_one(client) as job:
        assert job.heartbeat_interval == pytest.approx(5 / 3)
        time.sleep(15)
        job.check()
        job.complete("done")
    beats = [e for e in recorder.events if e.kind == "heartbeat"]
    assert len(beats) >= 7 and all(e.status == 200 for e in beats), beats
    assert status("quiet")["attempt"] == 1 and status("quiet")["phase"] == "Succeeded"


def test_a_frozen_worker_learns_it_lost_the_lease_and_sends_no_result(procs, queue):
    create_job("frozen", queue, {"steps": 30, "stepSeconds": 0.2}, lease=5)
    sidecar = procs.sidecar(queue, "frozen-a", ["--worker-timeout", "1"])
    worker, events = steps_worker(procs, "frozen-worker", sidecar)
    events.wait("a heartbeat with a checkpoint", kind="heartbeat", status=200)
    worker.signal(signal.SIGSTOP)
    # Another worker gets the job once the controller requeued it, and finishes it.
    other = leasehold.Client(procs.sidecar(queue, "frozen-b").base)
    job = wait_until("the requeued job", 30, lambda: leasehold.Job.claim(other, wait=2))
    assert job.attempt == 2 and job.checkpoint["step"] >= 1, job.claim_answer
    worker.signal(signal.SIGCONT)
    lost = events.wait("the frozen worker's lost event", 10, kind="lost", attempt=1)
    assert "lease_lost" in lost[0]["message"], lost
    with job:
        job.complete({"by": "b"})
    assert worker.popen.wait(10) == 0
    # Its refused heartbeat was the only call it made after waking: no result was offered.
    assert not events.find(kind="complete"), events.lines
    assert events.find(kind="heartbeat", status=409, error="lease_lost")
    assert status("frozen")["result"] == {"by": "b"}


def test_a_frozen_sidecar_makes_the_job_lost_within_about_a_lease_and_no_result_is_sent(procs, queue, recorder):
    create_job("frozen-sidecar", queue, lease=5)
    sidecar = procs.sidecar(queue, "fs-a")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    job = claim_one(client)
    with job:
        job.save({"step": 1})
        job.heartbeat()
        sidecar.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        with pytest.raises(leasehold.LeaseUnconfirmed) as lost:
            while True:
                job.sleep(0.1)
        noticed = time.monotonic() - frozen
        assert job.interrupted.is_set()
        assert 4.5 <= noticed <= 8, noticed
        assert "frozen-sidecar" in str(lost.value) and "whole lease" in str(lost.value)
        with pytest.raises(leasehold.LeaseUnconfirmed):
            job.complete({"late": True})
        # Leaving the block gives the job back, in case the sidecar still holds it (it renews
        # leases for a worker it heard from lately): 200 if so, 409 if it was requeued.
        sidecar.signal(signal.SIGCONT)
    assert not [e for e in recorder.events if e.kind in ("complete", "fail")], recorder.events
    ending = recorder.events[-1]
    assert (ending.kind, ending.status) in (("release", 200), ("lost", None)), recorder.events
    # The controller requeued it on its own clock; its next owner resumes from the checkpoint.
    other = leasehold.Client(procs.sidecar(queue, "fs-b").base)
    again = wait_until("the requeued job", 30, lambda: leasehold.Job.claim(other, wait=2))
    assert (again.attempt, again.checkpoint) == (2, {"step": 1})
    with again:
        again.complete()


def test_cancellation_reaches_the_handler_within_a_heartbeat(procs, queue, recorder):
    create_job("cancel-me", queue, lease=6)
    sidecar = procs.sidecar(queue, "cancel")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    job = claim_one(client)
    with job:
        kubectl("patch", "ljob", "cancel-me", "--type", "merge", "-p", '{"spec":{"cancel":true}}')
        patched = time.monotonic()
        assert job.interrupted.wait(job.heartbeat_interval + 3), "no cancellation seen"
        assert time.monotonic() - patched <= job.heartbeat_interval + 3
        with pytest.raises(leasehold.Cancelled) as cancelled:
            job.check()
        assert cancelled.value.status == 409 and cancelled.value.code == "cancelled"
        assert "cancel-me" in cancelled.value.message
        with pytest.raises(leasehold.Cancelled):
            job.complete("too late")
    assert status("cancel-me")["phase"] == "Cancelled"
    assert ("complete", 409) not in recorder.kinds() and recorder.kinds()[-1] == ("lost", None)


def test_sigterm_releases_the_running_job_with_its_latest_checkpoint(procs, queue):
    create_job("term", queue, {"steps": 100, "stepSeconds": 0.1}, lease=10)
    sidecar = procs.sidecar(queue, "term-a")
    worker, events = steps_worker(procs, "term-worker", sidecar, "release", max_jobs=0)
    events.wait("the job started", kind="started")
    time.sleep(1.0)
    worker.signal(signal.SIGTERM)
    assert worker.popen.wait(10) == 0
    released = events.find(kind="release", status=200)
    assert len(released) == 1, events.lines
    s = status("term")
    assert (s["phase"], s["attempt"]) == ("Queued", 1)
    client = leasehold.Client(sidecar.base)
    job = claim_one(client)
    # The release sent the last checkpoint first: nothing done was lost.
    last_sent = [e["checkpoint"] for e in events.find(kind="heartbeat", status=200)][-1]
    assert job.checkpoint == last_sent and job.checkpoint["step"] >= 5, (job.checkpoint, last_sent)
    with job:
        job.complete()


def test_sigterm_with_finish_lets_the_job_complete_and_claims_nothing_more(procs, queue):
    create_job("finish", queue, {"steps": 10, "stepSeconds": 0.2}, lease=10)
    create_job("finish-next", queue, {"steps": 1, "stepSeconds": 0}, lease=10, priority=-1)
    sidecar = procs.sidecar(queue, "finish-a")
    worker, events = steps_worker(procs, "finish-worker", sidecar, "finish", max_jobs=0)
    events.wait("the job started", kind="started", name="finish")
    worker.signal(signal.SIGTERM)
    assert worker.popen.wait(15) == 0
    assert events.find(kind="complete", status=200, name="finish"), events.lines
    assert status("finish")["result"] == {"steps": 10, "attempt": 1}
    assert status("finish-next")["phase"] == "Queued"


def test_a_handler_failure_fails_the_attempt_retryable_or_not(procs, queue, recorder):
    create_job("flaky", queue, lease=10, maxAttempts=3, backoff={"initialSeconds": 0, "maxSeconds": 0})
    sidecar = procs.sidecar(queue, "flaky")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    seen = []

    def handle(job):
        seen.append(job.attempt)
        if job.attempt == 1:
            raise RuntimeError("disk full")
        raise leasehold.Fail("BadInput", "payload.x: missing", retryable=False)

    worker = leasehold.Worker(handle, client=client, wait=5, max_jobs=2, handle_signals=False)
    assert worker.run() == 2
    assert seen == [1, 2]
    s = status("flaky")
    assert s["phase"] == "Failed"
    assert [(f["attempt"], f["reason"]) for f in s["failures"]] == [(1, "WorkerError"), (2, "BadInput")]
    assert "RuntimeError: disk full" in s["failures"][0]["message"]


def test_a_handler_sees_its_attempt_history_and_a_failure_sets_its_own_delay(procs, queue, recorder):
    create_job("quota", queue, lease=10, maxAttempts=2, backoff={"initialSeconds": 300, "maxSeconds": 600})
    sidecar = procs.sidecar(queue, "quota")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    seen = []

    def handle(job):
        seen.append((job.attempt, job.max_attempts, job.last_attempt, [f["reason"] for f in job.failures]))
        if not job.last_attempt:
            raise leasehold.Fail("RateLimited", "vendor said 429", retryable=True, retry_after=1.5)
        return {"fallback": True}

    started = time.monotonic()
    worker = leasehold.Worker(handle, client=client, wait=10, max_jobs=2, handle_signals=False)
    assert worker.run() == 2
    # 2 s (1.5 rounded up) instead of the backoff's 150 to 300 s.
    assert time.monotonic() - started < 10
    assert seen == [(1, 2, False, []), (2, 2, True, ["RateLimited"])]
    assert status("quota")["phase"] == "Succeeded"
    with pytest.raises(leasehold.InvalidRequest, match="not retryable"):
        leasehold.Job(client, {"name": "x", "token": "1." + "0" * 32}).fail("X", retryable=False, retry_after=5)
    with pytest.raises(leasehold.InvalidRequest, match="retry_after"):
        leasehold.Job(client, {"name": "x", "token": "1." + "0" * 32}).fail("X", retryable=True, retry_after=-1)


def test_every_documented_error_code_is_a_typed_exception_with_the_servers_message(procs, queue, recorder):
    # The table of docs/protocol.md lists the codes; each has its class.
    with open(os.path.join(REPO, "docs", "protocol.md")) as f:
        documented = set(re.findall(r"^\| \d{3} \| `([a-z_]+)` \|", f.read(), re.M))
    assert len(documented) >= 14 and documented == set(leasehold.ERRORS), documented ^ set(leasehold.ERRORS)

    create_job("errors", queue, lease=10)
    sidecar = procs.sidecar(queue, "errors")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    with pytest.raises(leasehold.InvalidRequest) as e:
        client.claim(301)
    assert e.value.status == 400 and "wait" in e.value.message
    job = claim_one(client)
    with pytest.raises(leasehold.InvalidToken) as e:
        client.heartbeat("errors", "not-a-token")
    assert e.value.status == 400 and e.value.message
    with pytest.raises(leasehold.JobNotFound) as e:
        client.heartbeat("no-such-job", job.token)
    assert "no-such-job" in e.value.message and isinstance(e.value, leasehold.JobLost)
    with pytest.raises(leasehold.InvalidName):
        client.heartbeat("Not_A_Name", job.token)
    with pytest.raises(leasehold.InvalidRequest) as e:
        client.fail("errors", job.token, "not camel case!", "x")
    assert "reason" in e.value.message
    with pytest.raises(leasehold.TooLarge):
        client.complete("errors", job.token, "x" * (1024 * 1024))  # over the body limit: not sent
    with pytest.raises(leasehold.TooLarge):
        job.save("y" * (64 * 1024 + 1))  # refused here, before the sidecar would
    with pytest.raises(leasehold.NotFound):
        client._job_call("frobnicate", "errors", None, {"token": job.token}, 5)
    with pytest.raises(leasehold.LeaseLost) as e:
        client.heartbeat("errors", "1." + "0" * 32)  # well-formed, but not the holder's
    assert e.value.status == 409 and "errors" in e.value.message
    with job:
        job.complete({"ok": True})
    with pytest.raises(leasehold.JobFinished):
        client.complete("errors", job.token, {"again": True})
    # A draining sidecar refuses claims but still serves the job it holds, then exits.
    create_job("errors-held", queue, lease=10)
    held = claim_one(client)
    sidecar.signal(signal.SIGTERM)
    with pytest.raises(leasehold.ShuttingDown) as e:
        wait_until("a draining sidecar", 5, lambda: client.claim(0))
    assert e.value.status == 503
    with held:
        held.complete({"ok": True})
    assert sidecar.popen.wait(10) == 0
    with pytest.raises(leasehold.ConnectionFailed):
        client.claim(0)


def test_a_result_too_large_for_the_job_is_refused_and_the_job_is_still_held(procs, queue):
    create_job("big", queue, {"blob": "p" * 900000}, lease=10)
    sidecar = procs.sidecar(queue, "big")
    with claim_one(leasehold.Client(sidecar.base)) as job:
        with pytest.raises(leasehold.TooLarge) as e:
            job.complete({"blob": "r" * 900000})  # payload and result: past what the API server stores
        assert e.value.status == 413 and "big" in e.value.message, e.value
        job.complete({"blob": "stored elsewhere"})
    assert status("big")["result"] == {"blob": "stored elsewhere"}


def test_the_package_installs_with_pip(tmp_path):
    # From a copy: building writes build/ and *.egg-info beside the sources.
    source = tmp_path / "src"
    shutil.copytree(
        os.path.join(REPO, "clients", "python"), str(source), ignore=shutil.ignore_patterns("__pycache__", "tests")
    )
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import leasehold, sys; print(leasehold.__file__, leasehold.__version__)"],
        cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True,
    )
    assert probe.returncode == 0 and probe.stdout.startswith(str(target)), probe.stdout + probe.stderr


def test_an_async_handler_runs_its_job_to_the_end(procs, queue, recorder):
    create_job("awaited", queue, {"n": 3}, lease=5)
    sidecar = procs.sidecar(queue, "awaited")
    client = leasehold.Client(sidecar.base, on_event=recorder)
    seen = []

    async def handle(job):
        for step in range(job.payload["n"]):
            await asyncio.sleep(0.05)
            job.check()
            seen.append(step)
        return {"steps": len(seen)}

    worker = leasehold.Worker(handle, client=client, wait=5, max_jobs=1, handle_signals=False)
    assert worker.run() == 1
    assert seen == [0, 1, 2]
    s = status("awaited")
    assert s["phase"] == "Succeeded", s
    assert s["result"] == {"steps": 3}


def test_an_async_handler_runs_when_the_calling_thread_already_runs_an_event_loop(procs, queue, recorder):
    create_job("in-a-loop", queue, {"n": 2}, lease=5)
    sidecar = procs.sidecar(queue, "in-a-loop")
    client = leasehold.Client(sidecar.base, on_event=recorder)

    async def handle(job):
        await asyncio.sleep(0.05)
        job.check()
        return {"n": job.payload["n"]}

    async def notebook():  # as a notebook cell or an async service would call it
        return leasehold.Worker(handle, client=client, wait=5, max_jobs=1, handle_signals=False).run()

    assert asyncio.run(notebook()) == 1
    s = status("in-a-loop")
    assert s["phase"] == "Succeeded", s
    assert s["result"] == {"n": 2}


def test_a_result_that_is_not_json_fails_the_attempt_once_naming_its_type(procs, queue, recorder):
    create_job("unencodable", queue, lease=5, maxAttempts=3)
    sidecar = procs.sidecar(queue, "unencodable")
    client = leasehold.Client(sidecar.base, on_event=recorder)

    class Transcript:
        pass

    worker = leasehold.Worker(lambda job: Transcript(), client=client, wait=5, max_jobs=1, handle_signals=False)
    assert worker.run() == 1
    s = status("unencodable")
    assert s["phase"] == "Failed", s
    assert [(f["attempt"], f["reason"]) for f in s["failures"]] == [(1, "ResultNotJSON")]
    assert "result of type Transcript is not JSON" in s["failures"][0]["message"]


def test_a_four_at_once_async_worker_runs_four_jobs_and_a_frozen_one_is_taken_over(procs, queue):
    names = ["four-%d" % i for i in range(4)]
    for name in names:
        create_job(name, queue, {"steps": 40, "stepSeconds": 0.2}, lease=5)
    sidecar = procs.sidecar(queue, "four-a", ["--worker-timeout", "1"])
    worker, events = steps_worker(procs, "four-worker", sidecar, max_jobs=4, extra=["--concurrency", "4", "--async"])
    # All four start before any could end (each is 8 s): they run at once, through one sidecar.
    wait_until("four jobs started", 20, lambda: len({e["name"] for e in events.find(kind="started")}) == 4)
    for name in names:
        events.wait("a checkpoint of %s" % name, kind="heartbeat", status=200, name=name)
    worker.signal(signal.SIGSTOP)
    # A sync worker, also four at once, takes every job over once the leases expire.
    other = leasehold.Client(procs.sidecar(queue, "four-b").base)
    lock = threading.Lock()
    running = {"now": 0, "peak": 0}
    resumed = {}

    def handle(job):
        with lock:
            running["now"] += 1
            running["peak"] = max(running["peak"], running["now"])
        try:
            resumed[job.name] = (job.attempt, job.checkpoint["step"], [f["reason"] for f in job.failures])
            job.sleep(1.0)
            return {"by": "b"}
        finally:
            with lock:
                running["now"] -= 1

    taker = leasehold.Worker(handle, client=other, wait=20, max_jobs=4, concurrency=4, handle_signals=False)
    assert taker.run() == 4
    assert sorted(resumed) == names
    for name, (attempt, step, reasons) in resumed.items():
        assert attempt == 2 and step >= 1 and reasons == ["LeaseExpired"], (name, attempt, step, reasons)
    assert running["peak"] >= 2, running
    worker.signal(signal.SIGCONT)
    # The frozen worker wakes, learns each job is lost, sends no result and exits 0.
    for name in names:
        events.wait("the frozen worker's lost event for %s" % name, 15, kind="lost", name=name, attempt=1)
    assert worker.popen.wait(15) == 0
    assert not events.find(kind="complete"), events.lines
    for name in names:
        s = status(name)
        assert (s["phase"], s["result"], s["attempt"]) == ("Succeeded", {"by": "b"}, 2), s


def test_concurrency_is_checked_when_the_worker_is_made():
    for bad in (0, -1, 257, 1.5, True, "4"):
        with pytest.raises(ValueError, match="concurrency must be"):
            leasehold.Worker(lambda job: None, client=leasehold.Client("http://127.0.0.1:9"), concurrency=bad)


def test_the_producers_traceparent_reaches_the_handler_and_parents_its_span(procs, queue):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    create_job("traced", queue, annotations={"leasehold.dev/traceparent": traceparent})
    # A malformed one does not keep its job from being claimed: it carries no traceparent.
    create_job("untraced", queue, annotations={"leasehold.dev/traceparent": "00-not-a-traceparent"})
    sidecar = procs.sidecar(queue, "traced-a")
    seen = {}

    def handle(job):
        seen[job.name] = (job.traceparent, job.queue, trace.get_current_span().get_span_context())

    leasehold.Worker(handle, client=leasehold.Client(sidecar.base), wait=5, max_jobs=2, handle_signals=False).run()
    assert seen["traced"][:2] == (traceparent, queue)
    assert seen["untraced"][:2] == (None, queue)
    spans = {s.attributes["messaging.message.id"]: s for s in exporter.get_finished_spans() if s.name.startswith("leasehold.job")}
    traced = spans["traced"]
    assert traced.name == "leasehold.job " + queue
    assert "00-%032x-%016x-01" % (traced.context.trace_id, traced.parent.span_id) == traceparent
    assert seen["traced"][2].span_id == traced.context.span_id
    assert spans["untraced"].parent is None
    assert (status("traced")["phase"], status("untraced")["phase"]) == ("Succeeded", "Succeeded")


def test_a_stop_ends_every_long_poll_and_a_job_arriving_after_it_is_not_claimed(procs, queue):
    sidecar = procs.sidecar(queue, "stopping")
    worker = leasehold.Worker(
        lambda job: {"ok": True}, client=leasehold.Client(sidecar.base), wait=20, concurrency=3, handle_signals=False
    )
    runner = threading.Thread(target=worker.run)
    runner.start()
    time.sleep(1.0)  # three claims now long-poll the sidecar
    worker.stop()
    runner.join(5)
    assert not runner.is_alive()
    create_job("late", queue, lease=5)
    time.sleep(2.0)
    # The stop shut the polls' connections, so the sidecar stopped those claims: the job
    # waits for a worker, unclaimed (before: claimed and released once per poll).
    s = status("late")
    assert (s.get("phase"), s.get("attempt", 0)) == ("Queued", 0), s
