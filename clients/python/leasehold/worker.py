"""The claim loop: claims jobs one at a time, runs a handler on each, ends each attempt
exactly once, and stops gracefully on SIGTERM."""

import asyncio
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

from .client import MAX_CLAIM_WAIT, Client, Event
from .errors import ApiError, ConnectionFailed, JobLost, LeaseholdError, ShuttingDown
from .job import Job

log = logging.getLogger("leasehold")

#: What a running job does when the worker is asked to stop.
SHUTDOWN_POLICIES = ("release", "finish")


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

    An ``async def`` handler is run to its end on an event loop of its own
    (``asyncio.run``), one job at a time, with the same heartbeats, checkpoints, lease loss
    and cancellation: call :meth:`Job.check` between awaits, and ``await asyncio.sleep``
    rather than :meth:`Job.sleep`. Anything else that is not callable is refused with a
    TypeError when the worker is made.

    When the sidecar answers a claim with ``shutting_down`` (it is draining: its pod is
    stopping), the worker claims nothing more and returns, logging one line.

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
        exit_when_idle (bool): stop when a claim finds nothing (204).
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
        self.current: Optional[Job] = None

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

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            return
        job = self.current
        held = "" if job is None or job.ended else "; abandoning %s attempt %s, whose lease expires" % (
            job.label,
            job.attempt,
        )
        os.write(2, ("leasehold: second signal %d: exiting now%s\n" % (signum, held)).encode())
        os._exit(128 + signum)

    def _should_stop(self) -> bool:
        return self.stopping and self.on_shutdown == "release"

    def _loop(self) -> int:
        log.info("Worker started for %s, long-polling %d s per claim", self.client.base_url, self.wait)
        done = 0
        backoff = 0.5
        while not self.stopping:
            if self.max_jobs and done >= self.max_jobs:
                log.info("Handled %d job(s): stopping", done)
                break
            try:
                answer = self._claim()
            except ShuttingDown:
                log.info("The sidecar is shutting down: claiming nothing more; handled %d job(s)", done)
                return done
            except (ConnectionFailed, ApiError) as err:
                if isinstance(err, ConnectionFailed):
                    self.client.emit(Event("error", message="claim: %s" % err))
                log.warning("Claim failed: %s; retrying in %.1f s", err, backoff)
                self._pause(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.5
            if answer is _STOPPED:
                break
            if answer is None:
                if self.exit_when_idle:
                    log.info("Nothing to claim: stopping (exit_when_idle)")
                    break
                if self.wait == 0:
                    self._pause(1.0)
                continue
            done += 1
            self.handle(answer)
        if self.stopping:
            log.info("Stopped on request")
        return done

    def handle(self, answer: dict) -> None:
        """Runs the handler on one claim and ends its attempt (see the class)."""
        job = Job(self.client, answer, self.heartbeat_interval, self._should_stop)
        self.current = job
        log.info("Claimed LeasedJob %s (attempt %s)", job.label, job.attempt)
        try:
            with job:
                result = self.handler(job)
                if inspect.isawaitable(result):
                    result = _run_to_end(result)
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
            self.current = None
        if job.ended:
            log.info("Ended LeasedJob %s (attempt %s): %s", job.label, job.attempt, job.ended)

    def _claim(self):
        """Long-polls in a helper thread, so that a stop request ends the wait at once.
        A job claimed after the wait was abandoned is released by the helper."""
        box = {}
        lock = threading.Lock()
        finished = threading.Event()

        def call():
            try:
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


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _run_to_end(awaitable: Any) -> Any:
    """Runs an async handler's awaitable to its end on an event loop of its own: in this
    thread, or, when this thread already runs a loop (a notebook, an async caller), in a
    helper thread this one waits for. Returns its result or raises what it raised."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(awaitable))
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = asyncio.run(_awaited(awaitable))
        except BaseException as err:  # handed to the waiting thread
            box["error"] = err

    helper = threading.Thread(target=run, name="async-handler", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
    if "error" in box:
        raise box["error"]
    return box.get("result")


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
