"""The hivemind backend's event loop, on a thread of its own, and its client of the DHT's p2p daemon.

Every stream of the backend runs on this loop. The training thread hands it coroutines and waits for
each with a bound, so a stalled peer or daemon stalls training for at most that long.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

from hivemind.p2p import P2P, PeerID

logger = logging.getLogger(__name__)


class StreamLink:
    """An event loop thread, a p2p client bound to it, and the stream handlers registered through it."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.p2p: P2P | None = None
        self._handlers: list[str] = []  # the protocols registered here, which close() removes

    def start_loop(self) -> None:
        self._thread.start()

    def connect(self, daemon_maddr, timeout_s: float) -> None:
        # our own client of the DHT's p2p daemon, bound to our event loop (dht.replicate_p2p() caches
        # one per DHT, which a second backend on the same DHT must not share)
        self.p2p = self.call(P2P.replicate(daemon_maddr), timeout_s)

    def serve(self, handlers: dict, timeout_s: float) -> None:
        """Register each ``protocol: handler``, each within ``timeout_s``."""
        for name, handler in handlers.items():
            self.call(self.p2p.add_binary_stream_handler(name, handler), timeout_s)
            self._handlers.append(name)

    def open(self, peer: str, protocol: str):
        """A coroutine that opens a ``protocol`` stream to ``peer`` (a base58 peer id)."""
        return self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)

    def submit(self, coro) -> concurrent.futures.Future:
        """Start ``coro`` on the loop; the caller waits for the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float):
        """Run ``coro`` on the loop and wait for it at most ``timeout`` seconds."""
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self, cancel_first) -> None:
        """Run ``cancel_first()`` on the loop, remove our handlers, close our client, stop the loop
        (also after a start that failed half-way)."""
        if self._thread.is_alive():
            try:
                self.call(self._shutdown(cancel_first), 10)
            except Exception as exc:  # noqa: BLE001 - closing must not raise
                logger.debug("hivemind backend shutdown: %s", exc)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    async def _shutdown(self, cancel_first) -> None:
        cancel_first()
        for name in self._handlers:  # only ours: another backend on this DHT may serve the same run
            try:
                await asyncio.wait_for(self.p2p.remove_binary_stream_handler(name), 2)
            except Exception:  # noqa: BLE001 - the daemon may already be gone
                pass
        if self.p2p is not None:
            await self.p2p.shutdown()  # a replica: closes our client, leaves the DHT's daemon to the DHT
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        if others:
            await asyncio.wait(others, timeout=2)
