"""Submit jobs from code and wait for their results: the producer's side of leasehold.

::

    import leasehold

    jobs = leasehold.Producer()                      # kubeconfig, then in-cluster credentials
    job = jobs.submit("transcribe", {"url": "s3://media/talk.wav"}, key="upload-8812")
    result = jobs.wait(job.name, timeout=3600)       # the worker's result; raises JobFailed

A producer talks to the Kubernetes API server (not to a sidecar), through the official
``kubernetes`` client: ``pip install 'leasehold[producer]'``. It needs RBAC to create, get,
list, watch and patch ``leasedjobs`` (and patch ``leasedjobs/status`` for :meth:`Producer.retry`)
in its namespace.

Idempotency (docs/protocol.md, "Submitting with an idempotency key"): with ``key=``, the job
is named ``<queue>-<16 hex digits of the key's SHA-256>`` and carries the key and the SHA-256
of its spec (canonical JSON) in the annotations ``leasehold.dev/idempotency-key`` and
``leasehold.dev/spec-sha256``, the same rule ``kubectl leasehold submit --key`` follows: a
resubmission with the same key and spec, from either, returns the job the first one made; with
another spec it raises :class:`IdempotencyConflict`. The key holds for as long as the job
exists (``ttlSecondsAfterFinished`` or a deletion frees it).
"""

import asyncio
import hashlib
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

from . import tracing
from .errors import InvalidRequest, JobFinished, JobNotFound, LeaseholdError

GROUP = "leasehold.dev"
VERSION = "v1alpha1"
PLURAL = "leasedjobs"
#: Annotation with the idempotency key a job was submitted with.
KEY_ANNOTATION = "leasehold.dev/idempotency-key"
#: Annotation with the SHA-256 (hex) of the spec as submitted, in canonical JSON.
SPEC_HASH_ANNOTATION = "leasehold.dev/spec-sha256"
#: Annotation with the W3C traceparent of the producer's span (docs/protocol.md, "Traces
#: across the queue").
TRACEPARENT_ANNOTATION = "leasehold.dev/traceparent"
#: Longest idempotency key, in bytes of UTF-8.
MAX_KEY_BYTES = 512
#: Hex digits of the key's SHA-256 in a job's name.
NAME_HASH_HEX = 16
#: The phases a job ends in.
FINISHED = ("Succeeded", "Failed", "Cancelled")
#: Longest a single watch of :meth:`Producer.wait` runs before it is renewed, in seconds (a
#: cancelled :meth:`Producer.wait_async` leaves its thread within this).
WATCH_SECONDS = 30

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class ClusterError(LeaseholdError):
    """The API server could not be reached, or refused a request for a reason other than the
    job's content (403, 5xx, ...).

    Attributes:
        status (int): the HTTP status, 0 when there was no answer.
        message (str): what was being done, naming the job, and the API server's message.
    """

    def __init__(self, status: int, message: str):
        LeaseholdError.__init__(self, message)
        self.status = status
        self.message = message


class IdempotencyConflict(LeaseholdError):
    """The idempotency key's job exists and is not this submission: it was submitted with
    another spec (``differs`` names the fields), or not with this key at all.

    Attributes:
        job (str): ``namespace/name``. key (str): the key. differs (list of str): the spec
        fields whose values differ (``["spec.payload"]``), empty when the job was not submitted
        with the key.
    """

    def __init__(self, job: str, key: str, differs: List[str]):
        if differs:
            text = (
                "LeasedJob %s was submitted with idempotency key %r and a different spec (%s): a key names one "
                "submission; use a new key for a new job" % (job, key, ", ".join(differs) or "the spec")
            )
        else:
            text = "LeasedJob %s exists and was not submitted with idempotency key %r: delete it, or submit under another key" % (
                job,
                key,
            )
        LeaseholdError.__init__(self, text)
        self.job, self.key, self.differs = job, key, differs


