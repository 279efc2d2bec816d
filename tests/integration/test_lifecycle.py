"""Flow lifecycle through a real engine: close, idle timeout, updates, stats, leaks, stop."""

from __future__ import annotations

import socket
import threading

import pytest

from spliceway import ApiError
from tests.conftest import base_config, fd_count, thread_count, wait_until
from tests.helpers.flows import completed
from tests.helpers.servers import CountingPeer, EchoServer
from tests.helpers.socks import socks5_connect


def test_flows_close_cancels_an_active_flow(make_engine):
    with EchoServer() as server:
        engine = make_engine()
        sock = socks5_connect(engine.listen_address("socks-in"), *server.address)
        with sock:
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
            (flow,) = wait_until(
                lambda: [f for f in engine.query("flows")["active_flows"] if f["state"] == "active"]
            )
            assert engine.query("flow", {"flow_id": flow["flow_id"]})["flow_id"] == flow["flow_id"]
            result = engine.execute("flows.close", {"flow_id": flow["flow_id"]})
            assert result == {"flow_id": flow["flow_id"], "closed": True}
            sock.settimeout(5)
            assert sock.recv(10) == b""
        (done,) = completed(engine)
        record = done["payload"]["record"]
        assert record["result"] == {"outcome": "cancelled", "close_reason": "manual"}
        assert done["payload"]["close_reason"] == "manual"
        assert record["traffic"]["bytes_up"] == 4
        assert record["traffic"]["bytes_down"] == 4
        with pytest.raises(ApiError) as info:
            engine.execute("flows.close", {"flow_id": flow["flow_id"]})
        assert info.value.code == "not_found"
        with pytest.raises(ApiError) as info:
            engine.query("flow", {"flow_id": flow["flow_id"]})
        assert info.value.code == "not_found"


def test_idle_timeout_closes_a_silent_flow(make_engine):
    cfg = base_config(runtime={"tcp_idle_timeout_seconds": 1, "stats_interval_ms": 200})
    with EchoServer() as server:
        engine = make_engine(cfg)
        sock = socks5_connect(engine.listen_address("socks-in"), *server.address)
        with sock:
            sock.settimeout(10)
            assert sock.recv(10) == b""
        (done,) = completed(engine)
        result = done["payload"]["record"]["result"]
        assert result == {"outcome": "direct_relayed", "close_reason": "idle_timeout"}
        duration = done["payload"]["record"]["timing"]["duration_ms"]
        assert 900 <= duration < 5000


def test_flow_updated_only_when_traffic_moved(make_engine):
    with EchoServer() as server:
        engine = make_engine()
        sock = socks5_connect(engine.listen_address("socks-in"), *server.address)
        with sock, engine.subscribe(["flow.updated", "stats.sampled"], timeout=5) as sub:
            sock.sendall(b"x" * 1000)
            got = 0
            while got < 1000:
                got += len(sock.recv(4096))
            update = next(e for e in sub if e["event_type"] == "flow.updated")
            payload = update["payload"]
            assert payload["bytes_up"] == 1000
            assert payload["bytes_down"] == 1000
            assert payload["record"]["traffic"]["bytes_up"] == 1000
            assert payload["outbound_tag"] == "direct"
            # Two quiet sampling rounds: stats keep coming, flow.updated does not.
            quiet = [next(iter(sub)) for _ in range(2)]
            assert [e["event_type"] for e in quiet] == ["stats.sampled", "stats.sampled"]
            stats = quiet[-1]["payload"]
            assert stats["active_sessions"] == 1
            assert stats["bytes_up"] == 1000
            assert set(stats["udp_upstream"]) >= {"active_associations", "packets_sent"}


def test_engine_stop_completes_every_open_flow(make_engine):
    with EchoServer() as server:
        engine = make_engine()
        address = engine.listen_address("socks-in")
        socks = [socks5_connect(address, *server.address) for _ in range(5)]
        wait_until(lambda: len(engine.query("flows")["active_flows"]) == 5)
        sub = engine.subscribe(["flow.completed", "engine.stopped"])
        engine.stop()
        events = list(sub)
        assert [e["event_type"] for e in events] == ["flow.completed"] * 5 + ["engine.stopped"]
        outcomes = {e["payload"]["record"]["result"]["outcome"] for e in events[:5]}
        assert outcomes == {"direct_relayed"}
        for s in socks:
            s.close()


