#!/usr/bin/env python3
"""Starts attnbench's Python bridge: ``python3 -u serve_bridge.py``, beside the attnbench_bridge
package (a script's own folder is the first entry of sys.path). The protocol is in the package's
docstring."""
import sys

from attnbench_bridge.protocol import serve

if __name__ == "__main__":
    sys.exit(serve())
