"""Image sources: data: URLs, and remote fetches against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import datetime
import io
import ipaddress
import socket
import ssl
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from PIL import Image

from moonserve.pipeline.vision import errors
from moonserve.pipeline.vision.errors import ImageError
from moonserve.pipeline.vision.preprocess_config import DEFAULT_CONFIG
from moonserve.pipeline.vision.sources import RemotePolicy, fetch_remote, parse_data_url

MAX_BYTES = DEFAULT_CONFIG.max_image_bytes  # the preprocessor passes its max_image_bytes


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (30, 20), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()


@dataclass
class ServerLog:
    """What the test server saw: request paths and Host headers, body bytes it got out."""

    paths: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    streamed_bytes: int = 0
    stream_finished: bool = False


def build_app(log: ServerLog) -> web.Application:
    async def record(request: web.Request, handler):
        log.paths.append(request.path)
        log.hosts.append(request.headers.get("Host", ""))
        return await handler(request)

    async def image(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def loop_forever(_: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def stream(request: web.Request) -> web.StreamResponse:
        # 64 MiB in 64 KiB chunks, with no Content-Length: only the client's running count can stop it.
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(1024):
            await response.write(b"\0" * 65536)
            log.streamed_bytes += 65536
        log.stream_finished = True
        return response

    async def declared_huge(_: web.Request) -> web.Response:
        return web.Response(body=b"\0" * 300_000, content_type="image/png")

    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"\x89")
        await asyncio.sleep(30)
        return response

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(300):
            await response.write(b"\0")
            await asyncio.sleep(0.05)
        return response

    async def missing(_: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app = web.Application(middlewares=[web.middleware(record)])
    app.add_routes([web.get("/image.png", image), web.get("/redirect", redirect), web.get("/loop", loop_forever),
                    web.get("/stream", stream), web.get("/declared-huge", declared_huge), web.get("/slow", slow),
                    web.get("/trickle", trickle), web.get("/missing", missing)])
    return app


@dataclass
class Server:
    base: str
    port: int
    log: ServerLog


@pytest.fixture
async def image_host():
    log = ServerLog()
    runner = web.AppRunner(build_app(log), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield Server(f"http://127.0.0.1:{port}", port, log)
    await runner.cleanup()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client:
        yield client


LOCAL = RemotePolicy(allowed_hosts=("127.0.0.1",), allowed_networks=("127.0.0.1/32",))


async def refusal(url: str, policy: RemotePolicy, session: aiohttp.ClientSession,
                  max_bytes: int = MAX_BYTES) -> ImageError:
    with pytest.raises(ImageError) as caught:
        await fetch_remote(url, policy, session, max_bytes)
    return caught.value


async def test_remote_urls_are_disabled_by_default(image_host, session):
    error = await refusal(f"{image_host.base}/image.png", RemotePolicy(), session)
    assert error.reason == "remote image URLs are disabled; send a data: URL"
    assert error.code == errors.IMAGE_URL_DISABLED
    assert image_host.log.paths == []


async def test_allow_listed_loopback_network_fetches_the_image(image_host, session):
    assert await fetch_remote(f"{image_host.base}/image.png", LOCAL, session, MAX_BYTES) == PNG
    assert image_host.log.hosts == [f"127.0.0.1:{image_host.port}"]


async def test_loopback_is_refused_unless_its_network_is_allow_listed(image_host, session):
    policy = RemotePolicy(allowed_hosts=("127.0.0.1",))
    error = await refusal(f"{image_host.base}/image.png", policy, session)
    assert error.reason == "image URL host '127.0.0.1' resolves to a loopback address; refused"
    assert error.code == errors.IMAGE_URL_FORBIDDEN
    assert image_host.log.paths == []  # refused before connecting


async def test_host_outside_the_allow_list_is_refused(image_host, session):
    error = await refusal(f"http://localhost:{image_host.port}/image.png", LOCAL, session)
    assert error.reason == "image URL host 'localhost' is not in the allowed hosts"


@pytest.mark.parametrize(
    "target, reason",
    [
        ("http://169.254.169.254/latest/meta-data/", "'169.254.169.254' resolves to a link-local address"),
        ("http://10.0.0.1/", "'10.0.0.1' resolves to a private address"),
        ("http://[::ffff:10.0.0.1]/", "'::ffff:a00:1' resolves to a private address"),
        ("http://metadata.internal/", "'metadata.internal' is not in the allowed hosts"),
        ("file:///etc/passwd", "scheme file: is not allowed"),
    ],
)
async def test_redirect_to_a_forbidden_target_is_refused(image_host, session, target, reason):
    # The forbidden hosts are allow-listed by name, so only the address check stands in the way.
    policy = RemotePolicy(allowed_hosts=("127.0.0.1", "169.254.169.254", "10.0.0.1", "::ffff:10.0.0.1"),
                          allowed_networks=("127.0.0.1/32",))
    error = await refusal(f"{image_host.base}/redirect?to={target}", policy, session)
    assert reason in error.reason
    assert image_host.log.paths == ["/redirect"]


async def test_relative_redirect_is_followed(image_host, session):
    assert await fetch_remote(f"{image_host.base}/redirect?to=/image.png", LOCAL, session, MAX_BYTES) == PNG
    assert image_host.log.paths == ["/redirect", "/image.png"]


async def test_redirects_are_capped(image_host, session):
    error = await refusal(f"{image_host.base}/loop", LOCAL, session)
    assert error.reason == "image URL redirected more than 3 times"
    assert len(image_host.log.paths) == 4


async def test_streamed_body_is_cut_off_at_the_byte_cap(image_host, session):
    error = await refusal(f"{image_host.base}/stream", LOCAL, session, max_bytes=200_000)
    assert error.reason == "image at URL is over the 200,000-byte limit"
    assert error.code == errors.IMAGE_TOO_LARGE
    await asyncio.sleep(0.2)  # let the server notice the dropped connection
    assert not image_host.log.stream_finished  # the client hung up instead of draining 64 MiB


async def test_declared_content_length_over_the_cap_is_refused_unread(image_host, session):
    error = await refusal(f"{image_host.base}/declared-huge", LOCAL, session, max_bytes=100_000)
    assert error.reason == "image at URL is over the 100,000-byte limit"


async def test_stalled_body_hits_the_read_timeout(image_host, session):
    policy = RemotePolicy(allowed_hosts=LOCAL.allowed_hosts, allowed_networks=LOCAL.allowed_networks,
                          read_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    error = await refusal(f"{image_host.base}/slow", policy, session)
    assert error.reason.startswith("image URL timed out (limits: connect 5 s, read 0.3 s, total 30 s)")
    assert loop.time() - started < 5


async def test_trickling_body_hits_the_total_timeout(image_host, session):
    # A byte every 50 ms never trips the 10 s read timeout; the 0.5 s total bounds it.
    policy = RemotePolicy(allowed_hosts=LOCAL.allowed_hosts, allowed_networks=LOCAL.allowed_networks,
                          total_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    error = await refusal(f"{image_host.base}/trickle", policy, session)
    assert "total 0.5 s" in error.reason
    assert loop.time() - started < 5


async def test_http_error_status_is_reported(image_host, session):
    error = await refusal(f"{image_host.base}/missing", LOCAL, session)
    assert error.reason == "image URL answered HTTP 404"
    assert error.code == errors.IMAGE_FETCH_FAILED


@pytest.mark.parametrize(
    "url, reason",
    [
        ("ftp://127.0.0.1/image.png", "image URL scheme ftp: is not allowed; use http(s):// or a data: URL"),
        ("file:///etc/passwd", "image URL scheme file: is not allowed; use http(s):// or a data: URL"),
        ("gopher://127.0.0.1:70/", "image URL scheme gopher: is not allowed; use http(s):// or a data: URL"),
        ("data:image/png;base64,AAAA", "image URL scheme data: is not allowed; use http(s):// or a data: URL"),
        ("//127.0.0.1/image.png", "image URL scheme (none) is not allowed; use http(s):// or a data: URL"),
        ("http://user:pw@127.0.0.1/image.png", "image URL must not contain credentials"),
        ("http:///image.png", "image URL has no host"),
    ],
)
async def test_urls_that_are_not_plain_http_are_refused(image_host, session, url, reason):
    assert (await refusal(url, LOCAL, session)).reason == reason
    assert image_host.log.paths == []


@pytest.fixture
async def fake_dns(monkeypatch):
    """Fake DNS answers (the one part faked: this machine has no resolver we control)."""
    answers: dict[str, list[str]] = {}
    loop = asyncio.get_running_loop()

    async def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in answers[host]]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return answers


async def test_request_goes_to_the_vetted_address_with_the_name_as_host(image_host, session, fake_dns):
    # The private answer is dropped; the request is pinned to 127.0.0.1 and carries the name.
    fake_dns["images.test"] = ["10.0.0.1", "127.0.0.1"]
    policy = RemotePolicy(allowed_hosts=("*.test",), allowed_networks=("127.0.0.0/8",), connect_timeout_s=1)
    url = f"http://images.test:{image_host.port}/image.png"
    assert await fetch_remote(url, policy, session, MAX_BYTES) == PNG
    assert image_host.log.hosts == [f"images.test:{image_host.port}"]


def self_signed_certificate(directory, name: str) -> tuple[str, str]:
    """(cert.pem, key.pem) of a self-signed certificate for the DNS name `name`."""
    x509 = pytest.importorskip("cryptography.x509", reason="cryptography makes the test certificate")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture
async def tls_server(tmp_path):
    """The test app over HTTPS on 127.0.0.1 with a certificate for images.test, and a client trusting it."""
    cert, key = self_signed_certificate(tmp_path, "images.test")
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    log = ServerLog()
    runner = web.AppRunner(build_app(log), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context)
    await site.start()
    client_context = ssl.create_default_context(cafile=cert)
    connector = aiohttp.TCPConnector(ssl=client_context)
    async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as client:
        yield Server(f"https://127.0.0.1:{runner.addresses[0][1]}", runner.addresses[0][1], log), client
    await runner.cleanup()


async def test_https_is_pinned_and_still_verifies_the_certificate_name(tls_server, fake_dns):
    server, client = tls_server
    fake_dns["images.test"] = ["127.0.0.1"]
    fake_dns["other.test"] = ["127.0.0.1"]
    policy = RemotePolicy(allowed_hosts=("images.test", "other.test"), allowed_networks=("127.0.0.1/32",))
    url = f"https://images.test:{server.port}/image.png"
    assert await fetch_remote(url, policy, client, MAX_BYTES) == PNG
    assert server.log.hosts == [f"images.test:{server.port}"]
    # Same address, another name: the certificate (for images.test) must not be accepted for it.
    error = await refusal(f"https://other.test:{server.port}/image.png", policy, client)
    assert error.reason == "image URL host 'other.test' has an invalid TLS certificate"


async def test_name_resolving_only_to_private_addresses_is_refused(image_host, session, fake_dns):
    fake_dns["rebind.test"] = ["192.168.1.10"]
    policy = RemotePolicy(allowed_hosts=("rebind.test",))
    error = await refusal(f"http://rebind.test:{image_host.port}/image.png", policy, session)
    assert error.reason == "image URL host 'rebind.test' resolves to a private address; refused"


async def test_unresolvable_host_is_reported(session, fake_dns):
    error = await refusal("http://nowhere.test/x.png", RemotePolicy(allowed_hosts=("nowhere.test",)), session)
    assert error.reason == "image URL host 'nowhere.test' does not resolve"


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
     "224.0.0.1", "240.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1", "ff02::1",
     "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::a00:1", "2002:a00:1::"],
)
def test_non_public_addresses_are_refused(address):
    assert not RemotePolicy(allowed_hosts=("x",)).address_allowed(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert RemotePolicy(allowed_hosts=("x",)).address_allowed(ipaddress.ip_address(address))


def test_allowed_network_admits_its_addresses_only():
    policy = RemotePolicy(allowed_hosts=("x",), allowed_networks=("10.1.2.0/24",))
    assert policy.address_allowed(ipaddress.ip_address("10.1.2.3"))
    assert policy.address_allowed(ipaddress.ip_address("::ffff:10.1.2.3"))
    assert not policy.address_allowed(ipaddress.ip_address("10.1.3.1"))


def test_host_allow_list_matching():
    policy = RemotePolicy(allowed_hosts=("Images.Example.com.", "*.cdn.example", "::1"))
    assert policy.allowed_hosts == ("images.example.com", "*.cdn.example", "::1")
    assert policy.host_allowed("images.example.com") and policy.host_allowed("a.b.cdn.example")
    assert not policy.host_allowed("cdn.example") and not policy.host_allowed("evilcdn.example")
    assert not policy.host_allowed("example.com")


@pytest.mark.parametrize("options, match", [
    ({"allowed_networks": ("ten",)}, r"allowed_networks\n.*'ten' is not an IP network"),
    ({"connect_timeout_s": 0}, r"connect_timeout_s\n.*greater than 0"),
    ({"max_redirects": -1}, r"max_redirects\n.*greater than or equal to 0"),
    # The byte cap is the preprocessor's max_image_bytes, given to each fetch.
    ({"max_bytes": 1}, r"max_bytes\n.*Unexpected keyword argument"),
])
def test_bad_policy_names_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        RemotePolicy(**options)


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


def test_data_url_round_trips():
    assert parse_data_url(data_url(PNG), max_bytes=1 << 20) == PNG
    assert parse_data_url(data_url(PNG, "IMAGE/PNG").replace("base64", "BASE64"), max_bytes=1 << 20) == PNG


@pytest.mark.parametrize(
    "url, reason",
    [
        ("data:image/png;base64,iVBO!!==", "invalid base64 in data: URL"),
        ("data:image/png;base64,iVBORw0KGgo", "invalid base64 in data: URL (its length is not a multiple of 4)"),
        ("data:image/png;base64,iVBO\nRw0K", "invalid base64 in data: URL (its length is not a multiple of 4)"),
        ("data:image/png;base64,iVBO Rw0KGg=", "invalid base64 in data: URL"),
        ("data:image/png;base64,iV=ORw0KGgo=", "invalid base64 in data: URL"),
        ("data:image/png;base64,iVBORw0KGg-_", "invalid base64 in data: URL"),
        ("data:image/png,rawbytes", "data: URL must be base64-encoded (data:image/<format>;base64,<data>)"),
        ("data:text/plain;base64,aGk=", "data: URL media type is 'text/plain'; expected image/png, image/jpeg, ..."),
        ("data:;base64,aGk=", "data: URL media type is 'missing'; expected image/png, image/jpeg, ..."),
        ("data:image/png;base64", "not a data: URL; expected data:image/<format>;base64,<data>"),
        ("https://example.com/a.png", "not a data: URL; expected data:image/<format>;base64,<data>"),
    ],
)
def test_bad_data_urls_say_what_is_wrong(url, reason):
    with pytest.raises(ImageError) as caught:
        parse_data_url(url, max_bytes=1 << 20)
    assert caught.value.reason == reason


def test_data_url_size_is_checked_before_decoding():
    # 4 MB of payload that is not valid base64 at all: refused on length, never decoded.
    url = "data:image/png;base64," + "!" * 4_000_000
    with pytest.raises(ImageError) as caught:
        parse_data_url(url, max_bytes=1_000_000)
    assert caught.value.reason == "image is 3,000,000 bytes, over the 1,000,000-byte limit"
    assert caught.value.code == errors.IMAGE_TOO_LARGE
    assert parse_data_url(data_url(b"x" * 999_999), max_bytes=1_000_000) == b"x" * 999_999
    with pytest.raises(ImageError, match="1,000,001 bytes"):
        parse_data_url(data_url(b"x" * 1_000_001), max_bytes=1_000_000)
