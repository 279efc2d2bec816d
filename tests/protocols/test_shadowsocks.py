"""Shadowsocks AEAD framing: key vectors, round trips over any fragmentation, tampering."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.protocols import ProtocolError
from spliceway.protocols import shadowsocks as ss
from spliceway.protocols.shadowsocks import (
    CIPHERS,
    MAX_PAYLOAD,
    TAG_SIZE,
    Decryptor,
    Encryptor,
    _subkey,
    master_key,
    target_header,
)

METHODS = sorted(CIPHERS)


def test_master_key_matches_openssl_evp_bytes_to_key() -> None:
    # `openssl enc -aes-256-cbc -k password -P -md md5 -nosalt` and the 128-bit analogue.
    assert master_key("password", 32).hex().upper() == (
        "5F4DCC3B5AA765D61D8327DEB882CF992B95990A9151374ABD8FF8C5A7A0FE08"
    )
    assert master_key("secret", 16).hex().upper() == "5EBE2294ECD0E0F08EAB7690D2A6EE69"


def _rfc5869_sha1(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    prk = hmac.new(salt, ikm, hashlib.sha1).digest()
    okm, block, i = b"", b"", 1
    while len(okm) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha1).digest()
        okm += block
        i += 1
    return okm[:length]


@pytest.mark.parametrize("method", METHODS)
def test_subkey_is_hkdf_sha1_ss_subkey(method: str) -> None:
    size = CIPHERS[method].key_size
    master, salt = master_key("k", size), bytes(range(size))
    assert _subkey(master, salt) == _rfc5869_sha1(master, salt, b"ss-subkey", size)


@pytest.mark.parametrize("method", METHODS)
def test_chunk_layout(method: str) -> None:
    cipher = CIPHERS[method]
    enc = Encryptor(cipher, master_key("k", cipher.key_size))
    assert len(enc.header) == cipher.key_size
    assert len(enc.seal(b"x")) == 2 + TAG_SIZE + 1 + TAG_SIZE
    assert enc.seal(b"") == b""
    big = enc.seal(b"y" * (MAX_PAYLOAD + 1))
    assert len(big) == 2 * (2 + TAG_SIZE) + MAX_PAYLOAD + 1 + 2 * TAG_SIZE


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(METHODS),
    messages=st.lists(st.binary(max_size=40000), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=1, max_value=5000), max_size=30),
)
def test_round_trip_over_any_fragmentation(
    method: str, messages: list[bytes], cuts: list[int]
) -> None:
    cipher = CIPHERS[method]
    master = master_key("pw", cipher.key_size)
    enc = Encryptor(cipher, master)
    stream = enc.header + b"".join(enc.seal(m) for m in messages)
    dec = Decryptor(cipher, master)
    out, pos = [], 0
    for cut in cuts:
        out.append(dec.feed(stream[pos : pos + cut]))
        pos += cut
    out.append(dec.feed(stream[pos:]))
    assert b"".join(out) == b"".join(messages)


@pytest.mark.parametrize("method", METHODS)
def test_tampering_and_wrong_key_fail_authentication(method: str) -> None:
    cipher = CIPHERS[method]
    master = master_key("pw", cipher.key_size)
    enc = Encryptor(cipher, master)
    stream = bytearray(enc.header + enc.seal(b"hello world"))
    with pytest.raises(ProtocolError):
        Decryptor(cipher, master_key("other", cipher.key_size)).feed(bytes(stream))
    for index in (cipher.key_size, cipher.key_size + 2 + TAG_SIZE + 3, len(stream) - 1):
        bad = bytearray(stream)
        bad[index] ^= 0x01
        with pytest.raises(ProtocolError):
            Decryptor(cipher, master).feed(bytes(bad))


@pytest.mark.parametrize("method", METHODS)
def test_reordered_chunks_fail(method: str) -> None:
    cipher = CIPHERS[method]
    master = master_key("pw", cipher.key_size)
    enc = Encryptor(cipher, master)
    first, second = enc.seal(b"one"), enc.seal(b"two")
    with pytest.raises(ProtocolError):
        Decryptor(cipher, master).feed(enc.header + second + first)


def test_target_header_is_socks5_address_form() -> None:
    assert target_header("127.0.0.1", 80) == b"\x01\x7f\x00\x00\x01\x00\x50"
    assert target_header("a.b", 443) == b"\x03\x03a.b\x01\xbb"


# -- UDP packets (SIP004: a salt per packet, nonce zero) ---------------------------------


@pytest.mark.parametrize("method", sorted(ss.CIPHERS))
def test_udp_packet_round_trip_and_size(method):
    cipher = ss.CIPHERS[method]
    key = ss.master_key("pw", cipher.key_size)
    packet = ss.seal_packet(cipher, key, "example.com", 53, b"query")
    assert len(packet) == cipher.key_size + (1 + 1 + 11 + 2) + 5 + ss.TAG_SIZE
    assert ss.open_packet(cipher, key, packet) == ("example.com", 53, b"query")
    # Every packet has its own salt.
    assert (
        ss.seal_packet(cipher, key, "example.com", 53, b"query")[: cipher.key_size]
        != (packet[: cipher.key_size])
    )
    with pytest.raises(ProtocolError):
        ss.open_packet(cipher, ss.master_key("other", cipher.key_size), packet)
    with pytest.raises(ProtocolError):
        ss.open_packet(cipher, key, packet[:-1])


@given(st.binary(max_size=200))
def test_open_packet_rejects_garbage_with_protocol_error_only(data):
    cipher = ss.CIPHERS["aes-128-gcm"]
    with pytest.raises(ProtocolError):
        ss.open_packet(cipher, ss.master_key("pw", 16), data)
