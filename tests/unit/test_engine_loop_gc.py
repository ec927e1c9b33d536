"""freeze_startup_heap: what a worker holds at startup is out of the cyclic collector's reach
afterwards (run in a child interpreter: freezing this test process would keep every later
test's garbage)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, weakref
from engine.engine_loop import freeze_startup_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

garbage = cycle()               # unreachable before the freeze: collected by it
kept = Node(); kept.me = kept   # reachable at the freeze
freeze_startup_heap()
assert garbage() is None, "the freeze collects first"
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
alive = weakref.ref(kept)
del kept                        # now garbage, but frozen: no collection walks it
gc.collect()
assert alive() is not None
later = cycle()                 # made after the freeze: collected as usual
gc.collect()
assert later() is None
print("ok")
"""


def test_objects_alive_at_startup_are_frozen_and_later_garbage_is_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
