"""Secrets a long-running command must not keep where other processes can read them: the
console's token and DSNs given on the command line (``worker run``, ``worker demo``)."""

from __future__ import annotations

import contextlib
import os
import sys

from ..engine.supervisor import (
    CONSOLE_TOKEN_ENV,
    CONSOLE_TOKEN_FD_ENV,
    child_environ,
    read_secret_pipe,
    secret_pipe,
)
from ..monitor.console.auth import TokenError, checked_token
from .common import CliError


def start_over(argv: list[str], moved: dict[str, str], *, serving: bool) -> None:
    """Start this command over, as the same process (exec), when its environment holds the
    console's token (WORKER_CONSOLE_TOKEN) or ``moved`` holds DSNs taken off its command line:
    any process of the same user, a task's handler included, can read /proc/PID/environ and
    /proc/PID/cmdline, and the kernel keeps showing there what a process started with. The new
    process gets ``moved`` in its environment, and the token (when it serves the console) on an
    inherited file descriptor (``secret_pipe``) named by WORKER_CONSOLE_TOKEN_FD, which it reads
    once and closes (``console_token``). A token that cannot be used is refused here, in one
    line."""
    token = os.environ.get(CONSOLE_TOKEN_ENV)
    if token is None and not moved:
        return
    env = child_environ(moved)
    if token is not None and serving:
        try:
            token = checked_token(token, CONSOLE_TOKEN_ENV)
        except TokenError as exc:
            raise CliError(str(exc), 2) from None
        try:
            env[CONSOLE_TOKEN_FD_ENV] = str(secret_pipe(token))
        except ValueError:
            raise CliError(
                f"the console token from {CONSOLE_TOKEN_ENV} is too long to hand over: use "
                "--console-token-file",
                2,
            ) from None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, "-m", "worker", *argv], env)
    except OSError as exc:
        raise CliError(
            f"cannot start over without the secrets in the environment: {exc.strerror}", 1
        ) from None


def console_token(path: str | None, *, serving: bool = True) -> str | None:
    """The console's token: from the file at ``path`` (--console-token-file), else the one
    ``start_over`` handed over, else WORKER_CONSOLE_TOKEN (a command run in-process, which could
    not start over); None, unread, when this process does not serve the console. Both variables
    leave os.environ either way, so that nothing this process starts gets them."""
    from_env = os.environ.pop(CONSOLE_TOKEN_ENV, None)
    fd = os.environ.pop(CONSOLE_TOKEN_FD_ENV, None)
    handed = None
    if fd is not None and not serving:
        with contextlib.suppress(OSError, ValueError):
            os.close(int(fd))
        return None
    if not serving:
        return None
    if fd is not None:
        try:
            handed = read_secret_pipe(fd)
        except (OSError, ValueError):
            raise CliError(
                f"cannot read the console token from {CONSOLE_TOKEN_FD_ENV} (it names the file "
                f"descriptor `worker` hands the token over on when it starts over; set "
                f"{CONSOLE_TOKEN_ENV} or use --console-token-file instead)",
                2,
            ) from None
    try:
        if path:
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read(64 * 1024)
            except (OSError, UnicodeDecodeError) as exc:
                why = getattr(exc, "strerror", None) or "not a UTF-8 text file"
                raise CliError(f"cannot read --console-token-file {path!r}: {why}", 2) from None
            return checked_token(text, "--console-token-file")
        given = handed if handed is not None else from_env
        return None if given is None else checked_token(given, CONSOLE_TOKEN_ENV)
    except TokenError as exc:
        raise CliError(str(exc), 2) from None
