"""Traces across the queue (leasehold.tracing): the handler runs inside a span parented on
the producer's traceparent, with OpenTelemetry's SDK recording it in memory; and without
OpenTelemetry, nothing changes."""

import asyncio
import os
import subprocess
import sys
import threading

import pytest

import leasehold
from leasehold import testing, tracing

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = "00-%s-%s-01" % (TRACE_ID, PARENT_ID)

_exporter = InMemorySpanExporter()


@pytest.fixture
def spans():
    """The spans ended during the test (the SDK provider is set once per process: the
    global provider cannot be replaced)."""
    if not getattr(trace.get_tracer_provider(), "_leasehold_test", False):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        provider._leasehold_test = True
        trace.set_tracer_provider(provider)
    _exporter.clear()
    yield _exporter
    _exporter.clear()


def job_spans(exporter):
    return [s for s in exporter.get_finished_spans() if s.name.startswith("leasehold.job")]


def test_the_handler_runs_in_a_span_parented_on_the_producers(spans):
    seen = {}

    def handle(job):
        seen["traceparent"] = job.traceparent
        seen["current"] = trace.get_current_span().get_span_context()
        return "ok"

    outcome = testing.run(handle, traceparent=TRACEPARENT, tracestate="rojo=00f067aa0ba902b7", attempt=2)
    assert outcome.status == "succeeded"
    assert seen["traceparent"] == TRACEPARENT
    (span,) = job_spans(spans)
    assert span.name == "leasehold.job jobs"
    assert span.kind == SpanKind.CONSUMER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.parent.is_remote
    assert span.context.trace_state.get("rojo") == "00f067aa0ba902b7"
    # Current in the handler's thread.
    assert seen["current"].span_id == span.context.span_id
    assert dict(span.attributes) == {
        "messaging.system": "leasehold",
        "messaging.operation.type": "process",
        "messaging.destination.name": "jobs",
        "messaging.message.id": "job",
        "leasehold.namespace": "default",
        "leasehold.attempt": 2,
        "leasehold.outcome": "complete",
    }
    assert span.status.status_code == StatusCode.UNSET


def test_a_failed_attempt_records_the_exception_and_an_error_status(spans):
    def handle(job):
        raise leasehold.Fail("BadInput", "no such file", retryable=False)

    outcome = testing.run(handle, traceparent=TRACEPARENT)
    assert outcome.status == "failed"
    (span,) = job_spans(spans)
    assert span.status.status_code == StatusCode.ERROR
    assert "no such file" in span.status.description
    (event,) = [e for e in span.events if e.name == "exception"]
    assert event.attributes["exception.type"].endswith("Fail")
    assert span.attributes["leasehold.outcome"] == "fail"

    # A result that is not JSON fails the attempt too, after the handler returned.
    spans.clear()
    outcome = testing.run(lambda job: object())
    assert outcome.reason == "ResultNotJSON"
    (span,) = job_spans(spans)
    assert span.status.status_code == StatusCode.ERROR


def test_a_job_handed_back_on_shutdown_is_not_an_error(spans):
    def handle(job):
        raise leasehold.ShutdownRequested("stopping")

    outcome = testing.run(handle)
    assert outcome.status == "released"
    (span,) = job_spans(spans)
    assert span.status.status_code == StatusCode.UNSET
    assert span.attributes["leasehold.outcome"] == "release"


@pytest.mark.parametrize(
    "traceparent",
    [
        None,
        # Malformed: the sidecar (and the fake) hand over none.
        "00-%s-%s-01" % (TRACE_ID.upper(), PARENT_ID),
        "00-%s-%s-01" % ("0" * 32, PARENT_ID),
        "01-%s-%s-01" % (TRACE_ID, PARENT_ID),
    ],
)
def test_without_a_valid_traceparent_the_span_is_a_root(spans, traceparent):
    seen = {}

    def handle(job):
        seen["traceparent"] = job.traceparent
        return None

    # Even inside a span of the test's own, the job's span does not become its child.
    with trace.get_tracer("test").start_as_current_span("outer"):
        testing.run(handle, traceparent=traceparent)
    assert seen["traceparent"] is None
    (span,) = job_spans(spans)
    assert span.parent is None
    assert format(span.context.trace_id, "032x") != TRACE_ID


def test_an_async_handler_runs_with_the_span_current_in_its_task(spans):
    seen = {}

    async def handle(job):
        await asyncio.sleep(0.01)
        seen[job.name] = trace.get_current_span().get_span_context()
        return job.name

    parents = {"a": "00-%s-%s-01" % (TRACE_ID, "1" * 16), "b": "00-%s-%s-01" % ("a" * 32, "2" * 16)}
    with testing.FakeSidecar(queue="media") as fake:
        for name, tp in parents.items():
            fake.add_job(name, traceparent=tp)
        leasehold.Worker(
            handle, client=fake.client(), wait=0, max_jobs=2, exit_when_idle=True, handle_signals=False, concurrency=2
        ).run()
        assert [fake.outcome(n).status for n in parents] == ["succeeded", "succeeded"]
    by_job = {s.attributes["messaging.message.id"]: s for s in job_spans(spans)}
    assert set(by_job) == {"a", "b"}
    for name, tp in parents.items():
        span = by_job[name]
        assert span.name == "leasehold.job media"
        assert "00-%032x-%016x-01" % (span.context.trace_id, span.parent.span_id) == tp
        assert seen[name].span_id == span.context.span_id


def test_sync_handlers_running_at_once_each_see_their_own_span(spans):
    seen = {}
    both = threading.Barrier(2, timeout=5)

    def handle(job):
        both.wait()  # both run at once, in two threads
        seen[job.name] = trace.get_current_span().get_span_context().trace_id
        return None

    with testing.FakeSidecar() as fake:
        fake.add_job("a", traceparent="00-%s-%s-01" % ("a" * 32, PARENT_ID))
        fake.add_job("b", traceparent="00-%s-%s-01" % ("b" * 32, PARENT_ID))
        leasehold.Worker(
            handle, client=fake.client(), wait=0, max_jobs=2, exit_when_idle=True, handle_signals=False, concurrency=2
        ).run()
    assert {n: format(t, "032x") for n, t in seen.items()} == {"a": "a" * 32, "b": "b" * 32}


def test_current_traceparent_is_the_active_spans(spans):
    assert tracing.current_traceparent() is None
    with trace.get_tracer("test").start_as_current_span("submit") as span:
        ctx = span.get_span_context()
        want = "00-%032x-%016x-%02x" % (ctx.trace_id, ctx.span_id, ctx.trace_flags)
        assert tracing.current_traceparent() == want


def test_without_opentelemetry_handlers_run_unchanged(spans, monkeypatch):
    # The import of the package fails, as when it is not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    seen = {}

    def handle(job):
        seen["traceparent"] = job.traceparent
        return {"done": True}

    outcome = testing.run(handle, traceparent=TRACEPARENT)
    assert (outcome.status, outcome.result) == ("succeeded", {"done": True})
    assert seen["traceparent"] == TRACEPARENT  # the claim's field is there all the same

    async def handle_async(job):
        raise leasehold.Fail("Boom", "async", retryable=False)

    assert testing.run(handle_async, traceparent=TRACEPARENT).reason == "Boom"
    assert job_spans(spans) == []
    assert tracing.current_traceparent() is None
    assert tracing.job_span(object()).span is None


def test_importing_the_client_imports_no_opentelemetry():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys; import leasehold, leasehold.testing, leasehold.tracing; "
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=here, check=True)
