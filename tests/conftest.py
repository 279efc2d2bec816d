"""Shared fixtures: real loopback servers and a real engine on ephemeral ports."""

from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pykka
import pytest

from tests import markers
from tests.helpers.servers import http_origin

#: Worker processes the suite runs in unless ``-n`` says otherwise (``-n 0``: none).
WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run the suite in :data:`WORKERS` pytest-xdist processes by default.

    Most of the suite waits on real sockets, engines and subprocesses, so two workers
    take about half the wall time even on two cores. The tests share nothing a second
    worker could disturb: ports are ephemeral, paths come from ``tmp_path`` or carry
    the pid, each worker has its own ``XDG_RUNTIME_DIR`` (:func:`private_runtime_dir`)
    and the network namespaces are named by pid (tests/helpers/netns*.py).

    Set here rather than in pyproject's ``addopts`` because this file is loaded only
    for runs of ``tests/``: ``python -m pytest benchmarks/test_micro.py
    --benchmark-only`` stays in one process, where pytest-benchmark measures (it
    disables itself under xdist). ``-n N`` on the command line wins; without the
    plugin (``-p no:xdist``) or with ``--pdb`` the run stays in this process.
    """
    if hasattr(config, "workerinput"):
        # A worker: it runs tests itself (never spawns workers); no benchmark in tests/.
        if hasattr(config.option, "benchmark_disable"):
            config.option.benchmark_disable = True
        return
    if not config.pluginmanager.hasplugin("xdist") or config.getoption("usepdb", False):
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            # Each test to whichever worker is idle: evens out the long ones.
            config.option.dist = "worksteal"
    if config.option.numprocesses and hasattr(config.option, "benchmark_disable"):
        config.option.benchmark_disable = True


def base_config(**overrides: Any) -> dict[str, Any]:
    """A test configuration: socks5, http and mixed inbounds on free ports, no control API."""
    cfg: dict[str, Any] = {
        "inbounds": [
            {"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}},
            {"tag": "http-in", "protocol": "http", "listen": {"port": 0}},
            {"tag": "mixed-in", "protocol": "mixed", "listen": {"port": 0}},
        ],
        "outbounds": [
            {"tag": "direct", "protocol": "direct"},
            {"tag": "block", "protocol": "block"},
        ],
        "runtime": {"stats_interval_ms": 200},
        "api": {"control": {"enabled": False}, "ipc": {"enabled": False}},
    }
    cfg.update(copy.deepcopy(overrides))
    return cfg


@pytest.fixture(scope="session", autouse=True)
def private_runtime_dir() -> Iterator[Path]:
    """``XDG_RUNTIME_DIR`` pointed at a directory of this run for every test and every
    ``spliceway`` they start, so an engine left on the default IPC path (one that no
    test configures on purpose) is this run's, never the user's own ``spliceway run``'s,
    and the suite passes beside it. Short: AF_UNIX paths end at 108 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="sw-xdg-"))
    previous = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(directory)
    try:
        yield directory
    finally:
        if previous is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = previous
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[Path]:
    """A path for an engine's IPC socket in a directory of its own, short enough for
    AF_UNIX (108 bytes, which pytest's tmp_path can exceed); removed afterwards."""
    short = Path(f"/tmp/sw-{os.getpid()}-{tmp_path.name[-16:]}")
    yield short / "control.sock"
    (short / "control.sock").unlink(missing_ok=True)
    if short.exists():
        short.rmdir()


@pytest.fixture
def origin() -> Iterator[tuple[str, int]]:
    """A local HTTP origin server."""
    with http_origin() as address:
        yield address


def engines_started(prepare: Callable[[Any], None] | None = None) -> Iterator[Callable[..., Any]]:
    """The body of an engine fixture: yields a starter of engines from config dicts
    (``base_config()`` by default; ``prepare`` sees each before it starts); after the
    test every one is stopped and must have left no flow actor."""
    from spliceway import Engine

    engines: list[Any] = []

    def _make(config: dict[str, Any] | None = None) -> Any:
        engine = Engine(config if config is not None else base_config())
        if prepare is not None:
            prepare(engine)
        engine.start()
        engines.append(engine)
        return engine

    yield _make
    for engine in engines:
        engine.stop()
    # Flow actors are not in pykka's registry (see _no_leftover_actors): the engine's own set.
    for engine in engines:
        assert not engine._core.flow_actors, f"flow actors left: {engine._core.flow_actors}"


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Any]]:
    """Start engines from config dicts; every one is stopped after the test."""
    yield from engines_started()


@pytest.fixture(autouse=True)
def _no_leftover_actors() -> Iterator[None]:
    yield
    leftover = pykka.ActorRegistry.get_all()
    pykka.ActorRegistry.stop_all(timeout=5)
    assert not leftover, f"actors left running: {leftover}"


@contextmanager
def spliceway_logs_at(level: int) -> Iterator[None]:
    """Let the ``spliceway`` records of ``level`` and above through, as ``spliceway run``
    does at that level: pytest leaves Python's default (warnings only) on the loggers."""
    logger = logging.getLogger("spliceway")
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "", *, interval: float = 0.01
) -> Any:
    """Poll ``predicate`` until truthy (its value is returned); fail after ``timeout``,
    naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or predicate}")
        time.sleep(interval)


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def thread_count() -> int:
    """Live Python threads of this process."""
    return threading.active_count()


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """Mount real size-limited tmpfs filesystems (``tmpfs("8m")``); all unmounted after the
    test. Skips only where mounting is not permitted (not root)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            text = result.stderr.lower()
            if os.geteuid() != 0 or "permission denied" in text or "not permitted" in text:
                pytest.skip(f"cannot mount a tmpfs here (EPERM): {result.stderr.strip()}")
            pytest.fail(f"mount failed: {result.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test ``unit`` or ``integration`` (tests/markers.py), before ``-m``
    selects."""
    markers.apply(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """A ``unit`` test's fixtures may start no process and no engine."""
    with markers.guard().watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A ``unit`` test may start no process and no engine."""
    with markers.guard().watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A ``unit`` test's teardown may start no process and no engine."""
    with markers.guard().watching(item):
        return (yield)
