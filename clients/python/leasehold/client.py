"""The sidecar's HTTP API, one method per call (docs/protocol.md, "The sidecar's HTTP API").

:class:`Client` is the thin layer: it sends one request, turns an error answer into the
typed exception of its code (:mod:`leasehold.errors`), and reports every exchange to an
optional listener. It keeps no state about jobs; :class:`leasehold.Job` does.
"""

import http.client
import json
import math
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .errors import ConnectionFailed, InvalidRequest, TooLarge, Unavailable, error_from_answer

#: The sidecar's address when neither the argument nor ``$LEASEHOLD_SIDECAR`` gives one.
DEFAULT_SIDECAR = "http://127.0.0.1:7070"
#: Longest long poll the sidecar accepts for a claim, in seconds.
MAX_CLAIM_WAIT = 300
#: Seconds added to a claim's ``wait`` for the HTTP timeout: the sidecar may take up to
#: min(5 s, leaseDurationSeconds / 3) for each of the claim's two writes beyond the wait.
CLAIM_SLACK = 15.0
#: The sidecar refuses a request body over this many bytes.
MAX_BODY_BYTES = 1024 * 1024
#: Largest ``retryAfterSeconds`` a failure may ask for (one day); the sidecar caps it further
#: at the job's ``backoff.maxSeconds`` (docs/protocol.md).
MAX_RETRY_AFTER_SECONDS = 86400
#: Default HTTP timeout of heartbeat, complete, fail and release, in seconds. The sidecar
#: answers each within min(5 s, leaseDurationSeconds / 3).
CALL_TIMEOUT = 10.0


@dataclass
class Event:
    """One thing the client did, for logs and metrics (see ``Client(on_event=...)``).

    Attributes:
        kind (str): ``"claimed"``, ``"idle"`` (a claim found nothing), ``"heartbeat"``,
            ``"complete"``, ``"fail"``, ``"release"`` (one per HTTP exchange, retries
            included), ``"lost"`` (an attempt ended without an accepted outcome) or
            ``"error"`` (a call that got no answer, or an error outside any job).
        name (str or None): the job's name.
        attempt (int or None): the job's attempt.
        status (int or None): the HTTP status of the answer; None when there was none.
        error (str or None): the answer's error code (``"lease_lost"``, ...), else None.
        checkpoint (Any): for a heartbeat, the checkpoint it carried (None if none).
        message (str or None): for errors and ``lost``, what happened.
    """

    kind: str
    name: Optional[str] = None
    attempt: Optional[int] = None
    status: Optional[int] = None
    error: Optional[str] = None
    checkpoint: Any = None
    message: Optional[str] = None