class JobFailed(LeaseholdError):
    """Raised by :meth:`Producer.wait` for a job that ended Failed (or, as
    :class:`JobCancelled`, Cancelled).

    Attributes:
        job (JobInfo): the finished job. failures (list of dict): its failed attempts, oldest
        first, ``{attempt, holder, reason, message, time}``. reason (str) and message (str):
        of its finished condition (``AttemptsExhausted``, the worker's reason, ``Cancelled``).
    """

    def __init__(self, job: "JobInfo"):
        condition = next(
            (c for c in job.conditions if c.get("status") == "True" and c.get("type") in ("Failed", "Cancelled")),
            {},
        )
        self.job = job
        self.failures = job.failures
        self.reason = condition.get("reason", job.phase)
        self.message = condition.get("message", "")
        history = "".join(
            "\n  attempt %s on %s: %s: %s" % (f.get("attempt"), f.get("holder"), f.get("reason"), f.get("message"))
            for f in self.failures
        )
        LeaseholdError.__init__(
            self, "LeasedJob %s %s: %s (%s)%s" % (job.label, job.phase, self.reason, self.message, history)
        )


class JobCancelled(JobFailed):
    """Raised by :meth:`Producer.wait` for a job that ended Cancelled."""


class WaitTimeout(LeaseholdError, TimeoutError):
    """:meth:`Producer.wait` gave up before the job finished; the job goes on."""


@dataclass
class JobInfo:
    """A LeasedJob as the API server last showed it.

    Attributes:
        namespace (str), name (str): the job. queue (str): spec.queue.
        phase (str): Queued, Leased, Succeeded, Failed or Cancelled ("" before the controller
            saw it). attempt (int): the latest attempt (0 before the first claim).
        result (Any): the worker's result once Succeeded, else None.
        failures (list of dict): failed attempts, oldest first.
        conditions (list of dict): status.conditions.
        created (bool): for :meth:`Producer.submit`, whether this call created the job (False:
            the same submission had, under its key).
        raw (dict): the whole object.
    """

    namespace: str
    name: str
    queue: str
    phase: str
    attempt: int
    result: Any
    failures: List[Dict[str, Any]]
    conditions: List[Dict[str, Any]]
    raw: Dict[str, Any] = field(repr=False)
    created: bool = False

    @property
    def label(self) -> str:
        """``namespace/name``."""
        return "%s/%s" % (self.namespace, self.name)

    @property
    def finished(self) -> bool:
        """Whether the job ended (Succeeded, Failed or Cancelled)."""
        return self.phase in FINISHED

    @classmethod
    def of(cls, obj: Dict[str, Any], created: bool = False) -> "JobInfo":
        meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            queue=spec.get("queue", ""),
            phase=status.get("phase") or "",
            attempt=status.get("attempt") or 0,
            result=status.get("result"),
            failures=list(status.get("failures") or []),
            conditions=list(status.get("conditions") or []),
            raw=obj,
            created=created,
        )


