# ruff: noqa: E501, RUF001 (the files are written as subscriptions write them: long flow lines, full-width punctuation in names)
"""Realistic Clash/mihomo files for the importer's tests, written the way people's files are.

- :func:`subconverter_file`: what subconverter emits for an airport subscription with an
  ACL4SSR-style ruleset expanded inline: emoji groups (``🚀 节点选择``, ``♻️ 自动选择``
  url-test, ``🎯 全球直连``, ``🛑 全球拦截``, ``🐟 漏网之鱼``...), thousands of
  ``DOMAIN-SUFFIX``/``DOMAIN-KEYWORD``/``DOMAIN``/``IP-CIDR,...,no-resolve`` lines
  generated deterministically, ``GEOIP,CN`` and ``MATCH``.
- :func:`provider_file`: the hand-written style: ``proxy-providers`` (a ``file`` one the
  test writes, an ``http`` one, an ``inline`` one), ``rule-providers``, groups with
  ``use:`` and ``filter:``.
- :func:`mixed_file`: supported and unsupported proxy types and plugins side by side.

Every proxy points at a local upstream (microsocks, ss-server, tinyproxy) or at a port
that refuses; nothing reaches the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway.routing import geodata

#: Targets the generated rules cycle through.
GENERATED_TARGETS = ("🎯 全球直连", "🛑 全球拦截", "🚀 节点选择", "🐟 漏网之鱼", "Ⓜ️ 微软服务")


@dataclass
class Upstreams:
    """Ports of the local upstreams (and of a port that refuses connections)."""

    socks: int
    ss: int
    http: int
    refused: int
    origin: int
    ss_method: str = "aes-256-gcm"
    ss_password: str = "no"


@dataclass
class Generated:
    """The generated rule lines and, for each target, sample hosts they match."""

    lines: list[str] = field(default_factory=list)
    suffix_samples: dict[str, list[str]] = field(default_factory=dict)
    keyword_samples: dict[str, list[str]] = field(default_factory=dict)
    domain_samples: dict[str, list[str]] = field(default_factory=dict)
    cidr_samples: dict[str, list[str]] = field(default_factory=dict)


def generated_rules(count: int) -> Generated:
    """``count`` rule lines of four kinds in turn, targets cycling (deterministic)."""
    out = Generated()
    for i in range(count):
        target = GENERATED_TARGETS[(i // 4) % len(GENERATED_TARGETS)]
        kind = i % 4
        if kind == 0:
            out.lines.append(f"DOMAIN-SUFFIX,s{i}.example,{target}")
            out.suffix_samples.setdefault(target, []).append(f"www.s{i}.example")
        elif kind == 1:
            out.lines.append(f"DOMAIN-KEYWORD,kw{i}x,{target}")
            out.keyword_samples.setdefault(target, []).append(f"a-kw{i}x-b.test")
        elif kind == 2:
            out.lines.append(f"DOMAIN,d{i}.example.org,{target}")
            out.domain_samples.setdefault(target, []).append(f"d{i}.example.org")
        else:
            a, b = divmod(i, 256)
            # Loopback networks: a connection there is refused at once, never hangs.
            out.lines.append(f"IP-CIDR,127.{a % 250 + 2}.{b}.0/24,{target},no-resolve")
            out.cidr_samples.setdefault(target, []).append(f"127.{a % 250 + 2}.{b}.9")
    return out


def _head(
    *,
    dns_port: int | None,
    ports: bool,
    listener: bool,
    log_level: str = "info",
) -> str:
    lines = []
    if ports:
        lines += ["port: 7890", "socks-port: 7891", "allow-lan: true"]
    else:
        lines += ["allow-lan: false", "bind-address: 127.0.0.1"]
    lines += [
        "mode: Rule",
        f"log-level: {log_level}",
        "ipv6: false",
        "external-controller: 127.0.0.1:0" if not ports else "external-controller: :9090",
        # mihomo offline: no geodata download, no process lookup, nothing stored.
        "geo-auto-update: false",
        "find-process-mode: off",
        "unified-delay: true",
        "profile: {store-selected: false, store-fake-ip: false}",
    ]
    if listener:
        lines += [
            "listeners:",
            "  - {name: mixed-in, type: mixed, listen: 127.0.0.1, port: 0}",
        ]
    if dns_port is not None:
        server = f"udp://127.0.0.1:{dns_port}"
        lines += [
            "dns:",
            "  enable: true",
            "  ipv6: false",
            "  enhanced-mode: redir-host",
            f"  default-nameserver: ['{server}']",
            f"  nameserver: ['{server}']",
        ]
    else:
        lines += [
            "dns:",
            "  enable: true",
            "  listen: 0.0.0.0:1053",
            "  enhanced-mode: fake-ip",
            "  fake-ip-range: 198.18.0.1/16",
            "  fake-ip-filter: ['*.lan', localhost.ptlogin2.qq.com]",
            "  default-nameserver: [223.5.5.5, 119.29.29.29]",
            "  nameserver: ['https://doh.pub/dns-query', 'tls://223.5.5.5:853', 114.114.114.114]",
        ]
    return "\n".join(lines) + "\n"


def subconverter_file(
    up: Upstreams,
    *,
    rule_count: int = 3000,
    dns_port: int | None = None,
    ports: bool = True,
    listener: bool = False,
    extra_head_rules: tuple[str, ...] = (),
    geoip: bool = True,
    extra_yaml: str = "",
) -> tuple[str, Generated]:
    """A subconverter-style file (see the module) and its generated rules."""
    gen = generated_rules(rule_count)
    probe = f"http://127.0.0.1:{up.origin}/generate_204"
    text = _head(dns_port=dns_port, ports=ports, listener=listener)
    text += f"""proxies:
  - {{name: 🇭🇰 香港 01, server: 127.0.0.1, port: {up.socks}, type: socks5, udp: true}}
  - {{name: 🇯🇵 日本 01, server: 127.0.0.1, port: "{up.ss}", type: ss, cipher: {up.ss_method}, password: {up.ss_password}, udp: true}}
  - {{name: 🇸🇬 新加坡 01, server: 127.0.0.1, port: {up.http}, type: http}}
  - {{name: 🇹🇼 台湾 01, server: 127.0.0.1, port: {up.refused}, type: socks5}}
  - {{name: 🇺🇸 美国 01, server: 127.0.0.1, port: {up.refused}, type: vmess, uuid: 2f0b8f3e-1d5c-4a8f-9e3b-7a6c5d4e3f21, alterId: 0, cipher: auto, udp: true}}
  - {{name: 🇰🇷 韩国 01, server: 127.0.0.1, port: {up.refused}, type: trojan, password: pw, sni: kr.example, udp: true}}
  - {{name: 🇬🇧 英国 01, server: 127.0.0.1, port: {up.refused}, type: ss, cipher: 2022-blake3-aes-128-gcm, password: "AAAAAAAAAAAAAAAAAAAAAA==", udp: true}}
  - {{name: 🇩🇪 德国 01, server: 127.0.0.1, port: {up.refused}, type: ss, cipher: aes-128-gcm, password: pw, plugin: obfs, plugin-opts: {{mode: tls, host: bing.com}}}}
