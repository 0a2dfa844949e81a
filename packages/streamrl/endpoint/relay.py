"""Inside an agent program's sandbox: the endpoint on 127.0.0.1, then the program (issue 31).

Run by the sandbox's own python as `python3 -I -S -c <this file> SOCKET PORT ARGV...`
(`streamrl.endpoint.command`), so it imports nothing of streamrl and only the standard
library. The sandbox has a network namespace of its own with loopback alone; the one way
out is the endpoint's unix socket, bound in at SOCKET. This relays each TCP connection to
127.0.0.1:PORT (where OPENAI_BASE_URL points) to that socket, byte for byte, runs ARGV as
its child with this process's stdin, stdout, stderr and environment, and exits with the
child's exit status (128 + N for a death by signal N). When it exits the sandbox's every
process dies with it (it is PID 1 of the sandbox's pid namespace).
"""

import contextlib
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy `src` to `dst` until `src` ends, then end `dst`'s writing half."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        conn, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
        except OSError as err:
            print(f"relay: cannot reach the endpoint: {err}", file=sys.stderr)
            conn.close()
            upstream.close()
            continue
        threading.Thread(target=_pipe, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: relay SOCKET PORT ARGV...", file=sys.stderr)
        return 2
    path, port, command = argv[0], int(argv[1]), argv[2:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    try:
        code = subprocess.run(command, check=False).returncode
    except OSError as err:
        print(f"cannot run the agent {command[0]!r}: {err}", file=sys.stderr)
        return 127
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
