"""Test a handler without a cluster: an in-process fake of the sidecar.

:class:`FakeSidecar` is a real HTTP server on ``127.0.0.1`` (a random port, in a thread of
this process) that answers the sidecar's worker API (docs/protocol.md, "The sidecar's HTTP
API") with the same routes, bodies, status codes and error codes as the real sidecar: claim
with a long poll, heartbeat with checkpoint and progress, complete, fail, release; the same
validation rules and the same fencing (a stale or foreign token gets 409 ``lease_lost``, a
finished job ``job_finished``, a cancelled one ``cancelled``; an ended attempt's token is
refused). Point the real client at it, ``Worker(handler, client=fake.client())``, and the
handler runs through the true :class:`leasehold.Worker` and :class:`leasehold.Job` code.

The common case in one call (``import leasehold.testing``, or ``from leasehold import
testing``: ``import leasehold`` alone does not load it)::

    from leasehold import testing

    def test_resumes_where_the_last_attempt_stopped():
        outcome = testing.run(handle, {"steps": 5}, checkpoint=3)
        assert (outcome.status, outcome.result) == ("succeeded", {"steps": 5})

And with the fake in hand, to lose the lease at a chosen moment::

    with testing.FakeSidecar() as fake:
        fake.add_job("j", {"steps": 5}, lease_duration=1)
        fake.lose_lease("j", after_heartbeats=2)        # the 3rd call for the attempt gets 409
        leasehold.Worker(handle, client=fake.client(), wait=0, max_jobs=1,
                         exit_when_idle=True, handle_signals=False).run()
        assert fake.outcome("j").status == "lost"

What the fake does not do: it keeps no real clock of leases unless asked (leases never run
out by themselves; see ``expire_leases``), applies no backoff of its own (a requeued job is
claimable at once, or after the failure's ``retryAfterSeconds``), has no priorities (jobs
are claimed in the order they were added), and serves only the worker's routes (plus
``/healthz`` and ``/readyz``). Standard library only.
"""

import json
import re
import secrets
import threading
import time
import traceback
import unicodedata
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .client import Client, Event
from .tracing import parse_traceparent
from .worker import Worker

__all__ = ["Call", "FakeJob", "FakeSidecar", "Heartbeat", "Outcome", "Request", "run"]

#: Routes a test can slow down or make unavailable (:meth:`FakeSidecar.delay`,
#: :meth:`FakeSidecar.unavailable`).
ROUTES = ("claim", "heartbeat", "complete", "fail", "release")
#: Largest request body, in bytes (the real sidecar's limit).
MAX_BODY_BYTES = 1024 * 1024
#: Largest checkpoint, in bytes of compact JSON.
MAX_CHECKPOINT_BYTES = 64 * 1024
#: Largest failure message, in bytes of UTF-8.
MAX_FAIL_MESSAGE_BYTES = 4096
#: Largest progress message, in bytes of UTF-8.
MAX_PROGRESS_MESSAGE_BYTES = 256
#: Largest ``retryAfterSeconds``; and the cap of a job without a backoff.
MAX_RETRY_AFTER_SECONDS = 86400
DEFAULT_RETRY_AFTER_CAP = 3600
MAX_WAIT_SECONDS = 300
#: The whole job (payload, result, ...) must stay under this many bytes of JSON.
MAX_JOB_BYTES = 1024 * 1024

_REASON = re.compile(r"[A-Za-z][A-Za-z0-9]*\Z")
_TOKEN = re.compile(r"([1-9][0-9]*)\.([0-9a-f]{32})\Z")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_UNSET = object()

_FIELDS = {
    "heartbeat": ("token", "checkpoint", "progress", "message"),
    "complete": ("token", "result"),
    "fail": ("token", "reason", "message", "retryable", "retryAfterSeconds"),
    "release": ("token",),
}


class Call(NamedTuple):
    """One exchange about an attempt, as the fake answered it: ``route`` (``"heartbeat"``,
    ``"complete"``, ``"fail"``, ``"release"``), the HTTP ``status``, and the error code of
    an error answer (``"lease_lost"``, ...) else None. Compare with plain tuples:
    ``("heartbeat", 409, "lease_lost")``."""

    route: str
    status: int
    error: Optional[str]


class Heartbeat(NamedTuple):
    """An accepted heartbeat, as a trigger's ``when`` predicate sees it: ``number`` (1 for
    the attempt's first), and the ``checkpoint``, ``progress`` and ``message`` it carried
    (None for a part it did not carry)."""

    number: int
    checkpoint: Any
    progress: Optional[float]
    message: Optional[str]


@dataclass
class Request:
    """One request the fake received (see :attr:`FakeSidecar.requests`).

    Attributes:
        route (str): ``"claim"``, ``"heartbeat"``, ``"complete"``, ``"fail"``, ``"release"``,
            or ``"other"`` (an unknown path or method).
        name (str or None): the job name of the URL, for a job route.
        body (Any): the parsed JSON body (None for a claim, or a body that was not JSON).
        status (int): the HTTP status answered.
        error (str or None): the error code answered, else None.
        time (float): when it arrived, ``time.monotonic()``.
    """

    route: str
    name: Optional[str]
    body: Any
    status: int = 0
    error: Optional[str] = None
    time: float = 0.0


