"""spliceway.routing.geodata: .mmdb and geosite.dat files built here, read back."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway.routing import geodata


def _mmdb(path: Path, records: list[tuple[list[str], object]], **kw: object) -> Path:
    writer = MMDBWriter(**{"ip_version": 6, "ipv4_compatible": True, **kw})  # type: ignore[arg-type]
    for nets, record in records:
        writer.insert_network(IPSet(nets), record)  # type: ignore[arg-type]
    writer.to_db_file(str(path))
    return path


def test_country_networks_merged_and_looked_up(tmp_path: Path) -> None:
    path = _mmdb(
        tmp_path / "country.mmdb",
        [
            (["1.0.0.0/24", "1.0.1.0/24", "1.0.2.0/23"], {"country": {"iso_code": "CN"}}),
            (["240e::/20"], {"country": {"iso_code": "CN"}}),
            (
                ["8.8.8.0/24"],
                {"country": {"iso_code": "US"}, "registered_country": {"iso_code": "CA"}},
            ),
            (["9.9.9.0/24"], {"registered_country": {"iso_code": "CH"}}),
            (["10.0.0.0/8"], {"continent": {"code": "AS"}}),
        ],
        database_type="GeoLite2-Country",
    )
    db = geodata.GeoIp.open(str(path))
    assert db.networks("CN") == ((4, 0x01000000, 22), (6, int(ipaddress.IPv6Address("240e::")), 20))
    assert db.networks("us") == ((4, 0x08080800, 24),)
    assert db.networks("ca") == ()  # country wins over registered_country
    assert db.networks("ch") == ((4, 0x09090900, 24),)
    assert db.networks("zz") == ()
    assert db.codes() == {"cn", "us", "ch"}
    assert db.lookup("1.0.3.9") == geodata.GeoRecord(("cn",), None)
    assert db.lookup("::ffff:8.8.8.8").countries == ("us",)
    assert db.lookup("10.1.1.1") == geodata.GeoRecord((), None)
    assert db.lookup("192.0.2.1") == geodata.GeoRecord((), None)


def test_asn_database(tmp_path: Path) -> None:
    path = _mmdb(
        tmp_path / "asn.mmdb",
        [
            (
                ["1.1.1.0/24", "1.0.0.0/24"],
                {"autonomous_system_number": 13335, "autonomous_system_organization": "CF"},
            ),
            (["2606:4700::/32"], {"autonomous_system_number": 13335}),
            (["8.8.8.0/24"], {"asn": "AS15169", "name": "Google"}),
        ],
        database_type="GeoLite2-ASN",
    )
    db = geodata.GeoIp.open(str(path))
    assert db.asn_networks(13335) == (
        (4, 0x01000000, 24),
        (4, 0x01010100, 24),
        (6, int(ipaddress.IPv6Address("2606:4700::")), 32),
    )
    assert db.asn_networks(15169) == ((4, 0x08080800, 24),)
    assert db.lookup("1.1.1.1").asn == 13335


def test_sing_and_meta_databases(tmp_path: Path) -> None:
    sing = _mmdb(tmp_path / "sing.mmdb", [(["1.0.0.0/24"], "cn")], database_type="sing-geoip")
    assert geodata.GeoIp.open(str(sing)).networks("CN") == ((4, 0x01000000, 24),)
    meta = _mmdb(
        tmp_path / "meta.mmdb",
        [(["1.0.0.0/24"], ["cn", "private"]), (["2.0.0.0/24"], "us")],
        database_type="Meta-geoip0",
    )
    db = geodata.GeoIp.open(str(meta))
    assert db.networks("private") == ((4, 0x01000000, 24),)
    assert db.networks("us") == ((4, 0x02000000, 24),)


def test_ipv4_only_database(tmp_path: Path) -> None:
    path = _mmdb(
        tmp_path / "v4.mmdb",
        [(["5.5.0.0/16"], {"country": {"iso_code": "DE"}})],
        ip_version=4,
        ipv4_compatible=False,
    )
    db = geodata.GeoIp.open(str(path))
    assert db.networks("de") == ((4, 0x05050000, 16),)
    assert db.lookup("2001:db8::1").countries == ()


def test_memoised_by_file_identity(tmp_path: Path) -> None:
    path = _mmdb(tmp_path / "c.mmdb", [(["1.0.0.0/24"], {"country": {"iso_code": "CN"}})])
    first = geodata.GeoIp.open(str(path))
    assert geodata.GeoIp.open(str(path)) is first
    _mmdb(path, [(["2.0.0.0/24"], {"country": {"iso_code": "CN"}})])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = geodata.GeoIp.open(str(path))
    assert second is not first
    assert second.networks("cn") == ((4, 0x02000000, 24),)


def test_bad_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(geodata.GeoDataError, match=r"nope\.mmdb: cannot read"):
        geodata.GeoIp.open(str(tmp_path / "nope.mmdb"))
    junk = tmp_path / "junk.mmdb"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(geodata.GeoDataError, match=r"junk\.mmdb: not a MaxMind database"):
        geodata.GeoIp.open(str(junk))
    dat = tmp_path / "junk.dat"
    dat.write_bytes(b"\xff\xff\xff\xff garbage")
    with pytest.raises(geodata.GeoDataError, match=r"junk\.dat: not a geosite\.dat"):
        geodata.GeoSite.open(str(dat))
    empty = tmp_path / "empty.dat"
    empty.write_bytes(b"")
    with pytest.raises(geodata.GeoDataError, match="no list"):
        geodata.GeoSite.open(str(empty))


def test_geosite_lists(tmp_path: Path) -> None:
    sites = geodata.GeoSiteListMessage()
    google = sites.entry.add(country_code="GOOGLE")
    for kind, value, attrs in [
        (2, "google.com", ["cn"]),
        (2, "Google.CN.", ["cn", "ads"]),
        (3, "www.youtube.com", []),
        (0, "gstatic", ["ads"]),
        (1, r"^ads\d+\.", []),
        (1, r"(?<bad>x)", []),
        (2, "bad name", []),
        (2, "例子.测试", []),
    ]:
        entry = google.domain.add(type=kind, value=value)
        for key in attrs:
            entry.attribute.add(key=key, bool_value=True)
    path = tmp_path / "geosite.dat"
    path.write_bytes(sites.SerializeToString())
    db = geodata.GeoSite.open(str(path))
    assert db.names() == {"google"}
    everything = db.domains("Google")
    assert everything.suffix == {"google.com", "google.cn", "xn--fsqu00a.xn--0zwm56d"}
    assert everything.exact == {"www.youtube.com"}
    assert everything.keyword == ("gstatic",)
    assert everything.regex == (r"^ads\d+\.",)
    assert (everything.count, everything.skipped) == (6, 2)
    assert db.domains("google@cn").suffix == {"google.com", "google.cn"}
    both = db.domains("google@cn@ads")
    assert both.suffix == {"google.cn"} and both.keyword == ()
    assert db.domains("google@ADS").keyword == ("gstatic",)
    with pytest.raises(KeyError):
        db.domains("nope")


@given(
    version=st.sampled_from([4, 6]),
    a=st.integers(0, 2**32 - 1),
    b=st.integers(0, 2**32 - 1),
    shift=st.sampled_from([0, 96]),
)
def test_range_to_cidrs_is_the_minimal_cover(version: int, a: int, b: int, shift: int) -> None:
    first, last = sorted((a, b))
    if version == 6:
        first, last = first << shift, (last << shift) | ((1 << shift) - 1)
    got = list(geodata.range_to_cidrs(version, first, last))
    make = ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address
    want = list(ipaddress.summarize_address_range(make(first), make(last)))
    assert got == [(version, int(n.network_address), n.prefixlen) for n in want]


def test_damaged_files_fail_as_geodata_errors(tmp_path: Path) -> None:
    """Bytes flipped and files cut: every failure is a GeoDataError naming the file (the
    pure-Python reader: libmaxminddb's C one corrupts its heap on such files)."""
    import random

    rnd = random.Random(29)
    path = _mmdb(
        tmp_path / "good.mmdb",
        [
            (
                [f"{i % 223 + 1}.{i}.0.0/16"],
                {"country": {"iso_code": "C" + chr(65 + i % 26)}, "autonomous_system_number": i},
            )
            for i in range(1, 120)
        ],
    )
    sites = geodata.GeoSiteListMessage()
    for k in range(10):
        entry = sites.entry.add(country_code=f"L{k}")
        for j in range(20):
            entry.domain.add(type=j % 4, value=f"d{j}.x{k}.com").attribute.add(
                key="a", bool_value=True
            )
    bodies = {"mmdb": path.read_bytes(), "dat": sites.SerializeToString()}
    messages: list[tuple[str, str]] = []
    for n in range(150):
        for kind, good in bodies.items():
            body = bytearray(good)
            for _ in range(rnd.randint(1, 20)):
                body[rnd.randrange(len(body))] = rnd.randrange(256)
            if rnd.random() < 0.3:
                body = body[: rnd.randrange(len(body))]
            damaged = tmp_path / f"damaged{n}.{kind}"
            damaged.write_bytes(bytes(body))
            try:
                if kind == "mmdb":
                    db = geodata.GeoIp.open(str(damaged))
                    db.networks("ca")
                    db.asn_networks(5)
                    db.lookup("1.1.1.1")
                else:
                    site = geodata.GeoSite.open(str(damaged))
                    for name in site.names():
                        site.domains(name)
            except geodata.GeoDataError as ex:
                messages.append((damaged.name, str(ex)))
    assert len(messages) > 200  # most damage is noticed; what is not read back is harmless
    assert all(name in message for name, message in messages)


@pytest.mark.parametrize("ip_version", [4, 6])
def test_walk_matches_maxminddb_iteration(tmp_path: Path, ip_version: int) -> None:
    """Networks by code from spliceway's walk of the search tree equal maxminddb's own
    iteration, collapsed (random IPv4 and IPv6 networks, a few codes)."""
    import random

    import maxminddb

    rnd = random.Random(ip_version)
    records: dict[str, list[str]] = {}
    for _ in range(400):
        code = rnd.choice(["aa", "bb", "cc", "dd"])
        if ip_version == 6 and rnd.random() < 0.3:
            head = f"2{rnd.randrange(16):x}{rnd.randrange(256):02x}:{rnd.randrange(65536):x}"
            net = f"{head}::/{rnd.choice([32, 48, 64])}"
        else:
            head = f"{rnd.randrange(1, 224)}.{rnd.randrange(256)}.{rnd.randrange(256)}"
            net = f"{head}.0/{rnd.choice([16, 20, 24])}"
        records.setdefault(code, []).append(net)
    path = _mmdb(
        tmp_path / "r.mmdb",
        [(nets, {"country": {"iso_code": code.upper()}}) for code, nets in records.items()],
        ip_version=ip_version,
        ipv4_compatible=ip_version == 6,
    )
    reference: dict[str, list[ipaddress.IPv4Network | ipaddress.IPv6Network]] = {}
    with maxminddb.open_database(str(path), maxminddb.MODE_MMAP) as reader:
        for network, record in reader:
            reference.setdefault(record["country"]["iso_code"].lower(), []).append(network)  # type: ignore[index,call-overload]
    db = geodata.GeoIp.open(str(path))
    for code in records:
        want = []
        for version in (4, 6):
            nets = [n for n in reference.get(code, []) if n.version == version]
            want += [
                (version, int(n.network_address), n.prefixlen)
                for n in ipaddress.collapse_addresses(nets)
            ]  # type: ignore[arg-type]
        assert list(db.networks(code)) == want, code
