"""The package's layers: the core imports no CLI, monitor or developer tool; no import cycle; no
import inside a function to dodge one; modules stay small. These need no database."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from worker.db.sql import parse_named, queries

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "worker"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
OUTER = (
    "worker.cli",
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
        ("engine/loop.py", "from ..cli import common as _layer_breach  # noqa\n"),
        ("tasks/enqueue.py", "from ..monitor.metrics import counters as _layer_breach  # noqa\n"),
        ("monitor/readmodel.py", "from ..dev import embedded as _layer_breach  # noqa\n"),
        ("tasks/registry.py", "from ..engine import loop as _layer_breach  # noqa\n"),
        ("store/claims.py", "from ..tasks import registry as _layer_breach  # noqa\n"),
        ("db/sql.py", "from ..store import claims as _layer_breach  # noqa\n"),
        ("engine/loop.py", "from ..ops import status as _layer_breach  # noqa\n"),
        ("monitor/doctor/checks.py", "from ..page import markup as _layer_breach  # noqa\n"),
        ("engine/job.py", "from . import loop as _cycle  # noqa\n"),
        ("engine/runners.py", "from ..contrib import otel as _layer_breach  # noqa\n"),
        ("hooks.py", "import opentelemetry.trace as _layer_breach  # noqa\n"),
    ],
)
def test_import_contract_fails_when_a_layer_is_crossed(
    tmp_path: Path, module: str, line: str
) -> None:
    """The contracts are not vacuous: a room importing a room above it (the engine the CLI, the
    task API the monitor or the engine, the store the task API, data access the store, the
    engine its sibling ops, the doctor the page), the monitor importing a developer tool, the
    core importing an optional integration or OpenTelemetry, or a cycle in a room each break
    them."""
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


def test_every_room_is_in_the_layers_contract() -> None:
    """A new room (or a module beside the rooms) cannot slip past the order by not being named
    in it: every subpackage and module of ``worker`` is a layer of the contract."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    rooms = next(c for c in config["contracts"] if c.get("containers") == ["worker"])
    named = {part.strip() for layer in rooms["layers"] for part in layer.split("|")}
    present = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
        or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert present == named


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
    """No module over 400 lines unless its docstring says why it must be one piece, and none
    over 600 at all."""
    long = []
    for path in _modules():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        lines = text.count("\n")
        if lines > 600 or (lines > 400 and "Over 400 lines on purpose" not in doc):
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert long == []


def test_loading_the_cli_registers_no_task() -> None:
    """The whole parser loads the demo and bench tools; their handlers must not join the user's
    registry (a module with no tasks would then run the demo's)."""
    code = (
        "import sys, worker\n"
        "from worker.cli import build_parser\n"
        "build_parser()\n"
        "assert 'worker.dev.bench' in sys.modules and 'worker.dev.demo' in sys.modules\n"
        "print(len(worker.registry))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_a_workers_query_set_holds_the_cores_statements_only() -> None:
    """The statements of the developer tools, the monitor, the integrations, worker.testing and
    the store (loaded by the store alone) are not in the set every worker loads."""
    core = queries("worker")
    outside = {
        name
        for path in PACKAGE.rglob("*.sql")
        if path.relative_to(PACKAGE).parts[0]
        in ("dev", "monitor", "contrib", "store", "testing.sql")
        for name in parse_named(path.read_text())
    }
    assert len(outside) > 50
    assert sorted(n for n in outside if n in core) == []
    assert "register" in core and "pause_queue" in core  # the core's own are there


def test_architecture_names_every_room_and_only_files_that_exist() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    rooms = next(c for c in config["contracts"] if c.get("containers") == ["worker"])
    for layer in rooms["layers"]:
        assert layer in text, f"ARCHITECTURE.md does not show the layer {layer!r}"
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.(?:py|sql))`", text))
    named |= {
        m[0] + (m[1] or ".py") for m in re.findall(r"`((?:[a-z_]+/)+[a-z_]+)(\.[a-z_]+)?`", text)
    }
    missing = [
        n for n in sorted(named)
        if not (PACKAGE / n).exists() and not (ROOT / n).exists()
        and not (PACKAGE / n.removesuffix(".py")).is_dir()
    ]  # fmt: skip
    assert len(named) > 20 and missing == []


def _loaded_by(code: str) -> set[str]:
    code += "\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_worker_loads_a_name_when_it_is_first_used() -> None:
    """``import worker`` is cheap: no module of the queue (and not psycopg) until a name is used,
    and then that name's module only."""
    before = _loaded_by("import sys, worker")
    assert {m for m in before if m.startswith(("worker.", "psycopg"))} == set()
    after = _loaded_by("import sys, worker\nworker.enqueue")
    assert "worker.tasks.enqueue" in after
    assert not {m for m in after if m.startswith(("worker.engine", "worker.coord.schedule"))}


def test_every_public_name_is_its_modules_object() -> None:
    """Each name of ``__all__`` resolves, at run time, to the object its module defines, and the
    imports type checkers read name the same modules as the run-time list."""
    import worker

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    typed = {
        alias.name: "." + node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
    }
    assert typed == worker._HOME
    assert sorted(worker.__all__) == sorted(typed)
    for name, home in typed.items():
        module = __import__(f"worker{home}", fromlist=[name])
        assert getattr(worker, name) is getattr(module, name), name
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        worker.nonesuch  # noqa: B018


@pytest.mark.parametrize("command", ["status", "enqueue", "pause", "wait", "--help"])
def test_a_command_loads_only_what_it_runs(command: str) -> None:
    """The short commands start without the engine, the monitor, the benchmarks, the demo or
    the cron parser: only the run's own module joins the parser's."""
    loaded = _loaded_by(
        f"import sys\nfrom worker.cli.main import COMMANDS, build_parser\n"
        f"build_parser({command!r} if {command!r} in COMMANDS else '')"
    )
    heavy = ("worker.engine", "worker.monitor", "worker.dev.bench", "worker.dev.demo")
    assert sorted(m for m in loaded if m.startswith(heavy)) == []
    assert {"croniter", "prometheus_client"} & loaded == set()
    if command == "--help":
        assert {"worker.cli.status", "worker.cli.run", "worker.cli.bulk"} & loaded == set()
