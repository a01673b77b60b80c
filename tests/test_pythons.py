"""The package on the other Pythons it supports, each in a venv of its own made here: on Python
3.12, the Django tests against Django 6's built-in ``django.tasks`` (this suite's own venv, on
3.11, has Django 5.2 and the django-tasks backport); on Python 3.13, every test that needs no
database. A Python that is not on this machine is skipped, saying which."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.db  # builds venvs, runs processes


def _venv(python: str, where: Path, *requirements: str) -> Path:
    """A fresh venv of ``python`` with this tree installed (not editable) and ``requirements``."""
    subprocess.run([python, "-m", "venv", str(where)], check=True, timeout=120)
    # No bytecode compiled ahead: Python compiles what the tests import as they import it,
    # and compiling every module of Django, Playwright and the rest took seconds of CPU.
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    r = subprocess.run(
        [*pip, *requirements], capture_output=True, text=True, timeout=900, cwd=where
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return where / "bin" / "python"


def _pytest(python: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # The tree's tests and code, run by the other venv's Python and packages.
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=-ra -n 2 --dist loadfile",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def _which(version: str) -> str:
    """A python{version} that runs: on the PATH, or one pyenv installed (its shims on the PATH
    fail for versions the shell has not selected)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [
        shutil.which(f"python{version}"),
        *sorted(pyenv.glob(f"{version}.*/bin/python{version}")),
    ]
    for candidate in filter(None, candidates):
        if subprocess.run([str(candidate), "-c", ""], capture_output=True).returncode == 0:
            return str(candidate)
    pytest.skip(f"python{version} is not on this machine")


def _env(pg_dsn: str, tmp: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**keep, "WORKER_TEST_DSN": pg_dsn, "PYTHONPATH": str(ROOT / "tests"),
            "PYTEST_DEBUG_TEMPROOT": str(tmp)}  # fmt: skip


def test_django_6_built_in_tasks_on_python_3_12(pg_dsn: str, tmp_path: Path) -> None:
    python = _venv(
        _which("3.12"), tmp_path / "venv", f"{ROOT}[django]", "pytest>=8", "pytest-xdist>=3.5"
    )
    r = subprocess.run(
        [str(python), "-c", "import django, django.tasks; print(django.get_version())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(r.stdout.split(".")[0]) >= 6, r.stdout
    r = _pytest(
        python, "tests/test_django.py", "tests/test_django_migrations.py",
        env=_env(pg_dsn, tmp_path),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]


def test_the_tests_without_a_database_on_python_3_13(pg_dsn: str, tmp_path: Path) -> None:
    """The package imports and its tests that need neither PostgreSQL nor worker processes pass
    on Python 3.13 (the embedded server's wheel has no build for it: those tests are `db`)."""
    python = _venv(_which("3.13"), tmp_path / "venv", f"{ROOT}[test]")
    r = _pytest(python, "-m", "not db", env=_env(pg_dsn, tmp_path))
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-500:]
