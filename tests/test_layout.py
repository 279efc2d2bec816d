"""The test tree mirrors the source tree (mitmproxy's ``test/filename_matching.py`` idea).

A product module ``spliceway/<pkg>/<mod>.py`` (``actors/``, ``api/`` and ``connector/``
count as ``spliceway/actors`` and so on: the package-dir mapping) has its tests in
``tests/<pkg>/test_<mod>.py``. A module that has no such file is either in
:data:`COVERED_ELSEWHERE`, named with the test file that covers it and why it has no
file of its own, or this test fails: a new module comes with a test file of its own, or
with a line here saying where it is tested. The list cannot rot: an entry whose module is
gone, whose covering file is gone, or whose module has since got its own test file fails
too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import markers

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spliceway"
TESTS = ROOT / "tests"

#: Files that are not modules under test: package glue, entry points, generated code.
NOT_MODULES = frozenset({"__init__.py", "__main__.py"})
GENERATED = frozenset(
    {"spliceway/api/grpc_gen/control_pb2.py", "spliceway/api/grpc_gen/control_pb2_grpc.py"}
)

#: Product modules without a test file of their own -> the test file that covers them.
COVERED_ELSEWHERE: dict[str, str] = {
    # The composition root's wiring and the ports' Protocols it satisfies: every engine
    # start goes through them (tests/app/test_transports.py starts real engines).
    "spliceway/app/compose.py": "tests/integration/test_lifecycle.py",
    "spliceway/engine/components.py": "tests/integration/test_lifecycle.py",
    # The OpenAPI document's hand-written schemas: the document is validated whole.
    "spliceway/api/schemas.py": "tests/api/test_openapi.py",
    # A declaration with no logic: real /sinks answers are held to the component made
    # from it (test_queries_conform_after_real_traffic).
    "spliceway/shapes/sink.py": "tests/api/test_openapi.py",
    # docgen's parts: the pages they write are checked against docs/ by test_docgen.
    "spliceway/tools/configdoc.py": "tests/tools/test_docgen.py",
    "spliceway/tools/markdown.py": "tests/tools/test_docgen.py",
    # The configuration's modules (the split of one config.py): test_config.py drives
    # them all through parse_config/load_config, as a user's document does.
    "spliceway/config/checks.py": "tests/config/test_config.py",
    "spliceway/config/environment.py": "tests/config/test_config.py",
    "spliceway/config/loading.py": "tests/config/test_config.py",
    "spliceway/config/models.py": "tests/config/test_config.py",
    "spliceway/config/models_api.py": "tests/config/test_config.py",
    "spliceway/config/models_inbounds.py": "tests/config/test_config.py",
    "spliceway/config/models_outbounds.py": "tests/config/test_config.py",
    "spliceway/config/models_runtime.py": "tests/config/test_config.py",
    "spliceway/config/problems.py": "tests/config/test_config.py",
    "spliceway/config/validation.py": "tests/config/test_config.py",
    "spliceway/config/validators.py": "tests/config/test_config.py",
    # Message types with no logic: the commands that send them (flows.close, group.select).
    "spliceway/control/messages.py": "tests/api/test_app.py",
    # Small helpers moved down out of their users; tested through them.
    "spliceway/support/loop.py": "tests/actors/test_dispatcher.py",
    "spliceway/support/probe_url.py": "tests/routing/test_policy.py",
    "spliceway/support/webhook_secret.py": "tests/integration/test_webhook_signing.py",
    # Entry point and error table: every CLI run, every API error envelope.
    "spliceway/_console.py": "tests/integration/test_cli.py",
    "spliceway/errors.py": "tests/api/test_app.py",
    # The engine's assembly and state: only meaningful with a whole engine running.
    "spliceway/app/engine.py": "tests/integration/test_lifecycle.py",
    "spliceway/engine/assembly.py": "tests/integration/test_lifecycle.py",
    "spliceway/engine/core.py": "tests/integration/test_lifecycle.py",
    # The core's mixins, split out of core.py: the TUN's wiring and the live counters.
    "spliceway/engine/tun_wiring.py": "tests/integration/test_tun_engine.py",
    "spliceway/engine/stats.py": "tests/api/test_metrics.py",
    "spliceway/engine/runtime.py": "tests/integration/test_lifecycle.py",
    "spliceway/engine/reconcile.py": "tests/integration/test_reload.py",
    # Actors: driven by real flows through a running engine.
    "spliceway/actors/bridge.py": "tests/csrc/test_relay_aead.py",
    "spliceway/actors/flow.py": "tests/integration/test_inbounds.py",
    "spliceway/actors/flow_conn.py": "tests/integration/test_conn_fastpath.py",
    "spliceway/actors/flow_deps.py": "tests/integration/test_inbounds.py",
    "spliceway/actors/http_forward.py": "tests/integration/test_http_keepalive.py",
    "spliceway/actors/http_upstream.py": "tests/integration/test_http_keepalive.py",
    "spliceway/actors/listener.py": "tests/integration/test_conn_fastpath.py",
    "spliceway/actors/messages.py": "tests/integration/test_lifecycle.py",
    "spliceway/actors/policy.py": "tests/integration/test_policy_groups.py",
    "spliceway/actors/sink.py": "tests/integration/test_sinks.py",
    "spliceway/actors/stats.py": "tests/api/test_metrics.py",
    "spliceway/actors/supervisor.py": "tests/integration/test_lifecycle.py",
    "spliceway/actors/tun.py": "tests/integration/test_tun_netns.py",
    "spliceway/actors/tun_udp.py": "tests/integration/test_tun_udp.py",
    "spliceway/actors/udp.py": "tests/integration/test_udp.py",
    "spliceway/actors/udp_flow.py": "tests/integration/test_udp.py",
    "spliceway/actors/udp_upstream.py": "tests/integration/test_udp.py",
    # Flow pieces: per-flow behaviour seen through the engine's inbounds and outbounds.
    "spliceway/flows/histograms.py": "tests/api/test_metrics.py",
    "spliceway/flows/inbound.py": "tests/integration/test_inbounds.py",
    "spliceway/flows/outbounds.py": "tests/integration/test_outbounds.py",
    "spliceway/flows/probe.py": "tests/integration/test_probe_outbound_url.py",
    "spliceway/flows/records.py": "tests/events/test_catalogue.py",
    # The control surface: exercised through the HTTP API that serves it.
    "spliceway/control/capabilities.py": "tests/api/test_app.py",
    "spliceway/control/commands.py": "tests/api/test_app.py",
    "spliceway/control/diagnostics.py": "tests/api/test_diagnostics.py",
    "spliceway/control/queries.py": "tests/api/test_query_params.py",
    "spliceway/api/auth.py": "tests/unit/test_api_parts.py",
    "spliceway/api/limits.py": "tests/unit/test_api_parts.py",
    "spliceway/api/grpc_server.py": "tests/api/test_grpc.py",
    "spliceway/api/grpc_service.py": "tests/api/test_grpc.py",
    # The Clash API's wiring: a dataclass and the app's assembly, exercised by every
    # request of tests/api/clash (the listener's own tests start real engines).
    "spliceway/api/clash/context.py": "tests/api/clash/test_server.py",
    "spliceway/api/clash/app.py": "tests/api/clash/test_server.py",
    "spliceway/events/logring.py": "tests/api/test_logs.py",
    # The CLI: run as the real program.
    "spliceway/cli/main.py": "tests/integration/test_cli.py",
    "spliceway/cli/remote.py": "tests/integration/test_cli_remote.py",
    "spliceway/cli/ipc_client.py": "tests/integration/test_cli_remote.py",
    # Sinks and the outbox: against real receivers, files and an engine.
    "spliceway/connector/inspect.py": "tests/integration/test_connector_cli.py",
    "spliceway/connector/intake.py": "tests/connector/test_openflows.py",
    "spliceway/connector/jetstream.py": "tests/integration/test_nats_sink.py",
    "spliceway/connector/ledger.py": "tests/connector/test_outbox.py",
    # The outbox's segment log and its recovery scan, split out of outbox.py.
    "spliceway/connector/segment_log.py": "tests/connector/test_outbox.py",
    "spliceway/connector/service.py": "tests/integration/test_sinks.py",
    "spliceway/connector/signing.py": "tests/integration/test_webhook_signing.py",
    # DNS: the resolver and service against real DNS servers through the engine.
    "spliceway/dns/diagnostics.py": "tests/api/test_diagnostics.py",
    "spliceway/dns/resolver.py": "tests/integration/test_dns.py",
    "spliceway/dns/service.py": "tests/integration/test_dns_server.py",
    # The DNS server's parts (the split of server.py): the screen and the rate limit
    # are driven byte by byte there, the counters and TCP side through a real server.
    "spliceway/dns/counters.py": "tests/integration/test_dns_server.py",
    "spliceway/dns/ratelimit.py": "tests/dns/test_server_screen.py",
    "spliceway/dns/tcp.py": "tests/integration/test_dns_server.py",
    "spliceway/dns/wire.py": "tests/dns/test_server_screen.py",
    # The C wrappers: tested beside the C they wrap (tests/csrc/), Python against C.
    "spliceway/native/conn.py": "tests/integration/test_conn_fastpath.py",
    "spliceway/native/relay.py": "tests/csrc/test_relay.py",
    "spliceway/native/route.py": "tests/csrc/test_route_diff.py",
    "spliceway/native/tun.py": "tests/csrc/test_tun_loop.py",
    "spliceway/native/udp.py": "tests/csrc/test_udp_relay.py",
    "spliceway/protocols/http_message.py": "tests/csrc/test_forward_parse_diff.py",
    "spliceway/routing/hostnorm.py": "tests/csrc/test_hostnorm_diff.py",
    "spliceway/tun/packet.py": "tests/csrc/test_pkt_diff.py",
    # Atomic replacement of files: seen by killing an apply half-way.
    "spliceway/support/atomic_file.py": "tests/integration/test_crash_recovery.py",
    # The TUN host side: pure parts together in one file, the rest in network namespaces.
    "spliceway/tun/controller.py": "tests/integration/test_tun_engine.py",
    "spliceway/tun/device.py": "tests/integration/test_tun_netns.py",
    "spliceway/tun/dns_hijack.py": "tests/integration/test_dns_hijack_shared.py",
    "spliceway/tun/egress.py": "tests/unit/test_tun_host.py",
    "spliceway/support/socket_mark.py": "tests/integration/test_socket_mark.py",
    "spliceway/tun/options.py": "tests/unit/test_tun_host.py",
    "spliceway/tun/routing.py": "tests/integration/test_tun_routing.py",
    "spliceway/tun/service.py": "tests/integration/test_tun_engine.py",
}


def product_modules() -> list[str]:
    """Every product module, as ``spliceway/<pkg>/<mod>.py`` (symlinked folders followed)."""
    found: list[str] = []
    for directory, dirnames, filenames in os.walk(PACKAGE, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = Path(directory).relative_to(PACKAGE)
        for name in sorted(filenames):
            path = (Path("spliceway") / rel / name).as_posix()
            if name.endswith(".py") and name not in NOT_MODULES and path not in GENERATED:
                found.append(path)
    return found


def expected_test_file(module: str) -> str:
    """Where the tests of ``module`` (``spliceway/<pkg>/<mod>.py``) live."""
    path = Path(module).relative_to("spliceway")
    return (Path("tests") / path.parent / f"test_{path.name}").as_posix()


def test_every_module_has_a_test_file_or_says_where_it_is_tested() -> None:
    missing = [
        f"{module}: add {expected_test_file(module)}, or a COVERED_ELSEWHERE entry naming the "
        "test file that covers it"
        for module in product_modules()
        if not (ROOT / expected_test_file(module)).is_file() and module not in COVERED_ELSEWHERE
    ]
    assert not missing, "product modules without tests/<pkg>/test_<mod>.py:\n" + "\n".join(missing)


def test_covered_elsewhere_names_real_modules_and_tests_only() -> None:
    modules = set(product_modules())
    stale = []
    for module, covering in COVERED_ELSEWHERE.items():
        if module not in modules:
            stale.append(f"{module}: no such module any more (drop or rename the entry)")
        elif (ROOT / expected_test_file(module)).is_file():
            stale.append(f"{module}: has {expected_test_file(module)} now (drop the entry)")
        if not (ROOT / covering).is_file():
            stale.append(f"{module}: its covering test {covering} does not exist")
    assert not stale, "stale COVERED_ELSEWHERE entries:\n" + "\n".join(stale)


def test_every_test_directory_is_a_package() -> None:
    """tests/ is a package and its test modules are imported as ``tests.<pkg>.test_<mod>``:
    a directory without ``__init__.py`` would make pytest import its files by bare name,
    and two ``test_log.py`` (flows/, events/) would then collide."""
    bare = sorted(
        str(directory.relative_to(ROOT))
        for directory in {path.parent for path in TESTS.rglob("test_*.py")}
        if not (directory / "__init__.py").is_file()
    )
    assert not bare, f"test directories without __init__.py: {bare}"


def test_every_test_is_unit_or_integration_and_engines_are_integration(
    request: pytest.FixtureRequest,
) -> None:
    """The markers tests/markers.py applies, checked over this run's whole collection
    (each xdist worker collects all of it): exactly one each, integration for
    tests/integration/ and for anything that starts an engine through ``make_engine``."""
    wrong = []
    for item in request.session.items:
        marks = {m.name for m in item.iter_markers()} & {markers.UNIT, markers.INTEGRATION}
        if len(marks) != 1:
            wrong.append(f"{item.nodeid}: {sorted(marks)}")
        elif markers.UNIT in marks and (
            item.nodeid.startswith("tests/integration/") or "make_engine" in item.fixturenames
        ):
            wrong.append(f"{item.nodeid}: unit, but it runs an engine")
    assert not wrong, "\n".join(wrong)
