"""``spliceway import clash``: the real program on real files and a local HTTP source."""

from __future__ import annotations

import base64
import http.server
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import yaml

from spliceway.cli.import_clash import FETCH_LIMIT
from spliceway.config import load_config_file, parse_config
from tests.clash.clash_files import Upstreams, mixed_file, subconverter_file
from tests.helpers.program import REPO, SPLICEWAY

UP = Upstreams(socks=1080, ss=8388, http=3128, refused=9, origin=8080)


def spliceway(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the program to completion (60 s at most), capturing its output as text; from
    ``cwd``, with this tree first on the path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [*SPLICEWAY, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
    )


def test_file_to_stdout_json(tmp_path: Path) -> None:
    source = tmp_path / "config.yaml"
    text, _ = subconverter_file(UP, rule_count=500)
    source.write_text(text)
    run = spliceway("import", "clash", str(source))
    assert run.returncode == 0, run.stderr
    config = json.loads(run.stdout)
    parse_config(config)
    assert config["route"]["final"] == "🐟 漏网之鱼"
    # Without --report: the summary and the notes only.
    lines = run.stderr.splitlines()
    assert lines[0].startswith("import: ") and "(--report lists them)" in lines[0]
    assert all(line.startswith("note: ") for line in lines[1:])


def test_output_file_yaml_and_report(tmp_path: Path) -> None:
    source = tmp_path / "mixed.yaml"
    source.write_text(mixed_file(UP))
    out = tmp_path / "out" / "spliceway.yaml"
    run = spliceway("import", "clash", str(source), "-o", str(out), "--report")
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    cfg = load_config_file(out)  # what `spliceway run -c` reads
    assert cfg.find_outbound("ss-ok") is not None
    # Strings YAML 1.1 would read as booleans are quoted in the output.
    assert "password: 'no'" in out.read_text() or 'password: "no"' in out.read_text()
    report = run.stderr
    for name in ("ss-2022", "ss-obfs", "vless-reality", "hy2-1", "wg-1", "snell-1"):
        assert f"({name})" in report
    assert "skipped:" in report and "changed:" in report and "converted:" in report
    validate = spliceway("validate", str(out))
    assert validate.returncode == 0, validate.stdout + validate.stderr


def test_report_as_json(tmp_path: Path) -> None:
    source = tmp_path / "mixed.yaml"
    source.write_text(mixed_file(UP))
    out = tmp_path / "out.json"
    run = spliceway("import", "clash", str(source), "-o", str(out), "--report", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stderr)
    assert report["source"] == "clash"
    assert set(report) == {"source", "counts", "notes", "converted", "changed", "skipped", "files"}
    skipped = {i["name"] for i in report["skipped"] if i["path"].startswith("proxies[")}
    assert {"ss-2022", "trojan-1", "tuic-1"} <= skipped
    assert report["counts"]["skipped"] == len(report["skipped"])
    parse_config(json.loads(out.read_text()))


def test_inline_providers_written_beside_the_output(tmp_path: Path) -> None:
    source = tmp_path / "c.yaml"
    source.write_text(
        "mixed-port: 7890\n"
        "rule-providers:\n"
        "  apps: {type: inline, behavior: domain, payload: [a.example, +.b.example]}\n"
        "rules:\n  - RULE-SET,apps,REJECT\n  - MATCH,DIRECT\n"
    )
    out = tmp_path / "conf.json"
    run = spliceway("import", "clash", str(source), "-o", str(out))
    assert run.returncode == 0, run.stderr
    config = json.loads(out.read_text())
    path = Path(config["providers"]["rules"]["apps"]["path"])
    assert path.parent == tmp_path / "conf.providers"
    assert json.loads(path.read_text()) == {"payload": ["a.example", "+.b.example"]}


def test_nothing_usable_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("proxies: [\n")
    run = spliceway("import", "clash", str(bad))
    assert run.returncode == 1
    assert run.stdout == ""
    assert "not valid YAML" in run.stderr and "line 2" in run.stderr
    html = tmp_path / "page.html"
    html.write_text("<html><body>502 Bad Gateway</body></html>")
    assert spliceway("import", "clash", str(html)).returncode == 1
    missing = spliceway("import", "clash", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "cannot read" in missing.stderr
    out = tmp_path / "never.json"
    assert spliceway("import", "clash", str(bad), "-o", str(out)).returncode == 1
    assert not out.exists()


class _Handler(http.server.BaseHTTPRequestHandler):
    bodies: ClassVar[dict[str, tuple[int, bytes]]] = {}
    agents: ClassVar[list[str]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.agents.append(self.headers.get("User-Agent", ""))
        status, body = self.bodies.get(self.path, (404, b"not found"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def serving(bodies: dict[str, tuple[int, bytes]]) -> Iterator[str]:
    _Handler.bodies = bodies
    _Handler.agents = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_url_sources(tmp_path: Path) -> None:
    links = "socks5://127.0.0.1:1080#🇭🇰 HK\nhttp://127.0.0.1:3128#web\n"
    bodies = {
        "/clash": (200, mixed_file(UP).encode()),
        "/sub": (200, base64.b64encode(links.encode())),
        "/huge": (200, b"#" * (FETCH_LIMIT + 1)),
        "/gone": (410, b"gone"),
    }
    with serving(bodies) as base:
        run = spliceway("import", "clash", f"{base}/clash", cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["outbounds"][0]["tag"] == "ss-ok"
        out = tmp_path / "sub.yaml"
        run = spliceway("import", "clash", f"{base}/sub", "-o", str(out), cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        doc = yaml.safe_load(out.read_text())
        assert [o["tag"] for o in doc["outbounds"]] == ["🇭🇰 HK", "web"]
        assert doc["route"]["final"] == "Proxy"
        huge = spliceway("import", "clash", f"{base}/huge", cwd=tmp_path)
        assert huge.returncode == 1 and "larger than" in huge.stderr
        gone = spliceway("import", "clash", f"{base}/gone", cwd=tmp_path)
        assert gone.returncode == 1 and "HTTP 410" in gone.stderr
        agents = list(_Handler.agents)
    assert agents and all(a == "clash.meta" for a in agents)
    refused = spliceway("import", "clash", "http://127.0.0.1:9/x", cwd=tmp_path)
    assert refused.returncode == 1 and refused.stderr.startswith("spliceway: import:")
