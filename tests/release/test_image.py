"""The container image as built (`make image` sets FENCEPOST_IMAGE to its
archive): loaded and run with podman, its health check answers, a lease's
lifecycle goes through the SDK, it runs as a non-root user, and SIGTERM stops
it with exit status 0. Skipped when no image was built (`make test`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import fencepost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))

from _proc import free_port

ARCHIVE = os.environ.get("FENCEPOST_IMAGE", "")
TAG = f"localhost/fencepost-server:{fencepost.__version__}"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ARCHIVE, reason="no image built: make image"),
]


def podman(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    # runc and cgroupfs: crun refuses hosts with cgroup v1 and v2 mounted side by side
    runtime = ["--runtime", "runc", "--cgroup-manager", "cgroupfs"] if shutil.which("runc") else []
    return subprocess.run(["podman", *runtime, *args], capture_output=True, text=True,
                          check=check, timeout=timeout)


@pytest.fixture(scope="module")
def container() -> Iterator[tuple[str, int]]:
    podman("load", "-i", ARCHIVE, timeout=300)
    port, health = free_port(), free_port()
    name, volume = f"fp-{uuid.uuid4().hex[:8]}", f"fp-data-{uuid.uuid4().hex[:8]}"
    podman(
        "run", "-d", "--name", name, "--network", "host", "-v", f"{volume}:/data",
        # lowered limits: raising them is refused where the runtime may not setrlimit
        "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
        "-e", "FENCEPOST_ALLOW_INSECURE=1", "-e", f"FENCEPOST_LISTEN=127.0.0.1:{port}",
        "-e", f"FENCEPOST_HEALTH_LISTEN=127.0.0.1:{health}", "-e", "FENCEPOST_HTTP_LISTEN=off",
        TAG,
    )
    try:
        yield name, port
    finally:
        podman("rm", "-f", name, check=False)
        podman("volume", "rm", "-f", volume, check=False)


def _healthy(name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if podman("healthcheck", "run", name, check=False).returncode == 0:
            return
        assert time.monotonic() < deadline, podman("logs", name, check=False).stderr
        time.sleep(0.2)


def test_the_image_is_configured_as_the_dockerfile_says() -> None:
    podman("load", "-i", ARCHIVE, timeout=300)
    (image,) = json.loads(podman("image", "inspect", TAG).stdout)
    config = image["Config"]
    assert config["User"] == "fencepost"
    assert config["Entrypoint"] == ["fencepost", "serve"]
    assert config["StopSignal"] == "SIGTERM"
    assert image["Healthcheck"]["Test"] == ["CMD", "fencepost", "health", "--timeout", "2"]
    print(f"\nimage {TAG}: {image['Size'] / 1e6:.0f} MB")


def test_it_serves_a_lifecycle_as_a_non_root_user_and_stops_on_sigterm(
    container: tuple[str, int],
) -> None:
    name, port = container
    _healthy(name)  # the image's own HEALTHCHECK command
    uid = podman("exec", name, "id", "-u").stdout.strip()
    assert uid != "0" and uid == "10001"
    version = podman("exec", name, "fencepost", "--version").stdout
    assert version.startswith(f"fencepost {fencepost.__version__}\n")

    async def lifecycle() -> str:
        run_id = f"img-{uuid.uuid4().hex[:8]}"
        async with fencepost.Client(f"127.0.0.1:{port}") as client:
            async with client.acquire(run_id, ttl_ms=10_000) as lease:
                await lease.record_checkpoint(f"ckpt/{run_id}/1", snapshot_version=1)
                await lease.finish("completed")
            return str((await client.get(run_id)).status)

    assert asyncio.run(lifecycle()) == "completed"
    podman("kill", "--signal", "TERM", name)
    assert podman("wait", name, timeout=60).stdout.strip() == "0"
    assert "fencepost stopped" in podman("logs", name).stderr
