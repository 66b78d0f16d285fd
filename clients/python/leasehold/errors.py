"""Exceptions of the leasehold client: one class per error code of the sidecar's HTTP API.

Every answer the sidecar gives with an ``{"error": CODE, "message": TEXT}`` body becomes an
instance of the class registered for CODE (see :data:`ERRORS`), carrying the HTTP status,
the code and the server's message unchanged. docs/protocol.md ("The sidecar's HTTP API")
lists the codes; the classes below follow its table.

The classes are grouped by what the worker should do:

* :class:`JobLost`: the job is no longer this worker's (lease lost, job finished, cancelled,
  job deleted, or no renewal confirmed for a whole lease). Stop working on it; send nothing
  more for it; claim again.
* :class:`RequestRejected`: the request itself was wrong (a bug in the caller); repeating it
  changes nothing.
* :class:`Unavailable` and :class:`ConnectionFailed`: transient; repeat with the same token.
"""

from typing import Any, Dict, Optional, Type


class LeaseholdError(Exception):
    """Base class of every exception this package raises."""


class ConnectionFailed(LeaseholdError):
    """The sidecar could not be reached, or did not answer within the call's timeout.

    Transient: repeating the call with the same token is safe (the sidecar answers a
    repeated complete, fail or release as it answered the first one that landed).
    """


class ApiError(LeaseholdError):
    """An error answer of the sidecar.

    Attributes:
        status (int): the HTTP status, e.g. 409.
        code (str): the error code of the body, e.g. ``"lease_lost"``.
        message (str): the server's message, unchanged (what happened, to which job, what
            to do).
        body (dict): the whole JSON body of the answer.
    """

    #: The error code this class stands for (None for classes that group several).
    code_name: Optional[str] = None

    def __init__(self, status: int, code: str, message: str, body: Optional[Dict[str, Any]] = None):
        LeaseholdError.__init__(self, "%d %s: %s" % (status, code, message))
        self.status = status
        self.code = code
        self.message = message
        self.body = body if body is not None else {}


class UnexpectedResponse(ApiError):
    """An answer the protocol does not describe: a body that is not a JSON error, or an
    error code this client does not know (a newer sidecar). ``code`` is ``""`` when the
    body had none."""


class RequestRejected(ApiError):
    """The sidecar refused the request as malformed: a bug in the caller, not a condition
    that repeating the call would change."""


class InvalidJson(RequestRejected):
    """400 ``invalid_json``: the body is not JSON of the expected shape (or has unknown fields)."""

    code_name = "invalid_json"


class InvalidToken(RequestRejected):
    """400 ``invalid_token``: the token is missing or not ``<attempt>.<32 hex>``."""

    code_name = "invalid_token"


class InvalidRequest(RequestRejected):
    """400 ``invalid_request``: a field breaks its rule (reason, message, wait)."""

    code_name = "invalid_request"


class InvalidName(RequestRejected):
    """400 ``invalid_name``: the job name in the URL is not a valid object name."""

    code_name = "invalid_name"


class NotFound(RequestRejected):
    """404 ``not_found``: no such route (a client for another version of the API?)."""

    code_name = "not_found"


class MethodNotAllowed(RequestRejected):
    """405 ``method_not_allowed``: a GET where a POST is expected, or the reverse."""

    code_name = "method_not_allowed"


class BodyTimeout(RequestRejected):
    """408 ``body_timeout``: the request body did not arrive in full within the sidecar's
    ``--body-timeout`` (10 s)."""

    code_name = "body_timeout"


class TooLarge(RequestRejected):
    """413 ``too_large``: the body is over 1 MiB, the checkpoint over 64 KiB, or the result
    would make the job larger than 1 MiB as JSON. Nothing was written; the job is still
    held, so a smaller result (e.g. a reference to an object store) can be sent instead."""

    code_name = "too_large"


class JobLost(ApiError):
    """The job is no longer this worker's. Stop working on it and send nothing more for it:
    the server refuses every write with this token from now on."""


class LeaseLost(JobLost):
    """409 ``lease_lost``: the token is not the current holder's (stale, another job's, or
    the attempt ended: expired or released). The message gives the current attempt."""

    code_name = "lease_lost"


class JobFinished(JobLost):
    """409 ``job_finished``: the job is already Succeeded or Failed."""

    code_name = "job_finished"


class Cancelled(JobLost):
    """409 ``cancelled``: the job was cancelled (``spec.cancel``); its outcome is Cancelled."""

    code_name = "cancelled"


