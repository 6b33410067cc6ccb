"""The floors of the server package and the SDK, read from their source with
``ast``: every server module on a floor (``FLOORS``) and every import to the
same floor or lower; no import circle; a core that imports only the standard
library; SQL drivers only in ``storage/``; protobuf messages only in
``rpc/``; committed reads handed to rpc/, web/ and the hub, never imported
from storage; no product module that imports the checkout's dev tools.

How imports are counted: every ``import`` and ``from ... import`` statement
anywhere in a module (at the top, inside functions and classes, under ``if
TYPE_CHECKING:``): an import deferred into a function or kept for types is
still an arrow between the two modules, and the usual way a circle hides.
``from P import N`` counts as importing ``P.N`` when that is a module of the
package, else ``P``; the parent packages an import runs are not counted.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "server" / "fencepost_server"
SDK = REPO / "clients" / "python" / "fencepost"
GENERATED = "v1"  # the SDK's generated stubs (make proto)
DEV_TOOLS = "fencepost_devtools"
SQL_DRIVERS = ("sqlite3", "psycopg")

# SDK back-arrows, each type-only or deferred into a function: the only ones
# allowed (one that is gone needs no entry).
SDK_BACK_ARROWS = {
    ("fencepost._renewal", "fencepost._client"),
    ("fencepost._transaction", "fencepost._client"),
    ("fencepost._store", "fencepost._transaction"),
}
# Server modules that import a SQL driver outside storage/: none.
SQL_OUTSIDE_STORAGE: set[str] = set()
# Server modules outside rpc/ that may import the generated messages: the
# package's version line names the API it serves.
PROTO_OUTSIDE_RPC = {"fencepost_server"}
PROTO = "fencepost.v1"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module imported, absolute
    line: int


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package at ``root``
    (generated stubs aside)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if GENERATED in parts[1:-1] or "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: Iterable[str]) -> list[Import]:
    """Every import statement of one module, resolved (see the module doc)."""
    known = set(known)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append(Import(name, sub if sub in known else source, node.lineno))
    return out


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    mods = modules(root)
    return {m: {i.target for i in imports_of(m, p, mods) if i.target in mods and i.target != m}
            for m, p in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _described(g: dict[str, set[str]], found: list[list[str]]) -> list[str]:
    return [" / ".join(f"{a} -> {b}" for a in c for b in sorted(g[a]) if b in c) for c in found]


def test_no_import_circle_in_the_server_package() -> None:
    g = graph(SERVER)
    assert len(g) > 40
    assert _described(g, circles(g)) == []


def test_no_import_circle_in_the_sdk() -> None:
    g = graph(SDK)
    for a, b in SDK_BACK_ARROWS:
        g.get(a, set()).discard(b)
    assert _described(g, circles(g)) == []


def test_the_core_imports_only_the_standard_library() -> None:
    mods = modules(SERVER)
    bad = [f"{i.module}:{i.line} imports {i.target}"
           for name, path in mods.items() if name.startswith("fencepost_server.core")
           for i in imports_of(name, path, mods)
           if not (i.target.startswith("fencepost_server.core")
                   or i.target.split(".")[0] in sys.stdlib_module_names)]
    assert bad == []


def test_only_storage_imports_a_sql_driver() -> None:
    mods = modules(SERVER)
    users = {name for name, path in mods.items() for i in imports_of(name, path, mods)
             if i.target.split(".")[0] in SQL_DRIVERS}
    outside = {m for m in users if not m.startswith("fencepost_server.storage")}
    assert outside <= SQL_OUTSIDE_STORAGE, sorted(outside - SQL_OUTSIDE_STORAGE)
    assert outside == SQL_OUTSIDE_STORAGE, "moved into storage/: drop it from the list"


def proto_users(root: Path) -> set[str]:
    """The modules of the package at ``root`` that import fencepost.v1."""
    mods = modules(root)
    return {name for name, path in mods.items() for i in imports_of(name, path, mods)
            if i.target == PROTO or i.target.startswith(PROTO + ".")}


def test_only_rpc_imports_the_protobuf_messages() -> None:
    outside = {m for m in proto_users(SERVER) if not m.startswith("fencepost_server.rpc")}
    assert outside <= PROTO_OUTSIDE_RPC, sorted(outside - PROTO_OUTSIDE_RPC)


# What builds a gRPC status: only rpc/status.py may use it (the one error builder).
STATUS_BUILDERS = ("abort_with_status", "status_pb2", "rpc_status", "KeepAliveError(")


def test_one_module_builds_a_grpc_status() -> None:
    bad = [f"{name} uses {word}" for name, path in modules(SERVER).items()
           if name != "fencepost_server.rpc.status"
           for word in STATUS_BUILDERS if word in path.read_text(encoding="utf-8")]
    assert bad == []


# The floors of the server package, lowest first. A module's floor is that of
# its longest dotted prefix here ("__init__": the package's own module); every
# import goes to the same floor or lower (the circles test keeps a floor flat).
FLOORS = {
    # pure rules, stdlib only
    "core": 0,
    # leaves under every part; the test kit's clock and faults, which app.py
    # and the tests hand in from above
    "clock": 1, "scope": 1, "addresses": 1, "auth": 1, "testing.clock": 1, "testing.hooks": 1,
    # SQL
    "storage": 2,
    # the single writer and its committed reads; Settings, the TLS files and
    # the version line name a store (its durability, its schema version)
    "writer": 3, "config": 3, "tls": 3, "__init__": 3,
    # what runs beside the writer: sessions, leadership, upkeep, counters
    "hub": 4, "ha": 4, "upkeep": 4, "metrics": 4,
    # the two front doors: gRPC and HTTP
    "rpc": 5, "web": 5,
    # the composition root
    "app": 6,
    # what starts an App: the command line and the test kit's server
    "cli": 7, "testing": 7,
}


def floor(module: str) -> int | None:
    """The floor of a server module (None: it has none)."""
    parts = module.split(".")[1:] or ["__init__"]
    while parts:
        if (found := FLOORS.get(".".join(parts))) is not None:
            return found
        parts.pop()
    return None


def back_arrows(root: Path) -> list[str]:
    """Every import of the package at ``root`` that goes to a higher floor."""
    mods = modules(root)
    return [f"{i.module}:{i.line} (floor {floor(i.module)}) imports {i.target} "
            f"(floor {floor(i.target)})"
            for name, path in mods.items() for i in imports_of(name, path, mods)
            if i.target in mods and (floor(i.target) or 0) > (floor(name) or 0)]


def test_every_server_module_has_a_floor() -> None:
    """A new top-level module or package is placed in FLOORS."""
    assert [m for m in modules(SERVER) if floor(m) is None] == []
    keys = {m.split(".", 1)[1] if "." in m else "__init__" for m in modules(SERVER)}
    assert [k for k in FLOORS if not any(m == k or m.startswith(k + ".") for m in keys)] == []


def test_every_import_goes_to_the_same_floor_or_lower() -> None:
    arrows = back_arrows(SERVER)
    assert not arrows, "imports up a floor:\n" + "\n".join(arrows)


def _importers(prefixes: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """Imports by a module under one of ``prefixes`` of a module under one of ``targets``."""
    mods = modules(SERVER)

    def under(name: str, roots: tuple[str, ...]) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    return [f"{i.module}:{i.line} imports {i.target}"
            for name, path in mods.items() if under(name, prefixes)
            for i in imports_of(name, path, mods) if under(i.target, targets)]


def test_servicers_the_dashboard_and_the_hub_read_through_seams() -> None:
    """Committed reads come in as objects the consumer declares (writer.Reads,
    writer.History, EngineReads), never by importing storage or App."""
    readers = ("fencepost_server.rpc", "fencepost_server.web", "fencepost_server.hub")
    assert _importers(readers, ("fencepost_server.app", "fencepost_server.storage")) == []


def test_no_product_module_imports_the_dev_tools() -> None:
    bad = []
    for root in (SERVER, SDK):
        mods = modules(root)
        bad += [f"{i.module}:{i.line} imports {i.target}"
                for name, path in mods.items() for i in imports_of(name, path, mods)
                if i.target.split(".")[0] in (DEV_TOOLS, "tests", "torture", "bench")]
    assert bad == []


# -- the checker itself ---------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_the_checker_finds_a_circle_however_its_arrows_hide(tmp_path: Path) -> None:
    """a -> b at the top, b -> c inside a function, c -> a for types only."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from .sub import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from ..sub import c\n",
        "pkg/sub/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from pkg.a import X\n"),
        "pkg/d.py": "import pkg.a\nfrom pkg.sub.b import f\n",
    }
    g = graph(_tree(tmp_path / "circle", files))
    assert g["pkg.d"] == {"pkg.a", "pkg.sub.b"}
    assert circles(g) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    files["pkg/sub/c.py"] = "X = 1\n"
    assert circles(graph(_tree(tmp_path / "none", files))) == []


def test_the_floors_find_an_import_up_a_floor(tmp_path: Path) -> None:
    """core (0) importing the writer (3), inside a function: one back-arrow."""
    files = {
        "pkg/__init__.py": "",
        "pkg/core/__init__.py": "",
        "pkg/core/rules.py": "def f():\n    from ..writer import w\n",
        "pkg/writer/__init__.py": "",
        "pkg/writer/w.py": "from ..core import rules\n",
    }
    root = _tree(tmp_path, files)
    assert [a.split(" imports ")[1] for a in back_arrows(root)] == ["pkg.writer.w (floor 3)"]