proxy-groups:
  - name: 🚀 节点选择
    type: select
    proxies:
      - ♻️ 自动选择
      - 🇭🇰 香港 01
      - 🇯🇵 日本 01
      - 🇸🇬 新加坡 01
      - 🇺🇸 美国 01
      - DIRECT
  - name: ♻️ 自动选择
    type: url-test
    url: {probe}
    interval: 300
    tolerance: 50
    proxies: [🇭🇰 香港 01, 🇹🇼 台湾 01, 🇺🇸 美国 01]
  - {{name: 🇯🇵 日本节点, type: select, proxies: [🇯🇵 日本 01]}}
  - {{name: 🇸🇬 狮城节点, type: select, proxies: [🇸🇬 新加坡 01]}}
  - {{name: 🇺🇸 美国节点, type: select, proxies: [🇺🇸 美国 01, 🇰🇷 韩国 01]}}
  - {{name: Ⓜ️ 微软服务, type: select, proxies: [🎯 全球直连, 🚀 节点选择]}}
  - {{name: 🎯 全球直连, type: select, proxies: [DIRECT, 🚀 节点选择, ♻️ 自动选择]}}
  - {{name: 🛑 全球拦截, type: select, proxies: [REJECT, DIRECT]}}
  - {{name: 🐟 漏网之鱼, type: select, proxies: [🚀 节点选择, 🎯 全球直连, ♻️ 自动选择, DIRECT]}}
