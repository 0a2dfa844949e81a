"""Command-line arguments shared by the `streamrl` subcommands that read a run config."""

from __future__ import annotations

import argparse


def config_arguments(p: argparse.ArgumentParser, run_dir: bool = True) -> None:
    """--config and --set (and --run-dir): the config `cli.main` loads for the command."""
    p.add_argument("--config", required=True, help="TOML run config (see configs/)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field (repeatable)",
    )
    if run_dir:
        p.add_argument("--run-dir", default=None, help="run directory (default runs/<run.name>)")
