"""Headless Chromium for the dashboard's browser tests, through Playwright's sync API. Registered for
every test directory by tests/conftest.py (pytest_plugins).

- `browser`: one Chromium per test module: Debian's, at CHROMIUM (`make test` installs it when missing;
  Playwright's own browser download is not used).
- `page`: a fresh context (its own cookies and storage) per test, VIEWPORT in size; a test fails if
  the page throws an uncaught JavaScript error.
- `screenshot_dir`: `<repo>/test-output/<test name>/`, made empty for the test's screenshots.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    # Without these Chromium keeps calling out for updates, sync and field trials, which a closed
    # network answers with timeouts.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1400, "height": 1000}


@pytest.fixture(scope="module")
def browser():
    # Module-scoped: while Playwright's sync API is open, its event loop counts as the thread's running
    # loop, and the tests after it that call asyncio.run would fail.
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT)
    errors: list[str] = []
    try:
        tab = context.new_page()
        tab.on("pageerror", lambda error: errors.append(str(error)))
        yield tab
    finally:
        context.close()
    assert not errors, f"the page threw: {errors}"


@pytest.fixture
def screenshot_dir(request) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    path = Path(request.config.rootpath) / "test-output" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