rules:
"""
    rules = list(extra_head_rules)
    rules += [
        "DOMAIN,vm,🇯🇵 日本节点",
        "DOMAIN-KEYWORD,runs,🇸🇬 狮城节点",
        "DOMAIN-SUFFIX,localhost,🚀 节点选择",
        "IP-CIDR,127.0.0.2/32,🛑 全球拦截,no-resolve",
        "SRC-IP-SUFFIX,10.0.0.1/32,DIRECT",
        "IP-CIDR6,fe80::/10,🎯 全球直连,no-resolve",
        *gen.lines,
    ]
    if geoip:
        rules.append("GEOIP,CN,🎯 全球直连")
    rules.append("MATCH,🐟 漏网之鱼")
    text += "".join(f"  - {line}\n" for line in rules)
    return text + extra_yaml, gen


def provider_file(up: Upstreams, provider_path: str, rules_path: str) -> str:
    """The hand-written provider style (see the module)."""
    return f"""mixed-port: 7890
allow-lan: false
mode: rule
log-level: warning
external-controller: 127.0.0.1:9090
secret: "s3cr3t"
proxy-providers:
  airport:
    type: file
    path: {provider_path}
    health-check: {{enable: true, url: "http://127.0.0.1:{up.origin}/generate_204", interval: 600}}
  backup:
    type: http
    url: https://sub.example.net/api/v1/client/subscribe?token=abc
    path: ./proxy_providers/backup.yaml
    interval: 86400
    proxy: DIRECT
    header: {{User-Agent: [clash.meta]}}
    override: {{additional-prefix: "[备] ", udp: true}}
  pinned:
    type: inline
    payload:
      - {{name: pinned-s5, type: socks5, server: 127.0.0.1, port: {up.socks}}}
rule-providers:
  reject:
    type: http
    behavior: domain
    url: https://cdn.example.net/rules/reject.txt
    path: ./ruleset/reject.yaml
    interval: 86400
  lan:
    type: file
    behavior: ipcidr
    format: text
    path: {rules_path}
  apps:
    type: inline
    behavior: classical
    payload: ["DOMAIN-SUFFIX,app.example", "IP-CIDR,192.0.2.0/24,no-resolve"]
proxies:
  - {{name: home-socks, type: socks5, server: 127.0.0.1, port: {up.socks}}}
proxy-groups:
  - name: Proxy
    type: select
    use: [airport, backup]
    proxies: [Auto, HK, home-socks, DIRECT]
  - name: Auto
    type: url-test
    use: [airport]
    filter: "(?i)hk|香港|jp"
    url: http://127.0.0.1:{up.origin}/generate_204
    interval: 300
  - name: HK
    type: fallback
    use: [airport]
    filter: "港|HK"
    exclude-filter: "(?i)expire|剩余"
  - name: Everything
    type: load-balance
    strategy: round-robin
    include-all: true
  - name: Final
    type: select
    proxies: [Proxy, DIRECT]
rules:
  - RULE-SET,reject,REJECT
  - RULE-SET,lan,DIRECT,no-resolve
  - RULE-SET,apps,Proxy
  - DOMAIN-SUFFIX,lan,DIRECT
  - MATCH,Final
