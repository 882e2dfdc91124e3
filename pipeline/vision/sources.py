"""Where image bytes come from: `data:` URLs, and remote URLs fetched under a `RemotePolicy`
(pipeline/vision/remote_policy.py).

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
from moonserve.pipeline.vision.remote_policy import (
    IPAddress,
    RemotePolicy,
    address_category,
    embedded_ipv4,
    normalize_host,
)

REMOTE_SCHEMES = ("http", "https")
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
READ_CHUNK_BYTES = 64 * 1024


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


async def fetch_hops(url: URL, policy: RemotePolicy, session: aiohttp.ClientSession,
                     max_bytes: int) -> bytes:
    """Follow up to max_redirects redirects by hand, vetting and pinning every hop."""
    for _ in range(policy.max_redirects + 1):
        target = await vet(url, policy)
        async with await open_pinned(session, target, policy) as response:
            if response.status not in REDIRECT_STATUSES:
                if response.status != 200:
                    raise ImageError(f"image URL answered HTTP {response.status}", IMAGE_FETCH_FAILED)
                return await read_capped(response, max_bytes)
            # Relative to the URL as written, not the pinned one (its host is an address).
            url = target.url.join(redirect_location(response))
    raise ImageError(f"image URL redirected more than {policy.max_redirects} times", IMAGE_FETCH_FAILED)


async def fetch_remote(url: str, policy: RemotePolicy, session: aiohttp.ClientSession,
                       max_bytes: int) -> bytes:
    """GET a remote image under `policy`; returns the body bytes or raises ImageError.

    A body over `max_bytes` is refused while streaming (the preprocessor's `max_image_bytes`, the
    same cap as `parse_data_url`'s). `session` is the caller's (one per replica); give it
    `cookie_jar=aiohttp.DummyCookieJar()` so that no cookie from one user's fetch is sent on
    another's.

        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
            data = await fetch_remote("https://images.example.com/cat.png",
                                      RemotePolicy(allowed_hosts=("images.example.com",)), session,
                                      max_bytes=20 * 1024 * 1024)
    """
    if not policy.allowed_hosts:
        raise ImageError("remote image URLs are disabled; send a data: URL", IMAGE_URL_DISABLED)
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            return await fetch_hops(parse_url(url), policy, session, max_bytes)
    except TimeoutError:
        raise ImageError(
            f"image URL timed out (limits: connect {policy.connect_timeout_s:g} s, read "
            f"{policy.read_timeout_s:g} s, total {policy.total_timeout_s:g} s)", IMAGE_FETCH_FAILED,
        ) from None
    except aiohttp.ClientError as exc:
        raise ImageError(f"could not fetch image URL ({type(exc).__name__})", IMAGE_FETCH_FAILED) from None
