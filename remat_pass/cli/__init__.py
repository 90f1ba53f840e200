"""The ``remat-pass`` command line: the parser and dispatch (``main``), one module per
group of commands (``sweep``, ``report``, ``plan``, ``parallel``) and the options they
share (``common``). ``main`` and the exit codes are the package's public names."""

from .main import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main"]
