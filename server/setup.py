"""fencepost-server's version is the SDK's, and it requires that very SDK.

The version is written once, in the SDK (clients/python/fencepost/__init__.py);
an sdist carries it in its PKG-INFO, where a build from the sdist reads it.
"""

import ast
import email
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
SDK_INIT = HERE.parent / "clients" / "python" / "fencepost" / "__init__.py"

RUNTIME = [
    "grpcio>=1.85.1",
    "grpcio-status>=1.85.1",
    "grpcio-health-checking>=1.85.1",
    "grpcio-reflection>=1.85.1",
    "protobuf>=7.35.1,<8",
    "googleapis-common-protos>=1.70",
    "prometheus-client>=0.20",
    "orjson>=3.10",
    "sortedcontainers>=2.4",
    "aiohttp>=3.9",
    # the PostgreSQL store (--db postgresql://...): sync connections in the writer thread
    "psycopg[binary]>=3.2",
]


def sdk_version() -> str:
    if SDK_INIT.exists():
        for node in ast.parse(SDK_INIT.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
            ):
                return str(ast.literal_eval(node.value))
        raise SystemExit(f"{SDK_INIT}: no __version__")
    pkg_info = HERE / "PKG-INFO"  # building from our own sdist
    return str(email.message_from_string(pkg_info.read_text())["Version"])


VERSION = sdk_version()
setup(version=VERSION, install_requires=[f"fencepost=={VERSION}", *RUNTIME])
