"""`streamrl report` as a subprocess, on a synthetic run's trace files: it needs neither Redis
nor a config, writes every plot and report.md, and names the bottleneck built in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.synthetic_run import write_synthetic_run


def test_report_cli_writes_plots_and_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir)
    out = tmp_path / "elsewhere"
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "report", str(run_dir), "-o", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        # No REDIS_URL: the report reads files alone.
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"streamrl report: {out / 'report.md'}"
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "policy_age.png",
        "queues.png",
        "report.md",
        "reward.png",
        "throughput.png",
        "time_breakdown.png",
    ]
    assert "**trainer**: its input queue `groups` grew" in (out / "report.md").read_text()
    assert not (run_dir / "report").exists()
