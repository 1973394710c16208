"""The engine in this process as the server builds it, compiled passes ready: for
benchmarks that time decoding without a server around it.

    from inprocess import compiled_engine   # a benchmark script's own folder is on sys.path
    engine = compiled_engine(max_running=8)
"""

from __future__ import annotations

import time


def compiled_engine(max_running: int = 8, threads: int = 1):
    """An ``engine.core.Engine`` built from the server's settings (``threads`` torch threads,
    no engine process), returned once its compiled passes are loaded and its idle work
    (pass-cost tables) is done; raises if the passes could not be built -- eager passes
    are not what serves."""
    from nodraft.engine.process import build_engine, start_warm_up
    from nodraft.server.settings import Settings

    config = Settings.from_argv(["--threads", str(threads), "--max-running", str(max_running),
                                 "--engine-process", "false"]).engine_config()
    engine = build_engine(config)
    start_warm_up(engine, config)
    while not engine.compiled_ready:
        if engine.compiled_error is not None:
            raise RuntimeError(engine.compiled_error)
        time.sleep(0.2)
    while engine.idle_work():
        engine.idle()
    return engine
