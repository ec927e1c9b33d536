"""benchmarks/suite_timeline.py: what a run's timeline (tests/conftest.py `TIMELINE`) adds up to."""
from __future__ import annotations

from benchmarks.suite_timeline import summary


def test_modules_add_up_their_tests_busy_and_cpu_time_and_workers_their_idle_tail() -> None:
    lines = [
        {"worker": "gw0", "test": "tests/a.py::t1", "start": 100.0, "end": 110.0, "cpu_s": 2.0, "children_cpu_s": 1.0},
        {"worker": "gw1", "test": "tests/b.py::t1", "start": 100.0, "end": 104.0, "cpu_s": 4.0, "children_cpu_s": 0.0},
        {"worker": "gw1", "test": "tests/a.py::t2", "start": 104.0, "end": 107.0, "cpu_s": 1.5, "children_cpu_s": 0.5},
        {"worker": "main", "test": "tests/a.py::t3", "start": 101.0, "end": 109.0},  # a pytest a test ran: left out
        {"worker": "gw0", "test": "tests/b.py::t2", "start": 110.0, "end": 112.0},  # written before CPU was recorded
    ]
    got = summary(lines, top=5)
    assert got["wall_s"] == 12.0
    assert got["workers"] == {"gw0": {"busy_s": 12.0, "idle_at_end_s": 0.0},
                              "gw1": {"busy_s": 7.0, "idle_at_end_s": 5.0}}
    assert got["modules"] == [
        {"module": "tests/a.py", "busy_s": 13.0, "tests": 2, "cpu_s": 3.5, "children_cpu_s": 1.5, "worker": "gw0",
         "began_at_s": 0.0},
        {"module": "tests/b.py", "busy_s": 6.0, "tests": 2, "cpu_s": 4.0, "children_cpu_s": 0.0, "worker": "gw1",
         "began_at_s": 0.0},
    ]
