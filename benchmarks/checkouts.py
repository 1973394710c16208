"""Run another checkout of this repository with this interpreter: for A/B benchmarks.

    from checkouts import checkout_env   # a benchmark script's own folder is on sys.path
    env = checkout_env("/tmp/old")       # git worktree add /tmp/old <commit>
    subprocess.Popen([sys.executable, "-m", "nodraft.server.cli", "serve"], env=env)

The project installs as the ``nodraft`` namespace (``nodraft.server`` is the repository's
``server/`` folder, and so on: pyproject's package-dir mapping). An editable install
answers for ``nodraft.*`` from ITS checkout whatever the working directory is, so running
``python -m nodraft...`` inside another checkout would run this one's code. The
environment made here puts a folder first on ``PYTHONPATH`` whose ``nodraft/`` links to
the other checkout's folders: imports find it before the editable finder is asked. It
also gives the checkout a ``TORCH_EXTENSIONS_DIR`` of its own (keyed by its path), so the
two checkouts' builds of nodraft's kernels -- one extension name, two sources -- never
share a build folder.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

PACKAGES = ("micro", "drafters", "engine", "server", "clients")


def checkout_env(checkout: str | os.PathLike, base: dict | None = None) -> dict:
    """An environment (``base``, default this process's) whose ``python -m nodraft...``
    runs ``checkout``'s code."""
    checkout = Path(checkout).resolve()
    shim = Path(tempfile.mkdtemp(prefix="nodraft-checkout-")) / "nodraft"
    shim.mkdir()
    for name in PACKAGES:
        if (checkout / name).is_dir():
            (shim / name).symlink_to(checkout / name)
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(shim.parent), *filter(None, [env.get("PYTHONPATH")])])
    key = hashlib.sha1(str(checkout).encode()).hexdigest()[:10]
    env["TORCH_EXTENSIONS_DIR"] = str(Path(tempfile.gettempdir()) / f"nodraft-extensions-{key}")
    return env


def imported_from(env: dict, module: str = "nodraft.server.cli") -> Path:
    """Where ``module`` is imported from under ``env`` (to check a shim took)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"],
                         env=env, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).resolve()
