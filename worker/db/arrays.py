"""Parameters in the shapes the statements take cheaply: arrays as PostgreSQL's text form, and
the execution option of statements that must be planned for each batch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# The statements that take a batch of (id, attempt) pairs join it to the table by primary key.
# A generic plan cached while the table was small reads the whole primary key instead, in a
# nested loop with the batch inside (cheaper, for a table of a few pages, than one look-up per
# row); PostgreSQL keeps it until the table is next analysed, and with autovacuum off, never
# replaces it: an acknowledgement of one row then read every row of the table (0.1 ms at 500
# rows, growing). Planned for each execution (PostgreSQL then sees the batch and the table as
# they are), they cost a plan each, once per batch. The acknowledgements that end rows done join
# nothing (see complete in store/acks.sql) and are prepared.
PLAN_EACH: dict[str, Any] = {"prepare": False}


def text_array(values: Iterable[str]) -> str:
    """Strings as PostgreSQL's text form of an array ('{"a","b"}'), every element quoted, with
    backslashes and double quotes escaped, so any name (commas, braces, quotes: queue names are
    data) comes back as it was."""
    return (
        "{"
        + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


def int_array(values: Iterable[int]) -> str:
    """Integers as PostgreSQL's text form of an array ('{1,2,3}'), for the statements that take a
    batch of ids (cast to bigint[] or integer[] there). psycopg adapts a Python list of a hundred
    ints in about 250 µs, this string in about 15: on the acknowledgement path, per batch, that
    was the largest cost of the worker's main thread. int() keeps anything else out."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


__all__ = ["PLAN_EACH", "int_array", "text_array"]
