"""The claim loop: claims jobs (one at a time, or up to ``concurrency`` at once), runs a
handler on each, ends each attempt exactly once, and stops gracefully on SIGTERM."""

import asyncio
import concurrent.futures
import inspect
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import tracing
from .client import MAX_CLAIM_WAIT, Client, Event
from .errors import ApiError, ConnectionFailed, JobLost, LeaseholdError, ShutdownRequested, ShuttingDown
from .job import Job

log = logging.getLogger("leasehold")

#: What a running job does when the worker is asked to stop.
SHUTDOWN_POLICIES = ("release", "finish")
#: Most jobs one worker runs at once (``concurrency``): each holds a lease the sidecar renews.
MAX_CONCURRENCY = 256


class Worker:
    """Runs ``handler(job)`` on each job claimed from the sidecar.

    The handler gets a :class:`leasehold.Job` whose heartbeats run in the background. What
    it does decides how the attempt ends:

    * returns a value: the job is completed with it as the result (unless the handler ended
      the job itself, or the job was lost: then nothing is sent); a value that is not JSON
      fails the attempt as not retryable (reason ``ResultNotJSON``, naming its type): another
      attempt would return the same;
    * raises :class:`leasehold.Fail`: the attempt fails with its reason, message, retryable;
    * raises :class:`leasehold.JobLost` (e.g. from :meth:`Job.check`): nothing is sent;
    * raises :class:`leasehold.ShutdownRequested`: the job is released with its latest
      checkpoint;
    * raises anything else: the attempt fails (reason ``WorkerError``, retryable), the
      error is logged, and the worker goes on with the next job.

    An ``async def`` handler runs as a task on one event loop the worker keeps in a thread of
    its own for as long as :meth:`run` runs (so clients and sessions made in one job can
    serve the next), with the same heartbeats, checkpoints, lease loss and cancellation: call
    :meth:`Job.check` between awaits, and ``await asyncio.sleep`` rather than
    :meth:`Job.sleep`. Once the job is lost or cancelled, or to be handed back on shutdown,
    its task is also cancelled (``asyncio.CancelledError`` at the await it is in), so a
    handler waiting on I/O stops at once; what is sent then is what :meth:`Job.check` would
    have raised. Anything else that is not callable is refused with a TypeError when the
    worker is made.

    Tracing: with OpenTelemetry installed (``pip install 'leasehold[otel]'``), each job's
    handler runs inside a span ``leasehold.job <queue>`` whose parent is the producer's span
    (the claim's ``traceparent``), current in the thread or task that runs the handler; see
    :mod:`leasehold.tracing`. Without it, nothing of it is imported.

    Several jobs at once: with ``concurrency=N`` the worker keeps up to N jobs, each claimed
    by a long poll of its own through the one sidecar: sync handlers run in N threads, async
    ones as N tasks on the one loop. Each job has its own :class:`Job`, heartbeats and
    ending, so one job lost, failed or slow leaves the others alone.

    When the sidecar answers a claim with ``shutting_down`` (it is draining: its pod is
    stopping), the worker claims nothing more, lets its running jobs end, and returns,
    logging one line.

    Stopping: the first SIGTERM or SIGINT stops claiming (a claim waiting in its long poll
    returns at once) and, with ``on_shutdown="release"`` (the default), makes the running
    job's next :meth:`Job.check` or :meth:`Job.sleep` raise ShutdownRequested, so the job is
    handed back at once; with ``"finish"`` the handler runs to the end (check
    :attr:`Job.stopping` to cut it short). A handler that never checks finishes either way:
    keep the pod's terminationGracePeriodSeconds above the time that takes. A second signal
    exits at once, saying which job it abandons (its lease then expires; a native sidecar
    started with ``--release-on-shutdown`` releases it when it stops).

    Args:
        handler (callable): ``handler(job) -> result``.
        client (Client or None): default ``Client()`` (``$LEASEHOLD_SIDECAR``).
        wait (int): seconds each claim long-polls, 0..300.
        on_shutdown (str): ``"release"`` or ``"finish"`` (see above).
        max_jobs (int): stop after this many jobs; 0 for no limit.
        exit_when_idle (bool): stop when a claim finds nothing (204); running jobs end first.
        concurrency (int): how many jobs run at once, 1..256 (see above).
        heartbeat_interval (float or None): see :class:`leasehold.Job`.
        handle_signals (bool): install the SIGTERM/SIGINT handlers during :meth:`run`
            (only possible in the main thread); otherwise call :meth:`stop`.
    """

    def __init__(
        self,
        handler: Callable[[Job], Any],
        client: Optional[Client] = None,
        wait: int = 20,
        on_shutdown: str = "release",
        max_jobs: int = 0,
        exit_when_idle: bool = False,
        heartbeat_interval: Optional[float] = None,
        handle_signals: bool = True,
        concurrency: int = 1,
    ):
        if not callable(handler):
            raise TypeError(
                "handler must be a function (or an async function) taking a leasehold.Job, not %r of type %s"
                % (handler, type(handler).__name__)
            )
        call = handler if inspect.isfunction(handler) or inspect.ismethod(handler) else getattr(handler, "__call__", handler)
        if any(inspect.isasyncgenfunction(f) or inspect.isgeneratorfunction(f) for f in (handler, call)):
            raise TypeError(
                "handler %s is a generator function: it must return the result (def) or be awaited to it (async def)"
                % getattr(handler, "__qualname__", repr(handler))
            )
        if on_shutdown not in SHUTDOWN_POLICIES:
            raise ValueError("on_shutdown must be one of %s, not %r" % (SHUTDOWN_POLICIES, on_shutdown))
        if not 0 <= wait <= MAX_CLAIM_WAIT:
            raise ValueError("wait must be 0..%d seconds, not %r" % (MAX_CLAIM_WAIT, wait))
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ValueError("concurrency must be a whole number of jobs from 1 to %d, not %r" % (MAX_CONCURRENCY, concurrency))
        self.handler = handler
        self.client = client or Client()
        self.wait = int(wait)
        self.on_shutdown = on_shutdown
        self.max_jobs = max_jobs
        self.exit_when_idle = exit_when_idle
        self.heartbeat_interval = heartbeat_interval
        self.handle_signals = handle_signals
        #: Set by the first SIGTERM/SIGINT or by :meth:`stop`. A plain flag: safe to set
        #: from a signal handler.
        self.stopping = False
        self.concurrency = concurrency
        #: The jobs being handled now (at most ``concurrency``).
        self.running: List[Job] = []
        self._lock = threading.Lock()
        self._claimed = 0
        self._drained = False
        self._idle = False
        self._events: Optional["_LoopThread"] = None
        try:
            self._claim_takes_connection = "on_connection" in inspect.signature(self.client.claim).parameters
        except (TypeError, ValueError):
            self._claim_takes_connection = False

    @property
    def current(self) -> Optional[Job]:
        """A job being handled now (the one, with ``concurrency=1``), or None."""
        with self._lock:
            return self.running[-1] if self.running else None

    def stop(self) -> None:
        """Asks the worker to stop, as the first SIGTERM does. Safe from any thread."""
        self.stopping = True

    def run(self) -> int:
        """Claims and handles jobs until stopped. Returns how many jobs it handled."""
        previous = {}
        if self.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._events is not None:
                self._events.close()
                self._events = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            return
        with self._lock:
            unended = [j for j in self.running if not j.ended]
        abandoned = ", ".join("%s attempt %s" % (j.label, j.attempt) for j in unended)
        held = "; abandoning %s, whose lease expires" % abandoned if abandoned else ""
        os.write(2, ("leasehold: second signal %d: exiting now%s\n" % (signum, held)).encode())
        os._exit(128 + signum)

    def _should_stop(self) -> bool:
        return self.stopping and self.on_shutdown == "release"

    def _loop(self) -> int:
        log.info(
            "Worker started for %s, long-polling %d s per claim%s",
            self.client.base_url,
            self.wait,
            "" if self.concurrency == 1 else ", up to %d jobs at once" % self.concurrency,
        )
        if self.concurrency == 1:
            self._slot()
        else:
            slots = [
                threading.Thread(target=self._guarded_slot, name="leasehold-slot-%d" % i, daemon=True)
                for i in range(self.concurrency)
            ]
            for slot in slots:
                slot.start()
            for slot in slots:
                while slot.is_alive():  # in steps, so that signals reach the main thread
                    slot.join(0.1)
        done = self._claimed
        if self._drained:
            log.info("The sidecar is shutting down: claiming nothing more; handled %d job(s)", done)
        elif self.stopping:
            log.info("Stopped on request")
        elif self._idle:
            log.info("Nothing to claim: stopping (exit_when_idle)")
        elif self.max_jobs and done >= self.max_jobs:
            log.info("Handled %d job(s): stopping", done)
        return done

    def _guarded_slot(self) -> None:
        """A slot in a thread of its own: a handler that raises SystemExit or
        KeyboardInterrupt there (which would end the process in the main thread) stops the
        whole worker, as a SIGTERM does, instead of silently ending one slot."""
        try:
            self._slot()
        except BaseException as err:  # noqa: B036: the worker must hear of it
            log.error("A job slot ended on %r: stopping the worker", err)
            self.stopping = True

    def _over(self) -> bool:
        return self.stopping or self._drained or self._idle

    def _slot(self) -> None:
        """One claim-and-handle loop; ``concurrency`` of them run at once."""
        backoff = 0.5
        while not self._over():
            with self._lock:
                if self.max_jobs and self._claimed >= self.max_jobs:
                    return
                self._claimed += 1  # reserved, so that slots never claim past max_jobs
            handled = False
            try:
                try:
                    answer = self._claim()
                except ShuttingDown:
                    self._drained = True
                    return
                except (ConnectionFailed, ApiError) as err:
                    if isinstance(err, ConnectionFailed):
                        self.client.emit(Event("error", message="claim: %s" % err))
                    log.warning("Claim failed: %s; retrying in %.1f s", err, backoff)
                    self._pause(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = 0.5
                if answer is _STOPPED:
                    return
                if answer is None:
                    if self.exit_when_idle:
                        self._idle = True
                        return
                    if self.wait == 0:
                        self._pause(1.0)
                    continue
                handled = True
                self.handle(answer)
            finally:
                if not handled:
                    with self._lock:
                        self._claimed -= 1

    def handle(self, answer: dict) -> None:
        """Runs the handler on one claim and ends its attempt (see the class)."""
        job = Job(self.client, answer, self.heartbeat_interval, self._should_stop)
        with self._lock:
            self.running.append(job)
        log.info("Claimed LeasedJob %s (attempt %s)", job.label, job.attempt)
        # The span is current while the handler runs, sees what it raises, and ends once the
        # attempt has (Job's exit sends a Fail), saying how.
        traced = tracing.job_span(job, end_on_exit=False)
        try:
            with job, traced:
                result = self.handler(job)
                if inspect.isawaitable(result):
                    result = self._await(traced.carry(result), job)
                if job.ended is None and job.lost is None:
                    unencodable = _not_json(result)
                    if unencodable:
                        log.error("%s: %s", job.label, unencodable)
                        job.fail("ResultNotJSON", unencodable, retryable=False)
                    else:
                        job.complete(result)
        except JobLost:
            pass  # reported by the job as a `lost` event
        except LeaseholdError as err:
            self.client.emit(Event("error", job.name, job.attempt, message=str(err)))
            log.error("%s: %s", job.label, err)
        except Exception as err:  # a bug in one job must not stop the worker
            self.client.emit(Event("error", job.name, job.attempt, message="handler failed: %r" % (err,)))
            log.exception("Handler failed on %s", job.label)
        finally:
            traced.end()
            with self._lock:
                self.running.remove(job)
        if job.ended:
            log.info("Ended LeasedJob %s (attempt %s): %s", job.label, job.attempt, job.ended)

    def _await(self, awaitable: Any, job: Job) -> Any:
        """Runs an async handler's awaitable as a task on the worker's loop and waits for it
        here; cancels the task once the job is interrupted (lost, cancelled, or to be handed
        back), then raises what :meth:`Job.check` raises."""
        with self._lock:
            if self._events is None:
                self._events = _LoopThread()
            events = self._events
        future, cancel = events.submit(awaitable)
        cancelled_at = None
        warned = False
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if cancelled_at is None and job.interrupted.is_set():
                    cancel()
                    cancelled_at = time.monotonic()
                elif cancelled_at is not None and not warned and time.monotonic() - cancelled_at > 5:
                    # Its slot stays taken until it ends: never more than `concurrency` run.
                    warned = True
                    log.warning(
                        "The handler of %s goes on 5 s after its task was cancelled (it catches CancelledError?): "
                        "waiting for it to end",
                        job.label,
                    )
            except concurrent.futures.CancelledError:
                job.check()
                raise ShutdownRequested("the handler of %s was cancelled" % job.label)

    def _claim(self):
        """Long-polls in a helper thread, so that a stop request ends the wait at once.
        On a stop request the long poll's connection is shut down, so the sidecar stops the
        claim (and gives back a job it claimed meanwhile); a job that still reaches the
        helper after the wait was abandoned is released by it."""
        box = {}
        lock = threading.Lock()
        finished = threading.Event()
        connections: List[Any] = []

        def call():
            try:
                if self._claim_takes_connection:
                    result = self.client.claim(self.wait, on_connection=connections.append)
                else:
                    result = self.client.claim(self.wait)
            except BaseException as err:  # handed to the waiting thread
                result = err
            with lock:
                box["result"] = result
                abandoned = box.get("abandoned", False)
            finished.set()
            if abandoned and isinstance(result, dict):
                late = Job(self.client, result)
                log.info("Releasing %s, claimed while the worker was stopping", late.label)
                late.__exit__(None, None, None)

        threading.Thread(target=call, name="claim", daemon=True).start()
        while not finished.wait(0.1):
            if self.stopping:
                with lock:
                    if "result" not in box:
                        box["abandoned"] = True
                        for conn in connections:
                            _abort(conn)
                        return _STOPPED
                break
        result = box["result"]
        if isinstance(result, BaseException):
            raise result
        return result

    def _pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))


