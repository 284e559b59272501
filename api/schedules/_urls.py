"""Which webhook targets a coordinator may POST to (server-side request forgery guard). How a webhook
URL is shown to readers is api.redact's rule (chat webhook URLs carry their secret in the path/query).

Always refused: link-local addresses (169.254.0.0/16, fe80::/10 — cloud metadata services live
there), known metadata hosts and addresses, unspecified and multicast addresses. Refused unless
``MESHTUNE_WEBHOOK_ALLOW_PRIVATE=true``: loopback, private (RFC 1918, fc00::/7), shared (100.64/10)
and reserved addresses. A host name is checked on every address it resolves to, at submission (when
it resolves) and again just before each delivery (DNS can change in between).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata", "instance-data",
                            "instance-data.ec2.internal"})
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("100.100.100.200"),
                                ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("169.254.170.2")})
ALLOW_PRIVATE_ENV = "MESHTUNE_WEBHOOK_ALLOW_PRIVATE"


class RefusedTarget(ValueError):
    """The webhook URL points somewhere a coordinator must not POST to."""


def allow_private() -> bool:
    """The ``MESHTUNE_WEBHOOK_ALLOW_PRIVATE`` setting (read when checked, so tests and operators can
    flip it without a restart of anything cached)."""
    from api.settings import Settings

    return bool(Settings().webhook_allow_private)


def _check_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, *, private_ok: bool) -> str | None:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if addr.is_link_local:
        return "a link-local address"
    if addr.is_unspecified or addr.is_multicast:
        return "not a unicast address"
    if not private_ok and (addr.is_loopback or addr.is_private or addr.is_reserved
                           or addr in ipaddress.ip_network("100.64.0.0/10")):
        return f"a loopback/private address (allowed only with {ALLOW_PRIVATE_ENV}=true)"
    return None


def check_target(url: str, *, resolve: bool = True, strict: bool = False) -> None:
    """Raise RefusedTarget naming why ``url``'s host may not be POSTed to. With ``resolve`` a host
    name is looked up; ``strict`` also refuses a name that does not resolve (delivery time)."""
    host = (urlsplit(url).hostname or "").rstrip(".").lower()
    private_ok = allow_private()
    if host in METADATA_HOSTS:
        raise RefusedTarget(f"host {host!r} is a cloud metadata service")
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        if not resolve:
            return
        try:
            infos = socket.getaddrinfo(host, urlsplit(url).port or 443, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            if strict:
                raise RefusedTarget(f"host {host!r} does not resolve") from None
            return
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    for addr in addresses:
        why = _check_address(addr, private_ok=private_ok)
        if why:
            shown = host if str(addr) == host else f"{host} ({addr})"
            raise RefusedTarget(f"host {shown} is {why}")
