"""Where providers' content lives: ``spliceway.config.provider_paths``."""

from __future__ import annotations

from spliceway.config import parse_config
from spliceway.config.provider_paths import cache_file_name, provider_content_path


def test_content_paths() -> None:
    config = parse_config(
        {
            "runtime": {"providers_cache_dir": "/var/cache/sw"},
            "providers": {
                "proxies": {"🚀 a/b": {"url": "https://sub.example/"}},
                "rules": {"local": {"path": "/srv/r.txt", "behavior": "ipcidr"}},
            },
        }
    )
    path = provider_content_path(config, "proxies", "🚀 a/b")
    assert path.startswith("/var/cache/sw/proxies/")
    assert "🚀" not in path and cache_file_name("a/b") != cache_file_name("a_b")
    assert provider_content_path(config, "rules", "local") == "/srv/r.txt"
