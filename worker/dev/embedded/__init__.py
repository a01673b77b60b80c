"""The embedded PostgreSQL: a private server for when the user gives no DSN (the CLI, the demo
and the test suite). ``server`` runs its lifecycle, ``datadir`` reads its files, ``install``
finds its binaries and the user it runs as, ``attached`` says who is connected to it."""

from .install import EXTRA, EmbeddedError, EmbeddedUnavailable, find_pg_bin
from .server import EmbeddedPostgres, default_data_dir, ensure_embedded

__all__ = [
    "EXTRA",
    "EmbeddedError",
    "EmbeddedPostgres",
    "EmbeddedUnavailable",
    "default_data_dir",
    "ensure_embedded",
    "find_pg_bin",
]
