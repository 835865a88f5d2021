"""A fork server for worker launchers: one long-lived process that imports torch and the backends
once and forks a launcher (backends/launcher.py) for each engine core that asks, so that an
engine starts in the time its model takes to load instead of a torch import (a tiny model's
engine: 0.2-0.3 s instead of 1.3 s here). For hosts that start many engines one after another:
a test suite, a service with an engine per job.

`python -m pagedllm.backends.launcher_server SOCKET` serves at the Unix socket SOCKET; an engine
core uses it when $PAGEDLLM_LAUNCHER_SERVER names SOCKET, and starts a launcher of its own when
it cannot connect or is refused. A request is refused unless the core's environment (less
what shells and pytest set: VOLATILE_ENV), working directory, interpreter and CPU affinity are
the server's: what was read at import time (OpenMP's spin count, Triton's interpreter switch,
plugins on PYTHONPATH) must be what a launcher of the core's own would have read. The forked launcher takes the
connection as its stdin and stdout and the core's stderr (sent with the request), and is the
server's child, not the core's: it ends, with its workers, when the core closes the connection.
The socket is its owner's alone (mode 0600): a launcher runs what its core sends it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from ..core.process.local_workers import VOLATILE_ENV, launched_line, process_context

START = process_context()  # before the launcher's import adds its own settings to the environment

from . import launcher  # noqa: E402 - torch and the backends, imported once for every launcher forked here

REQUEST_LIMIT = 1 << 20
REQUEST_TIMEOUT_S = 2.0  # a core sends its request as soon as it connects


def differences(request: dict) -> list[str]:
    """What in a core's request would make a launcher forked here differ from its own."""
    env, start_env = request.get("env", {}), START["env"]
    names = {k for k in set(env) | set(start_env) if k not in VOLATILE_ENV and env.get(k) != start_env.get(k)}
    return [f"${n}" for n in sorted(names)] + [k for k, v in START.items() if k != "env" and request.get(k) != v]


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n") and len(data) < REQUEST_LIMIT:
        chunk, got, _, _ = socket.recv_fds(conn, 65536, 1)
        if not chunk:
            break
        data, fds = data + chunk, fds + got
    return json.loads(data), fds


def _become_launcher(conn: socket.socket, stderr_fd: int | None, env: dict) -> None:
    """In the forked child: the connection as stdin and stdout, the core's stderr, then the launcher."""
    conn.setblocking(True)  # the launcher's stdin and stdout block, as a pipe's would
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the launcher reaps its own workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()  # out of the server's process group: a signal to the server's group is not the core's
    os.dup2(conn.fileno(), 0)
    os.dup2(conn.fileno(), 1)
    if stderr_fd is not None:
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
    conn.close()
    os.environ.clear()
    os.environ.update(env)
    os.write(1, launched_line(os.getpid()))
    code = 1
    try:
        code = launcher.main()
    finally:
        launcher.worker.exit_now(code)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    umask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(umask)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # launchers forked here are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            conn, _ = listener.accept()
            conn.settimeout(REQUEST_TIMEOUT_S)  # a client that connects and says nothing does not stall the others
            fds: list[int] = []
            try:
                request, fds = _read_request(conn)
                refused = differences(request)
                if refused:
                    conn.sendall(f"refused {' '.join(refused[:8])}\n".encode())
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                if os.fork() == 0:
                    try:
                        listener.close()
                        _become_launcher(conn, fds[0] if fds else None, request["env"])
                    finally:
                        os._exit(1)  # never back into the server's loop
            except (OSError, ValueError, KeyError):
                pass  # a client that went away or sent garbage: it starts a launcher of its own
            finally:
                conn.close()
                for fd in fds:
                    os.close(fd)
    finally:
        listener.close()
        if os.path.exists(path):
            os.unlink(path)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pagedllm.backends.launcher_server SOCKET", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
