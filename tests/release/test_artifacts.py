"""The release artifacts as a user installs them, not the checkout.

`make dist-python` builds both sdists and wheels (each wheel from its sdist)
and `make dist-npm` packs the three TypeScript packages, each into a
temporary directory.
The wheels go into a fresh venv outside the repository: the SDK alone first
(it must pull no server dependency), then the server, whose `fencepost serve`
serves the README's Python examples and the dashboard. The tarballs go into a
fresh npm project, where a program using all three compiles with `tsc
--strict` and runs against a coordinator.
"""

from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

import fencepost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))

from _proc import ServerProc, free_port, running_server
from test_doc_examples import DOC_ADDRESS, python_blocks

REPO = Path(__file__).resolve().parents[2]
TS = REPO / "clients" / "typescript"
V = fencepost.__version__
STATIC = REPO / "server" / "fencepost_server" / "web" / "static"
# what the SDK needs, and nothing the server alone needs
SDK_SET = {"fencepost", "grpcio", "grpcio-status", "protobuf", "googleapis-common-protos",
           "typing-extensions"}
VENV_BOOT = {"pip", "setuptools"}

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    # nothing of the checkout's environment leaks into the installed programs
    drop = ("FENCEPOST_", "VIRTUAL_ENV", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _make(target: str, out: Path) -> Path:
    """Run `make TARGET DIST=out` in the checkout: the release's own commands."""
    done = subprocess.run(["make", "-s", target, f"DIST={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _one(dist: Path, pattern: str) -> Path:
    (found,) = sorted(dist.glob(pattern))
    return found


def _wheels_carry_the_type_stubs_and_the_dashboard(dist: Path) -> None:
    sdk = set(zipfile.ZipFile(_one(dist, "fencepost-*.whl")).namelist())
    assert "fencepost/py.typed" in sdk and "fencepost/__init__.py" in sdk
    protos = sorted(p.stem for p in (REPO / "proto" / "fencepost" / "v1").glob("*.proto"))
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert f"fencepost/v1/{stem}{suffix}" in sdk
    assert not any(n.startswith("fencepost_server/") for n in sdk)
    wheel = zipfile.ZipFile(_one(dist, "fencepost_server-*.whl"))
    server = set(wheel.namelist())
    assert "fencepost_server/py.typed" in server
    for f in STATIC.iterdir():
        assert f"fencepost_server/web/static/{f.name}" in server
    assert not any(n.startswith("fencepost/") for n in server)
    # the test kit ships (fencepost.testing needs it); the checkout's dev tools do not
    assert {"fencepost_server/testing/server.py", "fencepost_server/testing/clock.py"} <= server
    for dev_only in ("pgcluster.py", "ports.py", "_codegen.py", "harness.py"):
        assert not any(n.endswith("/" + dev_only) for n in server | sdk), dev_only
    assert not any(n.startswith("fencepost_devtools/") for n in server | sdk)
    meta = next(n for n in server if n.endswith(".dist-info/METADATA"))
    requires = email.message_from_bytes(wheel.read(meta)).get_all("Requires-Dist") or []
    assert f"fencepost=={V}" in requires
    entry = next(n for n in server if n.endswith(".dist-info/entry_points.txt"))
    assert "fencepost = fencepost_server.cli:main" in wheel.read(entry).decode()


def _sdists_carry_their_sources(dist: Path) -> None:
    with tarfile.open(_one(dist, "fencepost_server-*.tar.gz")) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "pyproject.toml", "README.md", "PKG-INFO"} <= names
    assert {f"fencepost_server/web/static/{f.name}" for f in STATIC.iterdir()} <= names
    with tarfile.open(_one(dist, "fencepost-*.tar.gz")) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"fencepost/py.typed", "fencepost/v1/ledger_pb2.pyi", "README.md"} <= names


def _installed(venv: Path) -> set[str]:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                         capture_output=True, text=True, check=True, timeout=120, env=_env()).stdout
    return {p["name"].lower().replace("_", "-") for p in json.loads(out)} - VENV_BOOT


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                           *args], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]


def _readme_examples_and_dashboard(venv: Path, server: ServerProc, http: int, cwd: Path) -> None:
    blocks = [b for b in python_blocks(REPO / "README.md", REPO) if not b.fragment]
    assert len(blocks) >= 3
    for block in blocks:
        code = block.code.replace(DOC_ADDRESS, server.address)
        run = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd,
                             env=_env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{block.id}:\n{run.stderr[-3000:]}"
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=10) as r:
        assert r.read() == (STATIC / "index.html").read_bytes()
    for f in STATIC.iterdir():
        if f.suffix in (".js", ".css"):
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/static/{f.name}",
                                        timeout=10) as r:
                assert r.read() == f.read_bytes(), f.name


