"""The ``unit`` and ``integration`` markers: which a test gets, and a guard that keeps
``-m unit`` honest.

A test is ``integration`` when it lives in ``tests/integration/`` or when it uses, directly
or through anything of ``tests.*`` it reaches (fixtures, helper functions, helper classes),
an engine (:class:`spliceway.Engine`), a subprocess (a Debian peer, ``spliceway run``,
``ip netns``, ``mount``), ``shutil.which`` (a test that looks for a peer on PATH), or a
fork. Everything else is ``unit``: pure code, or real loopback sockets and threads of this
process. ``python -m pytest -m unit`` therefore needs no Debian package and starts no
engine.

Reachability is read from the bytecode (the global names a function's code loads,
followed into the ``tests`` package and no further), so a new test is classified without
anyone remembering to mark it. What the bytecode cannot see (a product function that
starts an engine or a process on a unit test's behalf) the guard catches at run time: a
``unit`` test that spawns a process or starts an engine fails, naming this module.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import spliceway

UNIT = "unit"
INTEGRATION = "integration"

#: Directories (first component under tests/) whose every test is integration.
INTEGRATION_DIRS = frozenset({"integration"})

#: Modules whose use makes a test integration: processes and forks.
_PROCESS_MODULES = frozenset({"subprocess", "multiprocessing", "pty"})

#: Functions whose use makes a test integration (identity, not name).
_TRIGGERS: frozenset[int] = frozenset(
    id(obj)
    for obj in (
        spliceway.Engine,
        shutil.which,
        os.fork,
        os.system,
        os.posix_spawn,
        os.posix_spawnp,
        os.execv,
        os.execvp,
        os.execvpe,
    )
)

#: Audit events (sys.addaudithook) that mean a process was started.
_PROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
    }
)


def _is_ours(obj: object) -> bool:
    """Whether ``obj`` is defined in the test tree (followed) rather than elsewhere."""
    module = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "")
    return isinstance(module, str) and (module == "tests" or module.startswith("tests."))


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every code object nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions_of(obj: object) -> Iterable[Callable[..., Any]]:
    """The functions to follow for an object of the test tree: itself, or a class's methods."""
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if not _is_ours(klass):
                continue
            for attr in vars(klass).values():
                func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                if isinstance(func, property):
                    yield from (f for f in (func.fget, func.fset) if f is not None)
                elif inspect.isfunction(func):
                    yield func
    elif inspect.isfunction(obj):
        yield obj


class Classifier:
    """Decides, and remembers per function, whether code reaches an integration trigger."""

    def __init__(self) -> None:
        self._verdicts: dict[types.CodeType, bool] = {}

    def _trigger(self, obj: object) -> bool:
        if id(obj) in _TRIGGERS:
            return True
        if isinstance(obj, types.ModuleType):
            return obj.__name__.partition(".")[0] in _PROCESS_MODULES
        module = getattr(obj, "__module__", None)
        return isinstance(module, str) and module.partition(".")[0] in _PROCESS_MODULES

    def _function(self, func: Callable[..., Any]) -> bool:
        func = inspect.unwrap(func)
        code = getattr(func, "__code__", None)
        if code is None:
            return False
        if code in self._verdicts:
            return self._verdicts[code]
        # Provisional answer first: recursion through a cycle ends here.
        self._verdicts[code] = False
        namespace: dict[str, Any] = dict(getattr(func, "__globals__", {}))
        for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
            try:
                namespace[name] = cell.cell_contents
            except ValueError:  # a cell not filled yet
                continue
        verdict = any(self._names(inner, namespace) for inner in _codes(code))
        self._verdicts[code] = verdict
        return verdict

    def _names(self, code: types.CodeType, namespace: dict[str, Any]) -> bool:
        names = code.co_names + code.co_freevars
        for name in names:
            # A name the function imports itself (``from spliceway import Engine`` in a
            # fixture) is not in its globals; the module it names is in sys.modules.
            obj = namespace[name] if name in namespace else sys.modules.get(name)
            if obj is None:
                continue
            if self._object(obj):
                return True
            if isinstance(obj, types.ModuleType):
                # ``module.attr``: the attribute names are in the same co_names.
                for attr in names:
                    value = getattr(obj, attr, None)
                    if value is not None and value is not obj and self._object(value):
                        return True
        return False

    def _object(self, obj: object) -> bool:
        if self._trigger(obj):
            return True
        if not _is_ours(obj) or isinstance(obj, types.ModuleType):
            return False
        return any(self._function(func) for func in _functions_of(obj))

    def is_integration(self, item: pytest.Item) -> bool:
        """Whether ``item`` (a collected test) is an integration test."""
        parts = item.path.relative_to(item.config.rootpath).parts
        if len(parts) > 2 and parts[0] == "tests" and parts[1] in INTEGRATION_DIRS:
            return True
        function = getattr(item, "obj", None)
        inner = getattr(getattr(function, "hypothesis", None), "inner_test", None)
        followed: list[object] = [inner or function]
        cls = getattr(item, "cls", None)
        if cls is not None:
            followed.append(cls)
        info = getattr(item, "_fixtureinfo", None)
        if info is not None:
            for name in item.fixturenames:  # type: ignore[attr-defined]
                for fixturedef in info.name2fixturedefs.get(name, ()):
                    followed.append(fixturedef.func)
        for obj in followed:
            if obj is None:
                continue
            if self._trigger(obj):
                return True
            funcs = list(_functions_of(obj)) if isinstance(obj, type) else [obj]
            if any(self._function(f) for f in funcs if callable(f)):
                return True
        return False


def apply(items: list[pytest.Item]) -> None:
    """Give every item exactly one of the two markers (an explicit one wins)."""
    classifier = Classifier()
    for item in items:
        if item.get_closest_marker(UNIT) or item.get_closest_marker(INTEGRATION):
            continue
        item.add_marker(INTEGRATION if classifier.is_integration(item) else UNIT)


class _Guard:
    """While a ``unit`` test runs: a started process or engine fails it."""

    def __init__(self) -> None:
        self.active = False
        self.seen: list[str] = []
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.active and event in _PROCESS_EVENTS:
            self.seen.append(f"{event} {args[:2]!r}")

    @contextmanager
    def watching(self, item: pytest.Item) -> Iterator[None]:
        """Watch ``item``'s setup, call or teardown; fail it if it crossed the line."""
        if not item.get_closest_marker(UNIT):
            yield
            return
        engine = spliceway.Engine
        original = engine.start
        guard = self

        def start(self: Any) -> Any:
            guard.seen.append("spliceway.Engine.start")
            return original(self)

        self.active, self.seen = True, []
        engine.start = start  # type: ignore[method-assign]
        try:
            yield
        finally:
            engine.start = original  # type: ignore[method-assign]
            self.active = False
        if self.seen:
            pytest.fail(
                f"{item.nodeid} is marked unit but started {self.seen[0]}"
                f"{f' (and {len(self.seen) - 1} more)' if len(self.seen) > 1 else ''}: mark it "
                "@pytest.mark.integration, or move what does so into a fixture or helper of "
                "tests/ that tests/markers.py can follow",
                pytrace=False,
            )


_guard: _Guard | None = None


def guard() -> _Guard:
    """The process's one guard (audit hooks cannot be removed, so installed once)."""
    global _guard
    if _guard is None:
        _guard = _Guard()
    return _guard
