"""``nodraft serve``'s entry: the engine process first, then this process's own imports.

The engine's start -- its interpreter, torch, the checkpoints, the compiled graphs -- is
the long one; this process's imports (FastAPI, pydantic, the drafters' modules) take a few
seconds of their own. So ``main`` reads the settings (nothing here imports torch), starts
the engine process (``engine.launch``), pins this process to its own core, and only then
imports the application (``server.app``), which takes the running engine over: the two
starts overlap. Stopped before the application's own signal handling is in place (SIGTERM
or Ctrl-C while it imports), it stops the engine and frees its sockets on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from pydantic import ValidationError

from nodraft.server.settings import Settings


def main(argv: list[str] | None = None) -> None:
    try:
        settings = Settings.from_argv(argv)
    except ValidationError as e:
        sys.exit(f"nodraft serve: {e}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s: %(message)s")
    launched = None
    api_cores = settings.cores()[1]  # before pinning, which would change the answer
    # stopped before uvicorn's own handlers (the drain) are in place: stop the engine too
    signal.signal(signal.SIGTERM, _exit)
    try:
        if settings.engine_process:
            from nodraft.engine.launch import launch

            # a signal now would come between the launch and the name that frees it
            stops = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
            try:
                launched = launch(settings.engine_config())
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, stops)  # delivered here, if sent
        if api_cores:  # the engine process has cores of its own; the event loop keeps this
            os.sched_setaffinity(0, api_cores)
        from nodraft.server.app import serve

        serve(settings, launched=launched)
    finally:
        if launched is not None:
            launched.close()  # a no-op once the application took it over
        elif not settings.engine_process:  # the engine's warm-up ran here: its compilers
            from nodraft.engine.launch import stop_children  # (an engine process stops its own)

            stop_children()


STOPS = {signal.SIGINT, signal.SIGTERM}


def _exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