class JobNotFound(JobLost):
    """404 ``job_not_found``: no such LeasedJob (deleted while held)."""

    code_name = "job_not_found"


class LeaseUnconfirmed(JobLost):
    """Raised by this client, not answered by the sidecar: no heartbeat was confirmed for a
    whole lease (``leaseDurationSeconds``, counted from when the last confirmed heartbeat was
    sent), while heartbeats failed (sidecar unreachable or answering ``unavailable``). The
    controller may have requeued the job meanwhile, so the client treats it as lost and
    sends no result for it. ``status`` is 0 and ``code`` ``"lease_unconfirmed"``."""

    code_name = "lease_unconfirmed"

    def __init__(self, message: str):
        JobLost.__init__(self, 0, "lease_unconfirmed", message)


class Unavailable(ApiError):
    """503 ``unavailable``: the API server could not be reached or did not answer in time
    (or, for a claim, the sidecar's watch has not synced yet). Transient: repeat the call
    with the same token.

    Attributes:
        expires_at (str or None): for a held job, when its lease runs out unless a renewal
            gets through, as far as the sidecar knows (RFC 3339, the sidecar's clock).
    """

    code_name = "unavailable"

    def __init__(self, status: int, code: str, message: str, body: Optional[Dict[str, Any]] = None):
        ApiError.__init__(self, status, code, message, body)
        expires = self.body.get("expiresAt")
        self.expires_at = expires if isinstance(expires, str) else None


class ShuttingDown(ApiError):
    """503 ``shutting_down`` (claim only): the sidecar is draining and claims nothing more;
    jobs already held can still be heartbeated, completed, failed and released."""

    code_name = "shutting_down"


class JobEnded(LeaseholdError):
    """Raised by this client: a call on a :class:`leasehold.Job` that this worker already
    completed, failed or released (each attempt ends once)."""


class ShutdownRequested(LeaseholdError):
    """Raised by :meth:`leasehold.Job.check` and :meth:`leasehold.Job.sleep` once the worker
    was asked to stop (SIGTERM or SIGINT) and its shutdown policy is ``"release"``: the
    runner then releases the job, with its latest checkpoint, so another worker resumes it
    at once. A handler may catch it to clean up, but should let it propagate."""


class Fail(LeaseholdError):
    """Raise from a handler to end the attempt as failed.

    Args:
        reason (str): a CamelCase word, ``^[A-Za-z][A-Za-z0-9]*$``, at most 64 characters,
            e.g. ``"BadPayload"``.
        message (str): what happened, at most 4096 bytes of UTF-8 (longer is cut).
        retryable (bool): whether another attempt could succeed. False ends the job Failed
            at once; True requeues it (after its backoff) until ``maxAttempts`` failed
            attempts were used.
        retry_after (float or None): with ``retryable``, how long the next attempt waits,
            in seconds (rounded up to whole seconds), instead of the backoff's delay: e.g. a
            vendor's ``Retry-After``. The sidecar caps it at the job's ``backoff.maxSeconds``
            (3600 s when the job has no backoff); see :meth:`leasehold.Job.fail`.
    """

    def __init__(self, reason: str, message: str, retryable: bool = False, retry_after: Optional[float] = None):
        LeaseholdError.__init__(self, message)
        self.reason = reason
        self.message = message
        self.retryable = retryable
        self.retry_after = retry_after


#: Error code -> exception class, for every code docs/protocol.md documents.
ERRORS: Dict[str, Type[ApiError]] = {
    cls.code_name: cls
    for cls in (
        InvalidJson,
        InvalidToken,
        InvalidRequest,
        InvalidName,
        JobNotFound,
        NotFound,
        MethodNotAllowed,
        BodyTimeout,
        LeaseLost,
        JobFinished,
        Cancelled,
        TooLarge,
        Unavailable,
        ShuttingDown,
    )
    if cls.code_name
}


def error_from_answer(status: int, body: Any) -> ApiError:
    """The exception for an error answer: the registered class for its code, else
    :class:`UnexpectedResponse`."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        code = body["error"]
        message = body.get("message") if isinstance(body.get("message"), str) else ""
        cls = ERRORS.get(code, UnexpectedResponse)
        return cls(status, code, message, body)
    shown = repr(body)[:200] if body is not None else "an empty body"
    return UnexpectedResponse(status, "", "HTTP %d with %s" % (status, shown), None)
