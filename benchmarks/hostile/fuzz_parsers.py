"""Coverage-guided fuzzing (atheris / libFuzzer) of the byte parsers that read from the network.

Targets:
  kvfabric   bytes arriving on a kvfabric connection: framing (`Conn.recv`), the typed
             messages (`parse` into `Hello` and `ReceiverMessage`) and
             the layout a hello carries (`FabricLayout.from_wire`)
  events     a KV event entry from a worker's Redis stream (`event_from_bytes`)
  heartbeat  a heartbeat entry from Redis (`Heartbeat.from_wire`)

A parser may accept its input or raise its own error type (ProtocolError /
PeerUnavailable / BadEntry); anything else is a crash, which libFuzzer reports with the
input that caused it. The suite runs the property-based versions of these
(tests/unit/test_registry_format_fuzz.py, tests/integration/test_kvfabric_fuzz.py); this
script is the long run. Needs `pip install -e '.[fuzz]'`.

    ./dev python benchmarks/hostile/fuzz_parsers.py --runs 200000          # every target
    ./dev python benchmarks/hostile/fuzz_parsers.py --target kvfabric --runs 1000000

One JSON line per target: runs, seconds, exit code (0: no crash).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

TARGETS = ("kvfabric", "events", "heartbeat")


def kvfabric_one(data: bytes) -> None:
    from kvfabric.errors import PeerUnavailable, ProtocolError
    from kvfabric.layout import FabricLayout
    from kvfabric.wire import Conn, Hello, Idle, ReceiverMessage, parse

    a, b = socket.socketpair()
    try:
        a.sendall(data[:200_000])
        a.shutdown(socket.SHUT_WR)
        conn = Conn(b, io_timeout_s=0.05)
        first = True
        while True:
            try:
                msg = conn.recv()
                if first and msg["t"] == "hello":
                    hello = parse(msg, Hello)
                    try:
                        FabricLayout.from_wire(hello.layout)
                    except (TypeError, ValueError):
                        pass  # the receiver refuses the handshake: a clean error
                else:
                    parse(msg, ReceiverMessage)
                first = False
            except (ProtocolError, PeerUnavailable, Idle):
                return
    finally:
        a.close()
        b.close()


def events_one(data: bytes) -> None:
    from control.heartbeat import BadEntry
    from control.kv_events import event_from_bytes

    try:
        event_from_bytes(data)
    except BadEntry:
        pass


def heartbeat_one(data: bytes) -> None:
    from control.heartbeat import BadEntry, Heartbeat

    try:
        Heartbeat.from_wire(data)
    except BadEntry:
        pass


def fuzz(target: str, runs: int) -> None:
    """In this process: hands `target` to libFuzzer (which exits when done or on a crash)."""
    import atheris

    one = {"kvfabric": kvfabric_one, "events": events_one, "heartbeat": heartbeat_one}[target]
    with atheris.instrument_imports():
        import control.heartbeat  # noqa: F401
        import control.kv_events  # noqa: F401
        import kvfabric.layout  # noqa: F401
        import kvfabric.wire  # noqa: F401
    atheris.Setup([sys.argv[0], f"-runs={runs}", "-max_len=4096"], one)
    atheris.Fuzz()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=TARGETS, action="append", help="default: every target")
    ap.add_argument("--runs", type=int, default=100_000, help="inputs per target")
    ap.add_argument("--child", choices=TARGETS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fuzz(args.child, args.runs)
        return
    failed = False
    for target in args.target or TARGETS:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", target, "--runs", str(args.runs)],
                              capture_output=True, text=True, check=False)
        tail = [line for line in proc.stderr.splitlines() if "Done" in line or "ERROR" in line or "Error" in line]
        print(json.dumps({"bench": "fuzz_parsers", "target": target, "runs": args.runs,
                          "seconds": round(time.perf_counter() - started, 1), "exit_code": proc.returncode,
                          "libfuzzer": tail[-3:]}), flush=True)
        if proc.returncode != 0:
            failed = True
            sys.stderr.write(proc.stderr[-4000:])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