def test_the_python_artifacts_as_a_user_installs_them(tmp_path: Path) -> None:
    dist = _make("dist-python", tmp_path / "dist")
    assert sorted(p.name for p in dist.iterdir()) == sorted([
        f"fencepost-{V}-py3-none-any.whl", f"fencepost-{V}.tar.gz",
        f"fencepost_server-{V}-py3-none-any.whl", f"fencepost_server-{V}.tar.gz",
    ])
    _wheels_carry_the_type_stubs_and_the_dashboard(dist)
    _sdists_carry_their_sources(dist)

    venv = tmp_path / "user" / "venv"  # outside the repository, as a user's
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    _pip(venv, str(_one(dist, "fencepost-*.whl")))
    sdk_only = _installed(venv)
    print(f"\npip install fencepost installs: {sorted(sdk_only)}")
    assert sdk_only == SDK_SET
    _pip(venv, "--find-links", str(dist), str(_one(dist, "fencepost_server-*.whl")))
    # what the server needs beside the SDK came with it, and not before
    assert {"fencepost-server", "aiohttp", "psycopg", "psycopg-binary", "prometheus-client",
            "orjson", "sortedcontainers", "grpcio-health-checking",
            "grpcio-reflection"} <= _installed(venv) - sdk_only

    exe = venv / "bin" / "fencepost"
    version = subprocess.run([str(exe), "--version"], env=_env(),
                             capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith(f"fencepost {V}\napi: fencepost.v1\n"), version.stderr
    http = free_port()
    server = ServerProc(tmp_path / "fencepost.db", tmp_path / "server.log", exe=exe,
                        args=("--http-listen", f"127.0.0.1:{http}"))
    server.start(timeout=60)
    try:
        (tmp_path / "work").mkdir()
        _readme_examples_and_dashboard(venv, server, http, tmp_path / "work")
    finally:
        assert server.stop() == 0, server.log_tail()


PROGRAM = """\
import { randomUUID } from "node:crypto";
import { FencepostClient, LeaseHeldError } from "@fencepost/client";
import { FencepostRunStore, type RunRecord } from "@fencepost/oma";
import { FencepostStore, type Run } from "@fencepost/chamvi";

const address: string = process.argv[2] ?? "";
const client = new FencepostClient(address, { owner: "packed-1" });
const runId = `packed-${randomUUID()}`;
const lease = await client.acquire(runId, { ttlMs: 10_000 });
const token: number = lease.fencingToken;
const rival = new FencepostClient(address, { owner: "packed-2" });
let refused = false;
try {
  await rival.acquire(runId);
} catch (e) {
  refused = e instanceof LeaseHeldError;
}
await lease.recordCheckpoint(`ckpt/${runId}`, 1);
const done = await lease.finish("completed");

const runs = await FencepostRunStore.connect(address);
const missing: RunRecord | null = await runs.get(`none-${randomUUID()}`);
const store = await FencepostStore.connect(address);
const run: Run = { id: `engine-${randomUUID()}`, agent: "packed", status: "pending" };
const created: boolean = await store.createRun(run);
const read: Run | undefined = await store.getRun(run.id);

console.log(JSON.stringify({ status: done.status, token: token.toString(), refused,
  missing, created, agent: read?.agent, atomicity: runs.atomicity }));
await Promise.all([runs.close(), store.close(), rival.close(), client.close()]);
"""


def test_the_npm_tarballs_compile_strict_and_run(tmp_path: Path) -> None:
    dist = _make("dist-npm", tmp_path / "dist")
    assert sorted(p.name for p in dist.iterdir()) == sorted(
        f"fencepost-{p}-{V}.tgz" for p in ("client", "oma", "chamvi"))
    dev = json.loads((TS / "package.json").read_text())["devDependencies"]
    project = tmp_path / "user-project"
    (project / "src").mkdir(parents=True)
    (project / "package.json").write_text(json.dumps({"name": "user-project", "private": True,
                                                      "type": "module"}))
    (project / "tsconfig.json").write_text(json.dumps({"compilerOptions": {
        "target": "ES2022", "module": "NodeNext", "moduleResolution": "NodeNext",
        # DOM: Connect's declarations name fetch's HeadersInit
        "lib": ["ES2022", "DOM"], "types": ["node"], "strict": True, "outDir": "dist",
        "rootDir": "src"}, "include": ["src"]}))
    (project / "src" / "main.ts").write_text(PROGRAM)
    tarballs = [str(_one(dist, f"fencepost-{p}-*.tgz")) for p in ("client", "oma", "chamvi")]
    npm = subprocess.run(
        ["npm", "install", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error",
         # the newest Node 20 types: the workspace's pinned ones predate this TypeScript's
         # lib and pass only under skipLibCheck, which would skip our declarations too
         *tarballs, f"typescript@{dev['typescript']}", "@types/node@20"],
        cwd=project, capture_output=True, text=True, timeout=300)
    assert npm.returncode == 0, npm.stderr[-3000:]
    installed = json.loads((project / "node_modules" / "@fencepost" / "client" / "package.json")
                           .read_text())
    assert installed["version"] == V
    tsc = subprocess.run([str(project / "node_modules" / ".bin" / "tsc"), "-p", ".", "--strict"],
                         cwd=project, capture_output=True, text=True, timeout=300)
    assert tsc.returncode == 0, tsc.stdout[-3000:] + tsc.stderr[-3000:]
    with running_server(tmp_path) as server:
        run = subprocess.run(["node", "dist/main.js", server.address], cwd=project,
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out == {"status": "completed", "token": out["token"], "refused": True,
                   "missing": None, "created": True, "agent": "packed",
                   "atomicity": "cross-process"}
    assert int(out["token"]) >= 1
