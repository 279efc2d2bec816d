"""The dashboard page (``GET /ui/``) in Debian's headless Chromium, driven by selenium
through Debian's chromedriver, against a real engine: real flows through its mixed
inbound to a loopback echo server, a selector group of two outbounds, a url_test group
probing a loopback HTTP origin, a jsonl sink. The page is checked against the engine
(queries and its event ring), never against mocks; each step saves a screenshot into
``$SPLICEWAY_SCREENSHOTS`` (or the test's tmp_path) and prints its path.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import control_config
from tests.conftest import spliceway_logs_at, wait_until
from tests.helpers.dashboard import chromium, missing_browser
from tests.helpers.servers import EchoServer, http_origin
from tests.helpers.socks import recv_exact, socks5_connect

try:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # pragma: no cover - CI installs it (the test extra)
    pass

# .ci/run installs chromium, chromium-driver and the test extra (selenium); only a
# developer's machine without them skips. CI (CI=true) fails instead of skipping.
_MISSING = missing_browser()
pytestmark = pytest.mark.skipif(
    bool(_MISSING) and not os.environ.get("CI"),
    reason=f"needs {', '.join(_MISSING)} (apt-get install chromium chromium-driver; "
    "pip install selenium)",
)

KEY_STORAGE = "spliceway.dashboard.apiKey"
KEY_ENV = "SW_TEST_DASHBOARD_KEY"
#: Long enough for a loaded CI machine; every wait polls and returns as soon as it holds.
TIMEOUT = 15.0


# -- the engine ------------------------------------------------------------------------


def dashboard_config(origin_port: int, sink_path: Path, **control: Any) -> dict[str, Any]:
    """Mixed/socks/http inbounds, two direct outbounds behind a selector (``proxy``, the
    final route) and a url_test group (``auto``) probing the loopback origin, a jsonl
    sink, the control API on a free loopback port."""
    cfg = control_config(**control)
    cfg["outbounds"] = [
        {"tag": "direct", "protocol": "direct"},
        {"tag": "direct-b", "protocol": "direct"},
        {"tag": "block", "protocol": "block"},
    ]
    cfg["outbound_groups"] = [
        {"tag": "proxy", "kind": "selector", "outbounds": ["direct", "direct-b"]},
        {
            "tag": "auto",
            "kind": "url_test",
            "outbounds": ["direct", "direct-b"],
            "url": f"http://127.0.0.1:{origin_port}/generate_204",
        },
    ]
    cfg["route"] = {"final": "proxy"}
    cfg["api"]["event_sinks"] = [{"type": "jsonl", "tag": "audit", "path": str(sink_path)}]
    return cfg


def ring(engine: Any, event_type: str) -> list[dict[str, Any]]:
    return engine.query("events", {"types": event_type})["events"]


def completed(engine: Any, flow_id: str) -> dict[str, Any] | None:
    """The record of ``flow_id``'s ``flow.completed`` in the engine's ring, if any."""
    for event in ring(engine, "flow.completed"):
        if event["payload"]["flow_id"] == flow_id:
            record: dict[str, Any] = event["payload"]["record"]
            return record
    return None


def active_ids(engine: Any) -> set[str]:
    return {r["flow_id"] for r in engine.query("flows")["active_flows"]}


def flow_to(engine: Any, port: int) -> dict[str, Any]:
    """The active flow whose target port is ``port``, once routed (waits for it)."""

    def found() -> dict[str, Any] | None:
        for record in engine.query("flows")["active_flows"]:
            if record["target"]["port"] == port and record["path"]["outbound"] is not None:
                return record  # type: ignore[no-any-return]
        return None

    record: dict[str, Any] = wait_until(found, TIMEOUT, f"a routed flow to port {port}")
    return record


def open_flow(engine: Any, echo: EchoServer) -> tuple[socket.socket, dict[str, Any]]:
    """A SOCKS5 tunnel through the mixed inbound to ``echo``, held open after a round
    trip; the flow's record as the engine lists it."""
    sock = socks5_connect(engine.listen_address("mixed-in"), "127.0.0.1", echo.port)
    sock.sendall(b"ping")
    assert recv_exact(sock, 4) == b"ping"
    return sock, flow_to(engine, echo.port)


