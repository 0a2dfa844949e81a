"""glibc's allocator under XLA on the CPU: transparent huge pages for the workers.

A jitted train step on the CPU (the warm start's, the trainer's) takes fresh buffers from
glibc's malloc at every execution and hands them back, so the kernel faults the same
memory in again, page by page, each step: 300 warm-start steps of the default config took
5.9 million page faults here, a third of the process's CPU in the kernel (user 21 s, sys
11 s). With `glibc.malloc.hugetlb=1` (glibc 2.35 on) malloc asks for transparent huge
pages (madvise), which fault in 2 MiB at a time: 0.15 million faults, sys 3 s, the
default config's whole warm start 100 -> 63 CPU s (`ops/bench/malloc.py`,
docs/BENCHMARKS.md). The host's THP setting must allow madvise (`always` or `madvise` in
/sys/kernel/mm/transparent_hugepage/enabled; `madvise` on the development machine); where
it does not, or where glibc is older, the tunable does nothing.

`streamrl up` starts its workers with it (`with_hugetlb`), the full image sets it, `make`
exports it for the tests. A `GLIBC_TUNABLES` of the user's own that names
`glibc.malloc.hugetlb` (`=0` turns it off) is left as it is; other tunables are kept.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["HUGETLB", "TUNABLES_ENV", "with_hugetlb"]

TUNABLES_ENV = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"


def with_hugetlb(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` whose GLIBC_TUNABLES (colon-separated name=value) holds
    `glibc.malloc.hugetlb=1`, added to what is there unless it names that tunable already."""
    out = dict(env)
    tunables = [t for t in out.get(TUNABLES_ENV, "").split(":") if t]
    if not any(t.split("=", 1)[0] == HUGETLB for t in tunables):
        out[TUNABLES_ENV] = ":".join([*tunables, f"{HUGETLB}=1"])
    return out
