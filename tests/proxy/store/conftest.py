"""Real databases for the store's tests: SQLite in a tmp file, and a PostgreSQL server started
once per session (its binaries, found on PATH), with a fresh database per test made by
pytest-postgresql's `DatabaseJanitor`. The PostgreSQL tests are `slow` (a server: not in the
fast run)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest_postgresql.janitor import DatabaseJanitor


@dataclass(frozen=True)
class PgServer:
    host: str
    port: int
    user: str = "postgres"

    def url(self, dbname: str) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{dbname}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres() -> list[str]:
    """PostgreSQL refuses to run as root: CI and the dev machines run as root."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    if shutil.which("pg_ctl") is None:
        pytest.fail("PostgreSQL's binaries (pg_ctl, initdb, postgres) are not on PATH")
    root = Path(tempfile.mkdtemp(prefix="tokenline-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", _free_port()
    run = _as_postgres()
    subprocess.run(
        [*run, "initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        [*run, "pg_ctl", "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"],
        check=True,
        capture_output=True,
    )
    try:
        yield PgServer("127.0.0.1", port)
    finally:
        subprocess.run([*run, "pg_ctl", "-D", str(data), "-m", "immediate", "stop"], check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh, empty database on the session's server."""
    dbname = f"tl_{time.monotonic_ns()}"
    with DatabaseJanitor(
        user=pg_server.user,
        host=pg_server.host,
        port=pg_server.port,
        dbname=dbname,
    ):
        yield pg_server.url(dbname)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on both databases."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'responses.db'}"
    return str(request.getfixturevalue("pg_url"))