@dataclass
class Outcome:
    """What one attempt did and how it ended, as the fake saw it.

    Attributes:
        name (str): the job. attempt (int): the attempt number. token (str): its token.
        resumed_from (Any): the checkpoint its claim handed over (None: a fresh start).
        status (str): ``"running"`` (not ended yet), ``"succeeded"``, ``"failed"``,
            ``"released"``, ``"lost"`` (its lease was lost or ran out: no ending was
            accepted) or ``"cancelled"``.
        result (Any): for ``"succeeded"``, the result.
        reason (str or None), message (str or None), retryable (bool or None),
        retry_after_seconds (int or None): for ``"failed"``, what the fail call sent
            (``retryAfterSeconds`` as sent, before the fake's cap); for ``"lost"``, reason
            ``"LeaseExpired"`` and what happened.
        phase (str or None): the job's phase right after this attempt ended (``"Queued"``,
            ``"Succeeded"``, ``"Failed"``, ``"Cancelled"``).
        heartbeats (int): heartbeats accepted (answered 200).
        checkpoints (list): the checkpoints accepted, in order.
        progress (list of (float or None, str or None)): the ``(progress, message)`` of
            every accepted heartbeat that carried either, in order.
        calls (list of :class:`Call`): every heartbeat, complete, fail and release with this
            attempt's token, in order, refused ones included.
    """

    name: str
    attempt: int
    token: str
    resumed_from: Any = None
    status: str = "running"
    result: Any = None
    reason: Optional[str] = None
    message: Optional[str] = None
    retryable: Optional[bool] = None
    retry_after_seconds: Optional[int] = None
    phase: Optional[str] = None
    heartbeats: int = 0
    checkpoints: List[Any] = field(default_factory=list)
    progress: List[Tuple[Optional[float], Optional[str]]] = field(default_factory=list)
    calls: List[Call] = field(default_factory=list)
    # internals
    _answer: Optional[Dict[str, Any]] = field(default=None, repr=False)
    _ended_by: Optional[str] = field(default=None, repr=False)
    _renewed_at: float = field(default=0.0, repr=False)
    _renewed_wall: Optional[datetime] = field(default=None, repr=False)
    _outage: bool = field(default=False, repr=False)
    _latest: Any = field(default=_UNSET, repr=False)

    @property
    def checkpoint(self) -> Any:
        """The last checkpoint this attempt saved, else the one it resumed from."""
        return self.checkpoints[-1] if self.checkpoints else self.resumed_from

    @property
    def latest_progress(self) -> Tuple[Optional[float], Optional[str]]:
        """``(progress, message)`` as last reported (each part as last sent; None if never)."""
        fraction = message = None
        for f, m in self.progress:
            fraction = f if f is not None else fraction
            message = m if m is not None else message
        return fraction, message


@dataclass
class FakeJob:
    """A snapshot of a job in the fake (see :meth:`FakeSidecar.job`).

    Attributes:
        name, namespace (str). payload (Any).
        phase (str): ``"Queued"``, ``"Leased"``, ``"Succeeded"``, ``"Failed"`` or
            ``"Cancelled"``.
        attempt (int): the latest attempt claimed (``status.attempt``; one less than the
            next claim's for a job never claimed).
        max_attempts (int). lease_duration (float, seconds).
        checkpoint (Any): the checkpoint the next claim hands over.
        result (Any): the result, once Succeeded.
        failures (list of dict): ``{attempt, holder, reason, message, time}``, oldest first.
        retry_after (str or None): not claimable before this time (RFC 3339), if set.
        attempts (list of :class:`Outcome`): the attempts claimed, oldest first.
    """

    name: str
    namespace: str
    payload: Any
    phase: str
    attempt: int
    max_attempts: int
    lease_duration: float
    checkpoint: Any
    result: Any
    failures: List[Dict[str, Any]]
    retry_after: Optional[str]
    attempts: List[Outcome]


class _Job:
    def __init__(self, name, namespace, payload, checkpoint, attempt, max_attempts, failures, lease, cap, trace):
        self.name = name
        self.trace = trace  # what the claim carries: {"traceparent", "tracestate"?}
        self.namespace = namespace
        self.payload = payload
        self.checkpoint = checkpoint
        self.attempt = attempt - 1  # status.attempt: the latest claimed
        self.max_attempts = max_attempts
        self.failures = failures
        self.lease = lease
        self.retry_cap = cap
        self.phase = "Queued"
        self.token: Optional[str] = None
        self.result: Any = None
        self.retry_after: Optional[float] = None  # monotonic
        self.retry_after_wall: Optional[datetime] = None
        self.attempts: List[Outcome] = []

    @property
    def ref(self):
        return "%s/%s" % (self.namespace, self.name)

    @property
    def current(self) -> Optional[Outcome]:
        return self.attempts[-1] if self.attempts else None


class _Trigger:
    def __init__(self, name, action, after_heartbeats, at_checkpoint, when):
        self.name = name
        self.action = action
        self.after_heartbeats = after_heartbeats
        self.at_checkpoint = at_checkpoint
        self.when = when
        self.fired = False

    def matches(self, beat: Optional[Heartbeat]) -> bool:
        """``beat`` None: the attempt was just claimed (heartbeat number 0)."""
        number = 0 if beat is None else beat.number
        if self.after_heartbeats is not None and number < self.after_heartbeats:
            return False
        if self.at_checkpoint is not _UNSET and (beat is None or beat.checkpoint != self.at_checkpoint):
            return False
        if self.when is not None and (beat is None or not self.when(beat)):
            return False
        return beat is not None or self.after_heartbeats == 0


class _Answer(Exception):
    def __init__(self, status, code=None, message="", body=None, close=False):
        Exception.__init__(self, message)
        self.status = status
        self.body = body if body is not None else {"error": code, "message": message}
        self.close = close


