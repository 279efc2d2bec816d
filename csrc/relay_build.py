"""cffi build script for ``spliceway._relay`` (named by setup.py's ``cffi_modules``).

The cdef is the marked section of each module's header (``relay.h``, ``iplit.h``,
``parse.h``, ``route.h``, ``pkt.h``, ``tun.h``, ``conn.h``, ``udp.h``) itself, so the declarations
Python sees can never drift from the ones the C code is compiled against.

``SPLICEWAY_RELAY_SANITIZE=address`` (or ``thread``, ``undefined``, comma
separated) builds an instrumented debug extension; load it with the matching
runtime preloaded, e.g. ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``.

``SPLICEWAY_RELAY_WERROR=1`` adds ``-Werror`` to ``-Wall -Wextra``: CI builds so, and
the sources build warning-free with the gcc of Debian 12 (12.2).

Run directly (``python csrc/relay_build.py``) to compile in place for quick
iteration; pip builds go through setup.py.
"""

import os
import pathlib
import re

from cffi import FFI

_HERE = pathlib.Path(__file__).resolve().parent


def _rel(path: pathlib.Path) -> str:
    # setuptools wants source paths relative to the project root, which is the
    # working directory for pip builds (in-tree, editable or not).  Falling back
    # to an absolute path keeps direct runs from elsewhere working.
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


#: The C modules linked into the extension, each a ``.c`` with its ``.h``, in cdef
#: order (conn.h's declarations use tun.h's sw_tun).
MODULES = ("relay", "iplit", "parse", "route", "pkt", "tun", "conn", "udp")
#: Further parts of a module, compiled in but not part of the cdef (conn.c is
#: split along its sections; conn_int.h is what the parts share; route_set.c holds
#: route.h's shared sets, route_int.h what it shares with route.c).
PARTS = (
    "conn_flow", "conn_dns", "conn_route", "conn_upstream", "conn_forward", "conn_handshake",
    "conn_api", "route_set",
)  # fmt: skip
#: Internal headers (static inline helpers, shared types): rebuild triggers only.
INTERNAL_HEADERS = ("clock", "evloop", "heap", "ip6text", "ring", "conn_int", "route_int")


def _cdef_text() -> str:
    parts = []
    for name in MODULES:
        header = (_HERE / f"{name}.h").read_text(encoding="utf-8")
        match = re.search(r"/\* SW_CDEF_BEGIN \*/(.*)/\* SW_CDEF_END \*/", header, re.S)
        if match is None:
            raise RuntimeError(f"csrc/{name}.h lacks the SW_CDEF_BEGIN/SW_CDEF_END markers")
        parts.append(match.group(1))
    return "\n".join(parts)


def _flags() -> tuple[list[str], list[str]]:
    compile_args = ["-O2", "-std=gnu11", "-Wall", "-Wextra"]
    link_args: list[str] = []
    sanitize = os.environ.get("SPLICEWAY_RELAY_SANITIZE", "").strip()
    if sanitize:
        kinds = "address,undefined" if sanitize == "1" else sanitize
        debug = [f"-fsanitize={kinds}", "-fno-omit-frame-pointer", "-g"]
        compile_args = ["-O1", "-std=gnu11", "-Wall", "-Wextra", *debug]
        link_args = [f"-fsanitize={kinds}"]
    if os.environ.get("SPLICEWAY_RELAY_WERROR", "").strip() not in ("", "0"):
        compile_args.append("-Werror")
        if "thread" in sanitize:
            # gcc's TSan does not model fences and says so (-Wtsan) about
            # relay.c's counter seqlock, whose fences are correct: a warning kept.
            compile_args.append("-Wno-error=tsan")
    return compile_args, link_args


def _make_builder(*, absolute: bool) -> FFI:
    path = str if absolute else _rel
    compile_args, link_args = _flags()
    builder = FFI()
    builder.cdef(_cdef_text())
    builder.set_source(
        "spliceway._relay",
        "".join(f'#include "{name}.h"\n' for name in MODULES),
        sources=[path(_HERE / f"{name}.c") for name in (*MODULES, *PARTS)],
        include_dirs=[path(_HERE)],
        depends=[path(_HERE / f"{name}.h") for name in (*MODULES, *INTERNAL_HEADERS)],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        # libcrypto (OpenSSL 3, Debian libssl-dev) for the Shadowsocks AEAD flows.
        libraries=["pthread", "crypto"],
    )
    return builder


ffibuilder = _make_builder(absolute=False)

if __name__ == "__main__":
    # cffi compiles from inside tmpdir, hence absolute paths here.  The
    # extension is then copied next to the package sources, where an
    # editable install would put it.
    import shutil

    built = _make_builder(absolute=True).compile(
        tmpdir=str(_HERE.parent / "build" / "cffi"), verbose=True
    )
    # Copy beside the target, then rename over it: a process that has the old
    # extension mapped keeps its (unlinked) file instead of crashing on a rewrite.
    target = _HERE.parent / "spliceway" / pathlib.Path(built).name
    staging = target.with_name(target.name + ".tmp")
    shutil.copy2(built, staging)
    os.replace(staging, target)
