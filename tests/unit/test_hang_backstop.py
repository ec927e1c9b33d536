"""tests/conftest.py `HANG_GRACE_S`: a test stuck where its timeout's SIGALRM cannot reach (a
thread blocked in C) ends its pytest process with every thread's stack, naming the test."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STUCK = '''
import ctypes
import pytest


@pytest.mark.timeout(1)
def test_stuck_in_c():
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # a default pthread mutex (zeroed), locked twice by one thread
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # never returns, and takes no signal


def test_after():
    pass
'''


def test_a_test_stuck_in_c_past_its_timeout_ends_its_process_with_the_stacks(tmp_path: Path) -> None:
    (tmp_path / "test_stuck.py").write_text(STUCK)
    env = {**os.environ, "SPLITSERVE_TEST_HANG_GRACE_S": "2",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    began = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                        "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_stuck.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - began
    assert r.returncode == 1, r.stdout[-2000:]
    assert "Timeout (0:00:03)!" in r.stderr and 'in test_stuck_in_c' in r.stderr, r.stderr[-2000:]
    assert "test_after" not in r.stdout and took < 30
