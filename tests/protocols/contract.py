"""The sans-I/O parser contract of ``spliceway.protocols``, checked the same way for every codec."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from spliceway.protocols import NEED_MORE, ProtocolError


def check_contract(parser: Callable[[bytes], Any], buf: bytes, trailer: bytes) -> Any:
    """NEED_MORE, a result with 0 < consumed <= len, or ProtocolError (returned, not raised).

    A result depends only on the bytes it consumed: the same parse follows from those bytes
    alone and from those bytes plus ``trailer`` (whatever follows is the caller's).
    """
    try:
        result = parser(buf)
    except ProtocolError as exc:
        result = exc
    if isinstance(result, ProtocolError):
        assert isinstance(result.message, str)
        assert result.reply is None or isinstance(result.reply, bytes)
        return result
    if result is NEED_MORE:
        return result
    assert 0 < result.consumed <= len(buf)
    assert parser(buf[: result.consumed]) == result
    assert parser(bytearray(buf[: result.consumed]) + trailer) == result
    return result


def check_prefixes(parser: Callable[[bytes], Any], message: bytes) -> None:
    """Every strict prefix of a complete message asks for more."""
    for cut in range(len(message)):
        assert parser(message[:cut]) is NEED_MORE, message[:cut]


def mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    """Valid messages with a few bytes replaced, inserted or deleted."""
    return st.sampled_from(seeds).flatmap(
        lambda seed: st.tuples(
            st.integers(0, len(seed)), st.integers(0, 3), st.binary(max_size=4)
        ).map(lambda t: seed[: t[0]] + t[2] + seed[t[0] + t[1] :])
    )