def name_for_key(queue: str, key: str) -> str:
    """The name of the job submitted to ``queue`` with ``key``: ``<queue>-<first 16 hex
    digits of SHA-256(key)>``, as every leasehold producer names it."""
    return "%s-%s" % (queue, hashlib.sha256(key.encode("utf-8")).hexdigest()[:NAME_HASH_HEX])


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON: keys sorted, no whitespace, non-ASCII as is (the form
    whose SHA-256 is a job's ``leasehold.dev/spec-sha256``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def spec_hash(spec: Dict[str, Any]) -> str:
    """SHA-256 (hex) of ``spec`` as canonical JSON."""
    return hashlib.sha256(canonical_json(spec).encode("utf-8")).hexdigest()


def check_key(key: Any) -> None:
    """Raises :class:`InvalidRequest` unless ``key`` is 1 to 512 bytes of UTF-8 without
    control characters."""
    if not isinstance(key, str):
        problem = "is not a string"
    elif not _utf8(key):
        problem = "is not valid Unicode (it holds a lone surrogate)"
    elif not key:
        problem = "is empty: give a key that names the submission (an order ID, a file's hash)"
    elif len(key.encode("utf-8")) > MAX_KEY_BYTES:
        problem = "is %d bytes: at most %d bytes of UTF-8 are accepted" % (len(key.encode("utf-8")), MAX_KEY_BYTES)
    elif any(ord(c) < 32 or 127 <= ord(c) < 160 for c in key):
        problem = "contains a control character (a line break, a tab, ...)"
    else:
        return
    raise InvalidRequest(400, "invalid_request", "idempotency key %r %s" % (str(key)[:80], problem))


class Producer:
    """Submits, reads, cancels, retries and awaits the LeasedJobs of one namespace.

    Args:
        namespace (str or None): default: the kubeconfig context's namespace, else the pod's
            own (in a cluster), else ``"default"``.
        context (str or None): the kubeconfig context (default: the current one).
        kubeconfig (str or None): the kubeconfig file (default: ``$KUBECONFIG``, else
            ``~/.kube/config``). Without one, the in-cluster service account is used.
        api_client (kubernetes.client.ApiClient or None): a client you configured yourself;
            then ``context`` and ``kubeconfig`` are not read.

    Raises:
        ImportError: the ``kubernetes`` package is missing (``pip install 'leasehold[producer]'``).
        ClusterError: no kubeconfig and not in a cluster.
    """

    def __init__(
        self,
        namespace: Optional[str] = None,
        *,
        context: Optional[str] = None,
        kubeconfig: Optional[str] = None,
        api_client: Any = None,
    ):
        try:
            import kubernetes  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "leasehold.Producer needs the kubernetes package: pip install 'leasehold[producer]'"
            ) from err
        from kubernetes import client, config

        default_ns = None
        if api_client is None:
            try:
                config.load_kube_config(config_file=kubeconfig, context=context)
                _, active = config.list_kube_config_contexts(config_file=kubeconfig)
                if context is not None:
                    contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
                    active = next((c for c in contexts if c.get("name") == context), active)
                default_ns = ((active or {}).get("context") or {}).get("namespace")
            except config.ConfigException as kube_err:
                if kubeconfig is not None or context is not None:
                    raise ClusterError(0, "kubeconfig: %s" % kube_err) from kube_err
                try:
                    config.load_incluster_config()
                except config.ConfigException as cluster_err:
                    raise ClusterError(
                        0,
                        "no cluster credentials: no kubeconfig (%s) and not in a cluster (%s)" % (kube_err, cluster_err),
                    ) from cluster_err
                default_ns = _read(_SERVICE_ACCOUNT_NAMESPACE)
            api_client = client.ApiClient()
        self.namespace = namespace or default_ns or "default"
        if not _DNS_LABEL.match(self.namespace):
            raise ValueError("namespace %r is not a DNS label" % self.namespace)
        self._api = client.CustomObjectsApi(api_client)
        from kubernetes.client.exceptions import ApiException

        self._api_exception = ApiException

    # ---- submit

    def submit(
        self,
        queue: str,
        payload: Any = None,
        *,
        key: Optional[str] = None,
        name: Optional[str] = None,
        priority: Optional[int] = None,
        lease_duration: Optional[int] = None,
        max_attempts: Optional[int] = None,
        backoff: Optional[Dict[str, int]] = None,
        not_before: Any = None,
        concurrency_key: Optional[str] = None,
        ttl_after_finished: Optional[int] = None,
        labels: Optional[Dict[str, str]] = None,
        annotations: Optional[Dict[str, str]] = None,
        traceparent: Optional[str] = None,
    ) -> JobInfo:
        """Submits a job to ``queue`` with ``payload`` (any JSON; default ``{}``).

        Args:
            key (str or None): idempotency key (see the module): resubmitting with the same
                key and spec returns the same job (``created`` False).
            name (str or None): the job's name (default: from the key, else generated as
                ``<queue>-<random>``).
            priority, lease_duration (seconds, 5..86400), max_attempts (>= 1), backoff
                (``{"initialSeconds": s, "maxSeconds": s}``), not_before (a timezone-aware
                datetime, or an RFC 3339 string), concurrency_key, ttl_after_finished
                (seconds): the spec's fields; None leaves them to the queue's defaults.
            labels, annotations (dict or None): metadata (not part of the idempotency spec).
            traceparent (str or None): the W3C traceparent the worker's span is made a child
                of (the annotation ``leasehold.dev/traceparent``); default: the current
                OpenTelemetry span's, when the package is installed and a span is current.
                Not part of the idempotency spec.

        Returns:
            JobInfo: the job, with ``created`` True when this call made it.

        Raises:
            InvalidRequest: a bad queue, key, name or field, checked here or by the API server
                (its message names the field and the rule); nothing is created.
            IdempotencyConflict: the key's job was submitted with another spec.
            ClusterError: the API server could not be reached or refused otherwise.
        """
        if not isinstance(queue, str) or not _DNS_LABEL.match(queue):
            raise InvalidRequest(
                400, "invalid_request", "queue %r is not a DNS label (1 to 63 lowercase letters, digits and '-')" % (queue,)
            )
        spec: Dict[str, Any] = {"queue": queue, "payload": {} if payload is None else payload}
        if isinstance(not_before, datetime):
            if not_before.tzinfo is None:
                raise InvalidRequest(400, "invalid_request", "not_before %r has no timezone" % (not_before,))
            not_before = not_before.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        for field_name, value in (
            ("priority", priority),
            ("leaseDurationSeconds", lease_duration),
            ("maxAttempts", max_attempts),
            ("backoff", backoff),
            ("notBefore", not_before),
            ("concurrencyKey", concurrency_key),
            ("ttlSecondsAfterFinished", ttl_after_finished),
        ):
            if value is not None:
                spec[field_name] = value
        too_big = _out_of_range_number(spec["payload"])
        if too_big is not None:
            raise InvalidRequest(
                400,
                "invalid_request",
                "the payload's number %d is beyond the 64-bit integer range: the API server would store it as a rounded "
                "float; send it as a string" % too_big,
            )
        try:
            digest = spec_hash(spec)
        except (TypeError, ValueError) as err:
            raise InvalidRequest(400, "invalid_request", "the payload is not JSON: %s" % err) from err
        metadata: Dict[str, Any] = {"labels": dict(labels or {}), "annotations": dict(annotations or {})}
        if traceparent is not None:
            if tracing.parse_traceparent(traceparent) is None:
                raise InvalidRequest(
                    400,
                    "invalid_request",
                    "traceparent %r is not a valid W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, lowercase, "
                    "neither id all zeros)" % (traceparent,),
                )
        else:
            traceparent = tracing.current_traceparent()
        if traceparent is not None:
            metadata["annotations"][TRACEPARENT_ANNOTATION] = traceparent
        if key is not None:
            check_key(key)
            metadata["annotations"][KEY_ANNOTATION] = key
            metadata["annotations"][SPEC_HASH_ANNOTATION] = digest
            name = name or name_for_key(queue, key)
        if name is not None:
            if not isinstance(name, str) or len(name) > 253 or not _SUBDOMAIN.match(name):
                raise InvalidRequest(
                    400,
                    "invalid_request",
                    "name %r is not a valid LeasedJob name (a lowercase RFC 1123 subdomain of at most 253 characters)"
                    % (name,),
                )
            metadata["name"] = name
        else:
            metadata["generateName"] = queue + "-"
        body = {"apiVersion": "%s/%s" % (GROUP, VERSION), "kind": "LeasedJob", "metadata": metadata, "spec": spec}
        shown = "%s/%s" % (self.namespace, name or queue + "-...")
        try:
            created = self._api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
            return JobInfo.of(created, created=True)
        except self._api_exception as err:
            if err.status != 409 or key is None:
                raise self._refused("creating LeasedJob %s" % shown, err) from None
        existing = self._get(name)
        meta = existing.get("metadata") or {}
        notes = meta.get("annotations") or {}
        label = "%s/%s" % (self.namespace, name)
        if notes.get(KEY_ANNOTATION) != key:
            raise IdempotencyConflict(label, key, [])
        if notes.get(SPEC_HASH_ANNOTATION) != digest:
            stored = existing.get("spec") or {}
            differs = ["spec.%s" % f for f, v in spec.items() if stored.get(f) != v]
            # Fields the job sets that this submission leaves out (the API server's defaults
            # aside), as kubectl leasehold submit names them.
            differs += [
                "spec.%s (not given now)" % f
                for f, v in stored.items()
                if f not in spec and v is not None and (f, v) not in (("cancel", False), ("priority", 0))
            ]
            raise IdempotencyConflict(label, key, sorted(differs) or ["the spec"])
        return JobInfo.of(existing, created=False)

    # ---- read

    def get(self, name: str) -> JobInfo:
        """The job ``name``. Raises :class:`leasehold.JobNotFound`, :class:`ClusterError`."""
        return JobInfo.of(self._get(name))

    def list(
        self, queue: Optional[str] = None, phase: Optional[str] = None, selector: Optional[str] = None
    ) -> List[JobInfo]:
        """The namespace's jobs, by name: only those of ``queue``, in ``phase`` and matching
        the label ``selector`` when given (the API server selects). Raises InvalidRequest for
        a bad queue or phase, :class:`ClusterError`."""
        fields = []
        if queue is not None:
            if not _DNS_LABEL.match(queue):
                raise InvalidRequest(400, "invalid_request", "queue %r is not a DNS label" % (queue,))
            fields.append("spec.queue=%s" % queue)
        if phase is not None:
            phases = ("Queued", "Leased") + FINISHED
            if phase not in phases:
                raise InvalidRequest(400, "invalid_request", "phase %r is not one of %s" % (phase, ", ".join(phases)))
            fields.append("status.phase=%s" % phase)
        try:
            listed = self._api.list_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                field_selector=",".join(fields) or None,
                label_selector=selector,
            )
        except self._api_exception as err:
            raise self._refused("listing the LeasedJobs of namespace %s" % self.namespace, err) from None
        return sorted((JobInfo.of(o) for o in listed.get("items") or []), key=lambda j: j.name)

    # ---- change

    def cancel(self, name: str) -> JobInfo:
        """Cancels the job (spec.cancel; a Queued job ends Cancelled at once, a Leased one
        when the controller frees its lease and its worker learns at its next heartbeat). A
        job already Cancelled is returned as it is.

        Raises:
            JobFinished: it already Succeeded or Failed. JobNotFound. ClusterError.
        """
        for _ in range(5):
            job = self._get(name)
            info = JobInfo.of(job)
            if info.phase == "Cancelled":
                return info
            if info.phase in ("Succeeded", "Failed"):
                raise JobFinished(
                    409, "job_finished", "LeasedJob %s is already %s; there is nothing to cancel" % (info.label, info.phase)
                )
            patch = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "spec": {"cancel": True}}
            try:
                return JobInfo.of(
                    self._api.patch_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, PLURAL, name, patch, _content_type="application/merge-patch+json"
                    )
                )
            except self._api_exception as err:
                if err.status != 409:
                    raise self._refused("cancelling LeasedJob %s" % info.label, err) from None
        raise ClusterError(409, "cancelling LeasedJob %s/%s: it kept changing; try again" % (self.namespace, name))

    def retry(self, name: str, attempts: int = 1) -> JobInfo:
        """Gives a Failed or Cancelled job a new attempt, its history kept, as ``kubectl
        leasehold retry`` does (docs/protocol.md, "Retry by hand"): spec.cancel cleared and
        spec.maxAttempts raised to its failures plus ``attempts`` when lower, then phase
        Queued with finishedTime, retryAfter and result removed and the finished condition
        turned False (reason ``Retried``). Each write is conditional on the resourceVersion
        it was built from.

        Raises:
            InvalidRequest: the job is not Failed or Cancelled, or ``attempts`` < 1.
            JobNotFound. ClusterError (409: it changed in between; call again).
        """
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise InvalidRequest(400, "invalid_request", "attempts must be a whole number of at least 1, got %r" % (attempts,))
        job = self._get(name)
        label = "%s/%s" % (self.namespace, name)
        phase = (job.get("status") or {}).get("phase")
        if phase not in ("Failed", "Cancelled"):
            raise InvalidRequest(
                400, "invalid_request", "LeasedJob %s is %s: only a Failed or Cancelled job can be retried" % (label, phase)
            )
        spec, status = job.get("spec") or {}, job.get("status") or {}
        ops: List[Dict[str, Any]] = [_version_test(job)]
        if spec.get("cancel"):
            ops.append({"op": "remove", "path": "/spec/cancel"})
        wanted = len(status.get("failures") or []) + attempts
        current = spec.get("maxAttempts")
        if current is None:
            recorded = (status.get("policy") or {}).get("maxAttempts") or 3
            ops.append({"op": "add", "path": "/spec/maxAttempts", "value": max(wanted, recorded)})
        elif current < wanted:
            ops.append({"op": "add", "path": "/spec/maxAttempts", "value": wanted})
        if len(ops) > 1:
            job = self._json_patch(name, ops, label, status=False)
            status = job.get("status") or {}
        ops = [
            _version_test(job),
            {"op": "test", "path": "/status/phase", "value": phase},
            {"op": "add", "path": "/status/phase", "value": "Queued"},
        ]
        for key, path in (("finishedTime", "/status/finishedTime"), ("retryAfter", "/status/retryAfter"), ("result", "/status/result")):
            if key in status:
                ops.append({"op": "remove", "path": path})
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        conditions = [dict(c) for c in status.get("conditions") or []]
        changed = False
        for c in conditions:
            if c.get("type") in ("Failed", "Cancelled") and c.get("status") == "True":
                message = "retried by leasehold.Producer after attempt %s; it was %s (%s: %s)" % (
                    status.get("attempt", 0),
                    phase,
                    c.get("reason", ""),
                    c.get("message", ""),
                )
                c.update(status="False", reason="Retried", message=_cut(message, 1024), lastTransitionTime=now)
                changed = True
        if changed:
            ops.append({"op": "add", "path": "/status/conditions", "value": conditions})
        return JobInfo.of(self._json_patch(name, ops, label, status=True))

    # ---- await

    def wait(self, name: str, timeout: Optional[float] = None) -> Any:
        """Waits until the job finishes and returns its result (Succeeded), following it with
        a watch (re-read after any break: a 410, an API server restart).

        Args:
            timeout (float or None): seconds; None waits for ever.

        Raises:
            JobFailed: it ended Failed (with its failures). JobCancelled: Cancelled.
            WaitTimeout: not finished within ``timeout`` (the job goes on). JobNotFound: it is
            or got deleted. ClusterError.
        """
        _check_timeout(timeout)
        return self._wait(name, timeout, None)

    async def wait_async(self, name: str, timeout: Optional[float] = None) -> Any:
        """As :meth:`wait`, awaitable: the watch runs in a daemon thread of its own (never the
        loop's default executor, so a cancelled wait does not hold up the loop's shutdown).
        Cancelling the awaiting task stops that thread within :data:`WATCH_SECONDS`."""
        _check_timeout(timeout)
        loop = asyncio.get_running_loop()
        done: "asyncio.Future[Any]" = loop.create_future()
        stop = threading.Event()

        def settle(outcome: Any, error: Optional[BaseException]) -> None:
            if done.cancelled():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(outcome)

        def run() -> None:
            try:
                outcome, error = self._wait(name, timeout, stop), None
            except BaseException as err:  # handed to the awaiting task
                outcome, error = None, err
            if not stop.is_set():
                try:
                    loop.call_soon_threadsafe(settle, outcome, error)
                except RuntimeError:
                    pass  # the loop closed meanwhile

        threading.Thread(target=run, name="leasehold-wait %s" % name, daemon=True).start()
        try:
            return await done
        finally:
            stop.set()

    def _wait(self, name: str, timeout: Optional[float], stop: Optional[threading.Event]) -> Any:
        from kubernetes import watch

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = JobInfo.of(self._get(name))
            if job.finished:
                return _outcome(job)
            version = job.raw["metadata"].get("resourceVersion")
            left = WATCH_SECONDS if deadline is None else min(WATCH_SECONDS, deadline - time.monotonic())
            if left <= 0:
                raise WaitTimeout(
                    "LeasedJob %s did not finish within %gs; it goes on (it is %s)" % (job.label, timeout, job.phase or "new")
                )
            if stop is not None and stop.is_set():
                raise asyncio.CancelledError()
            w = watch.Watch()
            try:
                for event in w.stream(
                    self._api.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self.namespace,
                    PLURAL,
                    field_selector="metadata.name=%s" % name,
                    resource_version=version,
                    timeout_seconds=max(1, int(math.ceil(left))),
                ):
                    kind, obj = event.get("type"), event.get("object")
                    if kind == "DELETED":
                        raise JobNotFound(404, "job_not_found", "LeasedJob %s/%s was deleted" % (self.namespace, name))
                    if kind in ("ADDED", "MODIFIED") and isinstance(obj, dict):
                        seen = JobInfo.of(obj)
                        if seen.finished:
                            return _outcome(seen)
                    if stop is not None and stop.is_set():
                        break
            except self._api_exception as err:
                if err.status not in (410, 500, 503, 504):
                    raise self._refused("watching LeasedJob %s/%s" % (self.namespace, name), err) from None
            except (OSError, ValueError):
                time.sleep(1)  # a broken stream: read again
            finally:
                w.stop()

    # ---- plumbing

    def _get(self, name: str) -> Dict[str, Any]:
        try:
            return self._api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except self._api_exception as err:
            if err.status == 404:
                raise JobNotFound(404, "job_not_found", "LeasedJob %s/%s not found" % (self.namespace, name)) from None
            raise self._refused("reading LeasedJob %s/%s" % (self.namespace, name), err) from None

    def _json_patch(self, name: str, ops: List[Dict[str, Any]], label: str, status: bool) -> Dict[str, Any]:
        call = self._api.patch_namespaced_custom_object_status if status else self._api.patch_namespaced_custom_object
        try:
            return call(GROUP, VERSION, self.namespace, PLURAL, name, ops, _content_type="application/json-patch+json")
        except self._api_exception as err:
            if err.status in (409, 422) and "test" in (err.body or "") + str(err.reason or ""):
                raise ClusterError(
                    409, "LeasedJob %s changed while it was being retried; nothing was written by that step: call again" % label
                ) from None
            raise self._refused("retrying LeasedJob %s" % label, err) from None

    def _refused(self, doing: str, err: Any) -> LeaseholdError:
        message = _api_message(err)
        if err.status in (400, 422):
            return InvalidRequest(err.status, "invalid_request", "%s: %s" % (doing, message))
        return ClusterError(err.status or 0, "%s failed: %s %s" % (doing, err.status, message))


