"""Fixtures of the client's tests that need no cluster: each runs the real client against
leasehold.testing's in-process fake sidecar. (The tests against a real sidecar and control
plane are in ../tests, whose conftest requires that cluster.)"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from leasehold import testing  # noqa: E402


@pytest.fixture
def fake():
    """A fresh fake sidecar, closed at teardown."""
    with testing.FakeSidecar() as sidecar:
        yield sidecar


class Recorder:
    """Collects the client's events (``Client(on_event=...)``)."""

    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    def kinds(self):
        return [(e.kind, e.status) for e in self.events]


@pytest.fixture
def recorder():
    return Recorder()
