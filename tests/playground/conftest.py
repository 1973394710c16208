"""Fixtures for the playground tests: one live server for the session, built with the server
tests' helpers (``tests/server/server_testing.py``), and Debian's chromium under Playwright.

The browser tests skip, with the reason, when the ``playwright`` package or
``/usr/bin/chromium`` is missing (``.ci/run`` installs both).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_testing import live, serve_checkpoints  # noqa: E402,F401 - fixtures

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]




@pytest.fixture(scope="module")
def browser():
    """Module-scoped: Playwright's sync API keeps an event loop running while it is open,
    which would break later tests that call ``asyncio.run``."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is not installed "
        "(pip install -e '.[test]')")
    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if executable is None:
        pytest.skip(f"no chromium at {CHROMIUM} nor on PATH (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture()
def page(browser, live):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    # Offline: any request that is not to the live server fails the test.
    outside: list[str] = []

    def route(r):
        if r.request.url.startswith(live.url):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not outside, f"the page reached outside the server: {outside}"
    assert not errors, f"JavaScript errors: {errors}"
