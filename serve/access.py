"""Who may call the front ends: where the API key comes from, and the HTTP Host / Origin rules.

The API key (`resolve_api_key`) comes from `--api-key-file PATH`, the environment
(`JAXINFER_API_KEY`, or vLLM's `VLLM_API_KEY`), or `--api-key KEY`. The command-line value
still works but is visible to every user of the machine (`ps`), so it draws a warning.

The HTTP front end refuses, with 403, requests that a web page could have sent:

* `Host` not in the allowed hosts. A server bound to loopback allows only loopback names
  (`localhost`, `127.0.0.1`, `[::1]`, any port) by default, which stops DNS rebinding: a page
  on `evil.example` whose name later resolves to 127.0.0.1 still sends `Host: evil.example`.
  A server bound elsewhere allows any host unless `--allowed-hosts` says otherwise. A request
  without a `Host` header (HTTP/1.0) comes from no browser and is let through.
* `Origin` present and not in `--allowed-origins` (default: none). Browsers send `Origin` on
  every cross-site POST and on every cross-origin `fetch`; command-line clients and SDKs
  send none, so they are unaffected. An allowed origin gets CORS headers, so a page there
  can call the API.

`*` in either list allows anything; `*.example.com` in the hosts allows its subdomains.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

logger = logging.getLogger("jaxinfer.serve")

# Environment variables holding the API key, first found wins (vLLM's name works too).
API_KEY_ENVIRONMENT = ("JAXINFER_API_KEY", "VLLM_API_KEY")
# The Host names a loopback-bound server answers to by default.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY = "*"


def is_loopback(host: str) -> bool:
    """True when `host` (a bind address or a host name) is reachable from this machine only.

    Args:
        host: `127.0.0.1`, `::1`, `[::1]`, `localhost`, `0.0.0.0`, a name, ...

    Returns:
        Whether only local processes can connect to a socket bound there.
    """
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # another name: it may resolve anywhere
        return False


def split_list(value: str | None) -> tuple[str, ...] | None:
    """`--allowed-hosts a,b` to ("a", "b"); None (not given) stays None."""
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(",") if item.strip())


def host_name(header: str) -> str:
    """The host of a `Host` header, without port or brackets, lower-cased.

    `localhost:8000` -> `localhost`, `[::1]:8000` -> `::1`, `Example.COM.` -> `example.com`.
    A header that is not `name[:digits]` or `[ipv6][:digits]` is returned whole, so it
    matches no allowed name.
    """
    value = header.strip().lower()
    if value.startswith("["):  # an IPv6 literal, maybe with a port after "]"
        name, _, port = value[1:].partition("]")
    elif value.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        name, port = value[:value.index(":")], value[value.index(":"):]
    else:
        name, port = value, ""
    if port and not (port.startswith(":") and port[1:].isdigit()):
        return value
    return name.rstrip(".")


def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


@dataclasses.dataclass(frozen=True)
class HttpAccess:
    """The HTTP front end's Host and Origin allow-lists.

    Attributes:
        allowed_hosts: Host names (no port) requests may address; None allows any.
            `*.example.com` allows the subdomains of example.com.
        allowed_origins: Browser origins (`https://app.example`) allowed to call; empty
            allows none, `*` any.
    """

    allowed_hosts: frozenset[str] | None
    allowed_origins: frozenset[str]

    @classmethod
    def build(cls, bind_host: str, allowed_hosts: Iterable[str] | None = None,
              allowed_origins: Iterable[str] = ()) -> HttpAccess:
        """The policy of a server bound to `bind_host`.

        Args:
            bind_host: The interface the server listens on.
            allowed_hosts: The Host names to allow; None: the loopback names when
                `bind_host` is loopback, any host otherwise. `*` allows any.
            allowed_origins: The origins to allow (`*`: any); none by default.
        """
        if allowed_hosts is None:
            hosts = frozenset(LOOPBACK_NAMES) if is_loopback(bind_host) else None
        else:
            names = {host_name(host) if host != ANY else ANY for host in allowed_hosts}
            hosts = None if ANY in names else frozenset(names)
        return cls(hosts, frozenset(_normal_origin(origin) for origin in allowed_origins))

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request with this `Host` header (None: none sent) is served."""
        if self.allowed_hosts is None or header is None:
            return True
        name = host_name(header)
        return name in self.allowed_hosts or any(
            allowed.startswith("*.") and name.endswith(allowed[1:])
            for allowed in self.allowed_hosts)

    def origin_allowed(self, origin: str) -> bool:
        """Whether a browser page at `origin` may call the server."""
        return ANY in self.allowed_origins or _normal_origin(origin) in self.allowed_origins


def resolve_api_key(flag: str | None, key_file: str | None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """The server's API key from its sources; None when none is set.

    `--api-key` and `--api-key-file` exclude each other; either one wins over the
    environment. A key given on the command line is logged as a warning (other users see it
    in `ps`).

    Args:
        flag: `--api-key`'s value.
        key_file: `--api-key-file`'s path; the file's contents, surrounding whitespace
            removed, are the key.
        environ: The environment (default `os.environ`).

    Raises:
        ValueError: Both options given, an unreadable or empty key file, or an empty key.
    """
    environ = os.environ if environ is None else environ
    if flag is not None and key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read --api-key-file {key_file}: {error}") from None
        if not key:
            raise ValueError(f"--api-key-file {key_file} is empty")
        return key
    if flag is not None:
        if not flag:
            raise ValueError("--api-key is empty")
        logger.warning("--api-key puts the key on the command line, where every user of this "
                       "machine can read it (ps); prefer --api-key-file or %s",
                       API_KEY_ENVIRONMENT[0])
        return flag
    for name in API_KEY_ENVIRONMENT:
        if environ.get(name):
            return environ[name]
    return None


def exposure_warning(bind_host: str, api_key: str | None) -> str | None:
    """The start-up warning of a server reachable from other machines without a key."""
    if api_key is not None or is_loopback(bind_host):
        return None
    return (f"serving on {bind_host}, beyond loopback, without an API key: anyone who can "
            f"reach this machine can use the model; set {API_KEY_ENVIRONMENT[0]} or "
            "--api-key-file")
