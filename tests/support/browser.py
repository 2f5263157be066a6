"""A real browser for the admin's tests: Debian's headless chromium, driven by Playwright (``page``)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connections

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture
def page(monkeypatch) -> Iterator:
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing (apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}: the browser test must run under CI")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an asyncio loop in this thread, and Django
    # then refuses ORM calls; nothing here runs concurrently with them.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            tab = browser.new_page()
            # A deadline against a hang, not a speed claim.
            tab.set_default_timeout(60_000)
            tab.problems = []
            tab.on("pageerror", lambda error: tab.problems.append(f"page error: {error}"))
            tab.on("console", lambda msg: _console_problem(tab, msg))
            yield tab
        finally:
            browser.close()
            # While the loop runs, Django keys its connections to the loop's
            # context: close the ones the test opened, or PostgreSQL keeps a
            # session on the test database and it cannot be dropped.
            connections.close_all()


def _console_problem(tab, message) -> None:
    # The browser's own /favicon.ico request is no page's doing (there is none).
    if message.type == "error" and not message.location.get("url", "").endswith("/favicon.ico"):
        tab.problems.append(f"console: {message.text} ({message.location.get('url')})")


def assert_static_served(base: str) -> None:
    """The live pane is a static file: say so plainly when /static/ serves nothing."""
    try:
        with urllib.request.urlopen(f"{base}/static/tasks_app/task_live.js", timeout=10) as reply:
            assert b"EventSource" in reply.read()
    except urllib.error.HTTPError as exc:
        pytest.fail(
            f"the server does not serve /static/ ({exc.code}); the admin needs its static files (docs/admin.md)"
        )


def login(tab, base: str, path: str) -> None:
    tab.goto(f"{base}/admin/login/?next={path}")
    tab.fill("#id_username", "operator")
    tab.fill("#id_password", "an operator password")
    tab.click("input[type=submit]")
    tab.wait_for_url(f"{base}{path}")
