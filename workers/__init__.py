"""Thin process entrypoints: each wires parts from `streamrl` and runs them."""

import os
import sys

# Review N19: `streamrl up` starts its workers as `python -m streamrl_workers.cli`, which
# puts the launch directory first on sys.path: a stray redis.py or json.py there would
# shadow the real module in every worker. It goes last instead: installed packages win,
# and a plug-in package that lives there is still found.
if sys.path and sys.path[0] in ("", os.getcwd()):
    sys.path.append(sys.path.pop(0))
