"""Every tokenline module imports under the one name `tokenline`: none loads the `tests` package
(installed product code has no tests to import) or the folders as top-level `proxy`, `services`
or `shared` packages (which a wheel does not install)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests", "proxy", "services", "shared")

# pkgutil cannot list a namespace package behind setuptools' editable finder, so the walk also
# starts from every package pyproject.toml installs (their folders are real directories).
SCRIPT = """
import importlib, json, pkgutil, sys, tomllib
import tokenline
packages = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["packages"]
names = {info.name for info in pkgutil.walk_packages(tokenline.__path__, "tokenline.")}
for package in packages:
    names.add(package)
    path = importlib.import_module(package).__path__
    names |= {info.name for info in pkgutil.walk_packages(path, package + ".")}
failed = {}
for name in sorted(names):
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({"imported": sorted(names), "failed": failed, "loaded": sorted(sys.modules)}))
"""


@pytest.mark.slow  # the child imports every module, vLLM's users among them
def test_every_module_imports_as_tokenline_only() -> None:
    # From the checkout's root, where `tests`, `proxy`, ... would be importable by mistake.
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert "tokenline.launch.bench.pipeline" in result["imported"]
    assert "tokenline.services.generate.launcher" in result["imported"]
    assert result["failed"] == {}
    strays = [m for m in result["loaded"] if m.split(".")[0] in FOLDERS]
    assert strays == []
