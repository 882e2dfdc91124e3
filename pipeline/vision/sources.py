"""Where image bytes come from: `data:` URLs, and remote URLs fetched under a `RemotePolicy`.

Remote fetching is off unless hosts are allow-listed. Every hop (the URL and each redirect) is
checked for scheme, host allow-list, and the addresses its host resolves to: loopback, private,
link-local, multicast, reserved and unspecified addresses are refused unless their network is
allow-listed. The request then goes to a vetted address itself (the URL's host travels in the
Host header and as TLS server name), so a second DNS answer can never redirect it (no DNS
rebinding between check and connect).

Example:

    >>> parse_data_url("data:image/png;base64,iVBORw0KGgo=", max_bytes=1 << 20)
    b'\\x89PNG\\r\\n\\x1a\\n'
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass

import aiohttp
from yarl import URL

from moonserve.pipeline.vision.errors import (
    IMAGE_FETCH_FAILED,
    IMAGE_TOO_LARGE,
    IMAGE_URL_DISABLED,
    IMAGE_URL_FORBIDDEN,
    ImageError,
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
REMOTE_SCHEMES = ("http", "https")
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
READ_CHUNK_BYTES = 64 * 1024
# IPv6 prefixes that carry an IPv4 address in their low 32 bits (NAT64 well-known prefix).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class RemotePolicy:
    """Which remote image URLs may be fetched, and the limits of one fetch.

    `allowed_hosts` holds exact host names or IP literals, or `*.example.com` for any subdomain of
    example.com; empty means remote URLs are disabled. `allowed_networks` holds CIDRs (e.g.
    `10.1.2.0/24`) whose addresses may be fetched even though they are not public.
    """

    allowed_hosts: tuple[str, ...] = ()
    allowed_networks: tuple[str, ...] = ()
    # Largest body accepted; enforced while streaming (keep at most PreprocessConfig.max_image_bytes).
    max_bytes: int = 20 * 1024 * 1024
    connect_timeout_s: float = 5.0
    # Longest wait for the next chunk of the body.
    read_timeout_s: float = 10.0
    # Whole fetch, all redirects included: bounds a server that trickles bytes.
    total_timeout_s: float = 30.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(normalize_host(h) for h in self.allowed_hosts))
        for cidr in self.allowed_networks:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"RemotePolicy.allowed_networks: {cidr!r} is not an IP network") from None
        for name in ("max_bytes", "connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RemotePolicy.{name} must be positive, got {getattr(self, name)}")
        if self.max_redirects < 0:
            raise ValueError(f"RemotePolicy.max_redirects must be >= 0, got {self.max_redirects}")

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


def parse_data_url(url: str, max_bytes: int) -> bytes:
    """`data:image/<format>;base64,<payload>` -> the decoded bytes.

    The decoded size is computed from the payload's length and checked against `max_bytes`
    before decoding; the base64 must be strict (standard alphabet, correct padding, no whitespace).
    Raises ImageError.
    """
    header, comma, payload = url.partition(",")
    if not header.lower().startswith("data:") or not comma:
        raise ImageError("not a data: URL; expected data:image/<format>;base64,<data>")
    media_type, *params = header[len("data:"):].split(";")
    if not media_type.lower().startswith("image/"):
        raise ImageError(f"data: URL media type is {media_type or 'missing'!r}; expected image/png, image/jpeg, ...")
    if not params or params[-1].lower() != "base64":
        raise ImageError("data: URL must be base64-encoded (data:image/<format>;base64,<data>)")
    check_decoded_size(payload, max_bytes)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("invalid base64 in data: URL") from None


def check_decoded_size(payload: str, max_bytes: int) -> None:
    """Size limit from length arithmetic: 4 base64 characters carry 3 bytes, less the padding."""
    if len(payload) % 4:
        raise ImageError("invalid base64 in data: URL (its length is not a multiple of 4)")
    decoded = len(payload) // 4 * 3 - (len(payload) - len(payload.rstrip("=")))
    if decoded > max_bytes:
        raise ImageError(f"image is {decoded:,} bytes, over the {max_bytes:,}-byte limit", IMAGE_TOO_LARGE)


@dataclass(frozen=True)
class VettedTarget:
    """One hop's URL, its normalized host, and the resolved addresses allowed to be connected to."""

    url: URL
    host: str
    addresses: tuple[IPAddress, ...]


def check_url(url: URL, policy: RemotePolicy) -> str:
    """Scheme, credentials and allow-list checks of one hop; returns the normalized host."""
    if url.scheme not in REMOTE_SCHEMES:
        raise ImageError(f"image URL scheme {url.scheme + ':' if url.scheme else '(none)'} is not allowed; "
                         "use http(s):// or a data: URL", IMAGE_URL_FORBIDDEN)
    host = normalize_host(url.raw_host or "")
    if not host:
        raise ImageError("image URL has no host", IMAGE_URL_FORBIDDEN)
    if url.user is not None or url.password is not None:
        raise ImageError("image URL must not contain credentials", IMAGE_URL_FORBIDDEN)
    if not policy.host_allowed(host):
        raise ImageError(f"image URL host {host!r} is not in the allowed hosts", IMAGE_URL_FORBIDDEN)
    return host


