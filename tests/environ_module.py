"""A handler that does what hostile code in a worker would do to find secrets: it reads its own
environment, /proc/self/environ, and the environment and command line of its parent (the
supervisor, readable by any process of the same user), and returns them as its result."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import worker


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().replace(b"\0", b"\n").decode("latin-1")
    except OSError as exc:
        return f"unreadable: {exc.strerror}"


@worker.task("environ")
def environ(payload: dict[str, Any]) -> dict[str, Any]:
    parent = os.getppid()
    return {
        "pid": os.getpid(),
        "parent": parent,
        "os.environ": dict(os.environ),
        "/proc/self/environ": _read("/proc/self/environ"),
        "/proc/self/cmdline": _read("/proc/self/cmdline"),
        "parent environ": _read(f"/proc/{parent}/environ"),
        "parent cmdline": _read(f"/proc/{parent}/cmdline"),
    }
