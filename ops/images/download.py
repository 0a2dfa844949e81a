"""`pip download` as the images' Python resolves, run by the host venv's pip.

usage: python ops/images/download.py PYTHON_VERSION PIP_DOWNLOAD_ARGS...

The host venv's CPython (3.11.x) and the images' (Debian bookworm's 3.11.2) share wheel tags,
but not every environment marker: redis, for one, needs async-timeout only where
`python_full_version < "3.11.3"`. `--python-version` makes pip pick wheels and check
Requires-Python for the target, yet pip evaluates dependency markers against the interpreter
that runs it; so this runs pip with `platform` answering the target version, and pip's
marker environment is the image's.
"""

from __future__ import annotations

import platform
import sys


def main(argv: list[str]) -> int:
    version, args = argv[0], argv[1:]
    parts = version.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        print(f"download.py: want a version like 3.11.2, got {version!r}", file=sys.stderr)
        return 2
    platform.python_version = lambda: version
    platform.python_version_tuple = lambda: (parts[0], parts[1], parts[2])
    from pip._internal.cli.main import main as pip_main

    return pip_main(["download", "--python-version", version, "--only-binary=:all:", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
