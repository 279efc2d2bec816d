"""The host side of a TUN: device, routes and rules, socket mark, egress and status.

:class:`TunController` composes :mod:`~spliceway.tun.device`,
:mod:`~spliceway.tun.routing`, :mod:`~spliceway.support.socket_mark` and
:mod:`~spliceway.tun.egress`. It does not move packets: :meth:`TunController.start`
hands back a :class:`TunHandle` (the device's queue fds and addresses) for the
packet loop (:mod:`spliceway.native.tun`) to run on, and the engine's ``tun.start``
is the two composed::

    handle = controller.start(params, network_mtu=config.runtime.network.mtu)
    try:
        stack = <start the packet loop on handle.fds, handle.options>
    except BaseException:
        controller.stop()
        raise
    ...
    stack.stop()          # tun.stop: the loop first (it reads the fds) ...
    controller.stop()     # ... then the device, routes and rules

Order inside :meth:`TunController.start`, each step undone if a later one fails:
privilege check; sweep of an earlier run's leftovers in this network namespace;
device (addresses, MTU, up); the routing plan recorded in the state file, then
applied; the socket mark switched on; the egress monitor. :meth:`TunController.stop`
undoes them in reverse and removes the device's addresses explicitly (the device
itself goes when its last fd closes, and is deleted over netlink if someone else
still holds one).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spliceway.errors import ApiError
from spliceway.support import socket_mark as _mark
from spliceway.tun.device import TunDevice, require_net_admin, translate_privilege
from spliceway.tun.egress import Egress, EgressMonitor
from spliceway.tun.options import TunOptions, resolve_tun_options
from spliceway.tun.routing import (
    HostState,
    RoutingPlan,
    apply_plan,
    build_plan,
    remove_plan,
    remove_state,
    sweep,
    write_state,
)

log = logging.getLogger("spliceway.tun")


@dataclass(frozen=True, slots=True)
class TunHandle:
    """What the packet loop needs from a started TUN."""

    name: str
    """The device's name (``%d`` filled in)."""
    index: int
    """The device's ifindex."""
    fds: tuple[int, ...]
    """One non-blocking, close-on-exec fd per queue (raw IP packets, no PI header).
    Owned by the controller: the loop must not close them, and must stop using them
    before :meth:`TunController.stop`."""
    options: TunOptions
    """Every effective setting (addresses A and B, MTU, dns_hijack, mark, ...)."""

    @property
    def mtu(self) -> int:
        """Device MTU."""
        return self.options.mtu

    @property
    def inet4(self) -> ipaddress.IPv4Interface | None:
        """IPv4 address A (the kernel listener's) and prefix, or None."""
        return self.options.inet4

    @property
    def inet6(self) -> ipaddress.IPv6Interface | None:
        """IPv6 address A and prefix, or None."""
        return self.options.inet6

    @property
    def inet4_peer(self) -> ipaddress.IPv4Address | None:
        """IPv4 address B = A + 1 (the NAT source of captured connections)."""
        return self.options.inet4_peer

    @property
    def inet6_peer(self) -> ipaddress.IPv6Address | None:
        """IPv6 address B = A + 1."""
        return self.options.inet6_peer


