"""The hivemind backend's settings, checked before anything starts, and the DHT options they imply."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .hivemind_membership import check_heartbeat

VOTE_FRACTION = 0.8  # votes are awaited until 0.8 of the step deadline; the rest lets the last ones arrive
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Settings:
    """What every part of one backend reads and none changes (``HivemindBackend`` documents each)."""

    run_id: str
    client_mode: bool
    step_timeout_s: float
    gather_fraction: float
    exclude_s: float
    max_peers: int
    max_state_nbytes: int
    state_timeout_s: float
    startup_timeout_s: float
    untrusted_fraction: float = 0.0

    def protocol(self, name: str) -> str:
        """The libp2p protocol of this run's ``name`` streams (``gather`` or ``state``)."""
        return f"distro/{self.run_id}/{name}"


def check_settings(
    run_id, *, step_timeout_s, gather_fraction, exclude_s, heartbeat_s, ttl_s, max_peers,
    max_state_nbytes, state_timeout_s, startup_timeout_s, untrusted_fraction=0.0,
) -> None:
    """Refuse bad settings before anything starts: a refusal after the DHT started would leak it."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ValueError(f"Invalid run_id: {run_id!r} (1-64 characters of A-Z a-z 0-9 _ . -)")
    if not 0 < gather_fraction < VOTE_FRACTION:
        raise ValueError(f"Invalid gather_fraction: {gather_fraction!r} (expected in (0, {VOTE_FRACTION}))")
    check_heartbeat(heartbeat_s, ttl_s)
    for name, seconds in (
        ("step_timeout_s", step_timeout_s),
        ("state_timeout_s", state_timeout_s),
        ("startup_timeout_s", startup_timeout_s),
    ):
        if not seconds > 0:
            raise ValueError(f"Invalid {name}: {seconds!r} (expected a number of seconds > 0)")
    if isinstance(untrusted_fraction, bool) or not (
        isinstance(untrusted_fraction, (int, float)) and 0.0 <= untrusted_fraction < 0.5
    ):
        raise ValueError(f"Invalid untrusted_fraction: {untrusted_fraction!r} (expected in [0, 0.5))")
    if not exclude_s >= 0:
        raise ValueError(f"Invalid exclude_s: {exclude_s!r} (expected a number of seconds >= 0)")
    for name, count, least in (("max_peers", max_peers, 1), ("max_state_nbytes", max_state_nbytes, 0)):
        if not isinstance(count, int) or isinstance(count, bool) or count < least:
            raise ValueError(f"Invalid {name}: {count!r} (expected an int >= {least})")


def dht_options(host_maddrs, dht_kwargs: dict | None) -> dict:
    """``dht_kwargs``, plus ``nat_port_map=False`` when every listen address is a loopback one.

    libp2p's NAT port mapping otherwise probes the local network (UPnP M-SEARCH to 239.255.255.250,
    NAT-PMP to the gateway) even for a peer that listens on 127.0.0.1 only and has nothing to map.
    """
    options = dict(dht_kwargs or {})
    if all(is_loopback_maddr(m) for m in host_maddrs):
        options.setdefault("nat_port_map", False)
    return options


def is_loopback_maddr(maddr) -> bool:
    """Whether a multiaddr such as ``/ip4/127.0.0.1/tcp/0`` names a loopback address."""
    parts = str(maddr).split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False
