"""What malloc's transparent huge pages (`glibc.malloc.hugetlb=1`, streamrl.run.malloc) do
for a train step on the CPU: the warm start of a config, `--steps` steps from the built-in
checkpoint, in a process of its own, with GLIBC_TUNABLES unset (the baseline: glibc's
default, what a process gets outside `streamrl up`) and with `glibc.malloc.hugetlb=1` (what
`streamrl up` gives its workers), the two alternating, `--repeats` times each.

    .venv/bin/python -m ops.bench.malloc [--configs configs/tiny.toml configs/code.toml]
        [--steps 300] [--repeats 3]

Each run trains into a scratch model cache of its own (nothing is reused), its programs from
a scratch JAX compilation cache the first run of each config fills (so compiles count in
neither row after it). Printed per config: medians of wall, user and system CPU seconds and
minor page faults (the process's rusage), and the ratios hugetlb / baseline.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from streamrl.run.malloc import TUNABLES_ENV, with_hugetlb

_CHILD = """
import sys
from streamrl.config import load_config
from streamrl.trainer.warmstart import warmstart_params
cfg = load_config(sys.argv[1], [f'model.cache_dir="{sys.argv[2]}"',
                                f"model.warmstart_steps={sys.argv[3]}"])
warmstart_params(cfg)
"""


def run_once(config: str, steps: int, env: dict[str, str], scratch: Path) -> dict[str, float]:
    """One warm start in a child process: wall s, user s, sys s, minor faults."""
    cache = Path(tempfile.mkdtemp(dir=scratch))
    err_path = cache / "stderr"
    start = time.perf_counter()
    # stderr to a file, not a pipe: a child that prints more than a pipe holds would block
    # while this process waits for it
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, config, str(cache), str(steps)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = err_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"warm start of {config} failed ({code}): {tail}")
    return {
        "wall": wall,
        "user": usage.ru_utime,
        "sys": usage.ru_stime,
        "faults": float(usage.ru_minflt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["configs/tiny.toml", "configs/code.toml"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != TUNABLES_ENV}
    envs = {"baseline (unset)": base, "hugetlb=1": with_hugetlb(base)}
    print(f"THP: {Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}")
    print(f"warm starts of {args.steps} steps, {args.repeats} each, alternating; medians\n")
    head = f"{'config':<22} {'row':<18} {'wall s':>8} {'user s':>8} {'sys s':>8} {'CPU s':>8}"
    print(f"{head} {'faults':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for config in args.configs:
            jax_cache = scratch / f"jax-{Path(config).stem}"
            for env in envs.values():
                env["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache)
                env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
            run_once(config, 2, envs["baseline (unset)"], scratch)  # fills the JAX cache
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in envs}
            for _ in range(args.repeats):
                for name, env in envs.items():
                    runs[name].append(run_once(config, args.steps, env, scratch))
            med = {
                name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for name, rs in runs.items()
            }
            for name, m in med.items():
                cpu = m["user"] + m["sys"]
                print(
                    f"{config:<22} {name:<18} {m['wall']:>8.1f} {m['user']:>8.1f} "
                    f"{m['sys']:>8.1f} {cpu:>8.1f} {m['faults']:>11,.0f}"
                )
            b, h = med["baseline (unset)"], med["hugetlb=1"]
            print(
                f"{config:<22} {'ratio':<18} {h['wall'] / b['wall']:>8.2f} "
                f"{h['user'] / b['user']:>8.2f} {h['sys'] / b['sys']:>8.2f} "
                f"{(h['user'] + h['sys']) / (b['user'] + b['sys']):>8.2f} "
                f"{h['faults'] / b['faults']:>11.2f}"
            )
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\nall children: {usage.ru_utime + usage.ru_stime:.0f} CPU s")


if __name__ == "__main__":
    main()
