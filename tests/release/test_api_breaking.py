"""`make lint`'s breaking-change check of proto/ against the last released API
(scripts/api_breaking.py: buf breaking over descriptor sets protoc builds)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import fencepost

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "api_breaking.py"
RELEASED = REPO / "proto" / "released"


def _check(proto: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--proto", str(proto)],
                          capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "proto"
    shutil.copytree(REPO / "proto" / "fencepost", root / "fencepost")
    return root


def test_proto_keeps_the_released_api() -> None:
    done = _check(REPO / "proto")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no breaking change against proto/released/" in done.stdout


def test_a_renumbered_field_fails(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    record = root / "fencepost" / "v1" / "record.proto"
    text = record.read_text()
    assert "int64 snapshot_version = 2;" in text
    record.write_text(text.replace("int64 snapshot_version = 2;", "int64 snapshot_version = 12;"))
    done = _check(root)
    assert done.returncode != 0
    assert 'field "2" with name "snapshot_version" on message "CheckpointRef"' in done.stdout


def test_a_removed_enum_value_fails_and_an_added_field_does_not(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    record = root / "fencepost" / "v1" / "record.proto"
    text = record.read_text()
    added = text.replace("int64 snapshot_version = 2;",
                         "int64 snapshot_version = 2;\n  string note = 99;")
    record.write_text(added)
    assert _check(root).returncode == 0  # adding is compatible
    line = re.search(r"\n(\s*RUN_STATUS_RUNNING = 2;)", text)
    assert line
    record.write_text(text.replace(line.group(0), ""))
    done = _check(root)
    assert done.returncode != 0 and 'enum value "2" on enum "RunStatus"' in done.stdout


def test_this_version_has_a_released_api_to_check_against() -> None:
    assert (RELEASED / fencepost.__version__ / "fencepost" / "v1").is_dir()
