"""mihomo's binary rule sets (``format: mrs``): files written by the mihomo binary itself
(``mihomo convert-ruleset``) read back as the same sets as their text; damaged and
hostile bodies refused with a RuleSetError."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
import zstandard

from spliceway.routing.rules import _IpSet
from spliceway.routing.ruleset import MRS_MAX_BYTES, RuleSetError, parse_rule_set
from tests.helpers.mihomo import require_mihomo


def _convert(tmp_path: Path, behavior: str, text: str, name: str) -> bytes:
    exe = require_mihomo()
    source, target = tmp_path / f"{name}.txt", tmp_path / f"{name}.mrs"
    source.write_text(text)
    subprocess.run(
        [str(exe), "convert-ruleset", behavior, "text", str(source), str(target)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return target.read_bytes()


def _domains(rnd: random.Random, n: int) -> list[str]:
    labels = ["a", "b", "cdn", "example", "x-1", "com", "net", "org", "*"]
    out = []
    for _ in range(n):
        name = ".".join(rnd.choice(labels) for _ in range(rnd.randint(1, 4)))
        if name.split(".")[-1] == "*":
            name += ".com"
        out.append(rnd.choice(["", "", "+.", "."]) + name)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_domain_mrs_from_mihomo_reads_as_its_text(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    text = "\n".join(_domains(rnd, 300)) + "\n"
    mrs = parse_rule_set(_convert(tmp_path, "domain", text, f"d{seed}"), "domain", "mrs")
    plain = parse_rule_set(text.encode(), "domain", "text")
    assert (mrs.exact, mrs.suffix, mrs.subdomain) == (plain.exact, plain.suffix, plain.subdomain)
    assert set(mrs.wildcard) == set(plain.wildcard)


def test_big_domain_mrs(tmp_path: Path) -> None:
    text = "\n".join(f"+.d{i}.example{i % 97}.com" for i in range(50_000)) + "\n"
    mrs = parse_rule_set(_convert(tmp_path, "domain", text, "big"), "domain", "mrs")
    assert len(mrs.suffix) == 50_000 and mrs.count == 50_000


def test_ipcidr_mrs_from_mihomo_covers_the_same_addresses(tmp_path: Path) -> None:
    rnd = random.Random(7)
    nets = [
        f"{rnd.randrange(1, 224)}.{rnd.randrange(256)}.{rnd.randrange(256)}.0"
        f"/{rnd.choice([16, 20, 24, 32])}"
        for _ in range(300)
    ]
    nets += [f"2001:db8:{rnd.randrange(65536):x}::/{rnd.choice([48, 64])}" for _ in range(50)]
    text = "\n".join(nets) + "\n"
    mrs = parse_rule_set(_convert(tmp_path, "ipcidr", text, "c"), "ipcidr", "mrs")
    plain = parse_rule_set(text.encode(), "ipcidr", "text")
    a, b = _IpSet(mrs.cidr), _IpSet(plain.cidr)
    assert (a._starts, a._ends) == (b._starts, b._ends)


def test_damaged_and_hostile_mrs(tmp_path: Path) -> None:
    good = _convert(tmp_path, "domain", "\n".join(_domains(random.Random(1), 200)), "g")
    raw = zstandard.ZstdDecompressor().stream_reader(good).read()
    rnd = random.Random(29)
    messages = []
    for _ in range(300):
        body = bytearray(raw)
        for _ in range(rnd.randint(1, 8)):
            body[rnd.randrange(len(body))] = rnd.randrange(256)
        if rnd.random() < 0.3:
            body = body[: rnd.randrange(len(body))]
        try:
            parse_rule_set(zstandard.ZstdCompressor().compress(bytes(body)), "domain", "mrs")
        except RuleSetError as ex:
            messages.append(str(ex))
    assert messages  # damage is noticed where it breaks the structure; never another error
    with pytest.raises(RuleSetError, match="not zstd"):
        parse_rule_set(b"MRS\x01 not compressed", "domain", "mrs")
    with pytest.raises(RuleSetError, match="holds a domain set, not ipcidr"):
        parse_rule_set(good, "ipcidr", "mrs")
    with pytest.raises(RuleSetError, match="domain or ipcidr sets only"):
        parse_rule_set(good, "classical", "mrs")
    # A zstd bomb: a few kilobytes that would decompress past the limit.
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(1024 * 1024)
    bomb = compressor.compress(b"MRS\x01\x00")
    for _ in range(MRS_MAX_BYTES // len(chunk) + 1):
        bomb += compressor.compress(chunk)
    bomb += compressor.flush()
    assert len(bomb) < 100_000
    with pytest.raises(RuleSetError, match="decompresses to more than"):
        parse_rule_set(bomb, "domain", "mrs")
