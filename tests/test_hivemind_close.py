"""Closing a HivemindBackend: what a waiting gather, a second close and a late gather see (127.0.0.1)."""

import logging
import threading
import time

import pytest

pytest.importorskip("hivemind")

from distro_opt.comm.hivemind_backend import HivemindBackendError  # noqa: E402


import _hm_local as local  # noqa: E402
group, filled = local.group, local.filled
pytestmark = pytest.mark.timeout(60)


dhts = local.dhts_fixture(2)


def test_a_gather_waiting_when_the_backend_closes_raises_backend_closed(dhts):
    # b never gathers: a waits for its payload until a's gather deadline (5 s), unless closed first
    with group(dhts, n=2, options={0: {"step_timeout_s": 10.0}}) as (a, b):
        outcome = {}

        def waiter():
            t0 = time.monotonic()
            try:
                a.all_gather(filled(1))
                outcome["error"] = None
            except Exception as exc:  # noqa: BLE001 - the test looks at what came out
                outcome["error"] = exc
            outcome["s"] = time.monotonic() - t0

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        time.sleep(0.5)
        a.close()
        thread.join(10)
        assert isinstance(outcome["error"], HivemindBackendError), repr(outcome["error"])
        assert str(outcome["error"]) == "backend closed" and outcome["s"] < 2.0


def test_close_twice_is_quiet_and_a_gather_after_close_changes_nothing(dhts, caplog):
    with group(dhts, n=1) as (a,):
        a.close()
        caplog.clear()
        caplog.set_level(logging.WARNING)
        a.close()
        assert [r.getMessage() for r in caplog.records] == []
        with pytest.raises(HivemindBackendError, match="backend closed"):
            a.all_gather(filled(1))
        assert a.step == 0 and a.membership.step == 0


def test_stream_handlers_cancelled_by_close_print_no_asyncio_errors(dhts, caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    with group(dhts, n=2) as (a, b):
        local.gather([(a, filled(1))])  # b never gathers: a's stream to b still waits when b closes
    assert [r.getMessage()[:40] for r in caplog.records if r.name == "asyncio"] == []