class Client:
    """A client for one sidecar.

    Args:
        base_url (str or None): the sidecar's base URL, e.g. ``"http://127.0.0.1:7070"``;
            default ``$LEASEHOLD_SIDECAR``, else :data:`DEFAULT_SIDECAR`. Proxies are never
            used (the sidecar is the pod's own, on loopback).
        on_event (callable or None): called with an :class:`Event` after every exchange,
            from whichever thread made it (the heartbeat thread too). It must not raise.

    Each call opens its own connection, so no request is ever sent on a kept-alive
    connection the sidecar is closing (it closes idle ones after 10 s).

    Raises (every method): :class:`ConnectionFailed` when the sidecar does not answer in
    time or cannot be reached; the :mod:`leasehold.errors` class of the answer's code for
    an error answer.
    """

    def __init__(self, base_url: Optional[str] = None, on_event: Optional[Callable[[Event], None]] = None):
        base_url = base_url or os.environ.get("LEASEHOLD_SIDECAR") or DEFAULT_SIDECAR
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("sidecar URL %r: expected http://HOST:PORT" % base_url)
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._on_event = on_event

    # ---- the calls

    def claim(
        self, wait: float = 20, on_connection: Optional[Callable[[http.client.HTTPConnection], None]] = None
    ) -> Optional[Dict[str, Any]]:
        """Claims a job of the sidecar's queue, long-polling up to ``wait`` seconds.

        Args:
            wait (float): seconds to wait for a claimable job, 0..300 (whole seconds are
                sent; fractions are rounded down).
            on_connection (callable or None): called with the HTTP connection before the
                request is sent, so that another thread can abort the long poll (shut its
                socket down): the sidecar then stops the claim, and gives back a job it
                claimed meanwhile. The call raises :class:`ConnectionFailed`.

        Returns:
            dict or None: the claim ``{namespace, name, attempt, token, payload,
            leaseDurationSeconds, checkpoint, maxAttempts, failures, lastAttempt}``, or None when nothing was claimable in time
            (204). :meth:`leasehold.Job.claim` wraps it in a :class:`leasehold.Job`.

        Raises:
            ShuttingDown: the sidecar is draining. Unavailable: its watch has not synced,
            or the API server failed. InvalidRequest: ``wait`` out of range.
        """
        seconds = int(wait)
        status, body = self._post("/v1/claim?wait=%d" % seconds, None, seconds + CLAIM_SLACK, on_connection)
        if status == 204:
            self._emit(Event("idle", status=204))
            return None
        if status != 200:
            error = error_from_answer(status, body)
            self._emit(Event("error", status=status, error=error.code, message=str(error)))
            raise error
        if not (isinstance(body, dict) and isinstance(body.get("name"), str) and isinstance(body.get("token"), str)):
            error = error_from_answer(status, body)
            self._emit(Event("error", status=status, message="claim: malformed answer: %s" % error))
            raise error
        self._emit(Event("claimed", body["name"], body.get("attempt"), status))
        return body

    def heartbeat(
        self,
        name: str,
        token: str,
        checkpoint: Any = None,
        attempt: Optional[int] = None,
        timeout: float = CALL_TIMEOUT,
        progress: Optional[float] = None,
        message: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Renews the lease of job ``name``, storing ``checkpoint`` (any JSON, at most
        64 KiB encoded) for the next attempt to resume from when it is not None, and
        ``progress`` (the fraction done, 0 to 1) and ``message`` (at most 256 bytes of UTF-8,
        no control characters) for people to see (``kubectl leasehold get``) when not None.
        All of it is written with the renewal itself: one write to the Lease.

        Returns:
            dict: ``{renewTime, expiresAt, leaseDurationSeconds}`` (times RFC 3339 by the
            sidecar's clock, duration in seconds).

        Raises:
            JobLost (LeaseLost, Cancelled, JobFinished, JobNotFound): stop working on it.
            Unavailable: not confirmed in time; repeat. TooLarge: the checkpoint is over
            64 KiB (nothing was renewed). InvalidRequest: ``progress`` or ``message`` breaks
            its rule (nothing was renewed).
        """
        body: Dict[str, Any] = {"token": token}
        if checkpoint is not None:
            body["checkpoint"] = checkpoint
        if progress is not None:
            body["progress"] = progress
        if message is not None:
            body["message"] = message
        return self._job_call("heartbeat", name, attempt, body, timeout, checkpoint)

    def complete(
        self, name: str, token: str, result: Any = None, attempt: Optional[int] = None, timeout: float = CALL_TIMEOUT
    ) -> Dict[str, Any]:
        """Ends the attempt as Succeeded with ``result`` (any JSON; the whole job must stay
        under 1 MiB as JSON).

        Returns:
            dict: ``{namespace, name, attempt, phase: "Succeeded"}``.

        Raises:
            JobLost: the result was refused (another attempt holds the job, or it ended).
            TooLarge: the result would make the job too large (nothing was written; the
            job is still held). Unavailable: repeat with the same token.
        """
        return self._job_call("complete", name, attempt, {"token": token, "result": result}, timeout)

    def fail(
        self,
        name: str,
        token: str,
        reason: str,
        message: str = "",
        retryable: bool = False,
        attempt: Optional[int] = None,
        timeout: float = CALL_TIMEOUT,
        retry_after: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Ends the attempt as failed.

        Args:
            reason (str): CamelCase word, ``^[A-Za-z][A-Za-z0-9]*$``, at most 64 characters.
            message (str): at most 4096 bytes of UTF-8; longer is cut here at a character
                boundary rather than refused.
            retryable (bool): whether another attempt could succeed.
            retry_after (float or None): with ``retryable``, seconds before the next attempt
                (0 to 86400, rounded up to a whole second; sent as ``retryAfterSeconds``),
                instead of the backoff's delay. The sidecar caps it at the job's
                ``backoff.maxSeconds``, or 3600 s for a job without a backoff.

        Returns:
            dict: ``{namespace, name, attempt, phase, retryAfter?}``, phase ``"Queued"``
            (retried; ``retryAfter`` when it waits) or ``"Failed"``.

        Raises:
            InvalidRequest: a bad reason, or ``retry_after`` out of range or without
            ``retryable``. JobLost, Unavailable, TooLarge: as for complete.
        """
        body = {"token": token, "reason": reason, "message": _cut_utf8(message, 4096), "retryable": bool(retryable)}
        if retry_after is not None:
            body["retryAfterSeconds"] = _whole_seconds(retry_after)
        return self._job_call("fail", name, attempt, body, timeout)

    def release(
        self, name: str, token: str, attempt: Optional[int] = None, timeout: float = CALL_TIMEOUT
    ) -> Dict[str, Any]:
        """Gives the job back: it is requeued at once with its last checkpoint, and the
        release does not count as a failed attempt.

        Returns:
            dict: ``{namespace, name, attempt, phase: "Queued"}``.

        Raises:
            JobLost, Unavailable: as for complete.
        """
        return self._job_call("release", name, attempt, {"token": token}, timeout)

    # ---- plumbing

    def emit(self, event: Event) -> None:
        """Reports ``event`` to the listener given as ``on_event`` (used by the job and the
        runner for the events that are not a single exchange, e.g. ``lost``)."""
        self._emit(event)

    def _emit(self, event: Event) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _job_call(self, verb, name, attempt, body, timeout, checkpoint=None):
        path = "/v1/jobs/%s/%s" % (urllib.parse.quote(name, safe=""), verb)
        try:
            status, answer = self._post(path, body, timeout)
        except ConnectionFailed as err:
            self._emit(Event(verb, name, attempt, None, None, checkpoint, str(err)))
            raise
        if status == 200 and isinstance(answer, dict):
            self._emit(Event(verb, name, attempt, status, None, checkpoint))
            return answer
        error = error_from_answer(status, answer)
        self._emit(Event(verb, name, attempt, status, error.code or None, checkpoint, error.message))
        raise error

    def _post(
        self,
        path: str,
        body: Any,
        timeout: float,
        on_connection: Optional[Callable[[http.client.HTTPConnection], None]] = None,
    ) -> Tuple[int, Any]:
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json", "Content-Length": str(len(data))}
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout)
        if on_connection is not None:
            on_connection(conn)
        url = self._prefix + path
        if len(data) > MAX_BODY_BYTES:
            raise TooLarge(
                413,
                "too_large",
                "request body of %d bytes is larger than the sidecar's limit of %d bytes (not sent): "
                "keep results and checkpoints small, with references to large data" % (len(data), MAX_BODY_BYTES),
            )
        try:
            try:
                conn.request("POST", url, body=data, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the sidecar may have answered (e.g. 413) and closed early: read it
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        except (OSError, socket.timeout, http.client.HTTPException) as err:
            raise ConnectionFailed("POST %s%s: %s" % (self.base_url, path, err or type(err).__name__)) from err
        finally:
            conn.close()
        if not raw:
            return status, None
        try:
            return status, json.loads(raw.decode("utf-8"))
        except ValueError:
            return status, {"raw": raw[:200].decode("utf-8", "replace")}


def retrying(call: Callable[[], Any], deadline: float, pause: float = 0.5, max_pause: float = 4.0) -> Any:
    """Runs ``call`` until it returns, repeating it after :class:`ConnectionFailed` or
    :class:`Unavailable` (both safe to repeat with the same token) with exponential backoff
    from ``pause`` to ``max_pause`` seconds, until the monotonic time ``deadline``; then the
    last exception is raised. Every other exception is raised at once."""
    while True:
        try:
            return call()
        except (ConnectionFailed, Unavailable):
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, max_pause)


def _whole_seconds(seconds: Any) -> int:
    """``seconds`` rounded up to a whole number, checked as the sidecar checks
    ``retryAfterSeconds`` (0 to :data:`MAX_RETRY_AFTER_SECONDS`), so that a failure is never
    refused for it. Raises :class:`InvalidRequest` naming the value."""
    ok = not isinstance(seconds, bool) and isinstance(seconds, (int, float)) and math.isfinite(seconds)
    if not ok or not 0 <= seconds <= MAX_RETRY_AFTER_SECONDS:
        raise InvalidRequest(
            400,
            "invalid_request",
            "retry_after %r is out of range: expected a number of seconds from 0 to %d"
            % (seconds, MAX_RETRY_AFTER_SECONDS),
        )
    return int(math.ceil(seconds))


def _cut_utf8(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")
