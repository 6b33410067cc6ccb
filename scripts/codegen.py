"""Regenerate the checked-in Python stubs from ``proto/`` (``make proto``).

``python scripts/codegen.py OUT_DIR`` writes ``fencepost/v1/*_pb2*.py``
and their ``.pyi`` type stubs under OUT_DIR. The contract test runs the same
function into a temporary directory and compares, so stale stubs fail CI.
"""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "fencepost" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) with the mypy-protobuf plugins into out_dir."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    # google/rpc/status.proto ships with googleapis-common-protos
    common = str(Path(str(resources.files("google.rpc") / "status.proto")).parents[2])
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"-I{common}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={shutil.which('protoc-gen-mypy', path=str(bindir))}",
        f"--plugin=protoc-gen-mypy_grpc={shutil.which('protoc-gen-mypy_grpc', path=str(bindir))}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / "fencepost" / "v1").glob("*_pb2*"))


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "clients" / "python"
    for path in generate(out):
        print(path)


if __name__ == "__main__":
    main()
