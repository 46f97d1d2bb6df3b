"""distro-peer as a program: check the options, start the hivemind backend, train, and turn what can
go wrong into one ``error:`` line and an exit status (2 bad input, 1 the run failed, 130 Ctrl-C)."""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback

from distro_opt.cli_args import UsageError, fail, os_error_message

from .args import backend_settings, check_args, parse_args, untrusted_fraction
from .tasks import task_errors
from .training import EXIT_INTERRUPTED, train

EXIT_FAILED = 1

_GO_LOG_TIME = re.compile(r"\b\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ")  # p2pd's log prefix, in its errors


def make_backend(args):
    """The ``HivemindBackend`` the options describe (this starts the DHT and its p2p daemon)."""
    from distro_opt.comm.hivemind_backend import HivemindBackend

    return HivemindBackend(
        args.run_id,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        client_mode=args.client_mode,
        allow_peers=args.allow_peers,
        untrusted_fraction=untrusted_fraction(args),
        **backend_settings(args),
    )


def main(argv=None) -> int:
    return run(parse_args(argv))


def run(args, *, make_backend=make_backend, after_step=None) -> int:
    """Run the peer that ``args`` (from ``parse_args``) describe; returns the exit status.
    ``make_backend(args)`` starts the backend once the options are checked (a test passes one on its
    own DHT); ``after_step(step, model)`` runs after each optimizer step (see ``training.train``)."""
    configure_logging(args.verbose)
    try:
        return _run(args, make_backend, after_step)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args, make_backend, after_step) -> int:
    try:
        task = check_args(args)
    except (UsageError, ValueError, *task_errors()) as exc:
        return fail(one_line(exc))
    except OSError as exc:
        return fail(os_error_message(exc))
    errors = run_errors()
    try:
        backend = make_backend(args)
    except errors as exc:
        return failed(args, f"cannot start this peer: {one_line(exc)}" + _bootstrap_hint(exc))
    try:
        return train(args, task, backend, after_step)  # closes the backend
    except FileExistsError as exc:  # created by someone else since check_outputs
        return failed(args, f"{exc.filename} appeared while the peer ran; not overwritten")
    except errors as exc:
        return failed(args, one_line(exc))
    except OSError as exc:
        return failed(args, os_error_message(exc))


def configure_logging(verbose: bool) -> None:
    # hivemind reads its level at import time and in the DHT child, so set both before importing it
    level = "INFO" if verbose else "ERROR"
    os.environ.setdefault("HIVEMIND_LOGLEVEL", level)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("distro_opt").setLevel(logging.DEBUG if verbose else logging.WARNING)


def run_errors() -> tuple:
    """What the library raises when a run cannot go on; printed as one line, exit status 1."""
    from hivemind.p2p import P2PDaemonError

    from distro_opt.comm.hivemind_backend import HivemindBackendError

    return (HivemindBackendError, P2PDaemonError, *task_errors(), ValueError, TimeoutError)


def one_line(exc: BaseException) -> str:
    text = _GO_LOG_TIME.sub("", " ".join(str(exc).split()))
    return text or type(exc).__name__


def _bootstrap_hint(exc) -> str:
    if "bootstrap" in str(exc):
        return " (check --initial-peers: is the peer that printed them still running, and reachable?)"
    return ""


def failed(args, message: str) -> int:
    """A run-time failure: one line (the traceback too with --verbose), exit status 1."""
    if args.verbose:
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_FAILED