def assert_served_under_csp(base_url: str) -> None:
    """The page and its files come with the dashboard's CSP (the page must keep to it)."""
    for name, content_type in (
        ("", "text/html"),
        ("app.js", "text/javascript"),
        ("style.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ):
        with urllib.request.urlopen(f"{base_url}/ui/{name}", timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith(content_type), name
            csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp, (name, csp)


def http_get(base_url: str, path: str, key: str | None = None) -> dict[str, Any]:
    """GET ``path`` from the control API as a plain local client (the envelope's result)."""
    request = urllib.request.Request(base_url + path)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["ok"], body
    result: dict[str, Any] = body["result"]
    return result


# -- the browser -----------------------------------------------------------------------


@pytest.fixture
def shots(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[[WebDriver, str], Path]:
    """``shot(driver, name)`` saves a PNG of the page and prints its path."""
    root = Path(os.environ.get("SPLICEWAY_SCREENSHOTS") or tmp_path / "screenshots")
    root.mkdir(parents=True, exist_ok=True)
    counter = iter(range(1, 100))

    def shot(driver: WebDriver, name: str) -> Path:
        path = root / f"{request.node.name}-{next(counter):02d}-{name}.png"
        assert driver.save_screenshot(str(path)), f"no screenshot {path}"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"screenshot: {path}")
        return path

    return shot


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    """Debian's Chromium, headless, through Debian's chromedriver (no downloads)."""
    with chromium(tmp_path / "chromium-profile", window_size="1400,2000", lang=None) as driver:
        yield driver


def wait_for(driver: WebDriver, what: str, predicate: Callable[[WebDriver], Any]) -> Any:
    """Poll ``predicate`` in the page until it is truthy (its value), failing on ``what``."""
    # Lists the page rebuilds (policy groups, events) can go stale between a lookup and
    # a read: such a poll just counts as not yet.
    wait = WebDriverWait(
        driver, TIMEOUT, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
    )
    try:
        return wait.until(predicate)
    except TimeoutException:
        status = driver.find_element(By.ID, "status").text
        raise AssertionError(f"not within {TIMEOUT} s: {what} (page status: {status!r})") from None


def find(driver: WebDriver, css: str) -> WebElement | None:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0] if found else None


def click(driver: WebDriver, css: str) -> None:
    """Click the element matching ``css`` once it is there and enabled (looked up again
    if the page rebuilt it meanwhile)."""

    def clicked(d: WebDriver) -> bool:
        element = find(d, css)
        if element is None or not element.is_enabled():
            return False
        element.click()
        return True

    wait_for(driver, f"a click on {css}", clicked)


def flow_row(driver: WebDriver, flow_id: str) -> WebElement | None:
    return find(driver, f'tr[data-flow-id="{flow_id}"]')


def cell(row: WebElement, column: str) -> str:
    return str(row.find_element(By.CSS_SELECTOR, f'td[data-col="{column}"]').text)


def page_event(driver: WebDriver, event_type: str, containing: str) -> bool:
    """Whether the page's event list has an item of ``event_type`` whose text contains
    ``containing`` (looked up in one script run: the list is rebuilt as events come)."""
    return bool(
        driver.execute_script(
            "return [...document.querySelectorAll('#events li')].some("
            "li => li.dataset.type === arguments[0] && li.textContent.includes(arguments[1]))",
            event_type,
            containing,
        )
    )


def page_text(driver: WebDriver, css: str) -> str | None:
    """The rendered text of the first element matching ``css`` (one script run)."""
    text = driver.execute_script(
        "const n = document.querySelector(arguments[0]); return n ? n.innerText : null", css
    )
    return None if text is None else str(text)


def open_page(driver: WebDriver, engine: Any) -> None:
    driver.get(f"{engine.control_url}/ui/")
    assert driver.title == "spliceway dashboard"


def wait_live(driver: WebDriver) -> None:
    wait_for(
        driver,
        "the event stream live",
        lambda d: d.find_element(By.ID, "stream-state").text == "Live",
    )


def assert_clean_console(driver: WebDriver) -> None:
    """Nothing broke in the page: no script error, no CSP violation."""
    problems = [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE"
        and ("Content Security Policy" in entry["message"] or "Uncaught" in entry["message"])
    ]
    assert not problems, problems


# -- the tests -------------------------------------------------------------------------


def test_dashboard_shows_and_steers_a_live_engine(make_engine, browser, shots, tmp_path) -> None:
    with http_origin() as origin, EchoServer() as echo:
        engine = make_engine(dashboard_config(origin[1], tmp_path / "audit.jsonl"))
        assert_served_under_csp(engine.control_url)
        open_page(browser, engine)
        wait_live(browser)

        # 1. A real flow appears with its destination, moves bytes, completes and leaves.
        sock, record = open_flow(engine, echo)
        flow_id = record["flow_id"]
        row = wait_for(browser, "the flow's row", lambda d: flow_row(d, flow_id))
        assert cell(row, "destination") == f"127.0.0.1:{echo.port}"
        assert cell(row, "inbound").splitlines()[0] == "mixed-in"
        assert cell(row, "source").startswith("127.0.0.1:")
        wait_for(
            browser,
            "the flow routed through proxy's member direct",
            lambda d: cell(row, "outbound").splitlines() == ["direct", "proxy \u203a direct"],
        )
        wait_for(
            browser,
            "the flow's 4 bytes each way",
            lambda d: (cell(row, "up"), cell(row, "down")) == ("4 B", "4 B"),
        )
        # 2 MiB more each way: the row's counters and the throughput chart follow.
        payload = os.urandom(2 * 1024 * 1024)
        sock.sendall(payload)
        assert recv_exact(sock, len(payload)) == payload
        wait_for(
            browser,
            "the flow's 2 MiB each way",
            lambda d: (cell(row, "up"), cell(row, "down")) == ("2.00 MiB", "2.00 MiB"),
        )
        wait_for(
            browser,
            "the burst in the chart",
            lambda d: "MiB/s" in d.find_element(By.ID, "rates").text,
        )
        shots(browser, "flow-open")
        sock.close()
        done = wait_until(lambda: completed(engine, flow_id), TIMEOUT, "flow.completed")
        assert done["result"]["outcome"] == "direct_relayed"
        wait_for(browser, "the completed flow leaves", lambda d: flow_row(d, flow_id) is None)
        wait_for(
            browser,
            "flow.completed in the page's events",
            lambda d: page_event(d, "flow.completed", f"127.0.0.1:{echo.port}"),
        )
        assert browser.find_element(By.ID, "flows-empty").is_displayed()
        shots(browser, "flow-completed")

        # 2. Close a held-open flow from the page: the engine completes it (manual).
        sock, record = open_flow(engine, echo)
        flow_id = record["flow_id"]
        row = wait_for(browser, "the held flow's row", lambda d: flow_row(d, flow_id))
        row.find_element(By.CSS_SELECTOR, 'button[data-testid="close-flow"]').click()
        done = wait_until(lambda: completed(engine, flow_id), TIMEOUT, "the closed flow completed")
        assert done["result"]["outcome"] == "cancelled"
        assert done["result"]["close_reason"] == "manual"
        assert flow_id not in active_ids(engine)
        sock.settimeout(TIMEOUT)
        assert sock.recv(16) == b""  # the engine closed the client's connection
        sock.close()
        wait_for(browser, "the closed flow leaves", lambda d: flow_row(d, flow_id) is None)
        wait_for(
            browser,
            "the close confirmed",
            lambda d: "Closed the flow" in d.find_element(By.ID, "status").text,
        )
        shots(browser, "flow-closed")

        # 3. Select the other member of the selector: the engine has it, the page shows
        # policy.selected, and new flows take it.
        assert http_get(engine.control_url, "/api/v1/policies/proxy")["selected"] == "direct"
        click(browser, '[data-testid="select-proxy-direct-b"]')
        wait_until(
            lambda: (
                http_get(engine.control_url, "/api/v1/policies/proxy")["selected"] == "direct-b"
            ),
            TIMEOUT,
            "GET /api/v1/policies/proxy selected direct-b",
        )
        wait_for(
            browser,
            "policy.selected in the page's events",
            lambda d: page_event(d, "policy.selected", "proxy: direct → direct-b"),
        )
        wait_for(
            browser,
            "the page showing direct-b selected",
            lambda d: page_text(d, '[data-testid="selected-proxy"]') == "direct-b",
        )
        sock, record = open_flow(engine, echo)
        assert record["path"]["outbound"]["tag"] == "direct-b"
        row = wait_for(browser, "the new flow's row", lambda d: flow_row(d, record["flow_id"]))
        wait_for(
            browser,
            "the new flow through direct-b",
            lambda d: cell(row, "outbound").splitlines()[0] == "direct-b",
        )
        shots(browser, "member-selected")
        sock.close()

        # The url_test group: members' health and latency from the startup round; a
        # probe run from the page ends in policy.probe.completed (trigger manual).
        wait_for(
            browser,
            "auto's members healthy",
            lambda d: (page_text(d, '[data-testid="policy-auto"]') or "").count("healthy") == 2,
        )
        click(browser, '[data-testid="probe-auto"]')
        wait_until(
            lambda: any(
                e["payload"]["trigger"] == "manual" for e in ring(engine, "policy.probe.completed")
            ),
            TIMEOUT,
            "a manual probe round",
        )
        wait_for(
            browser,
            "policy.probe.completed (manual) in the page's events",
            lambda d: page_event(d, "policy.probe.completed", "auto (manual)"),
        )

        # The mode switch: global through direct-b, then back to rule.
        browser.find_element(By.CSS_SELECTOR, '[data-testid="mode-global"]').click()
        Select(browser.find_element(By.ID, "mode-outbound")).select_by_value("direct-b")
        browser.find_element(By.ID, "mode-apply").click()
        wait_until(
            lambda: engine.query("config")["mode"] == {"kind": "global", "outbound": "direct-b"},
            TIMEOUT,
            "mode global via direct-b",
        )
        wait_for(
            browser,
            "the page showing mode global",
            lambda d: d.find_element(By.ID, "mode-current").text == "global → direct-b",
        )

        # The chart has samples from stats.sampled; the sink and its backlog are listed.
        wait_for(
            browser,
            "throughput samples",
            lambda d: int(d.find_element(By.ID, "chart").get_attribute("data-samples") or 0) >= 3,
        )
        backlog = wait_for(
            browser,
            "the audit sink's backlog",
            lambda d: page_text(d, 'tr[data-sink="audit"] [data-testid="sink-backlog"]'),
        )
        assert backlog.split()[0].isdigit(), backlog
        shots(browser, "mode-global")
        browser.find_element(By.CSS_SELECTOR, '[data-testid="mode-rule"]').click()
        browser.find_element(By.ID, "mode-apply").click()
        wait_until(
            lambda: engine.query("config")["mode"] == {"kind": "rule", "outbound": None},
            TIMEOUT,
            "mode rule again",
        )
        wait_for(
            browser,
            "the page showing mode rule",
            lambda d: d.find_element(By.ID, "mode-current").text == "rule",
        )
        assert_clean_console(browser)


def test_dashboard_asks_for_the_key_and_keeps_it_in_session_storage(
    make_engine, browser, shots, tmp_path, monkeypatch
) -> None:
    key = "dashboard-key-" + os.urandom(8).hex()
    monkeypatch.setenv(KEY_ENV, key)
    with http_origin() as origin, EchoServer() as echo:
        engine = make_engine(
            dashboard_config(origin[1], tmp_path / "audit.jsonl", api_key_env=KEY_ENV)
        )
        open_page(browser, engine)
        key_input = wait_for(
            browser, "the key dialog", lambda d: find(d, "#key-dialog[open] #key-input")
        )
        shots(browser, "key-asked")

        # A wrong key is refused and asked for again; nothing is kept of it.
        key_input.send_keys("not-the-key")
        browser.find_element(By.ID, "key-submit").click()
        wait_for(
            browser,
            "the wrong key refused",
            lambda d: (
                "did not accept" in d.find_element(By.ID, "key-reason").text
                and find(d, "#key-dialog[open]")
            ),
        )
        assert browser.execute_script(f"return sessionStorage.getItem('{KEY_STORAGE}')") is None

        browser.find_element(By.ID, "key-input").send_keys(key)
        browser.find_element(By.ID, "key-submit").click()
        wait_for(browser, "the dialog closed", lambda d: find(d, "#key-dialog[open]") is None)
        wait_live(browser)
        wait_for(
            browser, "the policy groups", lambda d: find(d, '[data-testid="select-proxy-direct-b"]')
        )

        # The key lives in this tab's sessionStorage only.
        assert browser.execute_script(f"return sessionStorage.getItem('{KEY_STORAGE}')") == key
        assert browser.execute_script("return window.localStorage.length") == 0
        assert browser.get_cookies() == []

        # The page works with it: a flow appears, and closing it (a command) works.
        sock, record = open_flow(engine, echo)
        row = wait_for(browser, "the flow's row", lambda d: flow_row(d, record["flow_id"]))
        assert cell(row, "destination") == f"127.0.0.1:{echo.port}"
        shots(browser, "key-given")
        row.find_element(By.CSS_SELECTOR, 'button[data-testid="close-flow"]').click()
        done = wait_until(lambda: completed(engine, record["flow_id"]), TIMEOUT, "the closed flow")
        assert done["result"]["close_reason"] == "manual"
        sock.close()
        assert http_get(engine.control_url, "/api/v1/policies/proxy", key)["selected"] == "direct"

        # Forgetting it empties the session storage and asks again.
        browser.find_element(By.ID, "forget-key").click()
        wait_for(
            browser, "the key asked for again", lambda d: find(d, "#key-dialog[open] #key-input")
        )
        assert browser.execute_script(f"return sessionStorage.getItem('{KEY_STORAGE}')") is None
        assert browser.execute_script("return window.localStorage.length") == 0
        shots(browser, "key-forgotten")
        assert_clean_console(browser)


# -- issue 25.6: first paint, member health, rules, filter, speed, log, IPC events ------


def test_first_paint_shows_empty_states_not_placeholders(make_engine, browser, shots) -> None:
    """With every API call held back (blocked in the browser), what the page paints by
    itself is each panel's empty state: no "connecting…" or "Loading…" placeholders."""
    engine = make_engine(control_config())
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/api/v1/*"]})
    open_page(browser, engine)
    # The page has run its start (the blocked calls fail and report): nothing will come.
    wait_for(
        browser,
        "the blocked API reported",
        lambda d: "cannot reach the engine" in d.find_element(By.ID, "status").text,
    )
    shots(browser, "first-paint")
    for element_id, text in (
        ("flows-empty", "No active flows."),
        ("events-empty", "No events yet."),
        ("rules-empty", "No rules yet."),
        ("logs-empty", "No log lines yet."),
    ):
        element = browser.find_element(By.ID, element_id)
        assert element.is_displayed() and element.text == text, element_id
    assert page_text(browser, '[data-testid="policies"]') == "No policy groups yet."
    assert page_text(browser, '[data-testid="sinks"]') == "No event sinks yet."
    assert browser.find_element(By.ID, "rates").text == "No samples yet."
    shown = str(browser.execute_script("return document.body.innerText")).lower()
    for placeholder in ("connecting…", "loading…", "waiting for"):
        assert placeholder not in shown, placeholder
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})


def health_dashboard_config(
    origin_port: int, dead_port: int, echo_port: int, sock_path: Path
) -> dict[str, Any]:
    """A selector ``pick`` over ``live`` and ``dead`` (a socks5 hop to a refusing port),
    which only the url_test group ``auto`` probes; a rule sending the echo port to
    ``direct-b``, one blocking ``ads``, the final route ``pick``; IPC on a tmp path."""
    cfg = control_config()
    cfg["outbounds"] = [
        {"tag": "live", "protocol": "direct"},
        {"tag": "direct-b", "protocol": "direct"},
        {"tag": "dead", "protocol": "socks5", "server": "127.0.0.1", "port": dead_port},
    ]
    cfg["outbound_groups"] = [
        {"tag": "pick", "kind": "selector", "outbounds": ["live", "dead"]},
        {
            "tag": "auto",
            "kind": "url_test",
            "outbounds": ["live", "dead"],
            "url": f"http://127.0.0.1:{origin_port}/generate_204",
        },
    ]
    cfg["rules"] = [
        {"port": [str(echo_port)], "outbound": "direct-b"},
        {"domain_keyword": ["ads"], "action": "block"},
    ]
    cfg["route"] = {"final": "pick"}
    cfg["runtime"]["log_level"] = "info"
    cfg["api"]["ipc"] = {"enabled": True, "path": str(sock_path)}
    return cfg


@pytest.fixture
def spliceway_info_logs() -> Iterator[None]:
    """Let the engine's info lines through, as ``spliceway run`` does at ``info``."""
    import logging

    with spliceway_logs_at(logging.INFO):
        yield


def rows_shown(driver: WebDriver) -> list[str]:
    """The flow ids of the flow rows the table shows."""
    ids = driver.execute_script(
        "return [...document.querySelectorAll('tr[data-testid=\"flow-row\"]')]"
        ".map(tr => tr.dataset.flowId)"
    )
    return [str(i) for i in ids]


def listed_types(driver: WebDriver) -> set[str]:
    types = driver.execute_script(
        "return [...document.querySelectorAll('#events li')].map(li => li.dataset.type)"
    )
    return {str(t) for t in types}


def type_into(driver: WebDriver, element_id: str, text: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    if text:
        box.send_keys(text)
    else:  # clear() fires no input event: the page listens to input
        driver.execute_script(
            "arguments[0].dispatchEvent(new Event('input', {bubbles: true}))", box
        )


def test_dashboard_health_rules_filter_speed_log_and_ipc_events(
    sock_path, make_engine, browser, shots, spliceway_info_logs
) -> None:
    # sock_path first: its directory is removed after the engine (make_engine) stops.
    import logging
    import threading

    from tests.helpers.upstreams import refused_port

    dead_port = refused_port()
    with http_origin() as origin, EchoServer() as echo, EchoServer() as other:
        engine = make_engine(health_dashboard_config(origin[1], dead_port, echo.port, sock_path))
        open_page(browser, engine)
        wait_live(browser)

        # Member health wherever the member appears: auto probed dead down, and the
        # selector pick, which probes nothing, shows it too.
        # Read in one script: the page re-renders the groups on every event, so an element
        # found by one call may be gone (stale) by the next.
        def member_state(group: str, name: str) -> tuple[str, str] | None:
            found = browser.execute_script(
                "const tr = document.querySelector("
                '`[data-policy-tag="${arguments[0]}"] tr[data-member="${arguments[1]}"]`);'
                "return tr ? [tr.getAttribute('data-health'), tr.innerText] : null",
                group,
                name,
            )
            return None if found is None else (found[0], found[1])

        wait_for(
            browser,
            "pick's dead member down (auto's probe)",
            lambda d: (member_state("pick", "dead") or ("", ""))[0] == "down",
        )
        dead_in_pick = member_state("pick", "dead")
        assert dead_in_pick is not None and "checked by auto" in dead_in_pick[1]
        assert (member_state("pick", "live") or ("", ""))[0] == "healthy"
        assert (member_state("auto", "dead") or ("", ""))[0] == "down"
        shots(browser, "member-health")

        # The rules view: both rules with their targets, and the final route.
        def rule_cells(rule: str) -> dict[str, str]:
            cells = browser.execute_script(
                'const tr = document.querySelector(`tr[data-rule="${arguments[0]}"]`);'
                "return tr ? Object.fromEntries([...tr.querySelectorAll('td[data-col]')]"
                ".map(td => [td.dataset.col, td.innerText])) : null",
                rule,
            )
            return dict(cells or {})

        wait_for(browser, "the rules listed", lambda d: rule_cells("1"))
        assert rule_cells("0") == {
            "condition": f"port={echo.port}",
            "target": "direct-b",
            "hits": "0",
        }
        assert rule_cells("1")["condition"] == "domain_keyword=ads"
        assert rule_cells("1")["target"] == "block"
        assert rule_cells("final")["target"] == "pick"

        # A flow the first rule routes: its row names the rule, and the rule counts it.
        sock, record = open_flow(engine, echo)
        flow_id = record["flow_id"]
        assert record["route"]["matched_rule"]["index"] == 0
        row = wait_for(browser, "the flow's row", lambda d: flow_row(d, flow_id))
        wait_for(
            browser,
            "the row's rule",
            lambda d: cell(row, "rule").splitlines() == [f"port={echo.port}", "rule #0 → direct-b"],
        )
        wait_for(browser, "rule 0 counted", lambda d: rule_cells("0").get("hits") == "1")

        # Its current speed: non-zero while bytes move, back to zero once they stop.
        stop = threading.Event()

        def pump() -> None:
            chunk = os.urandom(128 * 1024)
            for _ in range(2000):  # bounded; stopped long before
                if stop.is_set():
                    return
                sock.sendall(chunk)
                recv_exact(sock, len(chunk))

        pumping = threading.Thread(target=pump, daemon=True)
        pumping.start()
        try:
            speed = wait_for(
                browser,
                "a moving speed",
                lambda d: (
                    row.find_element(By.CSS_SELECTOR, 'td[data-col="speed"]').get_attribute(
                        "data-moving"
                    )
                    == "true"
                    and ("KiB/s" in cell(row, "speed") or "MiB/s" in cell(row, "speed"))
                    and cell(row, "speed")
                ),
            )
            assert speed.startswith("↑ ") and " ↓ " in speed, speed
            shots(browser, "flow-speed")
        finally:
            stop.set()
            pumping.join(TIMEOUT)
        assert not pumping.is_alive()
        wait_for(
            browser,
            "the speed back to zero",
            lambda d: cell(row, "speed") == "↑ 0 B/s ↓ 0 B/s",
        )

        # The filter box: a second flow (final route through pick); words narrow the rows.
        sock2, record2 = open_flow(engine, other)
        wait_for(browser, "both rows", lambda d: len(rows_shown(d)) == 2)
        type_into(browser, "flow-filter", "direct-b")
        wait_for(browser, "only the direct-b flow", lambda d: rows_shown(d) == [flow_id])
        assert browser.find_element(By.ID, "flow-count").text == "1 of 2"
        type_into(browser, "flow-filter", "final pick")
        wait_for(
            browser, "only the final-route flow", lambda d: rows_shown(d) == [record2["flow_id"]]
        )
        type_into(browser, "flow-filter", "mixed-in nothing-like-this")
        wait_for(browser, "no row", lambda d: rows_shown(d) == [])
        assert "No active flow matches" in browser.find_element(By.ID, "flows-empty").text
        shots(browser, "flow-filter")
        type_into(browser, "flow-filter", "")
        wait_for(browser, "both rows again", lambda d: len(rows_shown(d)) == 2)

        # IPC clients come and go: listed as events, never as flows, and filterable.
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(TIMEOUT)
        client.connect(str(sock_path))
        client.sendall(b'{"id": 1, "health": {}}\n')
        assert json.loads(client.makefile("rb").readline())["ok"]
        client.close()
        wait_for(
            browser,
            "ipc events listed",
            lambda d: {"ipc.connected", "ipc.disconnected"} <= listed_types(d),
        )
        assert len(rows_shown(browser)) == 2
        assert browser.find_element(By.ID, "flow-count").text == "2"
        browser.find_element(By.ID, "events-ipc").click()
        wait_for(
            browser,
            "ipc events hidden by the checkbox",
            lambda d: not listed_types(d) & {"ipc.connected", "ipc.disconnected"},
        )
        assert "policy.probe.completed" in listed_types(browser)
        browser.find_element(By.ID, "events-ipc").click()
        type_into(browser, "events-filter", "-ipc")
        wait_for(
            browser,
            "ipc events hidden by -ipc",
            lambda d: listed_types(d) and not any(t.startswith("ipc.") for t in listed_types(d)),
        )
        type_into(browser, "events-filter", "ipc")
        wait_for(
            browser,
            "only ipc events",
            lambda d: listed_types(d) == {"ipc.connected", "ipc.disconnected"},
        )
        shots(browser, "events-filtered")
        type_into(browser, "events-filter", "")

        # The engine's log: a failed flow's info line, a warning; the level choice.
        # (Whether the client sees the refusal as a SOCKS reply or a close is not the point.)
        with contextlib.suppress(OSError):
            socks5_connect(engine.listen_address("mixed-in"), "127.0.0.1", dead_port).close()
        logging.getLogger("spliceway.dashboard_test").warning("a warning for the dashboard")

        def log_lines() -> list[dict[str, str]]:
            lines = browser.execute_script(
                "return [...document.querySelectorAll('#logs li')]"
                ".map(li => ({level: li.dataset.level, text: li.innerText}))"
            )
            return [dict(line) for line in lines]

        target = f"target=127.0.0.1:{dead_port}"
        wait_for(
            browser,
            "the failed flow's log line",
            lambda d: any(target in x["text"] and x["level"] == "info" for x in log_lines()),
        )
        wait_for(
            browser,
            "the warning's log line",
            lambda d: any("a warning for the dashboard" in x["text"] for x in log_lines()),
        )
        failed = next(x for x in log_lines() if target in x["text"])
        assert "spliceway.flow" in failed["text"] and "outcome=failed" in failed["text"]
        shots(browser, "engine-log")
        Select(browser.find_element(By.ID, "logs-level")).select_by_value("warn")
        wait_for(
            browser,
            "info lines hidden at warn",
            lambda d: all(x["level"] in ("warn", "error") for x in log_lines()) and log_lines(),
        )
        sock.close()
        sock2.close()
        assert_clean_console(browser)