class TunController:
    """Start, stop and report one TUN's host side (thread-safe)."""

    def __init__(
        self,
        *,
        state_dir: str | None = None,
        on_egress_change: Callable[[Egress, int], None] | None = None,
    ) -> None:
        """``state_dir``: where the state file goes (default
        :func:`~spliceway.tun.routing.default_state_dir`). ``on_egress_change(egress,
        generation)`` runs on the monitor thread after each egress change (e.g. to emit
        an event or re-dial); it must be quick."""
        self._state_dir = state_dir
        self._on_egress_change = on_egress_change
        # _life serialises start and stop (held across the slow netlink work); _lock
        # guards the fields only, briefly, so the monitor thread's health check never
        # waits behind a stop that is joining that very thread.
        self._life = threading.Lock()
        self._lock = threading.Lock()
        self._device: TunDevice | None = None
        self._options: TunOptions | None = None
        self._plan = RoutingPlan((), ())
        self._monitor: EgressMonitor | None = None
        self._healthy = False
        self._last_error: str | None = None
        #: ``ipv6_to_ipv4_fallbacks`` of 2.9: the packet loop or the dialer adds to it.
        self.ipv6_to_ipv4_fallbacks = 0

    # -- lifecycle ---------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether a TUN is up."""
        with self._lock:
            return self._device is not None

    @property
    def options(self) -> TunOptions | None:
        """The running TUN's settings, or None."""
        with self._lock:
            return self._options

    def start(
        self,
        params: Mapping[str, Any],
        *,
        network_mtu: int = 1500,
        managed_by_config: bool = False,
        queues: int = 1,
        vnet_hdr: bool = False,
    ) -> TunHandle:
        """Validate ``tun.start`` params (4.4) and bring the TUN up; see the module docstring.

        Errors: ``conflict`` when a TUN already runs here (or another live engine's TUN
        holds this namespace's rules), ``invalid_argument`` for bad params,
        ``insufficient_os_privilege`` without CAP_NET_ADMIN, ``internal`` when the kernel
        refuses a route or rule (with what was refused; nothing is left behind).
        """
        if self.running:
            raise ApiError("conflict", "a TUN is already running")
        opts = resolve_tun_options(
            params,
            network_mtu=network_mtu,
            managed_by_config=managed_by_config,
            queues=queues,
        )
        return self.start_options(opts, vnet_hdr=vnet_hdr)

    def start_options(self, opts: TunOptions, *, vnet_hdr: bool = False) -> TunHandle:
        """:meth:`start` with options already resolved."""
        with self._life:
            if self.running:
                raise ApiError("conflict", "a TUN is already running")
            require_net_admin()
            with translate_privilege("removing an earlier TUN's routes and rules"):
                leftovers = sweep(self._state_dir, rule_base=opts.rule_base,
                                  tables=(opts.table, opts.dns_table))  # fmt: skip
            if leftovers.removed:
                log.warning(
                    "removed what an earlier TUN (pid %s) left behind: %s",
                    leftovers.previous_owner,
                    "; ".join(leftovers.removed),
                )
            try:
                dev = TunDevice.create(
                    opts.name,
                    mtu=opts.mtu,
                    addresses=opts.interfaces,
                    queues=opts.queues,
                    vnet_hdr=vnet_hdr,
                )
            except ApiError:
                raise
            except FileNotFoundError as ex:
                raise ApiError(
                    "unsupported", f"this system has no TUN driver ({ex.filename} is missing)"
                ) from ex
            except Exception as ex:  # OSError or pyroute2's NetlinkError: say which step
                raise ApiError("internal", f"creating the TUN device failed: {ex}") from ex
            plan = build_plan(opts, dev.name)
            monitor: EgressMonitor | None = None
            try:
                if plan.rules or plan.routes:
                    # Recorded before the first change: a crash half-way still leaves a
                    # complete list of what may have been added.
                    write_state(HostState.for_plan(opts, dev.name, plan), self._state_dir)
                    try:
                        with translate_privilege("adding the TUN's routes and rules"):
                            apply_plan(plan, dev.index)
                    except ApiError:
                        raise
                    except Exception as ex:
                        raise ApiError(
                            "internal", f"adding the TUN's routes and rules failed: {ex}"
                        ) from ex
                if opts.auto_route:
                    _mark.set_mark(opts.mark)
                monitor = EgressMonitor(
                    exclude={dev.name},
                    on_change=self._egress_changed,
                    on_event=self._check_health,
                )
                monitor.start()
            except BaseException:
                if monitor is not None:
                    monitor.stop()
                self._teardown(dev, plan)
                raise
            with self._lock:
                self._device, self._options, self._plan = dev, opts, plan
                self._monitor = monitor
                self._healthy, self._last_error = True, None
                self.ipv6_to_ipv4_fallbacks = 0
            log.info(
                "TUN %s up: %s, mtu %d, %d routes, %d rules",
                dev.name,
                ", ".join(str(i) for i in opts.interfaces),
                opts.mtu,
                len(plan.routes),
                len(plan.rules),
            )
            return TunHandle(dev.name, dev.index, tuple(dev.fds), opts)

    def stop(self) -> bool:
        """Remove everything :meth:`start` added; False when no TUN was running.

        Raises ``ApiError(internal)`` if some route or rule could not be removed (the
        state file is then kept, so the next start sweeps it again).
        """
        with self._life:
            with self._lock:
                dev, plan, monitor = self._device, self._plan, self._monitor
                if dev is None:
                    return False
                self._device, self._options, self._monitor = None, None, None
                self._plan = RoutingPlan((), ())
                self._healthy = False
            if monitor is not None:
                monitor.stop()
            errors = self._teardown(dev, plan)
            if errors:
                raise ApiError(
                    "internal",
                    "the TUN stopped but some of its routes or rules could not be removed "
                    f"(the next start removes them): {'; '.join(errors)}",
                )
            return True

    def _teardown(self, dev: TunDevice, plan: RoutingPlan) -> list[str]:
        """Undo the plan, the mark, the addresses and the device; return what failed."""
        errors: list[str] = []
        if plan.rules or plan.routes:
            try:
                errors = remove_plan(plan)
            except Exception as ex:  # netlink itself failed: keep the record for a sweep
                errors = [str(ex)]
            if not errors:
                remove_state(self._state_dir)
        _mark.set_mark(0)
        _delete_device(dev)
        return errors

    # -- health and egress ---------------------------------------------------

    def _egress_changed(self, egress: Egress, generation: int) -> None:
        if self._on_egress_change is not None:
            self._on_egress_change(egress, generation)

    def _check_health(self) -> None:
        with self._lock:
            dev = self._device
            if dev is None:
                return
            if not dev.exists():
                self._healthy, self._last_error = False, f"device {dev.name} disappeared"
            elif not _link_up(dev.name):
                self._healthy, self._last_error = False, f"device {dev.name} is down"
            else:
                self._healthy = True

    def record_error(self, message: str) -> None:
        """Mark the TUN unhealthy with ``message`` (for the packet loop's fatal errors)."""
        with self._lock:
            if self._device is not None:
                self._healthy, self._last_error = False, message

    # -- status --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``GET /api/v1/tun_status`` (interface.md 2.9)."""
        with self._lock:
            dev, opts, monitor = self._device, self._options, self._monitor
            if dev is None or opts is None:
                return {"running": False, "name": None, "addr": None, "tag": None}
            egress = monitor.egress if monitor is not None else Egress()
            out: dict[str, Any] = {
                "running": True,
                "name": dev.name,
                "addr": opts.addr,
                "tag": opts.tag,
                "addresses": [str(i) for i in opts.interfaces],
                "mtu": opts.mtu,
                "healthy": self._healthy,
                "last_error": self._last_error,
                "auto_route": opts.auto_route,
                "include_cidrs": list(opts.include_cidrs),
                "exclude_cidrs": list(opts.exclude_cidrs),
                "dual_stack": opts.inet4 is not None and opts.inet6 is not None,
                # Without auto_route there is nothing for strict_route to enforce.
                "strict_route": opts.strict_route and opts.auto_route,
                "dns_hijack": opts.dns_hijack,
                **egress.status_fields(),
                "network_generation": monitor.generation if monitor is not None else 0,
                "address_family_policy": opts.address_family_policy,
                "ipv6_to_ipv4_fallbacks": self.ipv6_to_ipv4_fallbacks,
                "managed_by_config": opts.managed_by_config,
            }
            return out


def _link_up(name: str) -> bool:
    try:
        with open(f"/sys/class/net/{name}/flags", encoding="ascii") as f:
            return bool(int(f.read(), 16) & 0x1)
    except (OSError, ValueError):
        return False


def _delete_device(dev: TunDevice) -> None:
    """Remove the addresses, close the fds, and delete the link if it survived that.

    Addresses go first and explicitly: a packet loop that still holds a duplicate fd
    would otherwise keep the device, and with it the host's view of the TUN, alive.
    """
    from pyroute2 import IPRoute

    with contextlib.suppress(Exception), IPRoute() as ipr:
        for iface in dev.addresses:
            with contextlib.suppress(Exception):
                ipr.addr(
                    "del", index=dev.index, address=str(iface.ip), prefixlen=iface.network.prefixlen
                )
    dev.close()
    if dev.exists():
        with contextlib.suppress(Exception), IPRoute() as ipr:
            ipr.link("del", index=dev.index)