async def resolve(host: str, port: int) -> list[IPAddress]:
    """The host's addresses: the literal itself, or what the system resolver answers."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ImageError(f"image URL host {host!r} does not resolve", IMAGE_FETCH_FAILED) from None
    # sockaddr[0]; an IPv6 scope ("fe80::1%eth0") is dropped, its address is link-local anyway.
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    return list(dict.fromkeys(addresses))


async def vet(url: URL, policy: RemotePolicy) -> VettedTarget:
    """Check one hop and pin it to the addresses that pass."""
    host = check_url(url, policy)
    addresses = await resolve(host, url.port or 0)
    allowed = tuple(address for address in addresses if policy.address_allowed(address))
    if not allowed:
        category = address_category(embedded_ipv4(addresses[0]) or addresses[0]) or "non-public"
        raise ImageError(f"image URL host {host!r} resolves to a {category} address; refused", IMAGE_URL_FORBIDDEN)
    return VettedTarget(url, host, allowed)


def host_header(url: URL) -> str:
    host = url.raw_host or ""
    host = f"[{host}]" if ":" in host else host
    return host if url.is_default_port() else f"{host}:{url.port}"


async def open_pinned(session: aiohttp.ClientSession, target: VettedTarget,
                      policy: RemotePolicy) -> aiohttp.ClientResponse:
    """GET the target from its first vetted address that accepts a connection; no redirects."""
    timeout = aiohttp.ClientTimeout(connect=policy.connect_timeout_s, sock_read=policy.read_timeout_s)
    headers = {"Host": host_header(target.url), "Accept-Encoding": "identity"}
    server_hostname = target.url.raw_host if target.url.scheme == "https" else None
    for address in target.addresses:
        pinned = target.url.with_host(str(address)).with_fragment(None)
        try:
            return await session.get(pinned, headers=headers, allow_redirects=False, timeout=timeout,
                                     server_hostname=server_hostname)
        except aiohttp.ClientConnectorCertificateError:
            raise ImageError(f"image URL host {target.host!r} has an invalid TLS certificate",
                             IMAGE_FETCH_FAILED) from None
        except aiohttp.ClientConnectorError:
            continue  # try the next vetted address
    raise ImageError(f"could not connect to image URL host {target.host!r}", IMAGE_FETCH_FAILED)


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body, refused as soon as it passes max_bytes (the connection is dropped, not drained)."""
    too_large = ImageError(f"image at URL is over the {max_bytes:,}-byte limit", IMAGE_TOO_LARGE)
    if response.content_length is not None and response.content_length > max_bytes:
        raise too_large
    chunks, total = [], 0
    async for chunk in response.content.iter_chunked(READ_CHUNK_BYTES):
        total += len(chunk)
        if total > max_bytes:
            response.close()
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def redirect_location(response: aiohttp.ClientResponse) -> URL:
    location = response.headers.get("Location")
    if not location:
        raise ImageError(f"image URL answered HTTP {response.status} without a Location", IMAGE_FETCH_FAILED)
    return parse_url(location)


def parse_url(url: str) -> URL:
    try:
        return URL(url)
    except (ValueError, TypeError):
        raise ImageError("image URL is not a valid URL", IMAGE_URL_FORBIDDEN) from None


async def fetch_hops(url: URL, policy: RemotePolicy, session: aiohttp.ClientSession) -> bytes:
    """Follow up to max_redirects redirects by hand, vetting and pinning every hop."""
    for _ in range(policy.max_redirects + 1):
        target = await vet(url, policy)
        async with await open_pinned(session, target, policy) as response:
            if response.status not in REDIRECT_STATUSES:
                if response.status != 200:
                    raise ImageError(f"image URL answered HTTP {response.status}", IMAGE_FETCH_FAILED)
                return await read_capped(response, policy.max_bytes)
            # Relative to the URL as written, not the pinned one (its host is an address).
            url = target.url.join(redirect_location(response))
    raise ImageError(f"image URL redirected more than {policy.max_redirects} times", IMAGE_FETCH_FAILED)


async def fetch_remote(url: str, policy: RemotePolicy, session: aiohttp.ClientSession) -> bytes:
    """GET a remote image under `policy`; returns the body bytes or raises ImageError.

    `session` is the caller's (one per replica); give it `cookie_jar=aiohttp.DummyCookieJar()` so
    that no cookie from one user's fetch is sent on another's.

        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            data = await fetch_remote("https://images.example.com/cat.png",
                                      RemotePolicy(allowed_hosts=("images.example.com",)), session)
    """
    if not policy.allowed_hosts:
        raise ImageError("remote image URLs are disabled; send a data: URL", IMAGE_URL_DISABLED)
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await fetch_hops(parse_url(url), policy, session)
    except TimeoutError:
        raise ImageError(
            f"image URL timed out (limits: connect {policy.connect_timeout_s:g} s, read "
            f"{policy.read_timeout_s:g} s, total {policy.total_timeout_s:g} s)", IMAGE_FETCH_FAILED,
        ) from None
    except aiohttp.ClientError as exc:
        raise ImageError(f"could not fetch image URL ({type(exc).__name__})", IMAGE_FETCH_FAILED) from None
