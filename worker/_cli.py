"""Entry point kept for installed scripts that name ``worker._cli:main``; see ``worker.cli``."""

from .cli import main

__all__ = ["main"]
