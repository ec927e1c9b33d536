"""`serve` as a daemon, for launchers that run it from a shell and come back (Ray's `ray up`
start commands, systemd, ssh): `serve --detach` starts serve in a session of its own with
its output in a log file and returns once it serves (or fails with the log's last lines);
`splitserve stop` stops the serve of this machine the way Ctrl-C does (the pools drain,
workers free their KV pools and shared memory, the embedded Redis stops) and waits for it.

Every serve, detached or not, records its process in `serve.pid` beside `serve.json` (the
cache directory), which is how `stop` finds it."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_MARK = "splitserve: serving "
"""The line serve prints once it serves (what --detach waits for)."""
STOPPED_MARK = "splitserve: stopped"


def _root() -> Path:
    from engine.checkpoints.gguf_checkpoint import cache_root

    return cache_root()


def pid_file() -> Path:
    return _root() / "serve.pid"


def default_log() -> Path:
    return _root() / "serve.log"


def add_flags(s: argparse.ArgumentParser) -> None:
    """serve's flags for running detached."""
    d = s.add_argument_group("running detached (under `ray up`, systemd, ssh)")
    d.add_argument("--detach", action="store_true",
                   help="run in the background (a session of its own) and return once serving; "
                        "`splitserve stop` stops it")
    d.add_argument("--log-file", type=Path, default=None,
                   help="--detach: where its output goes (default: serve.log in the cache directory, "
                        "~/.cache/splitserve)")
    d.add_argument("--ready-timeout-s", type=float, default=600.0,
                   help="--detach: how long to wait for it to serve (its workers may wait for Ray to add nodes)")


def add_stop_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    st = sub.add_parser("stop", help="stop this machine's `splitserve serve` (drains; frees KV and shared memory)")
    st.add_argument("--timeout-s", type=float, default=120.0,
                    help="how long to wait for it to stop before killing it")
    st.add_argument("--ray-worker-hosts", action="store_true",
                    help="on the head of a `ray up` cluster (where ~/ray_bootstrap_config.yaml is): then stop Ray on "
                         "its worker hosts too, over SSH with the launcher's key (what `ray down` leaves running "
                         "with Ray's local provider)")
    st.set_defaults(func=stop)


def detach(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts `serve argv` (without --detach) in a new session, output appended to the log,
    and waits for its ready line: 0 and where it serves, or 1 with the log's end."""
    if (running := running_pid()) is not None:
        print(f"error: a splitserve serve already runs here (pid {running}); `splitserve stop` stops it",
              file=sys.stderr)
        return 1
    log = args.log_file or default_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    start = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *[a for a in argv if a != "--detach"]],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    deadline = time.monotonic() + args.ready_timeout_s
    while time.monotonic() < deadline:
        text = _read_from(log, start)
        for line in text.splitlines():
            if line.startswith(READY_MARK):
                print(f"{line}\nsplitserve: running detached (pid {child.pid}); log {log}; "
                      "`splitserve stop` stops it", flush=True)
                return 0
        if child.poll() is not None:
            print(f"error: serve exited ({child.returncode}) before serving; the end of {log}:\n"
                  f"{_tail(text)}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"error: serve (pid {child.pid}) is not serving after {args.ready_timeout_s:.0f} s (--ready-timeout-s); "
          f"it runs on: `splitserve stop` stops it; the end of {log}:\n{_tail(_read_from(log, start))}",
          file=sys.stderr)
    return 1


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.splitlines()[-n:])


def record() -> None:
    """This process is this machine's serve (`stop` finds it here)."""
    pid_file().parent.mkdir(parents=True, exist_ok=True)
    pid_file().write_text(f"{os.getpid()}\n")


def forget() -> None:
    """At serve's exit: the record goes, if it is still this process's."""
    with contextlib.suppress(OSError, ValueError):
        if int(pid_file().read_text()) == os.getpid():
            pid_file().unlink()


def running_pid() -> int | None:
    """The recorded serve's pid while that process runs and is a serve (not a reused pid)."""
    try:
        pid = int(pid_file().read_text())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    words = [a.decode(errors="replace") for a in argv]
    is_serve = "serve" in words and any(w.endswith("splitserve") or w == "cluster.cli" for w in words)
    return pid if is_serve else None


def stop(args: argparse.Namespace) -> int:
    """`splitserve stop`: this machine's serve, then with --ray-worker-hosts the Ray of the
    worker hosts of the `ray up` cluster this is the head of."""
    code = stop_serve(args.timeout_s)
    if args.ray_worker_hosts:
        code = max(code, stop_ray_worker_hosts(BOOTSTRAP_CONFIG.expanduser()))
    return code


def stop_serve(timeout_s: float) -> int:
    """SIGTERM to the recorded serve, then wait for it to finish stopping its cluster; killed
    after `timeout_s` (its workers' shared memory is then swept by the next serve)."""
    pid = running_pid()
    if pid is None:
        print("splitserve: no serve runs here", flush=True)
        with contextlib.suppress(OSError):
            pid_file().unlink()
        return 0
    print(f"splitserve: stopping serve (pid {pid}): its pools drain and free their KV", flush=True)
    started = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while time.monotonic() - started < timeout_s:
        if not alive(pid):
            print(f"splitserve: stopped in {time.monotonic() - started:.1f} s", flush=True)
            return 0
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    print(f"error: serve (pid {pid}) did not stop within {timeout_s:.0f} s (--timeout-s): killed", file=sys.stderr)
    return 1


BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml")
"""What `ray up` leaves on a cluster's head: the cluster file as the head's autoscaler uses it
(its SSH key is the head's copy, ~/ray_bootstrap_key.pem)."""
WORKER_STOP_TIMEOUT_S = 60.0


def stop_ray_worker_hosts(config_path: Path) -> int:
    """`ray stop` on every worker host of the local-provider cluster `config_path` describes,
    in parallel over SSH as Ray's launcher reaches them (a login shell, the launcher's key); 0
    when each stopped or there is no such cluster here, else 1 naming the hosts that did not."""
    import concurrent.futures

    import yaml

    if not config_path.is_file():
        return 0
    config = yaml.safe_load(config_path.read_text())
    provider, auth = config.get("provider", {}), config.get("auth", {})
    if provider.get("type") != "local" or not provider.get("worker_ips"):
        return 0
    key = os.path.expanduser(auth.get("ssh_private_key", "~/ray_bootstrap_key.pem"))

    def ray_stop(ip: str) -> str | None:
        argv = ["ssh", "-i", key, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o",
                "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
                f"{auth.get('ssh_user', 'root')}@{ip}", "bash --login -c -i 'source ~/.bashrc; ray stop'"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"{ip}: no answer within {WORKER_STOP_TIMEOUT_S:.0f} s"
        return None if done.returncode == 0 else f"{ip}: {(done.stderr or done.stdout).strip()[-300:]}"

    ips = list(provider["worker_ips"])
    with concurrent.futures.ThreadPoolExecutor(len(ips)) as pool:
        failed = [f for f in pool.map(ray_stop, ips) if f]
    if failed:
        print(f"error: Ray did not stop on {len(failed)} worker host(s): {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"splitserve: stopped Ray on the worker hosts {', '.join(ips)}", flush=True)
    return 0


def alive(pid: int) -> bool:
    """Running or stopped; not gone, not a zombie (a killed process its parent has not reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