def test_thousand_flows_leave_no_fds_or_threads_behind(make_engine):
    with CountingPeer(reply_bytes=100) as peer:
        engine = make_engine()
        address = engine.listen_address("socks-in")

        def one_flow():
            with socks5_connect(address, *peer.address) as sock:
                sock.sendall(b"q" * 50)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(4096):
                    pass

        for _ in range(20):  # warm up lazily created threads and pools
            one_flow()
        wait_until(lambda: engine.query("stats")["completed_sessions"] == 20)
        fds, threads = fd_count(), thread_count()
        for _ in range(1000):
            one_flow()
        wait_until(lambda: engine.query("stats")["completed_sessions"] == 1020, timeout=30)
        stats = engine.query("stats")
        assert stats["active_sessions"] == 0
        assert stats["bytes_up"] == 1020 * 50
        assert stats["bytes_down"] == 1020 * 100
        wait_until(lambda: fd_count() <= fds, timeout=10)
        assert thread_count() <= threads


def test_many_concurrent_flows_beyond_fd_1024(make_engine):
    # 700 tunnels put engine-side fds well above 1024 in this one process:
    # nothing on the flow path may use select() or other fd-limited calls.
    server = socket.create_server(("127.0.0.1", 0), backlog=1024)
    held = []

    def accept_all():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_all, daemon=True).start()
    engine = make_engine()
    address = engine.listen_address("socks-in")
    tunnels = []
    try:
        for _ in range(700):
            tunnels.append(socks5_connect(address, *server.getsockname()[:2]))
        assert fd_count() > 1100
        wait_until(lambda: engine.query("stats")["active_sessions"] == 700, timeout=30)
        wait_until(lambda: len(held) == 700)
        tunnels[-1].sendall(b"last")
        held[-1].settimeout(5)
        assert held[-1].recv(4) == b"last"
    finally:
        for s in tunnels + held:
            s.close()
        server.close()
    wait_until(lambda: engine.query("stats")["active_sessions"] == 0, timeout=30)
    assert engine.query("stats")["failed_sessions"] == 0


def test_engine_started_is_the_first_event_even_with_startup_probes(make_engine):
    """A url_test group probes at start; its round (fast against a refused port) must
    still come after engine.started, sequence 1."""
    from tests.helpers.upstreams import refused_port

    dead = refused_port()
    config = base_config(
        outbounds=[
            {"tag": "dead-a", "protocol": "socks5", "server": "127.0.0.1", "port": dead},
            {"tag": "dead-b", "protocol": "http", "server": "127.0.0.1", "port": dead},
        ],
        outbound_groups=[{"tag": "auto", "kind": "url_test", "outbounds": ["dead-a", "dead-b"]}],
    )
    for _ in range(5):
        engine = make_engine(config)
        wait_until(
            lambda engine=engine: any(
                e["event_type"] == "policy.probe.completed"
                for e in engine.query("events")["events"]
            ),
            what="the startup probe round",
        )
        first = engine.query("events")["events"][0]
        assert (first["sequence"], first["event_type"]) == (1, "engine.started")
        engine.stop()


def test_engine_stop_while_dialling_completes_the_flow_as_cancelled(make_engine):
    """A flow stopped before its upstream connection existed was not relayed, whatever
    its route (a dialled flow that is still sniffing counts as relayed: see
    test_engine_stop_completes_every_open_flow)."""
    from tests.helpers.upstreams import black_hole

    with black_hole() as hole:
        engine = make_engine()
        sub = engine.subscribe(["flow.routed", "flow.completed", "flow.started"], timeout=10)
        client = socket.create_connection(engine.listen_address("socks-in"), timeout=10)
        with client:
            client.sendall(b"\x05\x01\x00")
            assert client.recv(2) == b"\x05\x00"
            client.sendall(b"\x05\x01\x00\x01\x7f\x00\x00\x01" + hole.to_bytes(2, "big"))
            started = next(iter(sub))
            assert started["event_type"] == "flow.started"
            engine.stop()
        done = [e for e in sub if e["event_type"] == "flow.completed"]
    assert len(done) == 1
    record = done[0]["payload"]["record"]
    assert record["result"]["outcome"] == "cancelled"
    assert record["path"]["outbound"]["tag"] == "direct"


def test_a_start_that_fails_after_engine_started_ends_every_subscription(monkeypatch):
    """engine.started already went out: a subscriber gets engine.stopped and then its end,
    and every socket and thread of the half-started engine is released."""
    from spliceway import Engine
    from spliceway.actors.supervisor import EngineSupervisor

    def refuse(*args, **kwargs):
        raise RuntimeError("supervisor refused to start")

    engine = Engine(base_config())
    sub = engine.subscribe()
    fds, threads = fd_count(), thread_count()
    monkeypatch.setattr(EngineSupervisor, "start", refuse)
    with pytest.raises(RuntimeError, match="supervisor refused"):
        engine.start()
    got = [sub.get(timeout=5), sub.get(timeout=5), sub.get(timeout=5)]
    assert [e["event_type"] if e else None for e in got] == [
        "engine.started",
        "engine.stopped",
        None,
    ]
    assert sub.ended
    wait_until(lambda: fd_count() <= fds and thread_count() <= threads, timeout=10)
