"""The wheel installs exactly one top-level import name, `tokenline`, and no test code."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_has_one_top_level_name(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tokenline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"tokenline"}
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    assert not any(p.startswith("tokenline/tests") or "/tests/" in p for p in packages)
    for expected in ("proxy/app.py", "services/render/app.py", "shared/wire.py", "launch/cli.py"):
        assert f"tokenline/{expected}" in names
    assert "tokenline/launch/models/chat_template.jinja" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tokenline = tokenline.launch.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_every_source_package_is_in_the_wheel_list() -> None:
    """pyproject lists packages by hand (the folders are mapped under `tokenline`): a new
    package folder must be added there, or it would be missing from the wheel."""

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for top in ("proxy", "services", "shared", "launch"):
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO)
            found.add("tokenline." + ".".join(rel.parts))
    assert found == listed
