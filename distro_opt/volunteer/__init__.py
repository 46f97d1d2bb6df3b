"""The volunteer program, ``distro-peer``: join (or start) a run over hivemind and train its own data
shard with DisTrO-AdamW.

    distro-peer --run-id demo --steps 200                                  # first peer; prints maddrs
    distro-peer --run-id demo --initial-peers /ip4/.../p2p/... --join --shard 1

(``python -m distro_opt.volunteer`` is the same program.) Each step prints
``step | loss | peers | sent_bytes | recv_bytes | gather_s``. Peers that started together begin from
the same seed; a ``--join`` peer downloads parameters and optimizer state from a live peer first.
Every ``--checksum-every`` steps peers publish a checksum of their parameters in the DHT; a peer that
does not hold the checksum the reports choose (the most reported; the lowest between equals) reloads
state from a peer that does.

Preset ``synthetic`` (default, no download): an MLP learns a fixed random teacher network; each
shard draws its own inputs. The teacher is the same for every peer, so the loss falls for all.
Any ``experiments.presets`` name (e.g. ``smoke``) trains that preset's transformer on its cached
corpus instead, shard ``--shard`` of ``--num-shards``.

Exit status: 0 when done; 2 for bad input (one ``error:`` line; everything is checked before the
DHT starts, and no file is written); 1 when the run fails (an initial peer unreachable, no peer to
serve state to a ``--join``, ...: one ``error:`` line, ``--verbose`` adds the traceback); 130 on Ctrl-C (one line; the peer leaves the run at once and
still writes ``--out``, marked ``"interrupted": true``).

Modules: ``args`` (options and their checks), ``tasks`` (what is trained), ``training`` (the loop
and the replica guard), ``outputs`` (the files it writes), ``program`` (``main`` and ``run``).
"""

from .args import parse_args
from .program import main, run

__all__ = ["main", "parse_args", "run"]
