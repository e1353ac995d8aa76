"""What the browser tests share: users, logging in, screenshots, waiting."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Page

from tests.conftest import ROOT, command_env, manage

PASSWORD = "console-tests-correct-horse"
SCREENSHOTS = Path(os.environ.get("CONSOLE_SCREENSHOTS") or ROOT / "tmp" / "screenshots")


def create_user(database_url: str, username: str, *, superuser: bool = True) -> None:
    if superuser:
        result = manage(
            database_url, "createsuperuser", "--noinput", "--username", username,
            "--email", f"{username}@example.com",
            env=command_env(database_url, DJANGO_SUPERUSER_PASSWORD=PASSWORD),
        )  # fmt: skip
    else:
        script = (
            "from django.contrib.auth import get_user_model;"
            f"get_user_model().objects.create_user({username!r}, password={PASSWORD!r})"
        )
        result = manage(database_url, "shell", "-c", script)
    assert result.returncode == 0, result.stderr


def log_in(page: Page, base_url: str, username: str, next_path: str = "/console/") -> None:
    """Through the admin's login form, as a person does."""
    page.goto(f"{base_url}/admin/login/?next={next_path}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base_url}{next_path}")


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
