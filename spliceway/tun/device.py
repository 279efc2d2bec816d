"""The TUN device: creation through /dev/net/tun, addresses, MTU and link state.

The device is created non-persistent (no TUNSETPERSIST): the kernel deletes it, with
its addresses and every route through it, when the last file descriptor closes. So a
crashed engine never leaves a device behind; only policy rules (which name no device
index) and unreachable routes outlive it, and :mod:`spliceway.tun.routing` sweeps
those.

Addresses, MTU and link state are set over netlink with pyroute2, never by running
``ip``. IPv6 addresses are added with IFA_F_NODAD: duplicate address detection on a
point-to-point device with no link layer can only delay the address (it stays
"tentative" for about a second, and binds to it fail meanwhile).

With ``vnet_hdr`` the device is opened with IFF_VNET_HDR and offloads: every packet
read or written carries a 10-byte ``struct virtio_net_hdr`` (TUNSETVNETHDRSZ 10, no
``num_buffers``), and TUNSETOFFLOAD turns on TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6, so
the kernel hands over TCP segments in bursts of up to 64 KiB (GSO) with checksums left
to finish, and takes them back the same way (what wireguard-go and sing-tun do on
Linux; csrc/tun.h, "Offloads", is the packet loop's side). No UDP segmentation offload
(USO) is asked for: the loop hands datagrams over one by one.

The transmit queue (packets the kernel routes into the device and the reader has not
taken yet) is raised from the kernel's 500 to :data:`TX_QUEUE_LEN`: a burst of a few
fast TCP senders fills 500 packets faster than one reader thread wakes up, and every
packet dropped there is a TCP loss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from spliceway.errors import ApiError

# linux/if_tun.h
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUNGETIFF = 0x800454D2
TUNSETVNETHDRSZ = 0x400454D8
TUNGETVNETHDRSZ = 0x800454D7
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_MULTI_QUEUE = 0x0100
IFF_VNET_HDR = 0x4000
IFF_TUN_EXCL = 0x8000

# linux/capability.h
CAP_NET_ADMIN = 12

IFA_F_NODAD = 0x02

#: ``sizeof(struct virtio_net_hdr)`` (linux/virtio_net.h), csrc/pkt.h's SW_VNET_HDR_LEN.
VNET_HDR_LEN = 10
#: The offloads a vnet_hdr device gets: checksum and TCP segmentation, both families.
TUN_OFFLOADS = TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6
#: The device's transmit queue length (the kernel's default for a TUN is 500).
TX_QUEUE_LEN = 5000

TUN_PATH = "/dev/net/tun"


def has_cap_net_admin(status_path: str = "/proc/self/status") -> bool:
    """Whether this process's effective capabilities include CAP_NET_ADMIN.

    Read from ``CapEff`` rather than by trying an operation, so the answer costs nothing
    and changes nothing. An unreadable file counts as "no".
    """
    try:
        with open(status_path, encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def privilege_error(what: str) -> ApiError:
    """The ``insufficient_os_privilege`` error (interface.md 7) for ``what`` failing."""
    return ApiError(
        "insufficient_os_privilege",
        f"{what} needs CAP_NET_ADMIN (run as root, or grant the capability: "
        "setcap cap_net_admin+ep, or AmbientCapabilities=CAP_NET_ADMIN under systemd)",
    )


def require_net_admin() -> None:
    """Raise ``insufficient_os_privilege`` unless CAP_NET_ADMIN is effective."""
    if not has_cap_net_admin():
        raise privilege_error("creating a TUN device and changing routes")


@contextlib.contextmanager
def translate_privilege(what: str) -> Iterator[None]:
    """Turn EPERM/EACCES (from a syscall or netlink) inside the block into the API error."""
    try:
        yield
    except OSError as ex:
        if ex.errno in (errno.EPERM, errno.EACCES):
            raise privilege_error(what) from ex
        raise
    except Exception as ex:  # pyroute2's NetlinkError is not an OSError subclass
        code = getattr(ex, "code", None)
        if code in (errno.EPERM, errno.EACCES):
            raise privilege_error(what) from ex
        raise


def set_offloads(fd: int) -> None:
    """On a TUN fd opened with IFF_VNET_HDR: a 10-byte virtio-net header (TUNSETVNETHDRSZ,
    stated even though it is the kernel's default) and checksum plus TCP segmentation
    offload for IPv4 and IPv6 (TUNSETOFFLOAD). Both apply to the device, every queue."""
    fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VNET_HDR_LEN))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_OFFLOADS)


def tun_flags(fd: int) -> int:
    """The IFF_* flags of the TUN ``fd`` is attached to (TUNGETIFF)."""
    out = fcntl.ioctl(fd, TUNGETIFF, struct.pack("16sH22x", b"", 0))
    return int(struct.unpack_from("16sH", out)[1])


def vnet_hdr_size(fd: int) -> int:
    """The virtio-net header size of the TUN ``fd`` is attached to (TUNGETVNETHDRSZ)."""
    out = fcntl.ioctl(fd, TUNGETVNETHDRSZ, struct.pack("i", 0))
    return int(struct.unpack("i", out)[0])


def open_tun(name: str, *, queues: int = 1, vnet_hdr: bool = False) -> tuple[str, list[int]]:
    """Create (or attach to) the TUN device ``name``; return its real name and one fd a queue.

    ``name`` may contain ``%d`` for the kernel to number it. Each fd is non-blocking and
    close-on-exec; the flags are IFF_TUN | IFF_NO_PI (raw IP packets, no 4-byte packet
    information header), plus IFF_MULTI_QUEUE for several queues and IFF_VNET_HDR when
    asked, with the offloads :func:`set_offloads` turns on (a virtio-net header before
    each packet; GSO and checksum offload). Closing every fd deletes the device.
    """
    flags = IFF_TUN | IFF_NO_PI
    if queues > 1:
        flags |= IFF_MULTI_QUEUE
    if vnet_hdr:
        flags |= IFF_VNET_HDR
    fds: list[int] = []
    real = name
    try:
        for _ in range(queues):
            fd = os.open(TUN_PATH, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            fds.append(fd)
            # struct ifreq: 16 bytes of name, then the short flags; 40 bytes in all.
            ifr = struct.pack("16sH22x", real.encode(), flags)
            out = fcntl.ioctl(fd, TUNSETIFF, ifr)
            # The kernel wrote the chosen name back (``%d`` filled in); later queues
            # attach to that device by its real name.
            real = out[:16].split(b"\0", 1)[0].decode()
        if vnet_hdr:
            set_offloads(fds[0])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return real, fds


@dataclass
class TunDevice:
    """A created TUN device and its queue file descriptors (owned: :meth:`close` closes them)."""

    name: str
    index: int
    fds: list[int]
    mtu: int
    vnet_hdr: bool = False
    addresses: list[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        name: str,
        *,
        mtu: int,
        addresses: Iterable[ipaddress.IPv4Interface | ipaddress.IPv6Interface],
        queues: int = 1,
        vnet_hdr: bool = False,
        txqueuelen: int = TX_QUEUE_LEN,
    ) -> TunDevice:
        """Create the device, set its MTU, transmit queue length and addresses and bring
        it up. ``vnet_hdr``: with a virtio-net header and offloads (see the module's
        docstring); the packet loop must then be told so (``TunStack(vnet_hdr=True)``).

        Raises ``ApiError(insufficient_os_privilege)`` when the kernel refuses for lack
        of privilege, ``ApiError(conflict)`` when ``name`` is taken by a device that is
        not a TUN or is in use; other failures as ``OSError``. A failure leaves nothing.
        """
        from pyroute2 import IPRoute

        with translate_privilege("creating a TUN device"):
            try:
                real, fds = open_tun(name, queues=queues, vnet_hdr=vnet_hdr)
            except OSError as ex:
                if ex.errno in (errno.EBUSY, errno.EINVAL) and "%" not in name:
                    raise ApiError(
                        "conflict", f"device {name!r} exists and cannot be used as this TUN"
                    ) from ex
                raise
        dev = cls(name=real, index=0, fds=fds, mtu=mtu, vnet_hdr=vnet_hdr)
        try:
            with translate_privilege("configuring the TUN device"), IPRoute() as ipr:
                dev.index = ipr.link_lookup(ifname=real)[0]
                ipr.link("set", index=dev.index, mtu=mtu, txqlen=txqueuelen)
                for iface in addresses:
                    kwargs = {"flags": IFA_F_NODAD} if iface.version == 6 else {}
                    ipr.addr(
                        "add",
                        index=dev.index,
                        address=str(iface.ip),
                        prefixlen=iface.network.prefixlen,
                        **kwargs,
                    )
                    dev.addresses.append(iface)
                ipr.link("set", index=dev.index, state="up")
            _relax_rp_filter(real)
        except BaseException:
            dev.close()
            raise
        return dev

    def close(self) -> None:
        """Close every queue fd; the kernel then deletes the device, its addresses and routes."""
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def exists(self) -> bool:
        """Whether a device of this name and index still exists."""
        try:
            with open(f"/sys/class/net/{self.name}/ifindex", encoding="ascii") as f:
                return int(f.read()) == self.index
        except (OSError, ValueError):
            return False


def _relax_rp_filter(name: str) -> None:
    """Loose reverse-path filtering on the device (best effort; it dies with the device).

    The system stack writes back packets from address B; the kernel's reverse-path
    check finds B through the device's own prefix route, but a strict check against a
    policy table can still refuse them on some setups (hev-socks5-tunnel documents the
    same). The effective value is the larger of ``all`` and the device's, so this only
    helps where ``all`` is 0 or 2; it never changes a global setting.
    """
    path = f"/proc/sys/net/ipv4/conf/{name}/rp_filter"
    with contextlib.suppress(OSError), open(path, "w", encoding="ascii") as f:
        f.write("2")
