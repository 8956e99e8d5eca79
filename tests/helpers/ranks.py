"""Start a command as several ranks of an mlx.distributed ring on this machine: free loopback
ports, a bounded wait, each rank's own output, and every process ended at the end."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Rank:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str

    def results(self) -> list[dict]:
        """The JSON objects it printed, one a line."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def describe(self) -> str:
        return f"rank {self.rank} (exit {self.returncode}):\n{self.stdout[-2000:]}\n{self.stderr[-3000:]}"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def hostfile(path: Path, n: int) -> Path:
    """A ring hostfile of ``n`` ranks on 127.0.0.1 (mlx.launch's format: one address list per rank)."""
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def start(n: int, argv: list[str], tmp: Path, env: dict | None = None) -> list[subprocess.Popen]:
    """Start ``argv`` as ranks 0..n-1 of one ring, each with its output in ``tmp``."""
    hosts = hostfile(tmp / "hosts.json", n)
    procs = []
    for r in range(n):
        rank_env = {**os.environ, **(env or {}), "MLX_HOSTFILE": str(hosts), "MLX_RANK": str(r),
                    "PYTHONUNBUFFERED": "1"}  # fmt: skip
        out, err = open(tmp / f"rank{r}.out", "w"), open(tmp / f"rank{r}.err", "w")
        # Its own process group, so that ending it ends whatever it started.
        procs.append(subprocess.Popen(argv, env=rank_env, stdout=out, stderr=err, cwd=ROOT, start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], tmp: Path, timeout: float) -> list[Rank]:
    """Wait up to ``timeout`` seconds for every rank, then end those still running."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    stop(procs)
    return [
        Rank(r, p.returncode, (tmp / f"rank{r}.out").read_text(), (tmp / f"rank{r}.err").read_text())
        for r, p in enumerate(procs)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(n: int, argv: list[str], tmp: Path, timeout: float = 60.0, env: dict | None = None) -> list[Rank]:
    """Run ``argv`` on ``n`` ranks to the end (at most ``timeout`` seconds).

    A job whose every rank was still running at the deadline having printed nothing is run once more, on fresh
    ports: on a loaded machine running tests in parallel, a ring has been seen to stall this way (a port chosen
    here can be taken before its rank binds it) and not again. A job that stalls twice is returned as it is."""
    ranks = finish(start(n, argv, tmp, env), tmp, timeout)
    if all(r.returncode == -signal.SIGKILL and not r.stdout for r in ranks):
        ranks = finish(start(n, argv, tmp, env), tmp, timeout)
    return ranks


def python(*args: str) -> list[str]:
    return [sys.executable, *args]
