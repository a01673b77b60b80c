"""Which ``Host`` headers the status page and the console answer.

A page on another site can make the browser of someone on the monitor's network send requests
to it under the page's own host name, once that name resolves to the monitor's address (DNS
rebinding); the browser then lets the page read the answers. Such a request always names the
other site in its ``Host`` header, so the page and the console answer only host names this
server is known by (421 Misdirected Request otherwise):

- the address it is bound to, with its port;
- ``localhost``, ``127.0.0.1`` and ``[::1]``, on any port (a tunnel such as ``ssh -L`` or
  ``kubectl port-forward`` may use another), when it listens on a loopback address;
- bound to every address (``0.0.0.0``, ``::``): the machine's addresses, with the port, and,
  unless names are configured, its host name and the names it resolves to;
- the names the operator configured (``--console-host``), on any port unless one is given
  (``console.example.com:8443``): a TLS proxy passes the browser's own ``Host`` on.

An IP address or ``localhost`` can never be a rebinding page's host, so they cost nothing to
accept; a name is accepted only when configured or the machine's own. /metrics, /healthz and
/readyz answer whatever the ``Host``: they show nothing a page could use, and scrapers and probes
address them by IP.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]{0,252})")


class HostError(ValueError):
    """A configured host name that cannot be one."""


def split_host(text: str) -> tuple[str, int | None] | None:
    """``name`` or ``name:port`` as (lower-case name, port or None): IPv6 addresses in brackets
    (``[::1]:80``) or, without a port, bare; None when it is not a host a browser would send."""
    text = text.strip().lower()
    port: str | None = None
    if text.startswith("["):
        name, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        name, port = text.split(":")
    else:
        name = text
    if name.endswith("."):  # the fully qualified form of the same name
        name = name[:-1]
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536 and len(port) <= 5):
        return None
    if not _valid(name):
        return None
    return name, None if port is None else int(port)


def _valid(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return bool(_NAME.fullmatch(name)) and ".." not in name


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def machine_names() -> tuple[set[str], set[str]]:
    """(the machine's addresses, its host names) as the system resolver knows them."""
    hostname = socket.gethostname().lower()
    names = {hostname}
    addresses: set[str] = set()
    try:
        for _f, _t, _p, canon, sockaddr in socket.getaddrinfo(
            hostname, None, flags=socket.AI_CANONNAME
        ):
            if canon:
                names.add(canon.lower().rstrip("."))
            addresses.add(str(sockaddr[0]).split("%")[0].lower())
    except OSError:
        pass
    return addresses, names


class HostCheck:
    """``allows(host_header)``: whether the page and the console answer a request so named."""

    def __init__(
        self,
        bound: str,
        port: int,
        names: Iterable[str] = (),
        *,
        machine: tuple[set[str], set[str]] | None = None,
    ) -> None:
        self.port = port
        self.with_port: set[str] = set()  # names accepted with the server's port
        self.any_port: set[str] = set()  # names accepted on any port
        self.exact: set[tuple[str, int]] = set()  # configured as name:port
        configured = [n for n in names if n.strip()]
        for entry in configured:
            parsed = split_host(entry)
            if parsed is None:
                raise HostError(f"{entry[:100]!r} is not a host name")
            if parsed[1] is None:
                self.any_port.add(parsed[0])
            else:
                self.exact.add(parsed)
        bound = bound.strip().lower().strip("[]")
        wildcard = bound in WILDCARDS
        if wildcard or _is_loopback(bound):
            self.any_port.update(LOOPBACK_NAMES)
        if not wildcard:
            self.with_port.add(bound)
        else:
            addresses, hostnames = machine if machine is not None else machine_names()
            self.with_port.update(addresses)
            if not configured:
                self.with_port.update(hostnames)

    def allows(self, header: str | None) -> bool:
        if not header:
            return False
        parsed = split_host(header)
        if parsed is None:
            return False
        name, port = parsed
        if name in self.any_port or (name, port) in self.exact:
            return True
        return name in self.with_port and (port or 80) == self.port

    def describe(self) -> str:
        """The accepted names, for the start-up log."""
        shown = [_show(n, self.port) for n in sorted(self.with_port)]
        shown += [f"{_show(n)} (any port)" for n in sorted(self.any_port)]
        shown += [_show(n, p) for n, p in sorted(self.exact)]
        return ", ".join(shown)


def _show(name: str, port: int | None = None) -> str:
    shown = f"[{name}]" if ":" in name else name
    return shown if port is None else f"{shown}:{port}"


__all__ = ["HostCheck", "HostError", "machine_names", "split_host"]
