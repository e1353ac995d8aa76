"""Browser tests: headless Chromium (Debian's ``chromium``, driven by Playwright through its
executable path: Playwright's own browser downloads are not used) against a real server.

The console's server runs with ``DS_AUTH__MODE=keys``, as in production: its pages must follow
streams through signed read URLs. Tests set up data through the protocol and REST API with an
API key, as any client would. A staff user logs in through the admin's login form once; each
test gets a fresh browser context with that session. Every page's JavaScript errors and
failed loads (a Content-Security-Policy violation included) fail the test that caused them.
Screenshots go to ``tmp/screenshots/`` (git-ignored, ``CONSOLE_SCREENSHOTS`` to change).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright

from tests.browser.support import create_user, log_in
from tests.conftest import ServerProcess
from tests.console import conftest as console_fixtures

# The server in keys mode and a client with a key that may do everything: tests/console's.
keys_server = console_fixtures.keys_server
ops_key = console_fixtures.ops_key
api = console_fixtures.api

VIEWPORT = {"width": 1280, "height": 900}


def chromium_path() -> str:
    path = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium")
    if not path:
        pytest.fail(
            "Chromium is not installed: `make test` installs Debian's chromium "
            "(scripts/setup-system.sh --test), or set CHROMIUM_PATH"
        )
    return path


@pytest.fixture(scope="module")
def browser(keys_server: ServerProcess) -> Iterator[Browser]:
    """Chromium, for one test module. While Playwright runs, its event loop runs in this
    thread, where Django then refuses database work: the database and server come first
    (this fixture's dependency), and the browser is gone before other modules' tests."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=["--disable-gpu"]
        )
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def staff(database_url: str) -> str:
    username = f"staff{time.time_ns()}"
    create_user(database_url, username)
    return username


@pytest.fixture(scope="module")
def session_state(
    browser: Browser, keys_server: ServerProcess, staff: str, tmp_path_factory: Any
) -> str:
    """The staff user's logged-in browser state (cookies), made once."""
    context = browser.new_context()
    page = context.new_page()
    log_in(page, keys_server.base_url, staff)
    path = tmp_path_factory.mktemp("browser") / "state.json"
    context.storage_state(path=str(path))
    context.close()
    return str(path)


class PageErrors:
    """What went wrong in a page: uncaught exceptions, console errors, failed requests."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.allowed: list[str] = []

    def allow(self, text: str) -> None:
        """A test that provokes an error says so (the browser logs a 400 page it loads)."""
        self.allowed.append(text)

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(text in e for text in self.allowed)]

    def watch(self, page: Page) -> None:
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        page.on(
            "console",
            lambda message: (
                self.errors.append(f"console.{message.type}: {message.text}")
                if message.type == "error"
                else None
            ),
        )


@pytest.fixture
def context(browser: Browser, session_state: str) -> Iterator[BrowserContext]:
    context = browser.new_context(
        storage_state=session_state,
        viewport=VIEWPORT,  # type: ignore[arg-type]
        permissions=["clipboard-read", "clipboard-write"],
    )
    yield context
    context.close()


@pytest.fixture
def page_errors() -> PageErrors:
    return PageErrors()


@pytest.fixture
def page(
    context: BrowserContext, keys_server: ServerProcess, page_errors: PageErrors
) -> Iterator[Page]:
    """A logged-in staff user's page; it fails the test if the page had errors."""
    page = context.new_page()
    page_errors.watch(page)
    page.set_default_timeout(10_000)
    yield page
    unexpected = page_errors.unexpected()
    assert not unexpected, "errors in the page:\n" + "\n".join(unexpected)
