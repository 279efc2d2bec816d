"""spliceway.clash.state: Clash names to spliceway tags."""

from __future__ import annotations

from pathlib import Path

from spliceway.clash.state import BLOCK_TAG, BUILTINS, ImportState, Names


def test_builtins_are_defined() -> None:
    names = Names()
    for name in BUILTINS:
        info = names.get(name)
        assert info is not None and info.kind == "builtin"
    assert names.get("DIRECT").tag == "direct"  # type: ignore[union-attr]
    assert names.get("REJECT-DROP").tag == BLOCK_TAG  # type: ignore[union-attr]
    assert names.get("GLOBAL") is None


def test_tags_are_unique_and_reserved_ones_avoided() -> None:
    names = Names()
    assert names.add("🇭🇰 HK", "proxy", "ss").tag == "🇭🇰 HK"
    assert names.add("direct", "proxy", "socks5").tag == "direct (2)"
    assert names.free_tag("REJECT") == "REJECT (2)"
    assert names.free_tag("REJECT") == "REJECT (3)"
    assert names.add("gone", "skipped", "vmess", "no vmess").tag == ""
    assert names.defined("gone") and not names.defined("other")
    assert names.proxies() == ["🇭🇰 HK", "direct"]
    assert not names.block_used
    assert names.block() == BLOCK_TAG and names.block_used


def test_paths_resolve_against_mihomos_home(tmp_path: Path) -> None:
    state = ImportState(home=str(tmp_path), files_dir=str(tmp_path / "f"))
    assert state.resolve("./providers/a.yaml") == str(tmp_path / "providers" / "a.yaml")
    assert state.resolve("/etc/x") == "/etc/x"
    assert state.resolve("../up.yaml") == str(tmp_path.parent / "up.yaml")
    assert state.inside_home(state.resolve("./a/b.yaml"))
    assert not state.inside_home(state.resolve("../up.yaml"))
    assert not state.inside_home("/etc/passwd")
