"""A claimed job: its claim, background heartbeats, and the calls that end its attempt."""

import json
import logging
import threading
import time
import unicodedata
from typing import Any, Callable, Dict, List, Optional

from .client import Client, Event, _whole_seconds, retrying
from .errors import (
    ApiError,
    ConnectionFailed,
    Fail,
    InvalidRequest,
    JobEnded,
    JobLost,
    LeaseholdError,
    LeaseUnconfirmed,
    ShutdownRequested,
    TooLarge,
    Unavailable,
)

log = logging.getLogger("leasehold")

#: The sidecar refuses a checkpoint over this many bytes of JSON (docs/protocol.md).
MAX_CHECKPOINT_BYTES = 64 * 1024
#: The sidecar refuses a progress message over this many bytes of UTF-8 (docs/protocol.md).
MAX_PROGRESS_MESSAGE_BYTES = 256
#: Heartbeats are sent every leaseDurationSeconds / HEARTBEAT_FRACTION: two more chances
#: before the lease runs out when one is lost (the sidecar renews at the same rate).
HEARTBEAT_FRACTION = 3
#: Seconds between tries of a heartbeat that got no confirmation (at most the interval).
RETRY_PAUSE = 1.0
#: How often, in seconds, the heartbeat thread looks at the worker's stop flag.
STOP_POLL = 0.2

_NOTHING = object()


