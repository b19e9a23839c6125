#!/usr/bin/env python3
"""Starts attnbench's Python bridge: ``python3 -u serve_bridge.py [--remove-own-folder]``, beside
the attnbench_bridge package (a script's own folder is the first entry of sys.path). The protocol
is in the package's docstring. With ``--remove-own-folder`` (the host's private copy) the folder
holding this script and the package is removed once the package is imported (its sources kept
in memory for the libraries that read a function's source): the worker is killed with its host,
so nothing would be left to remove it later."""
import os
import shutil
import sys

from attnbench_bridge import serve  # the whole package, imported before its folder goes
from attnbench_bridge.support import keep_sources

if __name__ == "__main__":
    if "--remove-own-folder" in sys.argv[1:]:
        own = os.path.dirname(os.path.abspath(__file__))
        keep_sources(own)
        shutil.rmtree(own, ignore_errors=True)
    sys.exit(serve())
