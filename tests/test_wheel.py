"""The package as a user installs it: a wheel built from this tree, installed with its
dependencies into a fresh venv that has nothing else, runs the first worker from the README
(`worker --version`, `migrate --module`, `enqueue`, `run --burst`) against a database. Nothing
is read from this source tree: the schema files, the SQL and the command come from the wheel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import uuid
import zipfile
from pathlib import Path

import psycopg
import pytest
from conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

TASKS = """\
import worker


@worker.task("send_email", queue="mail")
def send_email(payload, ctx):
    print("mail to", payload["to"])
"""


def _run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "WORKER_"))}
    r = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: hatchling comes with the test extra, so no download is needed here.
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    _run(*pip, "-w", out, ROOT, cwd=out)
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_has_its_name_and_its_data(wheel: Path) -> None:
    assert wheel.name.startswith(f"worker_pg-{PROJECT['version']}-"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    migrations = sorted(p.name for p in (ROOT / "schema").glob("0*.sql"))
    assert migrations and all(f"worker/schema/{m}" in names for m in migrations), names
    # Every .sql file of the package's rooms is in it.
    for sql in (ROOT / "worker").rglob("*.sql"):
        assert str(sql.relative_to(ROOT)) in names, sql
    assert not [n for n in names if n.startswith("tests/")]
    # The embedded server's 34 MB of PostgreSQL binaries come only with the `embedded` extra.
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [
        line.removeprefix("Requires-Dist: ")
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist: pgserver")
    ]
    assert requires and all("extra == 'embedded'" in r or "extra == 'test'" in r for r in requires)
    assert any("extra == 'embedded'" in r for r in requires), requires


def test_a_fresh_venv_with_the_wheel_runs_the_first_worker(
    wheel: Path, pg_dsn: str, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    bin_ = venv / "bin"
    # No bytecode compiled ahead (what the commands import is compiled as they import it).
    _run(bin_ / "pip", "install", "-q", "--no-compile", wheel, cwd=tmp_path)
    r = _run(bin_ / "worker", "--version", cwd=tmp_path)
    assert r.stdout == f"worker {PROJECT['version']}\n"
    # The import comes from the venv, not from this tree.
    r = _run(bin_ / "python", "-c", "import worker; print(worker.__file__)", cwd=tmp_path)
    assert r.stdout.startswith(str(venv)), r.stdout
    # A production install: no embedded server's binaries.
    r = _run(bin_ / "python", "-c", "import importlib.util as u; print(u.find_spec('pgserver'))",
             cwd=tmp_path)  # fmt: skip
    assert r.stdout == "None\n", r.stdout

    (tmp_path / "tasks.py").write_text(TASKS)
    schema = f"wheel_{uuid.uuid4().hex[:8]}"
    common = ["--dsn", pg_dsn, "--schema", schema]
    try:
        r = _run(bin_ / "worker", "migrate", "--module", "tasks", *common, cwd=tmp_path)
        assert re.search(r"applied \d+ migration\(s\)", r.stdout), r.stdout
        r = _run(bin_ / "worker", "enqueue", "send_email", "--payload", '{"to": "a@b.c"}',
                 *common, cwd=tmp_path)  # fmt: skip
        assert r.stdout.strip().isdigit() and r.stderr == "", (r.stdout, r.stderr)
        r = _run(bin_ / "worker", "run", "tasks", "--burst", "--processes", "1", *common,
                 cwd=tmp_path, timeout=120)  # fmt: skip
        assert "mail to a@b.c" in r.stdout, (r.stdout, r.stderr)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            rows = conn.execute(f"SELECT queue, state::text FROM {schema}.tasks").fetchall()
        assert rows == [("mail", "done")]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
