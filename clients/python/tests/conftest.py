"""Fixtures for the client's tests: the real leasehold sidecar as a process, jobs created
and read with the test control plane's kubectl.

Run from tests/python_client.rs (`scripts/test --test python_client`), which starts a
controller for the namespace and sets:
    LEASEHOLD_BIN               the leasehold binary
    LEASEHOLD_TEST_NAMESPACE    the namespace (shared by these tests: each uses its own queue)
    LEASEHOLD_KUBECTL           kubectl of the test control plane
    KUBECONFIG                  the test control plane's kubeconfig
    LEASEHOLD_PYTEST_LOGS       where the logs of the processes started here go
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the package under test, clients/python/leasehold

import leasehold  # noqa: E402


def env(name):
    value = os.environ.get(name)
    if not value:
        pytest.exit("%s is not set: run these tests with `scripts/test --test python_client`" % name, 2)
    return value


NAMESPACE = env("LEASEHOLD_TEST_NAMESPACE")
LOGS = env("LEASEHOLD_PYTEST_LOGS")


def kubectl(*args, stdin=None):
    done = subprocess.run(
        [env("LEASEHOLD_KUBECTL"), "-n", NAMESPACE] + list(args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, "kubectl %s: %s%s" % (" ".join(args), done.stdout, done.stderr)
    return done.stdout


def create_job(name, queue, payload=None, lease=5, annotations=None, **spec):
    manifest = {
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "LeasedJob",
        "metadata": dict({"name": name}, **({"annotations": annotations} if annotations else {})),
        "spec": dict({"queue": queue, "leaseDurationSeconds": lease, "payload": payload or {}}, **spec),
    }
    kubectl("create", "-f", "-", stdin=json.dumps(manifest))


def job(name):
    return json.loads(kubectl("get", "ljob", name, "-o", "json"))


def status(name):
    return job(name).get("status") or {}


def wait_until(what, timeout, probe, every=0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %ss waiting for %s" % (timeout, what))
        time.sleep(every)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A process started by a test; stopped (SIGCONT, SIGKILL) at teardown."""

    def __init__(self, name, args, stdout=None, extra_env=None):
        self.name = name
        self.log_path = os.path.join(LOGS, name + ".log")
        self.log = open(self.log_path, "wb")
        environment = dict(os.environ, **(extra_env or {}))
        self.popen = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=stdout or self.log, stderr=self.log, env=environment
        )

    def signal(self, sig):
        os.kill(self.popen.pid, sig)

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def kill(self):
        if self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.popen.kill()
        self.popen.wait()
        self.log.close()


class Sidecar(Proc):
    """`leasehold sidecar` for one queue on a free loopback port, ready when constructed."""

    def __init__(self, queue, identity, extra=()):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        Proc.__init__(
            self,
            "%s-sidecar" % identity,
            [
                env("LEASEHOLD_BIN"),
                "sidecar",
                "--namespace",
                NAMESPACE,
                "--queue",
                queue,
                "--identity",
                identity,
                "--listen",
                "127.0.0.1:%d" % self.port,
                "--metrics-addr",
                "127.0.0.1:0",
            ]
            + list(extra),
            extra_env={"RUST_LOG": "info"},
        )
        wait_until("sidecar %s ready" % identity, 30, self._ready)

    def _ready(self):
        assert self.popen.poll() is None, "sidecar exited:\n" + self.log_text()
        try:
            with urllib.request.urlopen(self.base + "/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


@pytest.fixture
def queue(request):
    """A queue of the test's own: its name and a random suffix."""
    short = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return "%s-%s" % (short, uuid.uuid4().hex[:6])


@pytest.fixture
def procs():
    """Starts processes (`procs.sidecar(...)`, `procs.start(...)`) stopped at teardown."""
    started = []

    class Starter:
        def sidecar(self, queue, identity, extra=()):
            p = Sidecar(queue, identity, extra)
            started.append(p)
            return p

        def start(self, name, args, **kwargs):
            p = Proc(name, args, **kwargs)
            started.append(p)
            return p

    yield Starter()
    for p in reversed(started):
        p.kill()


class Recorder:
    """Collects the client's events (``Client(on_event=...)``)."""

    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    def kinds(self, name=None, attempt=None):
        return [
            (e.kind, e.status)
            for e in self.events
            if (name is None or e.name == name) and (attempt is None or e.attempt == attempt)
        ]


@pytest.fixture
def recorder():
    return Recorder()
