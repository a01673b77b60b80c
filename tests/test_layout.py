"""The package's layers: the core imports no CLI, monitor or developer tool; no import cycle; no
import inside a function to dodge one; modules stay small. These need no database."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "worker"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
OUTER = (
    "worker.cli",
    "worker._cli",
    "worker.monitor",
    "worker.dev",
    "prometheus_client",
    "pgserver",
    "worker.contrib",
    "opentelemetry",
    "django",
    "django_tasks",
)


def _lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(
            f"lint-imports not installed beside {sys.executable} (pip install -e '.[test]')"
        )
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", "pyproject.toml", "--no-cache"],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pythonpath)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_worker_loads_the_core_only() -> None:
    code = (
        "import sys, worker\n"
        f"outer = [m for m in sys.modules if m.startswith({OUTER!r})]\n"
        "print(','.join(sorted(outer)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"`import worker` loaded {out.stdout.strip()}"


def test_import_contract_holds() -> None:
    result = _lint_imports(ROOT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("_worker.py", "from .cli import common as _layer_breach  # noqa\n"),
        ("_enqueue.py", "from .monitor import metrics as _layer_breach  # noqa\n"),
        ("monitor/readmodel.py", "from ..dev import embedded as _layer_breach  # noqa\n"),
        ("_registry.py", "from . import _worker as _cycle  # noqa\n"),
        ("_executor.py", "from .contrib import otel as _layer_breach  # noqa\n"),
        ("_hooks.py", "import opentelemetry.trace as _layer_breach  # noqa\n"),
    ],
)
def test_import_contract_fails_when_a_layer_is_crossed(
    tmp_path: Path, module: str, line: str
) -> None:
    """The contract is not vacuous: a core module importing the CLI, the monitor, an optional
    integration or OpenTelemetry, the monitor importing a developer tool, or a cycle in the core
    each break it."""
    shutil.copytree(PACKAGE, tmp_path / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "worker" / module
    text = target.read_text()
    marker = "from __future__ import annotations\n"
    assert marker in text
    target.write_text(text.replace(marker, marker + line, 1))
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout


def test_contract_names_every_core_module() -> None:
    """A new core module cannot slip past the forbidden contract by not being listed in it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden = next(c for c in config["contracts"] if c["type"] == "forbidden")
    listed = set(forbidden["source_modules"])
    flat = {
        f"worker.{p.stem}"
        for p in PACKAGE.glob("*.py")
        if p.stem not in ("__init__", "__main__", "_cli")
    }
    assert listed == flat


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_import_inside_a_function_of_the_package() -> None:
    """Imports of the package's own modules sit at the top; only platform modules (pwd, fcntl)
    and prometheus-client (whose storage mode is fixed at its import) may be imported later."""
    allowed = {"pwd", "fcntl", "resource"}
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    name = inner.module or ""
                    own = inner.level or name.startswith("worker")
                    if own or (not name.startswith("prometheus_client") and name not in allowed):
                        found.append(f"{path.relative_to(ROOT)}:{inner.lineno} from {name}")
                elif isinstance(inner, ast.Import):
                    for alias in inner.names:
                        if alias.name not in allowed:
                            found.append(f"{path.relative_to(ROOT)}:{inner.lineno} {alias.name}")
    assert found == []


def test_modules_stay_small_or_say_why() -> None:
    """No module over 500 lines unless its docstring says why it must be one piece."""
    long = []
    for path in _modules():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 500 and "Over 500 lines on purpose" not in doc:
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert long == []


def test_loading_the_cli_registers_no_task() -> None:
    """The CLI loads the demo and bench tools; their handlers must not join the user's registry
    (a module with no tasks would then run the demo's)."""
    code = "import worker.cli, worker; print(len(worker.registry))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
