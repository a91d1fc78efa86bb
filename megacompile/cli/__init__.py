"""The ``megacompile`` command: ``inspect``, ``plan``, ``calibrate``. Nothing imports it."""
from megacompile.cli.commands import main

__all__ = ["main"]
