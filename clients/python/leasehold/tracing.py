"""Traces across the queue, with OpenTelemetry when it is installed (``pip install
'leasehold[otel]'``; docs/protocol.md, "Traces across the queue").

A producer puts its span's W3C ``traceparent`` on the job (the annotation
``leasehold.dev/traceparent``: :func:`current_traceparent` gives it), the sidecar hands it to
the worker with the claim (:attr:`leasehold.Job.traceparent`), and :class:`leasehold.Worker`
runs the handler inside a span whose parent is the producer's span (:func:`job_span`):

* name ``leasehold.job <queue>`` (the job's name when the sidecar does not say its queue),
  kind CONSUMER;
* attributes of OpenTelemetry's messaging conventions: ``messaging.system`` =
  ``"leasehold"``, ``messaging.operation.type`` = ``"process"``,
  ``messaging.destination.name`` = the queue, ``messaging.message.id`` = the job's name,
  plus ``leasehold.namespace`` and ``leasehold.attempt`` (the attempt number, from 1);
* the exception recorded and the status ERROR when the handler raises (a
  :class:`leasehold.Fail` included) or the attempt ends failed; a job handed back on
  shutdown (:class:`leasehold.ShutdownRequested`) or cancelled is not an error.

Parent rather than link: a claim hands one job to one handler, the single-message case for
which the messaging conventions make the producer's context the consumer span's parent
(links are for batches, whose messages have many parents). Each attempt of the job is a child
of the producer's span, retries included. A job without a (valid) traceparent gets a root span.

OpenTelemetry is optional: this module imports it only when asked, each time (a cached
``sys.modules`` lookup), and without the ``opentelemetry-api`` package every function here is
a no-op: no span, nothing imported, the handler runs as it would anyway. The API alone makes
non-recording spans; install and configure an SDK (``opentelemetry-sdk``) to export them.
"""

import logging
import re
from typing import Any, Awaitable, Optional

__all__ = ["current_traceparent", "job_span", "parse_traceparent", "TRACER_NAME"]

log = logging.getLogger("leasehold")

#: The instrumentation scope of the spans made here.
TRACER_NAME = "leasehold"

# W3C Trace Context, version 00 (section 3.2.2): lowercase hex, neither id all zeros.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})\Z")


def parse_traceparent(value: Any) -> Optional[str]:
    """``value`` if it is a valid W3C traceparent of version 00
    (``00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>``, lowercase, neither id all
    zeros), else None: the rule the sidecar applies to the annotation."""
    if not isinstance(value, str):
        return None
    m = _TRACEPARENT.match(value)
    if m is None or set(m.group(1)) == {"0"} or set(m.group(2)) == {"0"}:
        return None
    return value


def _otel() -> Any:
    """The OpenTelemetry API's modules, or None when the package is not installed."""
    try:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return None
    return context, trace, TraceContextTextMapPropagator


def current_traceparent() -> Optional[str]:
    """The W3C traceparent of the current OpenTelemetry span, to set as a job's annotation
    ``leasehold.dev/traceparent`` when submitting it; None when OpenTelemetry is not
    installed or no valid span is current."""
    otel = _otel()
    if otel is None:
        return None
    _, _, propagator = otel
    carrier: dict = {}
    propagator().inject(carrier)
    return parse_traceparent(carrier.get("traceparent"))


class _JobSpan:
    """The span of one attempt, current while it is entered (see :func:`job_span`)."""

    def __init__(self, otel: Any, job: Any, end_on_exit: bool):
        context, trace, propagator = otel
        self._end_on_exit = end_on_exit
        self._ended = False
        self._context, self._trace = context, trace
        carrier = {}
        traceparent = parse_traceparent(getattr(job, "traceparent", None))
        if traceparent is not None:
            carrier["traceparent"] = traceparent
            tracestate = getattr(job, "tracestate", None)
            if isinstance(tracestate, str) and tracestate:
                carrier["tracestate"] = tracestate
        # The W3C propagator itself, not the global one (a no-op until an SDK sets it): the
        # claim's fields are W3C headers whatever the application propagates. Without a
        # traceparent, an empty context: a root span, not a child of whatever is current in
        # the worker's thread.
        parent = propagator().extract(carrier) if carrier else context.Context()
        queue = getattr(job, "queue", None)
        attributes = {
            "messaging.system": "leasehold",
            "messaging.operation.type": "process",
            "messaging.message.id": job.name,
            "leasehold.attempt": job.attempt,
        }
        if queue:
            attributes["messaging.destination.name"] = queue
        if getattr(job, "namespace", None):
            attributes["leasehold.namespace"] = job.namespace
        tracer = trace.get_tracer(TRACER_NAME)
        self.span = tracer.start_span(
            "leasehold.job %s" % (queue or job.name),
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
        )
        self._job = job
        self._token: Any = None
        self._errored = False

    def __enter__(self) -> Any:
        self._token = self._context.attach(self._trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        from .errors import Cancelled, ShutdownRequested

        try:
            self._context.detach(self._token)
            if err is not None and not isinstance(err, (ShutdownRequested, Cancelled)):
                self.span.record_exception(err)
                self._error("%s: %s" % (type(err).__name__, err))
        finally:
            if self._end_on_exit:
                self.end()

    def _error(self, description: str) -> None:
        if not self._errored:
            self._errored = True
            self.span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, description))

    def end(self) -> None:
        """Ends the span (once), saying how the attempt ended (``leasehold.outcome``:
        ``complete``, ``fail``, ``release``), an error if it failed."""
        if self._ended:
            return
        self._ended = True
        try:
            ended = getattr(self._job, "ended", None)
            if ended:
                self.span.set_attribute("leasehold.outcome", ended)
            if ended == "fail":
                self._error("the attempt failed")
        finally:
            self.span.end()

    def carry(self, awaitable: Awaitable[Any]) -> Awaitable[Any]:
        """``awaitable`` as a coroutine that makes this span current in the task that runs
        it (an async handler runs as a task on the worker's event loop, in another thread,
        whose context is not the one this span was made current in)."""
        current, context = self._trace.set_span_in_context(self.span), self._context

        async def carried() -> Any:
            token = context.attach(current)
            try:
                return await awaitable
            finally:
                context.detach(token)

        return carried()


class _NoSpan:
    """No OpenTelemetry: nothing to do."""

    span = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

    def carry(self, awaitable: Awaitable[Any]) -> Awaitable[Any]:
        return awaitable

    def end(self) -> None:
        return None


def job_span(job: Any, end_on_exit: bool = True) -> Any:
    """A context manager that makes the span of ``job``'s attempt current while entered,
    records an exception that leaves it (see the module) and ends it on exit, or, with
    ``end_on_exit=False``, at its ``end()``; its ``carry(awaitable)`` makes the span current
    in the task that runs an async handler. Without OpenTelemetry it does nothing (``span``
    is None). Used by :class:`leasehold.Worker` (which ends the span once the attempt has
    ended, to say how); call it yourself when you claim with :meth:`leasehold.Job.claim`::

        with leasehold.tracing.job_span(job), job:
            ...
    """
    otel = _otel()
    if otel is None:
        return _NoSpan()
    try:
        return _JobSpan(otel, job, end_on_exit)
    except Exception:  # tracing must never cost a job
        log.exception("No span for %s: OpenTelemetry failed", getattr(job, "label", job))
        return _NoSpan()

