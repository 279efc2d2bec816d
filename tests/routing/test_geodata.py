"""spliceway.routing.geodata: .mmdb and geosite.dat built here, read back."""

from __future__ import annotations

from pathlib import Path

import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway.routing import geodata


def test_country_networks_merged(tmp_path: Path) -> None:
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(IPSet(["1.0.0.0/24", "1.0.1.0/24"]), {"country": {"iso_code": "CN"}})
    path = tmp_path / "country.mmdb"
    writer.to_db_file(str(path))
    db = geodata.GeoIp.open(str(path))
    assert db.networks("CN") == ((4, 0x01000000, 23),)
    assert db.lookup("1.0.1.9").countries == ("cn",)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(geodata.GeoDataError, match="nope.mmdb"):
        geodata.GeoIp.open(str(tmp_path / "nope.mmdb"))