def _error(status, code, message, **extra):
    body = {"error": code, "message": message}
    body.update(extra)
    return _Answer(status, code, message, body)


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _whole_seconds_text(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _seconds_json(seconds: float) -> Any:
    return int(seconds) if float(seconds).is_integer() else seconds


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean `%s`" % ("true" if value else "false")
    if isinstance(value, int):
        return "integer `%d`" % value
    if isinstance(value, float):
        return "floating point `%s`" % value
    if isinstance(value, str):
        return "string %s" % json.dumps(value)
    return "sequence" if isinstance(value, list) else "map"


class FakeSidecar:
    """An in-process fake of the leasehold sidecar, for tests (see the module).

    It starts serving when made and stops at :meth:`close` (or the end of a ``with``
    block). Every method is safe to call from any thread, the test's or a trigger's.

    Args:
        namespace (str): the namespace the claims name.
        queue (str): the queue the claims name (the real sidecar serves one).
        identity (str): the worker identity recorded as ``holder`` of failures.
        expire_leases (bool): when True, an attempt whose lease is not renewed by an
            accepted heartbeat (or its claim) for ``lease_duration`` seconds is expired, as
            the controller would expire a worker that stopped heartbeating: its next call
            gets 409 ``lease_lost``, its outcome is ``"lost"`` with reason
            ``LeaseExpired``, and the job is requeued. When False (the default) leases
            last as long as the test wants, as the real sidecar keeps them renewed in the
            background; but, as the real sidecar does, an attempt whose heartbeats were
            answered ``unavailable`` (:meth:`unavailable`) with no accepted one for a whole
            lease is lost all the same.

    Attributes:
        url (str): ``http://127.0.0.1:PORT``.
        requests (list of :class:`Request`): every request received, in order.
    """

    def __init__(
        self, namespace: str = "default", identity: str = "fake-worker", expire_leases: bool = False, queue: str = "jobs"
    ):
        self.namespace = namespace
        self.queue = queue
        self.identity = identity
        self.expire_leases = expire_leases
        self.requests: List[Request] = []
        self._lock = threading.Condition(threading.RLock())
        self._jobs: Dict[str, _Job] = {}
        self._order: List[str] = []
        self._triggers: List[_Trigger] = []
        self._delays: Dict[str, float] = {}
        self._outages: Dict[str, Tuple[Optional[int], Optional[float]]] = {}
        self._shutting_down = False
        self._closed = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-sidecar", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> "FakeSidecar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<FakeSidecar %s>" % self.url

    def close(self) -> None:
        """Stops serving: claims waiting in their long poll are answered 503
        ``shutting_down``, later connections are refused. Records stay readable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def client(self, on_event: Optional[Callable[[Event], None]] = None) -> Client:
        """A :class:`leasehold.Client` for this fake (``on_event`` as for ``Client``)."""
        return Client(self.url, on_event=on_event)

    # ---- jobs

    def add_job(
        self,
        name: Optional[str] = None,
        payload: Any = None,
        *,
        checkpoint: Any = None,
        attempt: Optional[int] = None,
        max_attempts: int = 3,
        failures: Any = (),
        lease_duration: float = 60,
        backoff_max_seconds: Optional[int] = None,
        traceparent: Optional[str] = None,
        tracestate: Optional[str] = None,
    ) -> str:
        """Queues a job, claimable at once; returns its name.

        Args:
            name (str or None): a lowercase RFC 1123 subdomain; default ``job-N``.
            payload (Any): ``spec.payload``, any JSON (default ``{}``).
            checkpoint (Any): the checkpoint the claim hands over (an earlier attempt's), or
                None for a fresh start.
            attempt (int or None): the attempt number the claim hands out, from 1; default
                one more than the failures given.
            max_attempts (int): failed attempts that end the job (at least 1). The claim's
                ``lastAttempt`` is true when ``len(failures) + 1 >= max_attempts``.
            failures (list): the job's earlier failed attempts, oldest first, each a reason
                (str) or a dict ``{attempt?, holder?, reason, message?, time?}`` (missing
                keys are filled in); or an int, that many failures with reason
                ``WorkerError``.
            lease_duration (float): leaseDurationSeconds, in seconds (> 0; unlike the real
                sidecar's 5..86400, short leases such as 1 s keep tests fast: heartbeats
                go every lease / 3).
            backoff_max_seconds (int or None): the job's ``backoff.maxSeconds``, which caps
                a failure's ``retryAfterSeconds`` (3600 without a backoff). The fake applies
                no backoff delay of its own.
            traceparent (str or None): the job's annotation ``leasehold.dev/traceparent``,
                the producer's W3C traceparent: every claim of the job carries it, as the
                sidecar does, unless it is malformed (then the claim carries none).
            tracestate (str or None): the annotation ``leasehold.dev/tracestate``, carried
                beside a valid traceparent.

        Raises:
            ValueError: a bad name, a name already taken, or a bad number.
        """
        with self._lock:
            if name is None:
                name = "job-%d" % (len(self._order) + 1)
            if not _valid_name(name):
                raise ValueError("job name %r is not a lowercase RFC 1123 subdomain" % (name,))
            if name in self._jobs:
                raise ValueError("job %r was already added" % name)
            if isinstance(failures, int) and not isinstance(failures, bool):
                failures = ["WorkerError"] * failures
            records = []
            for i, f in enumerate(failures):
                f = {"reason": f} if isinstance(f, str) else dict(f)
                f.setdefault("attempt", i + 1)
                f.setdefault("holder", self.identity)
                f.setdefault("message", "")
                f.setdefault("time", _rfc3339(_now()))
                records.append(f)
            if attempt is None:
                attempt = len(records) + 1
            if not isinstance(attempt, int) or attempt < 1:
                raise ValueError("attempt must be a whole number from 1, not %r" % (attempt,))
            if not isinstance(max_attempts, int) or max_attempts < 1:
                raise ValueError("max_attempts must be a whole number from 1, not %r" % (max_attempts,))
            if not isinstance(lease_duration, (int, float)) or lease_duration <= 0:
                raise ValueError("lease_duration must be a number of seconds above 0, not %r" % (lease_duration,))
            cap = DEFAULT_RETRY_AFTER_CAP if backoff_max_seconds is None else backoff_max_seconds
            trace = {}
            if parse_traceparent(traceparent) is not None:
                trace["traceparent"] = traceparent
                if isinstance(tracestate, str) and tracestate:
                    trace["tracestate"] = tracestate
            self._jobs[name] = _Job(
                name,
                self.namespace,
                {} if payload is None else payload,
                checkpoint,
                attempt,
                max_attempts,
                records,
                float(lease_duration),
                cap,
                trace,
            )
            self._order.append(name)
            self._lock.notify_all()
            return name

    def job(self, name: str) -> FakeJob:
        """A snapshot of job ``name``. Raises KeyError for an unknown job."""
        with self._lock:
            self._expire_due()
            j = self._jobs[name]
            return FakeJob(
                j.name,
                j.namespace,
                j.payload,
                j.phase,
                j.attempt,
                j.max_attempts,
                j.lease,
                j.checkpoint,
                j.result,
                [dict(f) for f in j.failures],
                _whole_seconds_text(j.retry_after_wall) if j.retry_after_wall else None,
                list(j.attempts),
            )

    def outcome(self, name: str) -> Optional[Outcome]:
        """The latest attempt of job ``name`` (None if it was never claimed). The object is
        live: it keeps changing while the attempt runs."""
        with self._lock:
            self._expire_due()
            return self._jobs[name].current

    def outcomes(self, name: str) -> List[Outcome]:
        """Every attempt of job ``name``, oldest first."""
        with self._lock:
            self._expire_due()
            return list(self._jobs[name].attempts)

    # ---- what the test makes happen

    def at(
        self,
        name: str,
        action: Callable[[], Any],
        *,
        after_heartbeats: Optional[int] = None,
        at_checkpoint: Any = _UNSET,
        when: Optional[Callable[[Heartbeat], bool]] = None,
    ) -> None:
        """Runs ``action()`` once, when an attempt of job ``name`` meets every condition
        given: its ``after_heartbeats``-th heartbeat was accepted (0: as soon as it is
        claimed), an accepted heartbeat carried ``at_checkpoint`` (compared with ==; only
        the latest checkpoint saved goes with each heartbeat, so one saved faster than
        heartbeats go may never be sent: use ``when`` for a threshold), ``when(heartbeat)``
        is true for an accepted :class:`Heartbeat`. The action runs in the fake's server
        thread after the heartbeat (or claim) was applied and before it is answered, so
        what it changes applies from the attempt's next call on: e.g.
        ``fake.at("j", lambda: fake.unavailable("heartbeat", seconds=2), after_heartbeats=1)``.
        An exception of the action is printed and ignored.
        """
        if after_heartbeats is None and at_checkpoint is _UNSET and when is None:
            raise ValueError("give a condition: after_heartbeats, at_checkpoint or when")
        if after_heartbeats is not None and (not isinstance(after_heartbeats, int) or after_heartbeats < 0):
            raise ValueError("after_heartbeats must be a whole number from 0, not %r" % (after_heartbeats,))
        with self._lock:
            self._triggers.append(_Trigger(name, action, after_heartbeats, at_checkpoint, when))

    def lose_lease(
        self,
        name: str,
        *,
        after_heartbeats: Optional[int] = None,
        at_checkpoint: Any = _UNSET,
        when: Optional[Callable[[Heartbeat], bool]] = None,
    ) -> None:
        """Loses the lease of job ``name``'s running attempt, as when it expired: now, or,
        with a condition, at that moment (see :meth:`at`). The attempt's outcome becomes
        ``"lost"`` (reason ``LeaseExpired``, recorded as a failure), the job is requeued
        with the checkpoint last accepted (or Failed, when that was its last attempt), and
        every later call with the attempt's token is refused: 409 ``lease_lost`` (409
        ``job_finished`` once the job is Failed).

        Raises:
            ValueError: without a condition, when no attempt of the job is running.
        """
        self._now_or_at(name, lambda: self._lose(name, "the test took the lease away"), after_heartbeats, at_checkpoint, when)

    def cancel(
        self,
        name: str,
        *,
        after_heartbeats: Optional[int] = None,
        at_checkpoint: Any = _UNSET,
        when: Optional[Callable[[Heartbeat], bool]] = None,
    ) -> None:
        """Cancels job ``name`` (``spec.cancel``): now, or at the moment a condition gives
        (see :meth:`at`). A queued job ends Cancelled at once; a running attempt's outcome
        becomes ``"cancelled"`` and every later call with its token gets 409 ``cancelled``.
        A finished job is left as it is."""
        if after_heartbeats is None and at_checkpoint is _UNSET and when is None:
            self._cancel(name)
        else:
            self.at(name, lambda: self._cancel(name), after_heartbeats=after_heartbeats, at_checkpoint=at_checkpoint, when=when)

    def delay(self, seconds: float, *routes: str) -> None:
        """Delays every answer of ``routes`` (default: all of :data:`ROUTES`) by ``seconds``
        before the call is applied and answered (a claim's after its long poll); 0 ends it.
        A client whose timeout is shorter gets no answer (ConnectionFailed), and the call is
        applied all the same, as a call stuck in a slow API server may still land."""
        routes = self._routes(routes)
        with self._lock:
            for route in routes:
                if seconds > 0:
                    self._delays[route] = float(seconds)
                else:
                    self._delays.pop(route, None)

    def unavailable(self, *routes: str, times: Optional[int] = None, seconds: Optional[float] = None) -> None:
        """Answers calls of ``routes`` (default: all of :data:`ROUTES`) with 503
        ``unavailable`` (with ``expiresAt`` for a held job), as the real sidecar does when
        the API server fails: for the next ``times`` calls, or for ``seconds`` from now, or
        (neither given) until :meth:`available`. Nothing is applied. An attempt answered so
        that then goes a whole lease without an accepted heartbeat is lost, as with the real
        sidecar: its next call gets 409 ``lease_lost``. The fake waits one heartbeat retry's
        pause more (min(1 s, lease / 2)) than the lease, so the client, which gives an
        attempt up after a whole lease without a confirmed heartbeat
        (:class:`leasehold.LeaseUnconfirmed`), always notices first, and the release it
        then sends is accepted."""
        routes = self._routes(routes)
        until = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            for route in routes:
                self._outages[route] = (times, until)

    def available(self, *routes: str) -> None:
        """Ends the outages of ``routes`` (default: all) that :meth:`unavailable` began."""
        with self._lock:
            for route in self._routes(routes):
                self._outages.pop(route, None)

    def shut_down(self) -> None:
        """Begins the sidecar's shutdown: claims (waiting ones too) are answered 503
        ``shutting_down``, ``/readyz`` 503; jobs held can still be heartbeated and ended."""
        with self._lock:
            self._shutting_down = True
            self._lock.notify_all()

    # ---- internals: state changes (under the lock)

    def _routes(self, routes):
        routes = tuple(routes) or ROUTES
        for route in routes:
            if route not in ROUTES:
                raise ValueError("unknown route %r: expected some of %s" % (route, ", ".join(ROUTES)))
        return routes

    def _now_or_at(self, name, action, after_heartbeats, at_checkpoint, when):
        if after_heartbeats is not None or at_checkpoint is not _UNSET or when is not None:
            self.at(name, action, after_heartbeats=after_heartbeats, at_checkpoint=at_checkpoint, when=when)
            return
        with self._lock:
            j = self._jobs[name]
            if j.phase != "Leased":
                raise ValueError(
                    "job %r is %s: no attempt runs whose lease could be lost (give a condition, "
                    "e.g. after_heartbeats=0, to lose the next attempt's)" % (name, j.phase)
                )
            action()

    def _lose(self, name, why):
        with self._lock:
            j = self._jobs[name]
            if j.phase == "Leased":
                self._expire(j, why)

    def _expire(self, j: _Job, why: str) -> None:
        a = j.current
        a.status = "lost"
        a.reason = "LeaseExpired"
        a.message = "attempt %d: %s" % (a.attempt, why)
        j.failures.append(
            {"attempt": a.attempt, "holder": self.identity, "reason": "LeaseExpired", "message": a.message, "time": _rfc3339(_now())}
        )
        if a._latest is not _UNSET:
            j.checkpoint = a._latest
        j.phase = "Failed" if len(j.failures) >= j.max_attempts else "Queued"
        a.phase = j.phase
        self._lock.notify_all()

    def _cancel(self, name):
        with self._lock:
            j = self._jobs[name]
            if j.phase in ("Succeeded", "Failed", "Cancelled"):
                return
            if j.phase == "Leased":
                j.current.status = "cancelled"
                j.current.phase = "Cancelled"
            j.phase = "Cancelled"

    def _expire_due(self) -> None:
        now = time.monotonic()
        for j in self._jobs.values():
            a = j.current
            if j.phase != "Leased":
                continue
            # In an outage, one retry's pause more than the lease (see ``unavailable``).
            grace = 0.0 if self.expire_leases else min(1.0, j.lease / 2)
            if (self.expire_leases or a._outage) and now - a._renewed_at >= j.lease + grace:
                why = "no renewal for %gs, a whole lease" % j.lease
                if a._outage:
                    why += " (the sidecar could not renew it: unavailable)"
                self._expire(j, why)

    def _outage(self, route) -> bool:
        entry = self._outages.get(route)
        if entry is None:
            return False
        times, until = entry
        if until is not None and time.monotonic() >= until:
            del self._outages[route]
            return False
        if times is not None:
            if times <= 0:
                del self._outages[route]
                return False
            self._outages[route] = (times - 1, until)
        return True

    def _fire(self, j: _Job, beat: Optional[Heartbeat]) -> List[Callable[[], Any]]:
        due = []
        for t in self._triggers:
            if not t.fired and t.name == j.name and t.matches(beat):
                t.fired = True
                due.append(t.action)
        return due

    # ---- internals: the routes

    def _handle(self, method: str, raw_path: str, body: Optional[bytes]) -> Tuple[int, Any, bool]:
        """Answers one request: (status, JSON body or None, close)."""
        parts = urllib.parse.urlsplit(raw_path)
        record = Request("other", None, None, time=time.monotonic())
        with self._lock:
            self.requests.append(record)
        actions: List[Callable[[], Any]] = []
        try:
            status, answer, close = self._answer(method, parts, body, record, actions)
        except _Answer as a:
            status, answer, close = a.status, a.body, a.close
            if a.status >= 400 and isinstance(a.body, dict):
                record.error = a.body.get("error")
        record.status = status
        if record.name is not None and isinstance(record.body, dict) and isinstance(record.body.get("token"), str):
            self._record_call(record)
        for action in actions:
            try:
                action()
            except Exception:  # a test's action must not break the fake
                traceback.print_exc()
        return status, answer, close

    def _answer(self, method, parts, body, record, actions):
        path = parts.path
        if path in ("/healthz", "/readyz"):
            if method != "GET":
                raise _error(405, "method_not_allowed", "this route takes GET")
            with self._lock:
                ready = not self._shutting_down or path == "/healthz"
            return (200 if ready else 503), {"status": "ok" if ready else "shutting down"}, False
        route, name = self._route_of(path)
        if route is None:
            raise _error(404, "not_found", "no such route; see docs/protocol.md for the sidecar's API")
        record.route, record.name = route, name
        if method != "POST":
            raise _error(
                405,
                "method_not_allowed",
                "this route takes POST (GET for /healthz, /readyz, /metrics and /openapi.json)",
            )
        if body is None:
            raise _Answer(
                413,
                "too_large",
                "request body is larger than %d bytes: send results and checkpoints of at most that size"
                % MAX_BODY_BYTES,
                close=True,
            )
        with self._lock:
            pause = self._delays.get(route, 0.0)
        if route == "claim":
            answer, due = self._claim(parts.query)
            if pause:
                time.sleep(pause)
        else:
            if pause:
                time.sleep(pause)
            answer, due = self._job_route(route, name, body, record)
        actions.extend(due)
        return (200, answer, False) if answer is not None else (204, None, False)

    @staticmethod
    def _route_of(path):
        if path == "/v1/claim":
            return "claim", None
        m = re.match(r"/v1/jobs/([^/]*)/(heartbeat|complete|fail|release)\Z", path)
        if not m:
            return None, None
        try:
            name = urllib.parse.unquote(m.group(1), errors="strict")
        except UnicodeDecodeError:
            raise _error(
                400,
                "invalid_name",
                "the job name in the URL is not a valid object name: it is not UTF-8 once percent-decoded; "
                "a LeasedJob name is a lowercase RFC 1123 subdomain",
            )
        if not _valid_name(name):
            raise _error(
                400,
                "invalid_name",
                "job name %s is not a valid LeasedJob name (a lowercase RFC 1123 subdomain of at most 253 characters)"
                % json.dumps(name[:80]),
            )
        return m.group(2), name

    def _claim(self, query: str):
        try:
            params = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
        except ValueError as err:
            raise _error(400, "invalid_request", "bad query string: %s; the only parameter is wait=SECONDS" % err)
        extra = [k for k, _ in params if k != "wait"]
        if extra or len(params) > 1:
            raise _error(
                400,
                "invalid_request",
                "bad query string: unknown or repeated field `%s`; the only parameter is wait=SECONDS"
                % (extra[0] if extra else "wait"),
            )
        wait = 0
        if params:
            text = params[0][1]
            if not (text.isdigit() and text.isascii() and int(text) <= MAX_WAIT_SECONDS):
                raise _error(
                    400,
                    "invalid_request",
                    "wait=%s is not a whole number of seconds from 0 to %d" % (json.dumps(text), MAX_WAIT_SECONDS),
                )
            wait = int(text)
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                if self._shutting_down or self._closed:
                    raise _error(
                        503,
                        "shutting_down",
                        "this sidecar is shutting down and claims no more jobs; held jobs can still be "
                        "heartbeated, completed, failed or released",
                    )
                if self._outage("claim"):
                    raise _error(
                        503,
                        "unavailable",
                        "claim failed: the API server could not be reached (a fake outage); try again",
                    )
                self._expire_due()
                job = self._claimable()
                if job is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    job = None
                    break
                # Woken by every change; at least every 0.1 s for retry delays and expiries.
                self._lock.wait(min(left, 0.1))
            if job is None:
                return None, []
            job.attempt += 1
            token = "%d.%s" % (job.attempt, secrets.token_hex(16))
            job.token = token
            job.phase = "Leased"
            job.retry_after = job.retry_after_wall = None
            a = Outcome(job.name, job.attempt, token, resumed_from=job.checkpoint)
            a._renewed_at, a._renewed_wall = time.monotonic(), _now()
            job.attempts.append(a)
            answer = {
                "namespace": job.namespace,
                "name": job.name,
                "queue": self.queue,
                "attempt": job.attempt,
                "token": token,
                "payload": job.payload,
                "leaseDurationSeconds": _seconds_json(job.lease),
                "checkpoint": job.checkpoint,
                "maxAttempts": job.max_attempts,
                "failures": [dict(f) for f in job.failures],
                "lastAttempt": len(job.failures) + 1 >= job.max_attempts,
            }
            answer.update(job.trace)
            return answer, self._fire(job, None)

    def _claimable(self) -> Optional[_Job]:
        """The first job added that is Queued and past its retry delay, if any."""
        now = time.monotonic()
        for name in self._order:
            j = self._jobs[name]
            if j.phase == "Queued" and (j.retry_after is None or j.retry_after <= now):
                return j
        return None

    def _job_route(self, route, name, raw, record):
        body = self._parse(route, raw)
        record.body = body
        if body.get("token") is None or body.get("token") == "":
            raise _error(400, "invalid_token", "token is missing: present the token your claim returned")
        token = body["token"]
        if route == "heartbeat":
            return self._heartbeat(name, token, body)
        if route == "complete":
            if "result" not in body:
                raise _error(400, "invalid_request", "result is missing")
            return self._end(name, token, "complete", body)
        if route == "fail":
            for key in ("reason", "retryable"):
                if body.get(key) is None:
                    raise _error(400, "invalid_request", "%s is missing" % key)
            return self._fail(name, token, body)
        return self._end(name, token, "release", body)

    def _parse(self, route, raw: bytes) -> Dict[str, Any]:
        def refuse(why):
            raise _error(400, "invalid_json", "request body is not the expected JSON object: %s" % why)

        def pairs(items):
            seen = {}
            for key, value in items:
                if key in seen:
                    refuse("duplicate field `%s`" % key)
                seen[key] = value
            return seen

        def constant(text):
            refuse("expected value (%s is not JSON)" % text)

        try:
            body = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
        except (UnicodeDecodeError, ValueError) as err:
            refuse(str(err) if raw.strip() else "EOF while parsing a value at line 1 column 0")
        if not isinstance(body, dict):
            refuse("invalid type: %s, expected a JSON object" % _type_name(body))
        allowed = _FIELDS[route]
        for key in body:
            if key not in allowed:
                refuse("unknown field `%s`, expected one of %s" % (key, ", ".join("`%s`" % f for f in allowed)))
        strings = ("token", "reason") + (("message",) if route == "fail" else ())
        for key in strings:
            value = body.get(key)
            if value is not None and not isinstance(value, str):
                refuse("invalid type: %s, expected a string" % _type_name(value))
        value = body.get("retryable")
        if value is not None and not isinstance(value, bool):
            refuse("invalid type: %s, expected a boolean" % _type_name(value))
        return body

    def _token(self, token: str) -> int:
        m = _TOKEN.match(token)
        if not m or len(token) > 64 or int(m.group(1)) > 2147483647:
            raise _error(400, "invalid_token", "token is malformed: expected <attempt>.<32 lowercase hex digits>")
        return int(m.group(1))

    def _held(self, name: str, token: str, route: str) -> Tuple[_Job, Outcome]:
        """The job and the attempt of ``token``, or the refusal its token earns."""
        token_attempt = self._token(token)
        self._expire_due()
        j = self._jobs.get(name)
        if j is None:
            raise _error(404, "job_not_found", "LeasedJob %s/%s not found" % (self.namespace, name))
        ours = j.token == token
        refusal = self._refusal(j, token_attempt, ours)
        if refusal is not None:
            raise refusal
        return j, j.current

    @staticmethod
    def _refusal(j: _Job, token_attempt: int, ours: bool) -> Optional[_Answer]:
        current = j.attempt
        if j.phase == "Cancelled" and (ours or token_attempt <= current):
            return _error(409, "cancelled", "LeasedJob %s was cancelled; stop working on it" % j.ref)
        if j.phase in ("Succeeded", "Failed") and (ours or token_attempt <= current):
            return _error(
                409,
                "job_finished",
                "LeasedJob %s is already %s (attempt %d); nothing more can be written to it" % (j.ref, j.phase, current),
            )
        if ours and j.phase == "Leased":
            return None
        if ours:
            detail = "is %s again: attempt %d ended (its lease expired or it was given back)" % (j.phase, current)
        elif token_attempt < current:
            detail = "is on attempt %d, your token is from attempt %d" % (current, token_attempt)
        else:
            detail = (
                "is on attempt %d; the token presented is not the token of that attempt (is it another job's?)" % current
            )
        return _error(409, "lease_lost", "lease lost: %s %s; stop working on it and claim again" % (j.ref, detail))

    def _unavailable(self, j: _Job, a: Outcome, what: str) -> _Answer:
        a._outage = True
        expires = a._renewed_wall + timedelta(seconds=j.lease)
        return _error(
            503,
            "unavailable",
            "%s of LeasedJob %s failed: the API server could not be reached (a fake outage); try again with the same token"
            % (what, j.ref),
            expiresAt=_rfc3339(expires),
        )

    def _heartbeat(self, name, token, body):
        fraction, message = body.get("progress"), body.get("message")
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
                raise _error(
                    400,
                    "invalid_request",
                    "progress %s is not a number: expected a number from 0 to 1 (the fraction done)"
                    % json.dumps(fraction)[:60],
                )
            if not 0 <= fraction <= 1:
                raise _error(
                    400,
                    "invalid_request",
                    "progress %s is out of range: expected a number from 0 to 1 (the fraction done)" % json.dumps(fraction),
                )
        if message is not None:
            if not isinstance(message, str):
                raise _error(
                    400,
                    "invalid_request",
                    "message %s is not a string: expected text of at most %d bytes"
                    % (json.dumps(message)[:60], MAX_PROGRESS_MESSAGE_BYTES),
                )
            size = len(message.encode("utf-8"))
            if size > MAX_PROGRESS_MESSAGE_BYTES:
                raise _error(
                    400,
                    "invalid_request",
                    "message %s is %d bytes: at most %d bytes of UTF-8 are accepted"
                    % (json.dumps(message)[:60], size, MAX_PROGRESS_MESSAGE_BYTES),
                )
            if any(unicodedata.category(c) == "Cc" for c in message):
                raise _error(
                    400,
                    "invalid_request",
                    "message %s contains a control character (a line break, a tab, ...): it is shown on one line"
                    % json.dumps(message)[:60],
                )
        self._token(token)
        checkpoint = body.get("checkpoint")
        if checkpoint is not None:
            size = _json_bytes(checkpoint)
            if size > MAX_CHECKPOINT_BYTES:
                raise _error(
                    413, "too_large", "checkpoint is %d bytes of JSON; at most %d are accepted" % (size, MAX_CHECKPOINT_BYTES)
                )
        with self._lock:
            j, a = self._held(name, token, "heartbeat")
            if self._outage("heartbeat"):
                raise self._unavailable(j, a, "heartbeat")
            a.heartbeats += 1
            a._renewed_at, a._renewed_wall = time.monotonic(), _now()
            a._outage = False
            if checkpoint is not None:
                a.checkpoints.append(checkpoint)
                a._latest = checkpoint
            if fraction is not None or message is not None:
                a.progress.append((None if fraction is None else float(fraction), message))
            expires = a._renewed_wall + timedelta(seconds=j.lease)
            answer = {
                "renewTime": _rfc3339(a._renewed_wall),
                "expiresAt": _rfc3339(expires),
                "leaseDurationSeconds": _seconds_json(j.lease),
            }
            beat = Heartbeat(a.heartbeats, checkpoint, None if fraction is None else float(fraction), message)
            return answer, self._fire(j, beat)

    def _fail(self, name, token, body):
        # In the real sidecar's order: the delay's range, the reason, the delay's
        # retryable, the message.
        after = body.get("retryAfterSeconds")
        if isinstance(after, float) and after.is_integer():  # 30.0 is a whole number, as JSON Schema counts
            after = body["retryAfterSeconds"] = int(after)
        if after is not None:
            if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= MAX_RETRY_AFTER_SECONDS:
                raise _error(
                    400,
                    "invalid_request",
                    "retryAfterSeconds %s is not a whole number of seconds from 0 to %d"
                    % (json.dumps(after), MAX_RETRY_AFTER_SECONDS),
                )
        reason = body["reason"]
        if not (1 <= len(reason) <= 64 and _REASON.match(reason) and reason.isascii()):
            raise _error(
                400,
                "invalid_request",
                "reason %s is not a CamelCase word: expected 1 to 64 ASCII letters and digits, starting with a letter"
                % json.dumps(reason[:80]),
            )
        if after is not None and body.get("retryable") is not True:
            raise _error(
                400,
                "invalid_request",
                "retryAfterSeconds is given for a failure that is not retryable: only a retryable failure is retried",
            )
        message = body.get("message") or ""
        size = len(message.encode("utf-8"))
        if size > MAX_FAIL_MESSAGE_BYTES:
            raise _error(
                400, "invalid_request", "message is %d bytes; at most %d are accepted" % (size, MAX_FAIL_MESSAGE_BYTES)
            )
        return self._end(name, token, "fail", body)

    def _end(self, name, token, verb, body):
        self._token(token)
        with self._lock:
            j = self._jobs.get(name)
            a = j.current if j is not None and j.token == token else None
            if a is not None and a._ended_by == verb:
                # A repeat of a call whose first try landed: answered as that one was.
                return dict(a._answer), []
            j, a = self._held(name, token, verb)
            if self._outage(verb):
                raise self._unavailable(j, a, {"complete": "completion"}.get(verb, "end of attempt"))
            if verb == "complete":
                size = _json_bytes({"payload": j.payload, "result": body["result"], "failures": j.failures}) + 2048
                if size > MAX_JOB_BYTES:
                    raise _error(
                        413,
                        "too_large",
                        "LeasedJob %s would exceed the size limit of a job (%d bytes for the whole job as JSON, "
                        "payload included) with this write; nothing was written: send a smaller result or message, "
                        "or store large results elsewhere and send a reference" % (j.ref, MAX_JOB_BYTES),
                    )
                j.phase, j.result = "Succeeded", body["result"]
                a.status, a.result = "succeeded", body["result"]
                answer = {"namespace": j.namespace, "name": j.name, "attempt": a.attempt, "phase": j.phase}
            else:
                if a._latest is not _UNSET:
                    j.checkpoint = a._latest
                answer = self._apply_fail(j, a, body) if verb == "fail" else self._apply_release(j, a)
            a.phase = j.phase
            a._ended_by, a._answer = verb, answer
            self._lock.notify_all()
            return dict(answer), []

    def _apply_release(self, j, a):
        j.phase = "Queued"
        a.status = "released"
        return {"namespace": j.namespace, "name": j.name, "attempt": a.attempt, "phase": "Queued"}

    def _apply_fail(self, j, a, body):
        retryable = body["retryable"]
        after = body.get("retryAfterSeconds")
        a.status, a.reason, a.message = "failed", body["reason"], body.get("message") or ""
        a.retryable, a.retry_after_seconds = retryable, after
        j.failures.append(
            {"attempt": a.attempt, "holder": self.identity, "reason": a.reason, "message": a.message, "time": _rfc3339(_now())}
        )
        answer = {"namespace": j.namespace, "name": j.name, "attempt": a.attempt}
        if retryable and len(j.failures) < j.max_attempts:
            j.phase = "Queued"
            if after:
                wait = min(after, j.retry_cap)
                j.retry_after = time.monotonic() + wait
                at = _now() + timedelta(seconds=wait)
                j.retry_after_wall = at.replace(microsecond=0) + timedelta(seconds=1 if at.microsecond else 0)
                answer["retryAfter"] = _whole_seconds_text(j.retry_after_wall)
        else:
            j.phase = "Failed"
        answer["phase"] = j.phase
        return answer

    def _record_call(self, record: Request) -> None:
        """Adds the call to the ``calls`` of the attempt whose token it carried, if any."""
        with self._lock:
            j = self._jobs.get(record.name)
            for a in j.attempts if j is not None else ():
                if a.token == record.body["token"]:
                    a.calls.append(Call(record.route, record.status, record.error))


def _handler_for(fake: FakeSidecar):
    class Handler(BaseHTTPRequestHandler):
        server_version = "leasehold-fake"
        sys_version = ""

        def log_message(self, *args: Any) -> None:  # quiet: tests read fake.requests
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if length > MAX_BODY_BYTES:
                # Refused as too large. The real sidecar answers before reading the body; the
                # fake reads it first, so that closing the connection never resets it under
                # a client still sending (which could then miss the answer).
                body = None
            status, answer, close = fake._handle(method, self.path, body)
            data = b"" if answer is None else json.dumps(answer).encode("utf-8")
            try:
                self.send_response(status)
                if answer is not None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if close or length > MAX_BODY_BYTES:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client gave up waiting (a delayed answer): the call was applied

        def do_POST(self) -> None:
            self._serve("POST")

        def do_GET(self) -> None:
            self._serve("GET")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

    return Handler


def run(
    handler: Callable[..., Any],
    payload: Any = None,
    *,
    checkpoint: Any = None,
    attempt: Optional[int] = None,
    max_attempts: int = 3,
    failures: Any = (),
    lease_duration: float = 60,
    heartbeat_interval: Optional[float] = None,
    on_shutdown: str = "release",
    setup: Optional[Callable[[FakeSidecar], Any]] = None,
    name: str = "job",
    traceparent: Optional[str] = None,
    tracestate: Optional[str] = None,
) -> Outcome:
    """Runs ``handler`` (sync or ``async def``) on one job through a real
    :class:`leasehold.Worker` against a fresh :class:`FakeSidecar`, and returns the
    attempt's :class:`Outcome`.

    The job is added with ``payload``, ``checkpoint``, ``attempt``, ``max_attempts``,
    ``failures``, ``lease_duration`` (seconds), ``traceparent`` and ``tracestate`` (see
    :meth:`FakeSidecar.add_job`), then
    ``setup(fake)`` is called, if given, to arm triggers (e.g.
    ``setup=lambda fake: fake.lose_lease("job", after_heartbeats=1)``), then the worker
    handles exactly one job (``max_jobs=1``, ``exit_when_idle=True``,
    ``handle_signals=False``, ``heartbeat_interval``, ``on_shutdown`` as given) and the
    fake is closed. Returns when the worker does: a handler that never returns blocks it.
    """
    with FakeSidecar() as fake:
        fake.add_job(
            name,
            payload,
            checkpoint=checkpoint,
            attempt=attempt,
            max_attempts=max_attempts,
            failures=failures,
            lease_duration=lease_duration,
            traceparent=traceparent,
            tracestate=tracestate,
        )
        if setup is not None:
            setup(fake)
        Worker(
            handler,
            client=fake.client(),
            wait=0,
            max_jobs=1,
            exit_when_idle=True,
            heartbeat_interval=heartbeat_interval,
            on_shutdown=on_shutdown,
            handle_signals=False,
        ).run()
        outcome = fake.outcome(name)
    assert outcome is not None, "the worker claimed nothing"
    return outcome
