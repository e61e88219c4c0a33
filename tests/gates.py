"""The library gate, switched off where a test is about something else (its counts of rollouts and calls assume
every training problem is learned from): the gate's own behaviour is tested in tests/test_library_gate.py."""

from schemas.config import LibraryGate

UNGATED = LibraryGate(enabled=False)