class Job:
    """One claimed attempt of a LeasedJob.

    Get one from :meth:`Job.claim` (or from :class:`leasehold.Worker`, which hands one to
    your handler). Use it as a context manager: entering starts background heartbeats,
    leaving stops them and makes sure the attempt ends (see :meth:`__exit__`)::

        job = Job.claim(client, wait=30)
        if job is not None:
            with job:
                for step in range(job.checkpoint or 0, 100):
                    work(step)
                    job.save(step + 1)     # sent with the next heartbeat
                    job.progress((step + 1) / 100, "step %d" % (step + 1))  # kubectl leasehold get
                    job.check()            # raises once the job is lost or cancelled
                job.complete({"steps": 100})

    Attributes:
        name (str): the LeasedJob's name. namespace (str): its namespace.
        attempt (int): the attempt number, from 1.
        token (str): the fencing token of this attempt (``<attempt>.<32 hex>``).
        payload (Any): ``spec.payload``, any JSON.
        checkpoint (Any): the checkpoint to resume from: the last one a previous attempt
            saved, or None for a fresh start. It does not change while the job runs; the
            one saved last is :attr:`saved`.
        lease_duration (float): leaseDurationSeconds, in seconds.
        max_attempts (int or None): failed attempts that end the job (``maxAttempts`` of the
            policy this attempt was claimed under); None from a sidecar too old to say.
        failures (list of dict): the job's earlier failed attempts, oldest first, each
            ``{attempt, holder, reason, message, time}`` (lease expiries included, reason
            ``LeaseExpired``).
        last_attempt (bool): whether a failure of this attempt ends the job Failed (no
            attempt is left after it); False from a sidecar too old to say.
        queue (str or None): the job's queue; None from a sidecar too old to say.
        traceparent (str or None): the producer's W3C traceparent (the job's annotation
            ``leasehold.dev/traceparent``), when it set a valid one: the parent of the
            handler's span (:mod:`leasehold.tracing`). tracestate (str or None): its
            W3C tracestate, only beside a traceparent.
        claim_answer (dict): the sidecar's whole claim answer.
        interrupted (threading.Event): set once the job is lost (or cancelled) or the worker
            was asked to stop; wait on it, or pass it to code that can be interrupted.
        lost (JobLost or None): why the job is no longer this worker's, once it is not.
        ended (str or None): ``"complete"``, ``"fail"`` or ``"release"`` once the server
            accepted that ending.

    Thread safety: every method may be called from any thread; sends are serialised, so
    checkpoints reach the sidecar in the order they were saved.
    """

    def __init__(
        self,
        client: Client,
        claim: Dict[str, Any],
        heartbeat_interval: Optional[float] = None,
        should_stop: Optional[Callable[[], bool]] = None,
    ):
        """Wraps a claim answer (:meth:`Client.claim`).

        Args:
            client (Client): the sidecar's client.
            claim (dict): the claim answer.
            heartbeat_interval (float or None): seconds between heartbeats; default
                leaseDurationSeconds / 3. Values above leaseDurationSeconds / 2 are capped
                there: one lost heartbeat must not cost the lease.
            should_stop (callable or None): returns True once the worker should stop; then
                :meth:`check` and :meth:`sleep` raise :class:`ShutdownRequested`. It is
                read, never called from a signal handler, so a plain flag is enough.
        """
        self.client = client
        self.claim_answer = claim
        self.name: str = claim["name"]
        self.namespace: str = claim.get("namespace") or ""
        self.attempt: int = claim.get("attempt") or 0
        self.token: str = claim["token"]
        self.payload: Any = claim.get("payload")
        self.checkpoint: Any = claim.get("checkpoint")
        duration = claim.get("leaseDurationSeconds")
        self.lease_duration = float(duration) if isinstance(duration, (int, float)) and duration > 0 else 60.0
        max_attempts = claim.get("maxAttempts")
        self.max_attempts: Optional[int] = max_attempts if isinstance(max_attempts, int) else None
        failures = claim.get("failures")
        self.failures: List[Dict[str, Any]] = [f for f in failures if isinstance(f, dict)] if isinstance(failures, list) else []
        self.last_attempt: bool = claim.get("lastAttempt") is True
        queue = claim.get("queue")
        self.queue: Optional[str] = queue if isinstance(queue, str) and queue else None
        traceparent = claim.get("traceparent")
        self.traceparent: Optional[str] = traceparent if isinstance(traceparent, str) and traceparent else None
        tracestate = claim.get("tracestate")
        self.tracestate: Optional[str] = (
            tracestate if self.traceparent is not None and isinstance(tracestate, str) and tracestate else None
        )
        self._interval_wanted = heartbeat_interval
        self._should_stop = should_stop or (lambda: False)
        self.interrupted = threading.Event()
        self.lost: Optional[JobLost] = None
        self.ended: Optional[str] = None
        self._send_lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._pending: Any = _NOTHING
        self._saved: Any = self.checkpoint
        self._progress: Optional[float] = None
        self._message: Optional[str] = None
        self._confirmed_at = time.monotonic()  # the claim renewed the lease
        self._gave_up = False
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def claim(cls, client: Client, wait: float = 20, **kwargs: Any) -> Optional["Job"]:
        """Claims a job (long poll of ``wait`` seconds, 0..300); None when nothing was
        claimable in time. Keyword arguments go to :class:`Job`. Raises as
        :meth:`Client.claim`."""
        answer = client.claim(wait)
        return None if answer is None else cls(client, answer, **kwargs)

    def __repr__(self) -> str:
        return "<Job %s attempt %s>" % (self.label, self.attempt)

    @property
    def label(self) -> str:
        """``namespace/name``, as logs and messages name the job."""
        return "%s/%s" % (self.namespace, self.name) if self.namespace else self.name

    @property
    def saved(self) -> Any:
        """The checkpoint saved last (by :meth:`save`), else the one resumed from."""
        with self._state_lock:
            return self._saved

    @property
    def stopping(self) -> bool:
        """Whether the worker was asked to stop (SIGTERM or SIGINT), whatever its policy."""
        return bool(self._should_stop())

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between background heartbeats."""
        default = self.lease_duration / HEARTBEAT_FRACTION
        wanted = default if self._interval_wanted is None else self._interval_wanted
        return max(0.1, min(wanted, self.lease_duration / 2))

    # ---- while working

    def save(self, checkpoint: Any) -> None:
        """Saves ``checkpoint`` (any JSON value but None, at most 64 KiB encoded) for the next
        attempt to resume from, should this one not finish. It is sent with the next
        heartbeat (within :attr:`heartbeat_interval` seconds, and before a release); only the
        latest is sent. Does not block.

        Raises:
            TooLarge: the checkpoint is over 64 KiB as JSON (the sidecar would refuse it).
            ValueError: it is None or not JSON-serialisable.
        """
        if checkpoint is None:
            raise ValueError("a checkpoint cannot be None (None means 'keep the last one')")
        size = len(json.dumps(checkpoint, separators=(",", ":")).encode("utf-8"))
        if size > MAX_CHECKPOINT_BYTES:
            raise TooLarge(
                413,
                "too_large",
                "checkpoint of %s is %d bytes as JSON, over the sidecar's limit of %d; keep large "
                "state elsewhere and checkpoint a reference to it" % (self.label, size, MAX_CHECKPOINT_BYTES),
            )
        with self._state_lock:
            self._pending = checkpoint
            self._saved = checkpoint

    def progress(self, fraction: Optional[float] = None, message: Optional[str] = None) -> None:
        """Reports how far the attempt is, for people watching (``kubectl leasehold get``
        draws a bar and shows the message): ``fraction`` done from 0 to 1, and a short
        ``message`` (at most 256 bytes of UTF-8, one line). None leaves that part as last
        reported. Every heartbeat from now on carries the latest values (the next one within
        :attr:`heartbeat_interval` seconds); they cost no extra request. Does not block.

        Raises:
            InvalidRequest: ``fraction`` is not a number from 0 to 1, or ``message`` is not a
                string of at most 256 bytes without control characters (the sidecar's rules,
                checked here so that a heartbeat is never refused for them).
        """
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise InvalidRequest(
                    400,
                    "invalid_request",
                    "progress %r is out of range: expected a number from 0 to 1 (the fraction done)" % (fraction,),
                )
        if message is not None:
            if not isinstance(message, str):
                raise InvalidRequest(400, "invalid_request", "message %r is not a string" % (message,))
            size = len(message.encode("utf-8"))
            if size > MAX_PROGRESS_MESSAGE_BYTES:
                raise InvalidRequest(
                    400,
                    "invalid_request",
                    "message is %d bytes: at most %d bytes of UTF-8 are accepted" % (size, MAX_PROGRESS_MESSAGE_BYTES),
                )
            if any(unicodedata.category(c) == "Cc" for c in message):
                raise InvalidRequest(
                    400,
                    "invalid_request",
                    "message %r contains a control character (a line break, a tab, ...): it is shown on one line"
                    % (message,),
                )
        with self._state_lock:
            if fraction is not None:
                self._progress = float(fraction)
            if message is not None:
                self._message = message

    def check(self) -> None:
        """Returns while the job is still this worker's; call it often (between chunks).

        Raises:
            JobLost: the lease was lost, the job cancelled, finished or deleted, or no
                heartbeat was confirmed for a whole lease (:class:`LeaseUnconfirmed`).
            ShutdownRequested: the worker was asked to stop and releases jobs on stop.
            JobEnded: this worker already ended the attempt.
        """
        if self.lost is not None:
            raise self.lost
        if self.ended is not None:
            raise JobEnded("%s attempt %s was already ended (%s)" % (self.label, self.attempt, self.ended))
        if self._should_stop():
            self.interrupted.set()
            raise ShutdownRequested("the worker is stopping: %s is handed back" % self.label)

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds``, waking within :data:`STOP_POLL` seconds once the job is lost or
        the worker asked to stop; then raises as :meth:`check` does."""
        self.check()
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.interrupted.wait(min(left, STOP_POLL)) or self._should_stop():
                self.check()

    def heartbeat(self) -> Dict[str, Any]:
        """Sends a heartbeat now, with the checkpoint saved since the last one (if any) and
        the latest progress, instead of waiting for the background one.

        Returns:
            dict: the answer ``{renewTime, expiresAt, leaseDurationSeconds}``.

        Raises:
            JobLost: as :meth:`check`. Unavailable, ConnectionFailed: not confirmed this
            time (the background heartbeats go on). TooLarge: the checkpoint was refused.
        """
        self.check()
        return self._beat()

    # ---- ending the attempt

    def complete(self, result: Any = None) -> Dict[str, Any]:
        """Ends the attempt as Succeeded with ``result`` (any JSON; the whole job stays under
        1 MiB as JSON). Repeats the call while the sidecar answers ``unavailable`` or cannot
        be reached, for up to max(30 s, leaseDurationSeconds).

        Never sends anything once the job is known to be lost: the late result of a worker
        that lost its lease is not offered as if it still held the job.

        Returns:
            dict: ``{namespace, name, attempt, phase: "Succeeded"}``.

        Raises:
            JobLost: the job was or is now lost; nothing was accepted.
            JobEnded: already ended. TooLarge: the result is too large (the job is still
            held). Unavailable, ConnectionFailed: no answer in time (the lease then expires
            unless the sidecar gets through).
        """
        return self._end("complete", lambda: self.client.complete(self.name, self.token, result, self.attempt))

    def fail(
        self, reason: str, message: str = "", retryable: bool = False, retry_after: Optional[float] = None
    ) -> Dict[str, Any]:
        """Ends the attempt as failed. ``reason``: CamelCase word (at most 64 characters);
        ``message``: what happened (at most 4096 bytes; longer is cut); ``retryable``:
        whether another attempt could succeed; ``retry_after``: with ``retryable``, seconds
        the next attempt waits (0 to 86400, rounded up), instead of the backoff's delay,
        capped by the sidecar at the job's ``backoff.maxSeconds`` (3600 s without a backoff).
        Returns ``{..., phase, retryAfter?}`` with phase ``"Queued"`` or ``"Failed"``.
        Raises as :meth:`complete`, and InvalidRequest for a bad reason or ``retry_after``
        (nothing is sent then)."""
        if retry_after is not None:
            if not retryable:
                raise InvalidRequest(
                    400,
                    "invalid_request",
                    "retry_after is given for a failure that is not retryable: only a retryable failure is retried",
                )
            _whole_seconds(retry_after)
        return self._end(
            "fail",
            lambda: self.client.fail(
                self.name, self.token, reason, message, retryable, self.attempt, retry_after=retry_after
            ),
        )

    def release(self) -> Dict[str, Any]:
        """Hands the job back: it is requeued at once (not a failed attempt) and the next
        attempt resumes from the latest checkpoint, which is sent first if it has not been.
        Returns ``{..., phase: "Queued"}``. Raises as :meth:`complete`."""
        with self._send_lock:
            if self.lost is None and self.ended is None and self._has_pending():
                try:
                    self._beat()
                except JobLost:
                    raise
                except LeaseholdError as err:  # the release still hands the job back
                    log.warning("Could not send the last checkpoint of %s before releasing it: %s", self.label, err)
            return self._end("release", lambda: self.client.release(self.name, self.token, self.attempt))

    # ---- context manager

    def __enter__(self) -> "Job":
        self.start()
        return self

    def __exit__(self, etype, exc, tb) -> bool:
        """Stops the heartbeats and makes sure the attempt ends once:

        * the block ended the job (complete, fail, release): nothing more;
        * it raised :class:`Fail`: the attempt is failed with its reason, message and
          retryable; the exception is swallowed;
        * it raised :class:`ShutdownRequested`, or returned without ending the job: the job
          is released (with its latest checkpoint); swallowed;
        * it raised :class:`JobLost` or the job is lost: nothing is sent (but a release,
          when the loss was only presumed: :class:`LeaseUnconfirmed`); swallowed;
        * any other exception: the attempt is failed (reason ``WorkerError``, retryable) and
          the exception propagates.

        An attempt that ended without an accepted ending is reported as a ``lost`` event.
        """
        self.stop()
        handled = etype is not None and issubclass(etype, (Fail, ShutdownRequested, JobLost, JobEnded))
        if etype is not None and issubclass(etype, JobLost) and self.lost is None:
            self._set_lost(exc)
        if self.ended is None and self.lost is None and not self._gave_up:
            if etype is not None and issubclass(etype, Fail):
                self._quietly(
                    lambda: self.fail(exc.reason, exc.message, exc.retryable, getattr(exc, "retry_after", None))
                )
            elif etype is None or issubclass(etype, ShutdownRequested):
                if etype is None:
                    log.warning("%s was neither completed nor failed: releasing it", self.label)
                self._quietly(self.release)
            elif not handled:
                message = "%s: %s" % (etype.__name__, exc)
                self._quietly(lambda: self.fail("WorkerError", message, True))
        if isinstance(self.lost, LeaseUnconfirmed) and self.ended is None:
            self._release_unconfirmed()
        if self.ended is None:
            why = str(self.lost) if self.lost is not None else "no ending was accepted"
            self.client.emit(Event("lost", self.name, self.attempt, message=why))
            log.warning("Gave up %s (attempt %s): %s", self.label, self.attempt, why)
        return handled

    def start(self) -> None:
        """Starts the background heartbeats (done by ``with job:``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat_loop, name="heartbeat %s" % self.name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops the background heartbeats, waiting for one in flight to finish."""
        self._done.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ---- internals

    def _has_pending(self) -> bool:
        with self._state_lock:
            return self._pending is not _NOTHING

    def _set_lost(self, err: JobLost) -> None:
        if self.lost is None:
            self.lost = err
            log.warning("Lost LeasedJob %s (attempt %s): %s", self.label, self.attempt, err)
        self.interrupted.set()

    def _release_unconfirmed(self) -> None:
        """After :class:`LeaseUnconfirmed`, the sidecar may still hold the job, and renews it
        in the background while it hears from this worker. Give it back, so that it is not
        held by nobody until the sidecar's --worker-timeout: harmless if it was requeued
        meanwhile (the token is fenced: 409), and it sends no result."""
        deadline = time.monotonic() + max(30.0, self.lease_duration)
        try:
            retrying(lambda: self.client.release(self.name, self.token, self.attempt), deadline)
        except LeaseholdError as err:
            log.info("Release of %s after an unconfirmed lease: %s", self.label, err)
            return
        self.ended = "release"
        log.info("Released %s after its lease went unconfirmed", self.label)

    def _quietly(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except LeaseholdError as err:
            log.warning("%s: %s", self.label, err)

    def _end(self, verb: str, call: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        with self._send_lock:
            self.check_owned()
            deadline = time.monotonic() + max(30.0, self.lease_duration)
            try:
                answer = retrying(call, deadline)
            except JobLost as err:
                self._set_lost(err)
                raise
            except (ConnectionFailed, Unavailable):
                self._gave_up = True
                raise
            self.ended = verb
        self._done.set()
        self.interrupted.set()
        return answer

    def check_owned(self) -> None:
        """As :meth:`check`, but ignoring a stop request: raises :class:`JobLost` or
        :class:`JobEnded` when the job can no longer be ended by this worker."""
        if self.lost is not None:
            raise self.lost
        if self.ended is not None:
            raise JobEnded("%s attempt %s was already ended (%s)" % (self.label, self.attempt, self.ended))

    def _call_timeout(self) -> float:
        """The sidecar answers within min(5 s, LD/3); never wait past the lease's end as
        far as we know, so an unresponsive sidecar is noticed when the lease runs out."""
        normal = min(5.0, self.lease_duration / 3) + 2.0
        left = self._confirmed_at + self.lease_duration - time.monotonic()
        return max(1.0, min(normal, left))

    def _beat(self) -> Dict[str, Any]:
        """One heartbeat with the pending checkpoint, if any. Returns the answer; raises as
        :meth:`heartbeat`, and :class:`LeaseUnconfirmed` when it failed and no heartbeat was
        confirmed for a whole lease."""
        with self._send_lock:
            self.check_owned()
            with self._state_lock:
                pending, self._pending = self._pending, _NOTHING
                progress, message = self._progress, self._message
            checkpoint = None if pending is _NOTHING else pending
            sent = time.monotonic()
            try:
                answer = self.client.heartbeat(
                    self.name, self.token, checkpoint, self.attempt, self._call_timeout(), progress, message
                )
            except JobLost as err:
                self._set_lost(err)
                raise
            except (ConnectionFailed, Unavailable) as err:
                with self._state_lock:
                    if pending is not _NOTHING and self._pending is _NOTHING:
                        self._pending = pending
                silent = time.monotonic() - self._confirmed_at
                if silent >= self.lease_duration:
                    self._set_lost(
                        LeaseUnconfirmed(
                            "no heartbeat of %s (attempt %s) confirmed for %.1f s, its whole lease (%g s): "
                            "it may have been requeued; last error: %s"
                            % (self.label, self.attempt, silent, self.lease_duration, err)
                        )
                    )
                    raise self.lost
                raise
            self._confirmed_at = sent
            duration = answer.get("leaseDurationSeconds")
            if isinstance(duration, (int, float)) and duration > 0:
                self.lease_duration = float(duration)
            return answer

    def _beat_loop(self) -> None:
        next_at = time.monotonic() + self.heartbeat_interval
        while True:
            wait = min(STOP_POLL, max(0.0, next_at - time.monotonic()))
            if self._done.wait(wait):
                return
            if self._should_stop():
                self.interrupted.set()
            if time.monotonic() < next_at:
                continue
            try:
                self._beat()
                next_at = time.monotonic() + self.heartbeat_interval
            except JobLost:
                return
            except JobEnded:
                return
            except (ConnectionFailed, Unavailable):
                next_at = time.monotonic() + min(RETRY_PAUSE, self.heartbeat_interval)
            except ApiError as err:  # e.g. TooLarge: the checkpoint was refused; go on without it
                log.error("Heartbeat of %s refused: %s", self.label, err)
                next_at = time.monotonic() + min(RETRY_PAUSE, self.heartbeat_interval)
            except Exception:  # a bug here must not silently stop the heartbeats
                log.exception("Heartbeat of %s failed", self.label)
                next_at = time.monotonic() + min(RETRY_PAUSE, self.heartbeat_interval)
