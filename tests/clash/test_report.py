"""spliceway.clash.report: the import report, for people and as JSON."""

from __future__ import annotations

import json

from spliceway.clash.report import Item, Report


def test_report_text_and_json() -> None:
    report = Report()
    report.add("converted", "proxies[0]", "🇭🇰 HK", "shadowsocks outbound")
    report.add("changed", "proxies[1]", "s5", "socks5 outbound", "udp is off in mihomo")
    report.add("skipped", "proxies[2]", "vm", "vmess proxy", "no vmess outbound")
    report.add("skipped", "sniffer", "", "key not carried", "spliceway sniffs by itself")
    report.note("export SPLICEWAY_CLASH_SECRET")
    report.note("export SPLICEWAY_CLASH_SECRET")
    assert report.counts() == {"converted": 1, "changed": 1, "skipped": 2}
    text = report.render()
    assert text.splitlines() == [
        "import: 1 converted, 1 changed in meaning, 2 skipped",
        "note: export SPLICEWAY_CLASH_SECRET",
        "changed:",
        "  proxies[1] (s5): socks5 outbound - udp is off in mihomo",
        "skipped:",
        "  proxies[2] (vm): vmess proxy - no vmess outbound",
        "  sniffer: key not carried - spliceway sniffs by itself",
        "converted:",
        "  proxies[0] (🇭🇰 HK): shadowsocks outbound",
    ]
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["counts"] == {"converted": 1, "changed": 1, "skipped": 2}
    assert doc["notes"] == ["export SPLICEWAY_CLASH_SECRET"]
    assert doc["converted"] == [
        {"path": "proxies[0]", "name": "🇭🇰 HK", "what": "shadowsocks outbound"}
    ]
    assert doc["skipped"][1] == {
        "path": "sniffer",
        "name": "",
        "what": "key not carried",
        "why": "spliceway sniffs by itself",
    }


def test_extend_and_empty() -> None:
    report = Report()
    assert report.render() == "import: 0 converted, 0 changed in meaning, 0 skipped\n"
    report.extend("skipped", [Item("rules[3]", "", "GEOSITE,cn,DIRECT", "no geosite")])
    assert report.skipped[0].to_json()["why"] == "no geosite"
