"""Packaging: the Kubernetes manifest's ports and probes against the server's
own flags (and a real server started with its arguments), the image's health
check, .dockerignore, and `make serve` installing only what serving needs."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from _proc import ServerProc, free_port

from fencepost_server.addresses import split_address
from fencepost_server.cli.common import default_addr
from fencepost_server.cli.main import build_parser
from fencepost_server.config import Settings

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "docs" / "kubernetes.yaml"
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def _pod() -> dict[str, Any]:
    doc = yaml.safe_load(MANIFEST.read_text())
    return dict(doc["spec"]["template"]["spec"])


def _sidecar() -> dict[str, Any]:
    (c,) = [c for c in _pod()["containers"] if c["name"] == "fencepost"]
    return dict(c)


def _settings(args: list[str]) -> Settings:
    ns = build_parser().parse_args(["serve", *args])  # every flag must exist
    return Settings.from_env({}, listen=ns.listen, db_path=ns.db_path,
                             http_listen=ns.http_listen, metrics_listen=ns.metrics_listen)


def _port_number(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int):
        return port
    (match,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return int(match)


def test_the_manifest_probes_reach_a_listener_the_kubelet_can_reach() -> None:
    c = _sidecar()
    s = _settings(c["args"])
    listeners = {"grpc": s.listen, "http": s.http_listen, "metrics": s.metrics_listen}
    probes = [c[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c]
    assert probes, "the sidecar needs probes"
    for probe in probes:
        if "exec" in probe:  # runs inside the container: loopback is fine
            cmd = probe["exec"]["command"]
            assert cmd[:2] == ["fencepost", "health"], cmd
            assert cmd[cmd.index("--addr") + 1].rsplit(":", 1)[1] == s.listen.rsplit(":", 1)[1]
            continue
        kind = "grpc" if "grpc" in probe else "httpGet"
        port = _port_number(c, probe[kind]["port"])
        # the kubelet probes the pod IP: the listener must not be loopback-only
        names = [n for n, addr in listeners.items() if addr and split_address(addr, 0)[1] == port]
        assert names, f"no listener on probe port {port}: {listeners}"
        host = split_address(listeners[names[0]], 0)[0]
        assert host not in LOOPBACK, f"{kind} probe on {port}, but {names[0]} listens on {host}"
        if kind == "grpc":
            assert names == ["grpc"]
        else:
            assert names[0] in ("http", "metrics") and probe[kind]["path"] == "/healthz"
    for declared in c.get("ports", []):  # every declared port is a listener off loopback
        hosts = [split_address(a, 0) for a in listeners.values() if a]
        assert (any(p == declared["containerPort"] and h not in LOOPBACK for h, p in hosts)), (
            declared)


def test_the_manifest_volume_is_writable_by_the_image_user() -> None:
    pod = _pod()
    dockerfile = (REPO / "Dockerfile").read_text()
    uid = re.search(r"useradd [^\n]*--uid (\d+)", dockerfile)
    gid = re.search(r"groupadd [^\n]*--gid (\d+)", dockerfile)
    assert uid and gid
    sc = pod["securityContext"]
    assert sc["fsGroup"] == int(gid.group(1)) and sc["runAsUser"] == int(uid.group(1))
    c = _sidecar()
    db = _settings(c["args"]).db_path
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert any(db.startswith(m.rstrip("/") + "/") for m in mounts), (db, mounts)
    assert pod["volumes"][0]["name"] in [m["name"] for m in c["volumeMounts"]]


@pytest.mark.slow
def test_a_server_started_with_the_manifest_args_answers_its_probes(tmp_path: Path) -> None:
    c = _sidecar()
    flags = dict(zip(c["args"][::2], c["args"][1::2], strict=True))
    ports: dict[int, int] = {}  # the manifest's port -> a free one here
    extra: list[str] = []
    for flag, value in flags.items():
        if flag in ("--listen", "--db"):
            continue  # ServerProc passes these (a free port, a temp file)
        host, port = split_address(value, 0)
        ports[port] = free_port()
        extra += [flag, f"{host}:{ports[port]}"]
    srv = ServerProc(tmp_path / "fp.db", tmp_path / "log", args=tuple(extra))
    srv.start()
    try:
        for key in ("readinessProbe", "livenessProbe"):
            get = c[key]["httpGet"]
            port = ports[_port_number(c, get["port"])]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{get['path']}", timeout=10) as r:
                assert r.status == 200 and r.read() == b"SERVING\n"
        metrics_port = ports[int(_pod_annotations()["prometheus.io/port"])]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"fencepost_build_info" in r.read()
        with pytest.raises(urllib.error.HTTPError) as e:  # metrics-only: no dashboard there
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/", timeout=10)
        assert e.value.code == 404
    finally:
        srv.kill()


def _pod_annotations() -> dict[str, str]:
    doc = yaml.safe_load(MANIFEST.read_text())
    return dict(doc["spec"]["template"]["metadata"]["annotations"])


def test_the_image_health_check_follows_the_configured_port() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    check = dockerfile[dockerfile.index("HEALTHCHECK"):].split("\n\n")[0]
    assert '"fencepost", "health"' in check and "50051" not in check
    assert default_addr({"FENCEPOST_LISTEN": "0.0.0.0:7000"}) == "127.0.0.1:7000"
    assert default_addr({"FENCEPOST_LISTEN": "[::]:7001"}) == "127.0.0.1:7001"
    assert default_addr({"FENCEPOST_LISTEN": "10.1.2.3:7002"}) == "10.1.2.3:7002"
    assert default_addr({"FENCEPOST_LISTEN": "0.0.0.0:7000",
                         "FENCEPOST_ADDR": "h:1"}) == "h:1"
    assert default_addr({}) == "127.0.0.1:50051"


@pytest.mark.slow
def test_fencepost_health_follows_fencepost_listen(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "fp.db", tmp_path / "log", args=("--http-listen", "off"))
    srv.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "FENCEPOST_ADDR"}
        env["FENCEPOST_LISTEN"] = f"0.0.0.0:{srv.port}"
        exe = Path(sys.executable).parent / "fencepost"
        done = subprocess.run([str(exe), "health", "--timeout", "5"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, "SERVING\n"), done.stderr
    finally:
        srv.kill()


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    for pat in patterns:
        pat = pat.removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) for p in parts) or fnmatch.fnmatch(path, pat):
            return True
    return False


def test_dockerignore_keeps_the_venv_and_databases_out_and_the_sources_in() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for heavy in (".venv", ".git", "fencepost.db", "fencepost.db-wal", "x/__pycache__",
                  ".mypy_cache", "bench/results"):
        assert _ignored(heavy, patterns), heavy
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = [src for line in dockerfile.splitlines() if line.startswith("COPY ")
              for src in line.split()[1:-1]]
    assert "server" in copied and "clients/python" in copied
    for src in copied:
        assert not _ignored(src, patterns), src
    static = REPO / "server" / "fencepost_server" / "web" / "static"
    for f in static.iterdir():  # the dashboard ships in the image
        assert not _ignored(str(f.relative_to(REPO)), patterns), f


def test_make_serve_installs_only_what_serving_needs(tmp_path: Path) -> None:
    plan = subprocess.run(["make", "-n", "serve", f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True).stdout
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert installs, plan
    assert all("[dev]" not in line and "-e clients/python -e server" in line
               for line in installs), installs


@pytest.mark.slow
def test_fencepost_health_asks_the_health_only_port_when_there_is_one(tmp_path: Path) -> None:
    """The image's case: gRPC behind mutual TLS, health alone in plaintext on
    loopback (FENCEPOST_HEALTH_LISTEN): `fencepost health` needs no certificate."""
    health_port = free_port()
    srv = ServerProc(tmp_path / "fp.db", tmp_path / "log",
                     args=("--http-listen", "off", "--health-listen", f"127.0.0.1:{health_port}"))
    srv.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "FENCEPOST_ADDR"}
        env["FENCEPOST_LISTEN"] = f"0.0.0.0:{free_port()}"  # nothing answers there
        env["FENCEPOST_HEALTH_LISTEN"] = f"127.0.0.1:{health_port}"
        exe = Path(sys.executable).parent / "fencepost"
        done = subprocess.run([str(exe), "health", "--timeout", "5"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, "SERVING\n"), done.stderr
    finally:
        srv.kill()