_STOPPED = object()


def _abort(conn: Any) -> None:
    """Shuts down a connection's socket from another thread: its pending read fails at once."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class _LoopThread:
    """An asyncio event loop running in a thread of its own, on which async handlers run as
    tasks; closed (its async generators finished) by :meth:`close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="leasehold-asyncio", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # As asyncio.run ends: tasks still pending (a handler that outlived its worker)
            # are cancelled and given the chance to run their finally blocks.
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def submit(self, awaitable: Any) -> Tuple["concurrent.futures.Future[Any]", Callable[[], None]]:
        """Runs ``awaitable`` as a task; returns a future of its outcome, and a function that
        cancels the task. The future is settled only once the task has ended: a handler
        that catches the cancellation keeps its slot until it returns."""
        started: Dict[str, Any] = {}

        async def run() -> Any:
            task = asyncio.ensure_future(awaitable)
            started["task"] = task
            return await task

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)

        def cancel() -> None:
            def cancel_task() -> None:
                task = started.get("task")
                if task is not None:
                    task.cancel()

            self.loop.call_soon_threadsafe(cancel_task)

        return future, cancel

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _not_json(result: Any) -> Optional[str]:
    """Why ``result`` cannot be a job's result (strict JSON: no NaN), or None."""
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as err:
        return "the handler's result of type %s is not JSON: %s" % (type(result).__name__, err)
    return None


def run(handler: Callable[[Job], Any], **kwargs: Any) -> int:
    """``Worker(handler, **kwargs).run()``: claims and handles jobs until SIGTERM/SIGINT
    (or ``max_jobs``, ``exit_when_idle``). Returns how many jobs were handled."""
    return Worker(handler, **kwargs).run()


def main_logging(level: int = logging.INFO) -> None:
    """Logs the ``leasehold`` logger to stderr, one line per record (for scripts)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("leasehold")
    logger.addHandler(handler)
    logger.setLevel(level)
