"""Train a config's warm start into a model cache ahead of the tests that need it.

`make test` runs this beside ruff and mypy for the default config, into the tests'
persistent model cache (tests/helpers.model_cache_dir): the end-to-end tests and the compose
stack's seeding then read it. On 2 cores it saves little wall time (measured: the warm start
took 293 s under contention and the first end-to-end test waited for it; the suite is
CPU-bound, this moves the work earlier rather than removing it). The cache key and file lock are
streamrl.trainer.warmstart's own, so a test that starts while this still trains waits for
it and reads its result, as a rollout worker waits for its trainer.

    python ops/prewarm.py CONFIG CACHE_DIR
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    config, cache_dir = sys.argv[1], sys.argv[2]
    from streamrl.config import load_config
    from streamrl.trainer.warmstart import cache_path, warmstart_params
    from streamrl_workers.cli import keep_torch_out

    keep_torch_out()
    cfg = load_config(config, [f'model.cache_dir="{cache_dir}"'])
    if cfg.model.init != "warmstart":
        print(f"prewarm: {config} has model.init = {cfg.model.init!r}: nothing to train")
        return 0
    start = time.perf_counter()
    warmstart_params(cfg)
    print(f"prewarm: {cache_path(cfg)} ready in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
