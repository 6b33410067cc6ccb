"""The ``fencepost`` command: ``serve`` (``main``), the operator commands
(``ops``, printed by ``format``), ``hold``; exit codes and argument types in
``common``."""

from .main import main

__all__ = ["main"]
