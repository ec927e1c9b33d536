"""The `splitserve` command line as a user runs it (a real subprocess; the refusals before
anything starts, many commands of one test, through `main` in the test's process)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "cluster.cli"]


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, check=False)


def _digest(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_make_tiny_model_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The same checkpoint from a process of its own and from `main` here; another seed, another."""
    r = run(["make-tiny-model", str(tmp_path / "a"), "--arch", "qwen2", "--seed", "3"])
    assert r.returncode == 0, r.stderr
    r = in_process(["make-tiny-model", str(tmp_path / "b"), "--arch", "qwen2", "--seed", "3"], {}, capsys, monkeypatch)
    assert r.returncode == 0, r.stderr
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(_digest(tmp_path / "a"))
    r = in_process(["make-tiny-model", str(tmp_path / "c"), "--arch", "qwen2", "--seed", "4"], {}, capsys, monkeypatch)
    assert _digest(tmp_path / "c")["model.safetensors"] != _digest(tmp_path / "a")["model.safetensors"]


STARTUP_BUDGET_S = 90
"""The README's `serve` must be ready within this long on a 2-core CI machine (about 15 s seen here)."""


def test_readme_serve_then_generate_and_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """As a new user: `serve` (converting the default model's GGUF on first use), a chat request
    over HTTP, `generate`, `status`, Ctrl-C. The first `generate` and `status` run as a user runs
    them, a process each; the commands repeated after them (the polls) through `main` here."""
    env = {**os.environ, "SPLITSERVE_CACHE": str(tmp_path / "cache")}

    def cli(args: list[str]) -> subprocess.CompletedProcess:
        return in_process(args, {"SPLITSERVE_CACHE": env["SPLITSERVE_CACHE"]}, capsys, monkeypatch)
    serve = subprocess.Popen(CLI + ["serve", "--port", "0", "--http-port", "0"], env=env, text=True,  # 0: free ports
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        ready = _wait_for_line(serve, "ready in", STARTUP_BUDGET_S)
        found = re.search(r"serving SmolLM2-135M-Instruct\.Q4_1 on 127\.0\.0\.1:(\d+), OpenAI API on "
                          r"http://127\.0\.0\.1:(\d+)/v1 ", ready)
        assert found and int(found[1]) > 0 and "1 prefill, 1 decode on cpu float32, mode auto" in ready, ready
        port = int(found[1])
        assert list((tmp_path / "cache/gguf").glob("*/SmolLM2-135M-Instruct.Q4_1/model.safetensors"))  # converted once
        chat = urllib.request.Request(f"http://127.0.0.1:{found[2]}/v1/chat/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [
                {"role": "user", "content": "What is the capital of France?"}], "temperature": 0}).encode())
        with urllib.request.urlopen(chat, timeout=120) as answer:
            assert json.loads(answer.read())["choices"][0]["message"]["content"] == "The capital of France is Paris."
        target = ["--target", f"127.0.0.1:{port}"]
        r = run(["generate", "Once upon a time", "--max-tokens", "8", *target], env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("Once upon a time")
        assert "8 tokens, finish FINISH_REASON_LENGTH" in r.stderr
        again = cli(["generate", "Once upon a time", "--max-tokens", "8", *target])
        assert again.stdout == r.stdout  # greedy: the same text
        bad = cli(["generate", "hi", "--top-p", "0", *target])
        assert bad.returncode == 1 and "INVALID_ARGUMENT: top_p must be in (0, 1]" in bad.stderr
        st = run(["status"], env)
        deadline = time.monotonic() + 10
        while "3 done, 0 refused, 1 invalid" not in st.stdout and time.monotonic() < deadline:
            time.sleep(0.5)  # the router reports its stats once a second: until then, an older count
            st = cli(["status"])
        assert st.returncode == 0, st.stderr
        assert "decode-0" in st.stdout and "prefill-0" in st.stdout
        for worker, role in (("decode-0", "decode"), ("prefill-0", "prefill")):  # state, from their heartbeats
            assert re.search(rf"^{worker}\s+{role}\s+serving\s+127\.0\.0\.1:\d+", st.stdout, re.M), st.stdout
        assert "decode pool: target 1, 1 serving (decode-0 serving)" in st.stdout
        assert re.search(r"KV tokens charged 0 / used 0 of a budget of [1-9]\d*", st.stdout), st.stdout
        sc = cli(["scale", "decode", "2"])
        assert sc.returncode == 0 and "decode target set to 2" in sc.stdout, sc.stderr
        deadline = time.monotonic() + 60
        while "decode pool: target 2, 2 serving" not in (st := cli(["status"])).stdout:
            assert time.monotonic() < deadline, st.stdout
            time.sleep(0.5)
        assert "decode target 1 -> 2 (splitserve scale)" in st.stdout
        assert "3 done, 0 refused, 1 invalid" in st.stdout and "Redis feed up" in st.stdout
    finally:
        _ctrl_c(serve)
    assert serve.returncode == 0


def _ctrl_c(serve: subprocess.Popen) -> None:
    """Stops `serve` as a user does (killed if it does not stop within a minute)."""
    serve.send_signal(signal.SIGINT)
    try:
        serve.wait(timeout=60)
    except subprocess.TimeoutExpired:
        serve.kill()
        raise


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if needle in line:
                return line
    raise AssertionError(f"no {needle!r} within {timeout_s} s; output so far:\n{''.join(seen)}")


def ray_sessions(root: Path) -> list[Path]:
    """The Ray sessions started under `root` (Ray's temp dir, RAY_TMPDIR: each start makes one)."""
    return sorted(root.glob("ray/session_2*"))


def in_process(args: list[str], env: dict[str, str | None], capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess:
    """`splitserve ARGS` through `cluster.cli.main` in this process (no interpreter and torch
    import per command), its environment changed by `env` (None: unset) for the call only; an
    exception escaping `main` is what a user would see as a traceback, and fails the test."""
    from cluster.cli import main

    with monkeypatch.context() as m:
        for name, value in env.items():
            if value is None:
                m.delenv(name, raising=False)
            else:
                m.setenv(name, value)
        capsys.readouterr()
        code = main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_serve_refuses_a_bad_model_or_a_taken_port_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    ray_root = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    monkeypatch.setenv("RAY_TMPDIR", str(ray_root))  # these commands' Ray, if any started, and no other's
    cache = {"SPLITSERVE_CACHE": str(tmp_path / "cache")}
    r = run(["serve", "--model", str(tmp_path / "nowhere")])  # as a user runs it: a process of its own
    assert r.returncode == 2 and "error: --model" in r.stderr and "config.json not found" in r.stderr
    assert "Traceback" not in r.stderr

    def cli(args: list[str], env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
        return in_process(args, env or {}, capsys, monkeypatch)

    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    r = cli(["serve", "--model", str(tmp_path / "broken.gguf")], cache)
    assert r.returncode == 2 and "broken.gguf is not a readable GGUF file" in r.stderr
    r = cli(["serve", "--model", "tiny", "--chat-template", str(tmp_path / "none.jinja")], cache)
    assert r.returncode == 2 and "error: --chat-template: cannot read the chat template" in r.stderr
    with pytest.raises(SystemExit) as usage:  # argparse's own usage error
        cli(["serve", "--tenant-weight"])
    assert usage.value.code == 2
    r = cli(["serve", "--tenant-weight", "gold"], cache)
    assert r.returncode == 2 and "error: --tenant-weight takes TENANT=NUMBER, got 'gold'" in r.stderr
    assert not (tmp_path / "cache" / "gguf").exists()  # said before converting the default model (~25 s)
    r = cli(["status", "--redis-url", "redis://127.0.0.1:1/0"])
    assert r.returncode == 1 and "Redis at redis://127.0.0.1:1/0 is away" in r.stderr
    (tmp_path / "cache").mkdir(exist_ok=True)  # a serve that stopped without its record going (killed)
    (tmp_path / "cache" / "serve.json").write_text(json.dumps({"address": "127.0.0.1:1", "namespace": "splitserve",
                                                               "redis_url": "redis://127.0.0.1:1/0"}))
    r = cli(["status"], cache)
    assert r.returncode == 1 and "no cluster is running here: the last `splitserve serve` has stopped" in r.stderr
    no_secret = {"SPLITSERVE_CLUSTER_SECRET": None, "SPLITSERVE_CLUSTER_SECRET_FILE": None}
    for command in (["worker", "decode"], ["router"]):  # a plain process never falls back to a built-in secret
        r = cli([*command, "--redis-url", "redis://127.0.0.1:1/0"], no_secret)
        assert r.returncode == 2 and "no cluster secret: set SPLITSERVE_CLUSTER_SECRET_FILE" in r.stderr, r.stderr
        r = cli(command, {"SPLITSERVE_REDIS_URL": None, "SPLITSERVE_CLUSTER_SECRET": "x"})
        assert r.returncode == 2 and "no Redis: pass --redis-url or set $SPLITSERVE_REDIS_URL" in r.stderr, r.stderr
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret")
    secret_file.chmod(0o644)
    r = cli(["router"], {"SPLITSERVE_CLUSTER_SECRET_FILE": str(secret_file)})
    assert r.returncode == 2 and "is readable by others (mode 644); chmod 600 it" in r.stderr, r.stderr
    key_file = tmp_path / "keys"
    key_file.write_text("sk-0123456789\n")
    key_file.chmod(0o640)
    r = cli(["serve", "--api-key-file", str(key_file)])
    assert r.returncode == 2 and "--api-key-file" in r.stderr and "chmod 600" in r.stderr, r.stderr
    r = cli(["serve", "--kv-overcommit", "0"])
    assert r.returncode == 2 and "kv_overcommit" in r.stderr
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli(["serve", "--model", "tiny", "--port", str(port), "--http-port", "0"], cache)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert ray_sessions(ray_root) == [] and not ray.is_initialized()  # no Ray, no workers were started
    shutil.rmtree(ray_root, ignore_errors=True)


def test_serve_detached_outlives_its_controller_and_stop_stops_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --detach` (what `ray up`'s start commands run) returns once serving, with its
    output in the cache directory's log; a second one is refused. kill -9 of the controller:
    Ray restarts it (a new pid in `status`) and the cluster serves throughout; killed past its
    restarts, `serve` says so in its output within seconds, `status` says the controller is not
    reporting, requests are still served. `stop` still stops it, the way Ctrl-C does, and
    waits. (The serves a process each, as `ray up` runs them; the other commands through
    `main` here.)"""
    from cluster.daemon import alive

    env = {"SPLITSERVE_CACHE": str(tmp_path / "cache")}
    log = tmp_path / "cache" / "serve.log"

    def cli(args: list[str]) -> subprocess.CompletedProcess:
        return in_process(args, dict(env), capsys, monkeypatch)

    def controller_pid(other_than: int | None) -> int:
        deadline = time.monotonic() + 30
        while True:
            st = json.loads(cli(["status", "--json"]).stdout)
            if st.get("controller") and st["controller"]["pid"] != other_than:
                return int(st["controller"]["pid"])
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
    nothing = cli(["stop"])
    assert nothing.returncode == 0 and "no serve runs here" in nothing.stdout
    r = run(["serve", "--detach", "--model", "tiny", "--port", "0", "--http-port", "-1",
             "--controller-max-restarts", "1"], env)
    assert r.returncode == 0, r.stderr
    found = re.search(r"on 127\.0\.0\.1:(\d+).*\nsplitserve: running detached \(pid (\d+)\); log (\S+);", r.stdout)
    assert found and found[3] == str(log), r.stdout
    pid = int(found[2])
    assert (tmp_path / "cache" / "serve.pid").read_text().strip() == str(pid)
    target = ["--target", f"127.0.0.1:{found[1]}"]
    g = cli(["generate", "hi", "--max-tokens", "4", "--ignore-eos", *target])
    assert g.returncode == 0 and "4 tokens" in g.stderr, g.stderr

    first = controller_pid(None)
    os.kill(first, signal.SIGKILL)
    second = controller_pid(first)  # restarted by Ray
    assert cli(["generate", "hello", "--max-tokens", "4", *target]).returncode == 0
    os.kill(second, signal.SIGKILL)
    wait_s = time.monotonic() + 30
    while "the cluster is unsupervised" not in (said := log.read_text()):
        assert time.monotonic() < wait_s, said[-3000:]
        time.sleep(0.5)
    line = next(x for x in said.splitlines() if "the cluster is unsupervised" in x)
    assert "past its 1 restart(s)" in line and "`serve` starts it again" in line
    deadline = time.monotonic() + 30  # its state in Redis expires (10 s)
    while "controller: not reporting" not in (text := cli(["status"]).stdout):
        assert time.monotonic() < deadline, text
        time.sleep(1.0)
    g = run(["generate", "hello", "--max-tokens", "4", *target], env)  # the workers and router serve on
    assert g.returncode == 0, g.stderr
    twice = run(["serve", "--detach", "--model", "tiny", "--port", "0", "--http-port", "-1"], env)
    assert twice.returncode == 1 and f"already runs here (pid {pid})" in twice.stderr
    stopped = cli(["stop"])
    assert stopped.returncode == 0 and "splitserve: stopped in" in stopped.stdout, stopped.stderr
    assert not alive(pid) and not (tmp_path / "cache" / "serve.pid").exists()
    assert "splitserve: stopped" in (tmp_path / "cache" / "serve.log").read_text()


def test_a_detached_serve_that_cannot_start_says_why(tmp_path: Path) -> None:
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file")
    bad = run(["serve", "--detach", "--model", str(tmp_path / "broken.gguf")], {"SPLITSERVE_CACHE": str(tmp_path)})
    assert bad.returncode == 1 and "exited (2) before serving" in bad.stderr and "--model" in bad.stderr, bad.stderr
