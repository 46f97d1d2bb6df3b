"""A network lab of Linux namespaces: N peers joined by a bridge, each link capped with ``tbf``.

    python -m experiments.netlab --peers 2 --rate 10mbit --probe-bytes 4000000
    python -m experiments.netlab --peers 4 --rate 100mbit --nat 1 -- python3 -c "print('hi')"
    python -m experiments.netlab --help

Topology (every namespace's name starts with the lab's prefix, ``dolab-<pid>-<token>-``)::

    peer i (eth0 10.213.0.10+i) --veth-- router: bridge br0 --veth-- peer j
    NAT peer k (eth0 10.213.1.10+k) --veth-- nat: br0 10.213.1.1, MASQUERADE out of wan 10.213.0.2

Each veth pair is created with both ends inside the lab's namespaces, so nothing ever appears on
the host's own interfaces or routes. A peer's upload is capped by a ``tbf`` on its eth0, its download
by a ``tbf`` on its port in the router (or NAT) namespace. IPv6 is off inside the lab, so the kernel's
byte counters (``ip -s -j link`` inside the namespace) count the traffic the peers send and nothing
else. ``netem`` is not used: the links add no latency (see docs/netlab.md for the latency model).
Exit codes of the CLI: 0 done, 2 the lab cannot run here (one line) or bad arguments, else the
first command's own exit code.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

RATES_MBIT = {"10mbit": 10, "100mbit": 100, "1gbit": 1000, "uncapped": None}
# The headers on every packet the lab's counters count: Ethernet 14, IPv4 20, TCP 20 and the
# timestamps option Linux sends on every segment, 12. (A GSO packet, many segments long, is counted
# once with one header; the counters count it so too.)
TCP_FRAME_BYTES = 66
EXIT_CANNOT_RUN = 2
_CMD_TIMEOUT_S = 30


class LabUnavailable(RuntimeError):
    """This machine cannot build the lab (not root, no ``ip netns``, no ``tbf``, no ``iptables``)."""


class LabError(RuntimeError):
    """A command that builds or drives the lab failed (its command line and stderr in the message)."""


@dataclass(frozen=True)
class Peer:
    index: int
    namespace: str
    address: str
    behind_nat: bool


def parse_rate(text: str) -> float | None:
    """'10mbit', '100mbit', '1gbit', 'uncapped' or a number of Mbit/s -> Mbit/s (None: uncapped)."""
    if text.lower() in RATES_MBIT:
        return RATES_MBIT[text.lower()]
    try:
        mbit = float(text)
    except ValueError:
        raise ValueError(f"invalid rate: {text!r} (expected 10mbit, 100mbit, 1gbit, uncapped or Mbit/s)") from None
    if not 0.0 < mbit < 1e6:
        raise ValueError(f"invalid rate: {text!r} (Mbit/s must be positive)")
    return mbit


def _sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LabError(f"{' '.join(argv)}: no answer within {_CMD_TIMEOUT_S} s") from None
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done


def check_can_run(euid: int | None = None, nat: bool = False) -> None:
    """Raise LabUnavailable with one line naming what is missing. ``euid`` stands in for the
    process's effective user id (a test passes a non-root one)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise LabUnavailable(f"netlab needs root to create network namespaces (running as uid {euid})")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")) + ((("iptables", "iptables"),) if nat else ()):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"netlab needs `{tool}` on PATH (Debian package {package})")
    probe = f"dolab-{os.getpid()}-probe-{secrets.token_hex(3)}"
    made = _sh(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        raise LabUnavailable(f"netlab cannot create a network namespace (`ip netns add`): {made.stderr.strip()}")
    try:
        tbf = _sh(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf",
                   "rate", "10mbit", "burst", "16kb", "latency", "50ms"], check=False)
        if tbf.returncode != 0:
            raise LabUnavailable(f"netlab needs the kernel's tbf qdisc (sch_tbf): {tbf.stderr.strip()}")
    finally:
        _sh(["ip", "netns", "del", probe], check=False)


