"""The ``worker`` command's exit codes, one table for every command, and how a failure ends: one
line on stderr, and with ``--json`` a JSON object on stdout as well."""

from __future__ import annotations

import json
import os
import sys

OK = 0
NO = 1  # the answer is no: a finding, a failed task, no such task, nothing to resume
USAGE = 2  # configuration or input: a flag, a DSN that cannot be parsed, a schema, a module
TIMEOUT = 3  # `worker wait --timeout` passed first
UNREACHABLE = 4  # the database cannot be reached or refused the connection
DATABASE = 5  # the database refused a statement while the command ran (permissions, say)
INTERRUPTED = 130  # Ctrl-C (SIGINT)
TERMINATED = 143  # SIGTERM
CLOSED_PIPE = 141  # the reader of stdout went away (as SIGPIPE would end a shell tool)

# Their names in --json error objects.
KINDS = {
    NO: "no",
    USAGE: "usage",
    TIMEOUT: "timeout",
    UNREACHABLE: "unreachable",
    DATABASE: "database",
    INTERRUPTED: "interrupted",
    TERMINATED: "terminated",
}

EPILOG = """exit codes (every command):
  0    success
  1    the answer is no: doctor findings, a failed or missing task, nothing to act on
  2    usage or configuration: a flag, a value out of range, a DSN that cannot be parsed,
       a schema that is missing or not migrated, a module that cannot be imported
  3    worker wait: the timeout passed first
  4    the database cannot be reached or refused the connection (an embedded server that
       is not running included)
  5    the database refused a statement while the command ran
  130  interrupted (Ctrl-C); 143: stopped by SIGTERM where the command does not handle it
With --json, a failure also prints {"error": {"message": ..., "exit_code": ..., "kind": ...}}
on stdout."""


def fail(line: str, code: int, *, as_json: bool) -> int:
    """``line`` (``worker: error: ...``) on stderr, and with ``as_json`` the JSON error object
    on stdout; returns ``code``."""
    if as_json:
        _, sep, tail = line.partition(": error: ")
        message = tail if sep else line.removeprefix("worker: ")
        error = {"message": message, "exit_code": code, "kind": KINDS.get(code, "error")}
        print(json.dumps({"error": error}, indent=2), flush=True)
    print(line, file=sys.stderr)
    return code


def quiet_closed_pipe() -> int:
    """After a BrokenPipeError on stdout: point stdout at /dev/null, so that the interpreter's
    final flush cannot raise again, and end with CLOSED_PIPE, without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)
    return CLOSED_PIPE
