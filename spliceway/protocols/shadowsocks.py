"""Shadowsocks AEAD stream framing (SIP004), sans I/O: the codec for the shadowsocks outbound.

Wire format of each direction: ``salt`` (key-size random bytes), then chunks of
``seal(len_be16) || seal(payload)``, each ``seal`` adding a 16-byte tag, with
payloads of at most 0x3FFF bytes. The per-session subkey is
HKDF-SHA1(master key, salt, info=b"ss-subkey"); the master key is OpenSSL's
EVP_BytesToKey(MD5) of the password. The nonce is a 12-byte little-endian counter
that starts at zero and grows by one after every seal or open, so chunks cannot
be reordered, dropped or replayed within a session without failing
authentication. The client's first payload starts with the target in SOCKS5
address form (``ATYP ADDR PORT``).

Crypto comes from ``cryptography`` (AESGCM, ChaCha20Poly1305, HKDF); nothing
here is hand-rolled beyond the framing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from spliceway.protocols import ProtocolError
from spliceway.protocols.socks5 import encode_address, parse_udp_datagram

__all__ = [
    "CIPHERS",
    "MAX_PAYLOAD",
    "TAG_SIZE",
    "Cipher",
    "Decryptor",
    "Encryptor",
    "master_key",
    "target_header",
]

MAX_PAYLOAD = 0x3FFF
TAG_SIZE = 16
_NONCE_SIZE = 12
_INFO = b"ss-subkey"


@dataclass(frozen=True, slots=True)
class Cipher:
    """One AEAD method: its key (and salt) size and the primitive implementing it."""

    name: str
    key_size: int
    aead: type[AESGCM] | type[ChaCha20Poly1305]


CIPHERS: dict[str, Cipher] = {
    c.name: c
    for c in (
        Cipher("aes-128-gcm", 16, AESGCM),
        Cipher("aes-256-gcm", 32, AESGCM),
        Cipher("chacha20-ietf-poly1305", 32, ChaCha20Poly1305),
    )
}


def master_key(password: str, key_size: int) -> bytes:
    """OpenSSL EVP_BytesToKey with MD5, no salt, one iteration: what every
    shadowsocks implementation derives from a password."""
    secret = password.encode("utf-8")
    out = b""
    block = b""
    while len(out) < key_size:
        block = hashlib.md5(block + secret).digest()
        out += block
    return out[:key_size]


def _subkey(master: bytes, salt: bytes) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA1(), length=len(master), salt=salt, info=_INFO)
    return hkdf.derive(master)


class _Session:
    def __init__(self, cipher: Cipher, master: bytes, salt: bytes) -> None:
        self._key = _subkey(master, salt)
        self._aead = cipher.aead(self._key)
        self._counter = 0

    def _nonce(self) -> bytes:
        nonce = self._counter.to_bytes(_NONCE_SIZE, "little")
        self._counter += 1
        return nonce


class Encryptor(_Session):
    """Seals one direction of a session; ``header`` (the salt) goes out first."""

    def __init__(self, cipher: Cipher, master: bytes, salt: bytes | None = None) -> None:
        self.header = os.urandom(cipher.key_size) if salt is None else salt
        if len(self.header) != cipher.key_size:
            raise ValueError(f"{cipher.name} needs a {cipher.key_size}-byte salt")
        super().__init__(cipher, master, self.header)

    @property
    def subkey(self) -> bytes:
        """The session subkey (HKDF of the master key and ``header``)."""
        return self._key

    @property
    def nonce_counter(self) -> int:
        """The nonce counter the next seal will use (so another sealer can continue)."""
        return self._counter

    def seal(self, data: bytes | bytearray | memoryview) -> bytes:
        """The chunks carrying ``data`` (empty data gives no chunk)."""
        view = memoryview(data)
        out = []
        for start in range(0, len(view), MAX_PAYLOAD):
            piece = view[start : start + MAX_PAYLOAD]
            out.append(self._aead.encrypt(self._nonce(), len(piece).to_bytes(2, "big"), None))
            out.append(self._aead.encrypt(self._nonce(), bytes(piece), None))
        return b"".join(out)


class Decryptor:
    """Opens one direction of a session, fed arbitrary fragments of the stream.

    Raises ``ProtocolError`` on a failed tag or an oversized length: the peer
    does not hold the key, or the stream was tampered with; either way the
    connection must be closed.
    """

    def __init__(self, cipher: Cipher, master: bytes) -> None:
        self._cipher = cipher
        self._master = master
        self._session: _Session | None = None
        self._buf = bytearray()
        self._pending_len: int | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> bytes:
        """Plaintext completed by ``data`` (possibly empty)."""
        self._buf += data
        if self._session is None:
            size = self._cipher.key_size
            if len(self._buf) < size:
                return b""
            salt = bytes(self._buf[:size])
            del self._buf[:size]
            self._session = _Session(self._cipher, self._master, salt)
        session = self._session
        out = []
        while True:
            if self._pending_len is None:
                if len(self._buf) < 2 + TAG_SIZE:
                    break
                head = self._open(session, self._buf[: 2 + TAG_SIZE])
                del self._buf[: 2 + TAG_SIZE]
                length = int.from_bytes(head, "big")
                if not 0 < length <= MAX_PAYLOAD:
                    raise ProtocolError(f"shadowsocks chunk length {length} out of range")
                self._pending_len = length
            need = self._pending_len + TAG_SIZE
            if len(self._buf) < need:
                break
            out.append(self._open(session, self._buf[:need]))
            del self._buf[:need]
            self._pending_len = None
        return b"".join(out)

    @staticmethod
    def _open(session: _Session, sealed: bytes | bytearray) -> bytes:
        try:
            return session._aead.decrypt(session._nonce(), bytes(sealed), None)
        except InvalidTag as ex:
            raise ProtocolError("shadowsocks authentication failed (wrong key or tampered)") from ex


def target_header(host: str, port: int) -> bytes:
    """The target in SOCKS5 address form, the start of the client's first payload."""
    return encode_address(host, port)


#: A UDP packet's nonce: each packet has its own salt, so the nonce never repeats.
_ZERO_NONCE = bytes(_NONCE_SIZE)


def seal_packet(cipher: Cipher, master: bytes, host: str, port: int, payload: bytes) -> bytes:
    """One shadowsocks AEAD UDP packet (SIP004): ``salt || seal(target || payload)``."""
    salt = os.urandom(cipher.key_size)
    body = encode_address(host, port) + payload
    return salt + cipher.aead(_subkey(master, salt)).encrypt(_ZERO_NONCE, body, None)


def open_packet(cipher: Cipher, master: bytes, packet: bytes) -> tuple[str, int, bytes]:
    """(source host, port, payload) of a sealed UDP packet; ProtocolError when it is too
    short, fails authentication, or its address does not parse."""
    size = cipher.key_size
    if len(packet) < size + TAG_SIZE:
        raise ProtocolError("shadowsocks UDP packet shorter than salt and tag")
    salt = packet[:size]
    try:
        body = cipher.aead(_subkey(master, salt)).decrypt(_ZERO_NONCE, packet[size:], None)
    except InvalidTag as ex:
        raise ProtocolError("shadowsocks authentication failed (wrong key or tampered)") from ex
    # The body is a SOCKS5 UDP datagram without its RSV and FRAG: parse it as one.
    datagram = parse_udp_datagram(bytes(3) + body)
    return datagram.host, datagram.port, datagram.payload
