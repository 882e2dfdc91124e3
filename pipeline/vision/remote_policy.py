"""Which remote image URLs may be fetched: `RemotePolicy`, also the YAML block
`vision.preprocessor.remote`.

Only the standard library and pydantic, so that `moonserve.pipeline.config` (imported by the HTTP
edge) validates that block with this class itself without importing the HTTP client;
pipeline/vision/sources.py fetches under the policy.

Example:

    >>> policy = RemotePolicy(allowed_hosts=("Images.Example.com.", "*.cdn.example"))
    >>> policy.allowed_hosts
    ('images.example.com', '*.cdn.example')
    >>> policy.host_allowed("a.cdn.example"), policy.host_allowed("cdn.example")
    (True, False)
"""

from __future__ import annotations

import ipaddress

from pydantic import ConfigDict, Field, PositiveFloat, field_validator
from pydantic.dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# IPv6 prefixes that carry an IPv4 address in their low 32 bits (NAT64 well-known prefix).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


# A pydantic dataclass: the app config validates the YAML block as this class, so each field,
# default and bound is written once; unknown keys fail naming the key.
@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RemotePolicy:
    """Which remote image URLs may be fetched, and the time limits of one fetch.

    `allowed_hosts` holds exact host names or IP literals, or `*.example.com` for any subdomain of
    example.com; empty means remote URLs are disabled. Resolved addresses in loopback, private,
    link-local, multicast and reserved ranges are refused (also after each redirect) unless inside
    `allowed_networks`, which holds CIDRs (e.g. `10.1.2.0/24`). The byte cap is the
    preprocessor's `max_image_bytes`, passed to each fetch.
    """

    allowed_hosts: tuple[str, ...] = Field((), description=(
        "Hosts whose http(s) image URLs may be fetched: exact names or IP literals, or "
        "`*.example.com` for any subdomain of example.com; empty: remote URLs are off."))
    allowed_networks: tuple[str, ...] = Field((), description=(
        "CIDRs (e.g. `10.1.2.0/24`) whose loopback, private, link-local, multicast or reserved "
        "addresses may be fetched from; any other such address is refused, after redirects too."))
    connect_timeout_s: PositiveFloat = Field(5.0, description=(
        "Longest wait to connect to the image's server."))
    read_timeout_s: PositiveFloat = Field(10.0, description=(
        "Longest wait for the next chunk of the body."))
    total_timeout_s: PositiveFloat = Field(30.0, description=(
        "Whole fetch, all redirects included: bounds a server that trickles bytes."))
    max_redirects: int = Field(3, ge=0, description="Redirects one fetch may follow.")

    @field_validator("allowed_hosts")
    @classmethod
    def _normalize_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(normalize_host(host) for host in hosts)

    @field_validator("allowed_networks")
    @classmethod
    def _check_networks(cls, networks: tuple[str, ...]) -> tuple[str, ...]:
        for cidr in networks:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an IP network (write a CIDR such as "
                                 "10.1.2.0/24)") from None
        return networks

    def host_allowed(self, host: str) -> bool:
        """Whether a normalized host matches the allow-list."""
        return any(host == entry or (entry.startswith("*.") and host.endswith(entry[1:]))
                   for entry in self.allowed_hosts)

    def address_allowed(self, address: IPAddress) -> bool:
        """Public addresses, and any address inside an allow-listed network."""
        candidates = [address, *filter(None, [embedded_ipv4(address)])]
        networks = [ipaddress.ip_network(cidr, strict=False) for cidr in self.allowed_networks]
        if any(candidate in network for candidate in candidates for network in networks
               if candidate.version == network.version):
            return True
        return all(address_category(candidate) is None for candidate in candidates)


def normalize_host(host: str) -> str:
    """Lower-case, no trailing dot; IP literals in their canonical form."""
    host = host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, Teredo client, NAT64), if any."""
    if address.version == 4:
        return None
    if address.ipv4_mapped or address.sixtofour:
        return address.ipv4_mapped or address.sixtofour
    if address.teredo:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_category(address: IPAddress) -> str | None:
    """Why an address is refused ('loopback', 'private', ...), or None for a public address."""
    checks = (("loopback", address.is_loopback), ("link-local", address.is_link_local),
              ("unspecified", address.is_unspecified), ("multicast", address.is_multicast),
              ("private", address.is_private), ("reserved", address.is_reserved),
              ("non-public", not address.is_global))
    return next((name for name, refused in checks if refused), None)
