"""What the sandbox proxy costs a tool call: the real container sandbox through
`streamrl sandbox-proxy` against the same sandbox on the engine's own socket.

    DOCKER_HOST=unix:///run/streamrl-podman.sock CONTAINERS_CONF=/etc/streamrl/containers.conf \\
      .venv/bin/python ops/bench/sandbox_proxy.py [--calls 50]

Needs a container engine (ops/sandbox/setup_host.sh). Direct and proxied calls alternate, so
load on a shared machine hits both alike; the table gives the median and p90 of each, and
the median of the per-pair ratios (proxy / direct). A call is `print(1)` in the sandbox's
Python (exec create, exec start with stdin attached, exec inspect); a ping is one request.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from streamrl.tools.containers import ContainerConfig, ContainerSandbox


def start_proxy(upstream: str, sock: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "streamrl_workers.cli", "sandbox-proxy"]
    proc = subprocess.Popen(
        [*argv, "--upstream", upstream, "--listen", f"unix://{sock}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the proxy did not start")
        time.sleep(0.05)
    return proc


def row(name: str, direct: list[float], proxy: list[float]) -> str:
    def ms(xs: list[float], q: float) -> float:
        return 1000 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    ratio = statistics.median(p / d for p, d in zip(proxy, direct, strict=True))
    return (
        f"| {name} | {ms(direct, 0.5):.2f} | {ms(direct, 0.9):.2f} | {ms(proxy, 0.5):.2f} | "
        f"{ms(proxy, 0.9):.2f} | {ratio:.2f}x |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=50, help="calls (and pings) per path")
    args = ap.parse_args()
    upstream = os.environ.get("DOCKER_HOST", "")
    if not upstream.startswith("unix://"):
        raise SystemExit("set DOCKER_HOST to the engine's unix socket")
    ns = f"bench{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_proxy(upstream, Path(tmp) / "docker.sock")
        paths = {"direct": upstream, "proxy": f"unix://{Path(tmp) / 'docker.sock'}"}
        boxes = {
            k: ContainerSandbox(ContainerConfig(namespace=ns, docker_host=url))
            for k, url in paths.items()
        }
        calls: dict[str, list[float]] = {k: [] for k in paths}
        pings: dict[str, list[float]] = {k: [] for k in paths}
        try:
            for box in boxes.values():
                box.start()
                box.exec(["python3", "-c", "print(1)"], b"", 10.0, 4096)  # warm
            for _ in range(args.calls):
                for via, box in boxes.items():
                    t = time.perf_counter()
                    out = box.exec(["python3", "-c", "print(1)"], b"", 10.0, 4096)
                    calls[via].append(time.perf_counter() - t)
                    assert out.stdout == b"1\n", out
                    t = time.perf_counter()
                    box.client.api.ping()
                    pings[via].append(time.perf_counter() - t)
        finally:
            for box in boxes.values():
                box.close()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=10)
    print(f"sandbox proxy overhead, {args.calls} alternating calls per path (ms)\n")
    print("| request | direct p50 | direct p90 | proxy p50 | proxy p90 | proxy/direct |")
    print("|---|---:|---:|---:|---:|---:|")
    print(row("tool call (print(1))", calls["direct"], calls["proxy"]))
    print(row("ping", pings["direct"], pings["proxy"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