def lab_namespaces(prefix: str = "dolab-") -> list[str]:
    """The network namespaces whose names start with ``prefix`` (a lab's, or every lab's)."""
    listed = _sh(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    return [ns["name"] for ns in json.loads(listed or "[]") if ns["name"].startswith(prefix)]


def remove_namespaces(prefix: str) -> list[str]:
    """Delete the namespaces named ``prefix``* after killing the processes inside them; their veths
    go with them. Returns the names deleted."""
    if not prefix.startswith("dolab-"):
        raise ValueError(f"refusing to remove namespaces of a prefix not made by netlab: {prefix!r}")
    names = lab_namespaces(prefix)
    for name in names:
        for pid in _sh(["ip", "netns", "pids", name], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _sh(["ip", "netns", "del", name], check=False)
    return names


def remove_stale_labs() -> list[str]:
    """Delete the namespaces of labs whose creating process has ended (one killed with SIGKILL
    cannot clean up after itself); a live process's lab is left alone. Returns the names deleted."""
    gone = []
    for name in lab_namespaces("dolab-"):
        pid = name.split("-")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            gone += remove_namespaces(f"dolab-{pid}-")
    return gone


class Lab:
    """``with Lab(n=4, rate_mbit=10) as lab: lab.run(0, argv)``: builds the namespaces on entry,
    removes them on exit (also on an exception or Ctrl-C, and on SIGTERM while the lab is open in
    the main thread). ``nat``: how many of the n peers (the last ones) sit behind the NAT namespace.
    ``rate_mbit``: every peer's upload and download cap (None: uncapped)."""

    def __init__(self, n: int, rate_mbit: float | None = None, nat: int = 0, subnet: str = "10.213",
                 euid: int | None = None, mtu: int = 1500):
        if not 1 <= n <= 200:
            raise ValueError(f"invalid number of peers: {n} (1 to 200)")
        if not 0 <= nat <= n:
            raise ValueError(f"invalid number of NAT peers: {nat} (0 to {n})")
        if rate_mbit is not None and not 0.0 < rate_mbit < 1e6:
            raise ValueError(f"invalid rate: {rate_mbit} Mbit/s")
        self.n, self.nat, self.rate_mbit, self.mtu, self._euid = n, nat, rate_mbit, mtu, euid
        self.prefix = f"dolab-{os.getpid()}-{secrets.token_hex(2)}-"
        self.router = self.prefix + "r"
        self.nat_namespace = self.prefix + "nat" if nat else None
        public = n - nat
        self.peers = [Peer(i, f"{self.prefix}{i}",
                           f"{subnet}.1.{10 + i - public}" if i >= public else f"{subnet}.0.{10 + i}", i >= public)
                      for i in range(n)]
        self._subnet, self._procs, self._old_handlers = subnet, [], {}

    # -- building and tearing down -------------------------------------------------------------
    def __enter__(self) -> "Lab":
        check_can_run(self._euid, nat=self.nat > 0)
        self._catch_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the processes started in the lab, delete its namespaces, restore signal handlers."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self._procs.clear()
        remove_namespaces(self.prefix)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def _catch_sigterm(self) -> None:
        def leave(signum, frame):
            raise SystemExit(128 + signum)
        try:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, leave)
        except ValueError:  # not the main thread: the context manager's exit still cleans up
            self._old_handlers.clear()

    def _ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name])
        # no IPv6: its neighbour discovery would add bytes to the counters that no peer sent
        _sh(["ip", "netns", "exec", name, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6;"
             " echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6"])
        _sh(["ip", "-n", name, "link", "set", "lo", "up"])

    def _bridge(self, ns: str, address: str | None) -> None:
        _sh(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"])
        if address:
            _sh(["ip", "-n", ns, "addr", "add", address, "dev", "br0"])
        _sh(["ip", "-n", ns, "link", "set", "br0", "up"])

    def _wire(self, ns: str, ifname: str, hub: str, port: str, address: str) -> None:
        """A veth from ``ns``'s ``ifname`` (with ``address``) to the bridge of namespace ``hub``."""
        _sh(["ip", "-n", ns, "link", "add", ifname, "mtu", str(self.mtu), "type", "veth",
             "peer", "name", port, "mtu", str(self.mtu), "netns", hub])
        _sh(["ip", "-n", hub, "link", "set", port, "master", "br0", "up"])
        _sh(["ip", "-n", ns, "addr", "add", address, "dev", ifname])
        _sh(["ip", "-n", ns, "link", "set", ifname, "up"])

    def _build(self) -> None:
        self._ns(self.router)
        self._bridge(self.router, None)
        if self.nat_namespace:
            nat = self.nat_namespace
            self._ns(nat)
            self._bridge(nat, f"{self._subnet}.1.1/24")
            self._wire(nat, "wan", self.router, "pnat", f"{self._subnet}.0.2/24")
            _sh(["ip", "netns", "exec", nat, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            _sh(["ip", "netns", "exec", nat, "iptables", "-t", "nat", "-A", "POSTROUTING",
                 "-o", "wan", "-j", "MASQUERADE"])
        for peer in self.peers:
            self._ns(peer.namespace)
            hub = self.nat_namespace if peer.behind_nat else self.router
            self._wire(peer.namespace, "eth0", hub, f"p{peer.index}", f"{peer.address}/24")
            if peer.behind_nat:
                _sh(["ip", "-n", peer.namespace, "route", "add", "default", "via", f"{self._subnet}.1.1"])
            self.set_rate(peer.index, self.rate_mbit)

    # -- driving it ------------------------------------------------------------------------------
    def set_rate(self, i: int, rate_mbit: float | None) -> None:
        """Cap peer ``i``'s upload and download at ``rate_mbit`` (None: uncapped); callable mid-run."""
        peer = self.peers[i]
        hub = self.nat_namespace if peer.behind_nat else self.router
        for ns, dev in ((peer.namespace, "eth0"), (hub, f"p{i}")):
            if rate_mbit is None:
                _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            rate_bytes = rate_mbit * 1e6 / 8
            # burst: 2 ms of traffic, at least a few frames; queue: 100 ms of traffic beyond that
            burst = int(max(16 * 1024, 4 * self.mtu, rate_bytes * 0.002))
            limit = int(burst + rate_bytes * 0.1)
            _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                 "burst", str(burst), "limit", str(limit)])

    def argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.peers[i].namespace, *argv]

    def run(self, i: int, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside peer ``i``'s namespace to its end (kwargs go to subprocess.run)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(i, argv), timeout=timeout, **kwargs)

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside peer ``i``'s namespace; the lab kills it (its process group) on exit."""
        proc = subprocess.Popen(self.argv(i, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def counters(self, i: int) -> dict[str, int]:
        """The kernel's byte and packet counters of peer ``i``'s eth0: tx_bytes, rx_bytes, ..."""
        shown = json.loads(_sh(["ip", "-n", self.peers[i].namespace, "-s", "-j", "link", "show", "dev", "eth0"]).stdout)
        stats = shown[0]["stats64"]
        return {f"{way}_{what}": int(stats[way][what]) for way in ("tx", "rx") for what in ("bytes", "packets")}


_RECEIVER = """import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; first = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    first = time.monotonic() if first is None else first; n += len(b)
print(n, time.monotonic() - first, flush=True); c.sendall(b"k")
"""
_SENDER = """import socket, sys
n = int(sys.argv[2]); s = socket.create_connection((sys.argv[1], int(sys.argv[3])), timeout=120)
view = memoryview(bytes(1 << 20))
while n > 0:
    n -= s.send(view[:min(n, len(view))])
s.shutdown(socket.SHUT_WR); s.recv(1)
"""


def tcp_payload_bytes(counters: dict[str, int], way: str = "tx") -> int:
    """What the counter deltas ``counters`` (of ``Lab.counters``) say TCP carried one way: the bytes
    less one header per packet (``TCP_FRAME_BYTES``). Retransmits count as payload again; the longer
    options of a SYN make it a few bytes short per connection."""
    return counters[f"{way}_bytes"] - TCP_FRAME_BYTES * counters[f"{way}_packets"]


def transfer(lab: Lab, src: int, dst: int, nbytes: int, timeout: float = 120) -> dict:
    """Send ``nbytes`` over TCP from peer ``src`` to peer ``dst`` (plain Python sockets); returns the
    bytes received, the receiver's seconds from first byte to end, and each side's counter deltas."""
    before = (lab.counters(src), lab.counters(dst))
    rx = lab.popen(dst, [sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([rx.stdout], [], [], timeout)
    port = rx.stdout.readline().strip() if ready else ""  # it listens before it prints its port
    if not port:
        raise LabError(f"the receiver in peer {dst} did not start (exit code {rx.wait(timeout=10)})")
    sent = lab.run(src, [sys.executable, "-c", _SENDER, lab.peers[dst].address, str(nbytes), port], timeout=timeout)
    if sent.returncode != 0:
        raise LabError(f"the sender in peer {src} failed: {sent.stderr.strip()}")
    got, seconds = rx.communicate(timeout=timeout)[0].split()
    after = (lab.counters(src), lab.counters(dst))
    src = {k: after[0][k] - before[0][k] for k in after[0]}
    return {"bytes": int(got), "seconds": float(seconds), "src_tx_bytes": src["tx_bytes"],
            "dst_rx_bytes": after[1]["rx_bytes"] - before[1]["rx_bytes"], "src_tx_payload": tcp_payload_bytes(src)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.netlab", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=2, help="number of peer namespaces (default 2)")
    parser.add_argument("--rate", default="uncapped", help="cap of every link: 10mbit, 100mbit, 1gbit, uncapped or Mbit/s")
    parser.add_argument("--nat", type=int, default=0, help="how many peers (the last) sit behind a NAT namespace")
    parser.add_argument("--change-after", type=float, default=None, metavar="S",
                        help="after S seconds, set every link to --change-to")
    parser.add_argument("--change-to", default=None, metavar="RATE")
    parser.add_argument("--probe-bytes", type=int, default=0, help="send this many bytes from peer 0 to peer 1 and report")
    parser.add_argument("--remove-stale", action="store_true",
                        help="only delete the namespaces left by labs whose process has ended (killed with SIGKILL)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: a command run in every peer at once; {i}, {addr}, {addr0} are replaced")
    args = parser.parse_args(argv)
    try:
        rate = parse_rate(args.rate)
        change = parse_rate(args.change_to) if args.change_to else None
        if (args.change_after is None) != (args.change_to is None):
            raise ValueError("--change-after and --change-to go together")
        if args.remove_stale:
            check_can_run()
            print(json.dumps({"removed": remove_stale_labs()}))
            return 0
        with Lab(n=args.peers, rate_mbit=rate, nat=args.nat) as lab:
            return _drive(lab, args, change)
    except (ValueError, LabUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except LabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _drive(lab: Lab, args, change: float | None) -> int:
    for p in lab.peers:
        print(json.dumps({"peer": p.index, "namespace": p.namespace, "address": p.address, "behind_nat": p.behind_nat}), flush=True)
    if args.probe_bytes:
        print(json.dumps({"probe": transfer(lab, 0, 1, args.probe_bytes)}))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    code, start = 0, time.monotonic()
    if command:
        procs = [lab.popen(p.index, [a.format(i=p.index, addr=p.address, addr0=lab.peers[0].address) for a in command])
                 for p in lab.peers]
        while any(p.poll() is None for p in procs):
            if args.change_after is not None and time.monotonic() - start >= args.change_after:
                for p in lab.peers:
                    lab.set_rate(p.index, change)
                print(json.dumps({"rate_changed_to_mbit": change, "after_s": round(time.monotonic() - start, 3)}))
                args.change_after = None
            time.sleep(0.05)
        code = next((p.returncode for p in procs if p.returncode), 0)
    for p in lab.peers:
        print(json.dumps({"peer": p.index, **lab.counters(p.index)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
