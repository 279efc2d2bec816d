"""Target hosts in canonical form: every spelling of an IP address becomes that address.

Reference: docs/configuration.md (rules, "How a target host is read"). Pure functions,
no I/O; ``csrc/iplit.c`` (``sw_host_canon``) is the C twin, held to the same output by
``tests/csrc/test_hostnorm_diff.py``.

A client may name a target in a form that the engine's resolver, the C library or a
browser reads as an IP address although it is not the dotted quad an ``ip_cidr`` rule
would recognise: ``2130706433``, ``0x7f.0.0.1``, ``0x7f000001``, ``127.1``,
``0177.0.0.1``, ``127.0.0.1.``, ``0``, ``::ffff:127.0.0.1``. Routing such a host as a
domain name and letting the resolver turn it into 127.0.0.1 afterwards would walk around
every IP rule, so the engine reads the host here, once, before routing, and from then on
the flow's target is the address (routed, dialled, and written in the flow record).

What reads as an IPv4 address (:func:`target_address`):

- the WHATWG URL host parser's IPv4 numbers, which include everything glibc's
  ``inet_aton``/``getaddrinfo`` accept: one to four dot-separated parts, each decimal,
  octal (a leading ``0``) or hexadecimal (``0x``/``0X``, possibly with no digit after it,
  which is 0); every part but the last at most 255, the last filling the remaining bytes
  (``127.1`` is 127.0.0.1, ``2130706433`` is one 32-bit number); one trailing dot allowed;
- glibc's ``inet_aton`` also ignores anything after an ASCII whitespace character that
  follows an address (``"127.1 x"``): such a host reads as that address too, and so does
  one whose text before a NUL is an address (all a C function reads of it). Nothing else
  trailing is ignored: ``4chan.org`` is a name (``getaddrinfo`` and browsers agree);
- an IPv4-mapped IPv6 address (``::ffff:a.b.c.d`` in any IPv6 spelling), which a socket
  reaches as the IPv4 address;
- a non-ASCII host whose IDNA form (what the resolver and ``socket.getaddrinfo`` use) is
  one of the above: 127.0.0.1 in fullwidth digits (U+FF11...) is 127.0.0.1.

The unspecified addresses are where Linux connects to: a connection to 0.0.0.0 reaches
127.0.0.1 and one to ``::`` reaches ``::1``, so ``0`` (which is 0.0.0.0) is 127.0.0.1.

IPv6 text (brackets allowed) is written as :mod:`ipaddress` writes it (RFC 5952), a
scope id (``fe80::1%eth0``) kept. Any other host is a domain name, given back as it came
except for one trailing dot, which is dropped (``example.com.`` is ``example.com``; ``a..``
and ``::1.`` stay, so the function is idempotent), unless it has a ``%`` (a
percent-escape no resolver decodes): that is left as given.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["canonical_host", "target_address"]

_HEX = frozenset("0123456789abcdefABCDEF")
_OCT = frozenset("01234567")
_DEC = frozenset("0123456789")
# str.isspace's ASCII members are exactly C's isspace() in the "C" locale.
_SPACE = " \t\n\v\f\r"
_SPACE_SET = frozenset(_SPACE)
# What an IPv4 number can end with ("0x" alone is one: 0).
_NUMBER_END = _HEX | {"x", "X"}
_LOOPBACK4 = "127.0.0.1"
# A host that may read as IPv4: its last label (one trailing dot aside) is a number
# (decimal, or "0x"/"0X" and hex digits), or it has ASCII whitespace (inet_aton).
_MAYBE_V4 = re.compile(r"(?:^|\.)(?:[0-9]+|0[xX][0-9a-fA-F]*)\.?$|[ \t\n\v\f\r]")


def _whatwg_number(part: str) -> int | None:
    """The WHATWG "IPv4 number parser": the value, or None on failure."""
    if not part:
        return None
    digits = _DEC
    if len(part) >= 2 and part[:2] in ("0x", "0X"):
        part, digits = part[2:], _HEX
        base = 16
    elif len(part) >= 2 and part[0] == "0":
        part, digits = part[1:], _OCT
        base = 8
    else:
        base = 10
    if not part:
        return 0
    if not all(c in digits for c in part):
        return None
    return int(part, base)


def _whatwg_ipv4(text: str) -> int | None:
    """The WHATWG IPv4 parser (one trailing dot allowed): the address, or None."""
    parts = text.split(".")
    if parts[-1] == "" and len(parts) > 1:
        parts.pop()
    if len(parts) > 4:
        return None
    numbers: list[int] = []
    for part in parts:
        n = _whatwg_number(part)
        if n is None:
            return None
        numbers.append(n)
    if any(n > 255 for n in numbers[:-1]):
        return None
    if numbers[-1] >= 256 ** (5 - len(numbers)):
        return None
    value = numbers[-1]
    for i, n in enumerate(numbers[:-1]):
        value += n << (8 * (3 - i))
    return value


def _aton_prefix(text: str) -> int | None:
    """glibc ``inet_aton``: an address, then ASCII whitespace and anything; else None."""
    cut = min((i for i in (text.find(c) for c in _SPACE) if i >= 0), default=-1)
    if cut <= 0:
        return None
    head = text[:cut]
    # inet_aton's parts each start with a digit and "0x" needs a hex digit after it;
    # no trailing dot. Within that, the WHATWG parser agrees with it.
    for part in head.split("."):
        if not part or part[0] not in _DEC or part in ("0x", "0X"):
            return None
    if head.endswith("."):
        return None
    return _whatwg_ipv4(head)


def _v4_text(value: int) -> str:
    if value == 0:
        return _LOOPBACK4
    return f"{value >> 24}.{(value >> 16) & 255}.{(value >> 8) & 255}.{value & 255}"


def _v6_text(text: str) -> str | None:
    """An IPv6 literal canonically: mapped ones as IPv4, a scope id kept; else None."""
    try:
        ip = ipaddress.IPv6Address(text)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped
    if mapped is not None:
        return _v4_text(int(mapped))
    value = int(ip)
    base = "::1" if value == 0 else str(ipaddress.IPv6Address(value))
    return base if ip.scope_id is None else f"{base}%{ip.scope_id}"


def _ascii_address(host: str) -> str | None:
    if host[0] == "[" and host[-1] == "]":
        inner = host[1:-1]
        if ":" in inner:
            return _v6_text(inner)
        # routing has always read "[a.b.c.d]" as the address: strict dotted quads only.
        try:
            return _v4_text(int(ipaddress.IPv4Address(inner)))
        except ValueError:
            return None
    if ":" in host:
        address = _v6_text(host)
        if address is not None:
            return address  # else maybe inet_aton's, before whitespace ("0 :")
    last = host[-2] if host[-1] == "." and len(host) > 1 else host[-1]
    if last not in _NUMBER_END and _SPACE_SET.isdisjoint(host):
        return None  # the common case, a domain name, at a glance
    if _MAYBE_V4.search(host) is None:
        return None  # a domain name still: no parsing
    value = _whatwg_ipv4(host)
    if value is None:
        value = _aton_prefix(host)
    return None if value is None else _v4_text(value)


def target_address(host: str) -> str | None:
    """The canonical text of the IP address ``host`` reads as (see the module), else None."""
    # A C string ends at a NUL: that is all getaddrinfo or inet_aton would read.
    host = host.partition("\x00")[0]
    if not host:
        return None
    if "%" in host:
        # Only a scoped IPv6 address has one (percent-escapes are names no one decodes),
        # unless it comes after what inet_aton reads.
        inner = host[1:-1] if host[0] == "[" and host[-1] == "]" else host
        address = _v6_text(inner) if ":" in inner else None
        if address is not None:
            return address
        value = _aton_prefix(host)
        return None if value is None else _v4_text(value)
    if not host.isascii():
        try:
            name = host.encode("idna").decode("ascii")
        except UnicodeError:
            name = ""
        address = _ascii_address(name) if name and "%" not in name else None
        if address is None:
            # inet_aton reads an address before whitespace whatever follows it.
            value = _aton_prefix(host)
            address = None if value is None else _v4_text(value)
        return address
    return _ascii_address(host)


def canonical_host(host: str) -> str:
    """``host`` as the engine routes and dials it: an address canonically (see
    :func:`target_address`), a domain name without one trailing dot, else as given."""
    address = target_address(host)
    if address is not None:
        return address
    if len(host) > 1 and host[-1] == "." and host[-2] != "." and "%" not in host:
        name = host[:-1]
        # "::1." is no address, but "::1" would be: such a name keeps its dot.
        return name if target_address(name) is None else host
    return host