"""


def provider_style_file(up: Upstreams, *, web: int, dns_port: int, ports: dict[str, int]) -> str:
    """The provider style for the comparison with mihomo: every provider local (a file in
    mihomo's home, an HTTP server on ``web``, inline ones), groups over them with
    ``filter``/``exclude-filter`` (``backup`` is used by three groups, two of which
    filter it differently; ``Mixed`` has two expressions over inline and provider
    members, which mihomo puts in expression order: JP, HK, then the inline proxy), ``RULE-SET`` rules; DNS from the
    lab's server."""
    probe = f"http://127.0.0.1:{up.origin}/generate_204"
    server = f"udp://127.0.0.1:{dns_port}"
    return f"""\
allow-lan: false
bind-address: 127.0.0.1
mode: rule
log-level: info
ipv6: false
external-controller: 127.0.0.1:0
geo-auto-update: false
find-process-mode: off
profile: {{store-selected: false, store-fake-ip: false}}
listeners:
  - {{name: mixed-in, type: mixed, listen: 127.0.0.1, port: 0}}
dns: {{enable: true, ipv6: false, enhanced-mode: redir-host, default-nameserver: ['{server}'], nameserver: ['{server}']}}
proxy-providers:
  airport:
    type: file
    path: ./proxy_providers/airport.yaml
    health-check: {{enable: true, url: "{probe}", interval: 600}}
  backup:
    type: http
    url: http://127.0.0.1:{web}/backup.yaml
    path: ./proxy_providers/backup.yaml
    interval: 3600
  pinned:
    type: inline
    payload:
      - {{name: pinned-s5, type: socks5, server: 127.0.0.1, port: {up.socks}}}
rule-providers:
  reject: {{type: http, behavior: domain, format: text, url: "http://127.0.0.1:{web}/reject.txt", path: ./ruleset/reject.txt, interval: 86400}}
  lan: {{type: file, behavior: ipcidr, format: text, path: ./ruleset/lan.txt}}
  apps:
    type: inline
    behavior: classical
    payload: ["DOMAIN-SUFFIX,app.example", "DST-PORT,{ports["pinned"]}"]
proxies:
  - {{name: home-socks, type: socks5, server: 127.0.0.1, port: {up.socks}}}
proxy-groups:
  - {{name: HK, type: fallback, use: [airport], filter: "港|HK", exclude-filter: "(?i)expire|剩余", url: "{probe}", interval: 300}}
  - {{name: JP, type: select, use: [airport, backup], filter: "JP|日本"}}
  - {{name: Backup, type: select, use: [backup]}}
  - {{name: Spare, type: select, use: [backup], filter: "B2`B1"}}
  - {{name: Mixed, type: select, proxies: [home-socks], use: [airport], filter: "JP`HK"}}
  - {{name: Pinned, type: select, use: [pinned]}}
  - {{name: US, type: select, use: [airport], filter: "US"}}
  - {{name: Final, type: select, proxies: [HK, home-socks, DIRECT]}}
rules:
  - RULE-SET,reject,REJECT
  - RULE-SET,lan,DIRECT,no-resolve
  - RULE-SET,apps,Pinned
  - DOMAIN,vm,HK
  - DOMAIN,runsc,JP
  - DOMAIN,localhost,Backup
  - DST-PORT,{ports["us"]},US
  - DST-PORT,{ports["spare"]},Spare
  - DST-PORT,{ports["mixed"]},Mixed
  - MATCH,Final
"""


def provider_body(up: Upstreams) -> str:
    """What the ``airport`` provider file holds: a Clash document with ``proxies:``."""
    return f"""proxies:
  - {{name: 🇭🇰 HK 01, type: socks5, server: 127.0.0.1, port: {up.socks}}}
  - {{name: 🇭🇰 HK 02, type: ss, server: 127.0.0.1, port: {up.ss}, cipher: {up.ss_method}, password: {up.ss_password}}}
  - {{name: 🇯🇵 JP 01, type: http, server: 127.0.0.1, port: {up.http}}}
  - {{name: 剩余流量：100 GB, type: socks5, server: 127.0.0.1, port: {up.refused}}}
  - {{name: 🇺🇸 US vmess, type: vmess, server: 127.0.0.1, port: {up.refused}, uuid: 2f0b8f3e-1d5c-4a8f-9e3b-7a6c5d4e3f21, alterId: 0, cipher: auto}}
"""


def mixed_file(
    up: Upstreams,
    *,
    listener: bool = False,
    dns_port: int | None = None,
    chain_port: int = 4433,
    relay: bool = False,
) -> str:
    """Supported and unsupported proxy types and plugins side by side; ``http-chained``
    dials its tinyproxy through microsocks (``dialer-proxy``), for destination port
    ``chain_port``. ``relay`` adds a ``relay`` group (mihomo 1.19.2x refuses those)."""
    relay_group = "  - {name: Chain, type: relay, proxies: [socks-ok, http-ok]}\n" if relay else ""
    head = _head(dns_port=dns_port, ports=not listener, listener=listener)
    return (
        head
        + f"""proxies:
  - {{name: ss-ok, type: ss, server: 127.0.0.1, port: {up.ss}, cipher: {up.ss_method}, password: {up.ss_password}, udp: true}}
  - {{name: ss-chacha, type: ss, server: 127.0.0.1, port: {up.refused}, cipher: chacha20-ietf-poly1305, password: x}}
  - {{name: ss-2022, type: ss, server: 127.0.0.1, port: {up.refused}, cipher: 2022-blake3-aes-256-gcm, password: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}}
  - {{name: ss-cfb, type: ss, server: 127.0.0.1, port: {up.refused}, cipher: aes-256-cfb, password: x}}
  - {{name: ss-obfs, type: ss, server: 127.0.0.1, port: {up.refused}, cipher: aes-128-gcm, password: x, plugin: obfs, plugin-opts: {{mode: http, host: bing.com}}}}
  - {{name: ss-v2ray, type: ss, server: 127.0.0.1, port: {up.refused}, cipher: aes-128-gcm, password: x, plugin: v2ray-plugin, plugin-opts: {{mode: websocket, tls: true, host: v2.example}}}}
  - {{name: ss-shadowtls, type: ss, server: 127.0.0.1, port: {up.refused}, cipher: aes-128-gcm, password: x, plugin: shadow-tls, client-fingerprint: chrome, plugin-opts: {{host: cloud.tencent.com, password: st, version: 3}}}}
  - {{name: socks-ok, type: socks5, server: 127.0.0.1, port: {up.socks}}}
  - {{name: socks-tls, type: socks5, server: 127.0.0.1, port: {up.refused}, tls: true, skip-cert-verify: true}}
  - {{name: http-ok, type: http, server: 127.0.0.1, port: {up.http}}}
  - {{name: http-tls, type: http, server: 127.0.0.1, port: {up.refused}, tls: true, sni: proxy.example}}
  - {{name: http-chained, type: http, server: 127.0.0.1, port: {up.http}, dialer-proxy: socks-ok}}
  - {{name: vmess-ws, type: vmess, server: 127.0.0.1, port: {up.refused}, uuid: 2f0b8f3e-1d5c-4a8f-9e3b-7a6c5d4e3f21, alterId: 0, cipher: auto, network: ws, ws-opts: {{path: /ray}}}}
  - {{name: vless-reality, type: vless, server: 127.0.0.1, port: {up.refused}, uuid: 2f0b8f3e-1d5c-4a8f-9e3b-7a6c5d4e3f21, network: tcp, tls: true, flow: xtls-rprx-vision, servername: www.microsoft.com, reality-opts: {{public-key: 7K2Xbq0ZfTm8Y9sRw3LkPv4NnHc6JdQe1GaBxUiOtSA, short-id: ab}}, client-fingerprint: chrome}}
  - {{name: trojan-1, type: trojan, server: 127.0.0.1, port: {up.refused}, password: pw, sni: tj.example}}
  - {{name: hy2-1, type: hysteria2, server: 127.0.0.1, port: {up.refused}, password: pw}}
  - {{name: tuic-1, type: tuic, server: 127.0.0.1, port: {up.refused}, uuid: 2f0b8f3e-1d5c-4a8f-9e3b-7a6c5d4e3f21, password: p}}
  - {{name: wg-1, type: wireguard, server: 127.0.0.1, port: {up.refused}, ip: 172.16.0.2, private-key: eCtXsJZ27+4PbhDkHnB923tkUn2Gj59wZw5wFA75MnU=, public-key: Cr8hWlKvtDt7nrvf+f0brNQQzabAqrjfBvas9pmowjo=, udp: true}}
  - {{name: snell-1, type: snell, server: 127.0.0.1, port: {up.refused}, psk: yourpsk, version: 3}}
proxy-groups:
  - {{name: Proxy, type: select, proxies: [ss-ok, socks-ok, http-ok, vmess-ws, DIRECT]}}
  - {{name: Modern, type: select, proxies: [vless-reality, trojan-1, hy2-1, tuic-1]}}
  - {{name: Plugins, type: fallback, url: "http://127.0.0.1:{up.origin}/generate_204", interval: 300, proxies: [ss-obfs, ss-v2ray, ss-shadowtls, ss-ok]}}
  - {{name: Balance, type: load-balance, strategy: consistent-hashing, url: "http://127.0.0.1:{up.origin}/generate_204", proxies: [socks-ok, http-ok]}}
{relay_group}rules:
  - DST-PORT,{chain_port},http-chained
  - DOMAIN,vm,Plugins
  - DOMAIN,runsc,Modern
  - DOMAIN,localhost,Proxy
  - MATCH,Proxy
"""
    )


def write_geodata(home: Path) -> None:
    """mihomo's geodata files in its home: ``Country.mmdb`` (127.200.0.0/16 is CN) and
    ``GeoSite.dat`` (list ``testsite``: the domain ``geosite.example`` and subdomains)."""
    home.mkdir(parents=True, exist_ok=True)
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(IPSet(["127.200.0.0/16"]), {"country": {"iso_code": "CN"}})
    writer.insert_network(IPSet(["127.199.0.0/16"]), {"country": {"iso_code": "US"}})
    writer.to_db_file(str(home / "Country.mmdb"))
    sites = geodata.GeoSiteListMessage()
    entry = sites.entry.add(country_code="TESTSITE")
    entry.domain.add(type=2, value="geosite.example")
    # mihomo checks a GeoSite.dat by loading its `cn` list (and downloads one without).
    sites.entry.add(country_code="CN").domain.add(type=2, value="cn.example")
    (home / "GeoSite.dat").write_bytes(sites.SerializeToString())
    rulesets = home / "ruleset"
    rulesets.mkdir(exist_ok=True)
    (rulesets / "blocked.txt").write_text("# a domain set\n+.ruleset.example\nexact.example\n")
    (rulesets / "ips.txt").write_text("127.201.0.0/16\n")
