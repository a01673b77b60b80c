"""The ``worker`` command. It imports the queue's core, the monitor and the developer tools;
nothing in the package imports it but the entry points (``worker._cli``, ``python -m worker``)."""

from .main import build_parser, entry, main

__all__ = ["build_parser", "entry", "main"]
