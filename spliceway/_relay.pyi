"""Types of ``spliceway._relay``, the cffi extension ``csrc/relay_build.py`` builds.

cffi writes no stubs. ``ffi`` is the module's FFI object and ``lib`` holds the C
functions, constants and globals of the cdef in ``csrc/relay_build.py``. Both are
``Any``: types-cffi types every ``ffi.new`` result as an opaque ``CData`` without the
struct's fields, so the field types are checked by the C compiler and the
differential tests (tests/csrc/), not by mypy.
"""

from typing import Any

ffi: Any
lib: Any
