"""Test helper: a process that owns a HivemindBackend (and so a DHT process and a p2p daemon), for
the tests of how that DHT process takes signals and its owner's death.

    python _hm_owner.py RUN_ID INITIAL_PEER

Prints ``ready <peer id> <DHT process id>``, then idles until Ctrl-C (SIGINT), after which it leaves
the run, prints ``left``, waits for a line on stdin and closes the backend.
"""

from __future__ import annotations

import sys
import time

from distro_opt.comm.hivemind_backend import HivemindBackend


def main() -> int:
    run_id, initial_peer = sys.argv[1:]
    # ttl_s: its leave stays readable for 8 s
    backend = HivemindBackend(run_id, initial_peers=[initial_peer], heartbeat_s=0.5, ttl_s=8.0)
    try:
        backend.wait_for_peers(0, 0)  # announce this peer active
        print("ready", backend.peer_id, backend.dht.pid, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            backend.leave()
            print("left", flush=True)
            sys.stdin.readline()  # the test looks at the DHT process and its daemon, then lets us close
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
