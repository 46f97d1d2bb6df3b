"""Test helper: run peer programs as separate process groups on 127.0.0.1 and read their status lines.

Every wait is bounded; ``Cluster`` kills every process group it started when the test ends, passed
or failed, so a failing test leaves no peer behind (a peer's DHT process and p2p daemon run in a
session of their own and end with the peer: ``comm/hivemind_process.py``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from _procs import default_sigint

STEP_LINE = re.compile(r"^step (\d+) \| loss ([0-9.eE+-]+|nan|inf) \| peers (\d+) .*\| gather_s ([0-9.]+)")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class Peer:
    """One peer process; its output is collected by a reader thread."""

    def __init__(self, name: str, argv: list[str], workdir: Path):
        self.name = name
        env = dict(os.environ, HIVEMIND_LOGLEVEL="ERROR", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        # cwd is not the repository root: comm/ must not be importable as a top-level package
        self.proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=default_sigint,  # interrupt() is Ctrl-C, also under a shell's background job
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first output line matching ``pattern``; raise (with the output) after ``timeout_s``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{self.name}: no line matching {pattern!r}:\n{self.output()}")
                self._cond.wait(min(remaining, 0.5))

    def wait_exit(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout_s} s:\n{self.output()}") from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """SIGKILL the peer's process group (a crash); its DHT process and p2p daemon end with it."""
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def interrupt(self) -> None:
        """SIGINT to the peer's process group, as Ctrl-C in a terminal sends it (its DHT process and p2p
        daemon, in a session of their own, do not get it)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def steps(self) -> list[dict]:
        out = []
        for line in list(self.lines):
            m = STEP_LINE.match(line)
            if m:
                out.append(
                    {"step": int(m[1]), "loss": float(m[2]), "peers": int(m[3]), "gather_s": float(m[4])}
                )
        return out

    def output(self, last: int | None = 60) -> str:
        return "\n".join(self.lines[-last:] if last else self.lines)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Cluster:
    """Starts peer programs in ``workdir`` (``_hm_peer.py``, or ``script`` given the same options); use
    as a context manager so all of them die at the end."""

    def __init__(self, workdir: Path, run_id: str, common: list[str]):
        self.workdir, self.run_id, self.common = Path(workdir), run_id, list(common)
        self.peers: list[Peer] = []

    def start(
        self, name: str, *extra: str, initial_peers: list[str] | None = None, script: str | None = None
    ) -> Peer:
        program = [script or str(Path(__file__).with_name("_hm_peer.py"))]
        argv = [
            sys.executable,
            *program,
            "--run-id",
            self.run_id,
            "--host-maddrs",
            LOOPBACK,
            *self.common,
            *extra,
        ]
        if initial_peers:
            argv += ["--initial-peers", *initial_peers]
        peer = Peer(name, argv, self.workdir)
        self.peers.append(peer)
        return peer

    def read_maddrs(self, path: str, timeout_s: float) -> list[str]:
        file = self.workdir / path
        deadline = time.monotonic() + timeout_s
        while not file.exists():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{file} not written within {timeout_s} s:\n" + "\n".join(p.output() for p in self.peers)
                )
            time.sleep(0.1)
        maddrs = file.read_text().split()
        assert maddrs and all(m.startswith("/ip4/127.0.0.1/") for m in maddrs), maddrs
        return maddrs

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        for peer in self.peers:
            peer.kill()
