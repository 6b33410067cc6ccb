"""The Dockerfile and scripts/build_image.sh (`make image`) build one image:
the script builds the Dockerfile itself, only swapping its base for the same
Debian release made from Debian's packages."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
SCRIPT = (REPO / "scripts" / "build_image.sh").read_text()


def _instructions(text: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", text)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_stage_starts_from_the_base_the_script_replaces() -> None:
    froms = [i for i in _instructions(DOCKERFILE) if i.startswith("FROM ")]
    assert froms and all(i.split()[1] == "${BASE}" for i in froms), froms
    assert 'buildah bud "${build_flags[@]}" --build-arg "BASE=$base" -f Dockerfile' in SCRIPT


def test_the_script_makes_the_debian_release_the_dockerfile_names() -> None:
    (arg,) = [i for i in _instructions(DOCKERFILE) if i.startswith("ARG BASE=")]
    release = re.fullmatch(r"ARG BASE=debian:([a-z]+)-slim", arg)
    assert release, arg
    # the script's own extraction, run on the Dockerfile
    (line,) = [line for line in SCRIPT.splitlines() if line.startswith("suite=$(")]
    suite = subprocess.run(["bash", "-c", f"{line}; echo \"$suite\""], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert suite == release.group(1) == "bookworm"
    assert 'debootstrap --variant=minbase "$suite"' in SCRIPT


def test_the_build_secret_the_script_passes_is_the_one_the_dockerfile_mounts() -> None:
    mounts = re.findall(r"--mount=type=secret,id=(\w+)", DOCKERFILE)
    passed = re.findall(r'--secret "id=(\w+),src=', SCRIPT)
    assert mounts and set(mounts) == set(passed)


def test_the_image_runs_as_a_non_root_user_with_the_health_check() -> None:
    final = DOCKERFILE[DOCKERFILE.rindex("\nFROM "):]
    steps = _instructions(final)
    (user,) = [s.split()[1] for s in steps if s.startswith("USER ")]
    assert user != "root" and re.search(rf"useradd [^\n]*--uid 10001 [^\n]*{user}", final)
    assert any(s.startswith("HEALTHCHECK ") and '"fencepost", "health"' in s for s in steps)
    assert 'ENTRYPOINT ["fencepost", "serve"]' in steps and "STOPSIGNAL SIGTERM" in steps
