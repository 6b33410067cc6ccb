"""Fail when proto/ breaks a client built against the last released API.

    python scripts/api_breaking.py [--proto DIR] [--against DIR]

Compiles both trees into descriptor sets with protoc (grpcio-tools, as `make
proto` does) and runs `buf breaking` over them with the FILE rules: a
renumbered, retyped or removed field, enum value, message, RPC or package
fails. A release copies proto/fencepost into proto/released/VERSION/.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELEASED = REPO / "proto" / "released"
BUF_CONFIG = {"version": "v2", "breaking": {"use": ["FILE"]}}


def last_release() -> Path:
    """The newest released API under proto/released (by version number)."""
    def key(p: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", p.name))

    releases = sorted((p for p in RELEASED.iterdir() if p.is_dir()), key=key)
    if not releases:
        raise SystemExit(f"no released API under {RELEASED}")
    return releases[-1]


def descriptor_set(root: Path, out: Path) -> Path:
    """Compile root/fencepost/v1/*.proto (with their imports) into one image."""
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    common = str(Path(str(resources.files("google.rpc") / "status.proto")).parents[2])
    files = sorted(str(p.relative_to(root)) for p in (root / "fencepost" / "v1").glob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {root / 'fencepost' / 'v1'}")
    args = ["protoc", f"-I{root}", f"-I{well_known}", f"-I{common}",
            "--include_imports", "--include_source_info", f"--descriptor_set_out={out}", *files]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc could not compile {root}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proto", type=Path, default=REPO / "proto")
    parser.add_argument("--against", type=Path, default=None)
    args = parser.parse_args(argv)
    against = args.against or last_release()
    buf = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    if buf is None:
        raise SystemExit("buf not found: install the dev dependencies (make lint does)")
    with tempfile.TemporaryDirectory() as tmp:
        now = descriptor_set(args.proto, Path(tmp) / "now.binpb")
        then = descriptor_set(against, Path(tmp) / "then.binpb")
        done = subprocess.run(
            [buf, "breaking", str(now), "--against", str(then),
             "--config", json.dumps(BUF_CONFIG), "--against-config", json.dumps(BUF_CONFIG)],
            check=False,
        )
    if done.returncode == 0:
        print(f"proto/: no breaking change against {against.relative_to(REPO)}"
              if against.is_relative_to(REPO) else f"no breaking change against {against}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
