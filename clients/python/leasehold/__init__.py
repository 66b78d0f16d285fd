"""leasehold: a Python client for the leasehold sidecar.

A worker in a few lines::

    import leasehold

    def handle(job):
        done = job.checkpoint or 0            # resume where the last attempt stopped
        for i in range(done, len(job.payload["items"])):
            process(job.payload["items"][i])
            job.save(i + 1)                   # sent with the next heartbeat
            job.check()                       # raises once the lease is lost or cancelled
        return {"items": len(job.payload["items"])}   # -> complete

    leasehold.run(handle)                     # claims until SIGTERM

See :class:`Worker` for how a handler's outcome ends the attempt, :class:`Job` for the
claimed job, :class:`Client` for the raw HTTP calls, and :mod:`leasehold.errors` for the
exception of every error code. Standard library only; Python 3.9 or later.

Submitting jobs and awaiting their results from code is :class:`Producer`
(:mod:`leasehold.producer`), which needs the ``kubernetes`` package: ``pip install
'leasehold[producer]'``. Testing a handler without a cluster is :mod:`leasehold.testing`.
"""

from .client import DEFAULT_SIDECAR, Client, Event
from .errors import (
    ERRORS,
    ApiError,
    BodyTimeout,
    Cancelled,
    ConnectionFailed,
    Fail,
    InvalidJson,
    InvalidName,
    InvalidRequest,
    InvalidToken,
    JobEnded,
    JobFinished,
    JobLost,
    JobNotFound,
    LeaseholdError,
    LeaseLost,
    LeaseUnconfirmed,
    MethodNotAllowed,
    NotFound,
    RequestRejected,
    ShutdownRequested,
    ShuttingDown,
    TooLarge,
    Unavailable,
    UnexpectedResponse,
)
from .job import Job
from .producer import ClusterError, IdempotencyConflict, JobCancelled, JobFailed, JobInfo, Producer, WaitTimeout
from .worker import Worker, run

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SIDECAR",
    "ERRORS",
    "ApiError",
    "BodyTimeout",
    "Cancelled",
    "Client",
    "ClusterError",
    "ConnectionFailed",
    "Event",
    "Fail",
    "IdempotencyConflict",
    "InvalidJson",
    "InvalidName",
    "InvalidRequest",
    "InvalidToken",
    "Job",
    "JobCancelled",
    "JobEnded",
    "JobFailed",
    "JobInfo",
    "JobFinished",
    "JobLost",
    "JobNotFound",
    "LeaseLost",
    "LeaseUnconfirmed",
    "LeaseholdError",
    "MethodNotAllowed",
    "NotFound",
    "Producer",
    "RequestRejected",
    "ShutdownRequested",
    "ShuttingDown",
    "TooLarge",
    "Unavailable",
    "UnexpectedResponse",
    "WaitTimeout",
    "Worker",
    "run",
]
