"""spliceway.routing.process_lookup: netlink parsing (captured bytes, Hypothesis), requests the
kernel accepts, /proc resolution with its caches, locality, the service's modes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.routing import process_lookup as pl
from spliceway.routing.process_lookup import (
    LocalAddresses,
    NetlinkError,
    NetlinkParseError,
    ProcessInfo,
    ProcessLookup,
    ProcTable,
    SockDiag,
    build_diag_request,
    build_dump_request,
    is_loopback,
    parse_addr_reply,
    parse_diag_reply,
)
from tests.helpers.examples import examples

# Captured from this kernel (6.18): replies to exact lookups of a client socket
# 127.0.0.1:58290 -> 127.0.0.1:57657 and [::1]:34742 -> [::1]:58499, seq 1.
TCP4_REPLY = bytes.fromhex(
    "7c0000001400000001000000b768000002010000e3b2e1397f000001000000000000000000000000"
    "7f000001000000000000000000000000000000000c000000000000000000000000000000000000"
    "00000000005cbe3c04050008000000000008000f00000000000c00150001000000000000000600"
    "160052000000"
)
TCP6_REPLY = bytes.fromhex(
    "7c0000001400000001000000b76800000a01000087b6e48300000000000000000000000000000001"
    "00000000000000000000000000000001000000000e00000000000000000000000000000000000000"
    "0000000060be3c04050008000000000008000f00000000000c0015000100000000000000060016"
    "0012000000"
)
# The kernel's answer to a lookup of no socket: NLMSG_ERROR -ENOENT, request echoed.
ENOENT_REPLY = bytes.fromhex(
    "5c0000000200000001000000b7680000feffffff4800000014000100010000000000000002060000"
    "ffffffff000100027f0000010000000000000000000000007f000001000000000000000000000000"
    "00000000ffffffffffffffff"
)
# A filtered dump (seq 9): one socket in a multi-part message, then NLMSG_DONE.
DUMP_PART = bytes.fromhex(
    "7c0000001400020009000000756b000002010000d9f0866f7f000001000000000000000000000000"
    "7f000001000000000000000000000000000000001600000000000000000000000000000000000000"
    "000000006dc43c04050008000000000008000f00000000000c0015000100000000000000060016"
    "0052000000"
)
DUMP_DONE = bytes.fromhex("140000000300020009000000756b000000000000")
# RTM_GETADDR dump (seq 7): lo 127.0.0.1, eth0 192.0.2.2, ::1, fd00::2, fe80::fc:ff:fe00:1.
ADDR_REPLY = bytes.fromhex(
    "4c0000001400020007000000756b0000020880fe01000000080001007f000001080002007f000001"
    "070003006c6f0000080008008000000014000600ffffffffffffffff160000001600000058000000"
    "1400020007000000756b0000021880000400000008000100c000020208000200c000020208000400"
    "c00002ff090003006574683000000000080008008000000014000600ffffffffffffffff16000000"
    "16000000500000001400020007000000756b00000a8080fe01000000140001000000000000000000"
    "000000000000000114000600ffffffffffffffff1600000016000000080008008000000005000b00"
    "01000000480000001400020007000000756b00000a4082000400000014000100fd00000000000000"
    "000000000000000214000600ffffffffffffffff1600000016000000080008008200000050000000"
    "1400020007000000756b00000a4080fd0400000014000100fe8000000000000000fc00fffe000001"
    "14000600ffffffffffffffff1600000016000000080008008000000005000b0003000000"
)


# -- parsing captured bytes ----------------------------------------------------------------


def test_exact_tcp4_reply() -> None:
    reply = parse_diag_reply(TCP4_REPLY, 1)
    assert reply.done
    (info,) = reply.sockets
    assert (info.family, info.state) == (4, 1)  # ESTABLISHED
    assert (info.src, info.sport, info.dst, info.dport) == ("127.0.0.1", 58290, "127.0.0.1", 57657)
    assert (info.uid, info.inode) == (0, 0x043CBE5C)


def test_exact_tcp6_reply() -> None:
    (info,) = parse_diag_reply(TCP6_REPLY, 1).sockets
    assert (info.family, info.src, info.sport, info.dst, info.dport) == (
        6,
        "::1",
        34742,
        "::1",
        58499,
    )
    assert info.inode == 0x043CBE60


def test_enoent_is_a_netlink_error() -> None:
    with pytest.raises(NetlinkError) as caught:
        parse_diag_reply(ENOENT_REPLY, 1)
    assert caught.value.errno == errno.ENOENT


def test_dump_parts() -> None:
    first = parse_diag_reply(DUMP_PART, 9)
    assert not first.done and first.sockets[0].inode == 0x043CC46D
    assert parse_diag_reply(DUMP_DONE, 9) == pl.DiagReply((), True)
    both = parse_diag_reply(DUMP_PART + DUMP_DONE, 9)
    assert both.done and len(both.sockets) == 1


def test_other_sequence_is_skipped() -> None:
    assert parse_diag_reply(TCP4_REPLY, 2) == pl.DiagReply((), False)


def test_addr_reply() -> None:
    addresses, done = parse_addr_reply(ADDR_REPLY, 7)
    assert not done
    assert addresses == ("127.0.0.1", "192.0.2.2", "::1", "fd00::2", "fe80::fc:ff:fe00:1")
    assert parse_addr_reply(DUMP_DONE, 9) == ((), True)


@pytest.mark.parametrize(
    "data",
    [
        TCP4_REPLY[:15],  # header cut
        TCP4_REPLY[:-1],  # length says more than there is
        struct.pack("=IHHII", 8, 20, 0, 1, 0),  # length below a header
        TCP4_REPLY[:16] + b"",  # length 124, 16 bytes
        struct.pack("=IHHII", 20, 20, 0, 1, 0) + bytes(4),  # inet_diag_msg too short
        struct.pack("=IHHII", 16, 2, 0, 1, 0),  # error without its code
        struct.pack("=IHHII", 16, 99, 0, 1, 0),  # unknown type
    ],
)
def test_malformed_diag_replies(data: bytes) -> None:
    with pytest.raises(NetlinkParseError):
        parse_diag_reply(data, 1)


def test_bad_family_and_attribute() -> None:
    bad_family = bytearray(TCP4_REPLY)
    bad_family[16] = 7
    with pytest.raises(NetlinkParseError):
        parse_diag_reply(bytes(bad_family), 1)
    # An ifaddrmsg whose attribute claims more than the message holds.
    msg = struct.pack("=BBBBI", 2, 8, 0, 0, 1) + struct.pack("=HH", 64, 1) + bytes(4)
    data = struct.pack("=IHHII", 16 + len(msg), 20, 2, 7, 0) + msg
    with pytest.raises(NetlinkParseError):
        parse_addr_reply(data, 7)


# -- fuzzing: garbage is an error, never a crash ---------------------------------------------


def _parses_or_refuses(data: bytes) -> None:
    for parse in (parse_diag_reply, parse_addr_reply):
        with contextlib.suppress(NetlinkParseError, NetlinkError):
            parse(data)


@settings(max_examples=examples(3000), deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(data: bytes) -> None:
    _parses_or_refuses(data)


@settings(max_examples=examples(2000), deadline=None)
@given(
    st.sampled_from([TCP4_REPLY, TCP6_REPLY, ENOENT_REPLY, DUMP_PART + DUMP_DONE, ADDR_REPLY]),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=8),
    st.integers(0, 400),
)
def test_fuzz_mutated_captures(base: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(base)
    for pos, value in flips:
        if pos < len(data):
            data[pos] = value
    _parses_or_refuses(bytes(data[: len(data) - cut % (len(data) + 1)]))


@settings(max_examples=examples(2000), deadline=None)
@given(
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFF),
    st.binary(max_size=200),
)
def test_fuzz_framed_payloads(mtype: int, flags: int, payload: bytes) -> None:
    # Well-framed messages of any type and flags around arbitrary payloads.
    length = 16 + len(payload)
    _parses_or_refuses(struct.pack("=IHHII", length, mtype, flags, 1, 0) + payload)


# -- requests --------------------------------------------------------------------------------


def test_exact_request_layout() -> None:
    req = build_diag_request(5, 4, socket.IPPROTO_TCP, ("127.0.0.1", 1000), ("10.0.0.1", 80))
    length, mtype, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert (length, mtype, flags, seq) == (len(req), 20, 1, 5) and length == 72
    assert req[16:18] == bytes([socket.AF_INET, socket.IPPROTO_TCP])
    assert struct.unpack_from(">HH", req, 24) == (1000, 80)
    assert req[28:32] == bytes([127, 0, 0, 1]) and req[44:48] == bytes([10, 0, 0, 1])


def test_dump_request_carries_bytecode() -> None:
    req = build_dump_request(5, 6, socket.IPPROTO_TCP, ("::1", 1000), 80)
    _, _, flags, _, _ = struct.unpack_from("=IHHII", req)
    assert flags == 0x301
    attr_len, attr_type = struct.unpack_from("=HH", req, 72)
    assert attr_type == 1 and 72 + attr_len == len(req)
    # S_COND (4 + 8 + 16 bytes) then D_COND (4 + 8): the first rejects 4 past the end.
    assert struct.unpack_from("=BBH", req, 76) == (7, 28, 44)
    assert struct.unpack_from("=BBH", req, 76 + 28) == (8, 12, 16)


@pytest.fixture
def connected() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    client = socket.create_connection(srv.getsockname())
    accepted, _ = srv.accept()
    yield srv, client, accepted
    for s in (srv, client, accepted):
        s.close()


def test_kernel_answers_exact_and_dump(connected) -> None:
    _, client, accepted = connected
    diag = SockDiag()
    try:
        inode = os.fstat(client.fileno()).st_ino
        info = diag.lookup(4, socket.IPPROTO_TCP, client.getsockname(), client.getpeername())
        assert info is not None and info.inode == inode and info.uid == os.getuid()
        # The kernel's bytecode audit accepts the filter, and it selects exactly one.
        dumped = diag.dump_local(
            4, socket.IPPROTO_TCP, client.getsockname(), accepted.getsockname()[1]
        )
        assert [i.inode for i in dumped] == [inode]
        assert diag.dump_local(4, socket.IPPROTO_TCP, ("127.0.0.1", 1), 1) == []
        assert diag.lookup(4, socket.IPPROTO_TCP, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None
        # The wildcard-listener case: the server address is unknown.
        found = diag.find_client(
            socket.IPPROTO_TCP, client.getsockname(), (None, accepted.getsockname()[1])
        )
        assert found is not None and found.inode == inode
    finally:
        diag.close()


def test_kernel_udp_lookup() -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    diag = SockDiag()
    try:
        port = udp.getsockname()[1]
        info = diag.find_client(socket.IPPROTO_UDP, ("127.0.0.1", port), ("127.0.0.1", 1080))
        assert info is not None and info.inode == os.fstat(udp.fileno()).st_ino
    finally:
        diag.close()
        udp.close()


def test_kernel_addresses() -> None:
    local = LocalAddresses()
    addresses = local.refresh()
    assert "127.0.0.1" in addresses
    watch = LocalAddresses.watch_socket()
    watch.close()


# -- /proc ------------------------------------------------------------------------------------


def _fake_proc(root: Path, pid: int, exe: str | None, fds: dict[int, str], comm: str = "x") -> None:
    base = root / str(pid)
    (base / "fd").mkdir(parents=True)
    for fd, target in fds.items():
        (base / "fd" / str(fd)).symlink_to(target)
    if exe is not None:
        (base / "exe").symlink_to(exe)
    (base / "comm").write_text(comm + "\n")


def test_proc_table_finds_and_caches(tmp_path: Path) -> None:
    _fake_proc(
        tmp_path, 10, "/usr/bin/curl", {0: "/dev/null", 3: "socket:[111]", 4: "socket:[222]"}
    )
    _fake_proc(tmp_path, 20, "/opt/app/bin/app (deleted)", {5: "socket:[333]", 6: "pipe:[9]"})
    (tmp_path / "self").mkdir()  # not a pid
    table = ProcTable(str(tmp_path))
    assert table.find(333) == ProcessInfo(20, "app", "/opt/app/bin/app")
    assert table.scans == 1
    # pid 20 was scanned on the way (highest first): 222 is unknown yet, 111 too.
    assert table.find(111) == ProcessInfo(10, "curl", "/usr/bin/curl")
    assert table.scans == 2
    # Both of pid 10's sockets are known now: no scan.
    assert table.find(222) == ProcessInfo(10, "curl", "/usr/bin/curl")
    assert table.scans == 2
    # A descriptor that changed is not believed: 222 now belongs to nobody.
    (tmp_path / "10" / "fd" / "4").unlink()
    (tmp_path / "10" / "fd" / "4").symlink_to("socket:[444]")
    assert table.find(222) is None
    assert table.find(444) == ProcessInfo(10, "curl", "/usr/bin/curl")
    assert table.find(0) is None


def test_proc_table_comm_when_exe_unreadable(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 7, None, {3: "socket:[5]"}, comm="kworker")
    assert ProcTable(str(tmp_path)).find(5) == ProcessInfo(7, "kworker", None)


def test_proc_table_uid_filter(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 7, "/bin/a", {3: "socket:[5]"})
    other_uid = os.stat(tmp_path / "7").st_uid + 1
    assert ProcTable(str(tmp_path)).find(5, other_uid) is None
    assert ProcTable(str(tmp_path)).find(5, os.stat(tmp_path / "7").st_uid) is not None


def test_proc_table_bounded(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 7, "/bin/a", {i: f"socket:[{100 + i}]" for i in range(3, 40)})
    table = ProcTable(str(tmp_path), max_inodes=16)
    assert table.find(120) is not None
    assert len(table._inodes) <= 40


# -- locality and modes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ip", "local"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.2", True),
        ("::ffff:192.0.2.2", True),
        ("fd00::2", True),
        ("192.0.2.3", False),
        ("8.8.8.8", False),
        ("2001:db8::1", False),
        ("", False),
        ("not an ip", False),
    ],
)
def test_locality(ip: str, local: bool) -> None:
    addresses = LocalAddresses(frozenset({"192.0.2.2", "fd00::2"}))
    assert addresses.is_local(ip) is local


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.9")
    assert not is_loopback("10.0.0.1") and not is_loopback("::2")


@pytest.mark.parametrize(
    ("mode", "rules", "expected"),
    [
        ("auto", False, False),
        ("auto", True, True),
        ("always", False, True),
        ("off", True, False),
    ],
)
def test_wanted_by_mode(mode: pl.LookupMode, rules: bool, expected: bool) -> None:
    lookup = ProcessLookup(local=LocalAddresses(frozenset({"192.0.2.2"})))
    assert lookup.wanted("127.0.0.1", mode, rules) is expected
    assert lookup.wanted("192.0.2.2", mode, rules) is expected
    # A remote client is never looked up, whatever the mode.
    assert lookup.wanted("198.51.100.7", mode, rules) is False


def test_service_finds_a_child_process(connected) -> None:
    srv, _, _ = connected
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys; "
            f"s = socket.create_connection({srv.getsockname()!r}); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )
    lookup = ProcessLookup()
    try:
        accepted, peer = srv.accept()
        with accepted:
            found = asyncio.run(lookup.lookup_tcp(peer, (None, srv.getsockname()[1])))
        assert found is not None and found.pid == child.pid
        assert found.path == os.path.realpath(sys.executable)
        assert found.name == os.path.basename(found.path)
        assert lookup.looked_up == 1 and lookup.found == 1
    finally:
        lookup.close()
        assert child.stdin is not None
        child.stdin.close()
        child.wait()


def test_service_sheds_past_its_bound() -> None:
    lookup = ProcessLookup(max_pending=0)
    try:
        assert asyncio.run(lookup.lookup_tcp(("127.0.0.1", 1), ("127.0.0.1", 2))) is None
        assert lookup.shed == 1 and lookup.looked_up == 0
    finally:
        lookup.close()


def test_service_lookup_of_nothing() -> None:
    lookup = ProcessLookup()
    try:
        assert lookup.find(socket.IPPROTO_TCP, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None
        assert lookup.errors == 0
    finally:
        lookup.close()