def _outcome(job: JobInfo) -> Any:
    if job.phase == "Succeeded":
        return job.result
    if job.phase == "Cancelled":
        raise JobCancelled(job)
    raise JobFailed(job)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _out_of_range_number(value: Any) -> Optional[int]:
    """The first integer in ``value`` beyond the 64-bit range, which the API server would
    store as a rounded float (and other producers would hash differently), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if not -(2**63) <= value < 2**64 else None
    if isinstance(value, (list, tuple)):
        return next((n for n in map(_out_of_range_number, value) if n is not None), None)
    if isinstance(value, dict):
        return next((n for n in map(_out_of_range_number, value.values()) if n is not None), None)
    return None


def _check_timeout(timeout: Any) -> None:
    ok = timeout is None or (
        not isinstance(timeout, bool) and isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0
    )
    if not ok:
        raise InvalidRequest(
            400, "invalid_request", "timeout %r is not a positive, finite number of seconds (None waits for ever)" % (timeout,)
        )


def _version_test(job: Dict[str, Any]) -> Dict[str, Any]:
    return {"op": "test", "path": "/metadata/resourceVersion", "value": job["metadata"]["resourceVersion"]}


def _api_message(err: Any) -> str:
    try:
        body = json.loads(err.body or "")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except ValueError:
        pass
    return str(err.reason or err)


def _cut(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None
