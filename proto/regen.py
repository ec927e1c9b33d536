"""Regenerates proto/*_pb2*.py from proto/*.proto (grpcio-tools), or checks they are current.

  ./dev python -m proto.regen          write the generated files
  ./dev python -m proto.regen --check  exit 1 if they differ from what would be generated
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["proto/generate.proto"]
OUTPUTS = ["generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"]


def generate(out_root: Path) -> dict[str, str]:
    """Runs protoc into `out_root`; returns {file name: text} of the generated files."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *(str(ROOT / p) for p in PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return {name: (out_root / "proto" / name).read_text() for name in OUTPUTS}


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    here = ROOT / "proto"
    return [n for n, text in fresh.items() if not (here / n).is_file() or (here / n).read_text() != text]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"proto/{name} is out of date: run ./dev python -m proto.regen", file=sys.stderr)
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (ROOT / "proto" / name).write_text(text)
    print(f"wrote {', '.join(OUTPUTS)} to proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
