"""The version is written once (the SDK's fencepost.__version__): both Python
distributions, the three npm packages and the changelog say the same, and
`fencepost --version` names the API and the storage schemas."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import fencepost
from fencepost.v1 import ledger_pb2
from fencepost_server.storage import postgres, sqlite

REPO = Path(__file__).resolve().parents[2]
TS = REPO / "clients" / "typescript" / "packages"
PUBLISHED_TS = ("client", "oma", "chamvi")


def test_both_distributions_carry_the_sdk_version() -> None:
    assert metadata.version("fencepost") == fencepost.__version__
    assert metadata.version("fencepost-server") == fencepost.__version__
    requires = metadata.requires("fencepost-server") or []
    assert f"fencepost=={fencepost.__version__}" in requires


def test_the_npm_packages_carry_the_same_version_and_require_each_other_at_it() -> None:
    for name in PUBLISHED_TS:
        pkg = json.loads((TS / name / "package.json").read_text())
        assert pkg["version"] == fencepost.__version__, name
        for dep, want in pkg.get("dependencies", {}).items():
            if dep.startswith("@fencepost/"):
                assert want == fencepost.__version__, (name, dep)
    tests = json.loads((TS / "tests" / "package.json").read_text())
    assert all(v == fencepost.__version__ for d, v in tests["dependencies"].items()
               if d.startswith("@fencepost/"))


def test_the_changelog_starts_at_this_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, re.M)
    assert released and released[0] == fencepost.__version__
    assert "## [Unreleased]" in text


def test_version_names_the_release_the_api_and_the_storage_schemas() -> None:
    exe = Path(sys.executable).parent / "fencepost"
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"fencepost {fencepost.__version__}",
        f"api: {ledger_pb2.DESCRIPTOR.package}",
        f"storage schema: sqlite {sqlite.SCHEMA_VERSION}, postgresql {postgres.SCHEMA_VERSION}",
    ]
    assert ledger_pb2.DESCRIPTOR.package == "fencepost.v1"
