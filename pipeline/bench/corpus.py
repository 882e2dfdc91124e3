"""Request inputs for benchmarks, load tests and the test suite: filler text of a known token
length, and inputs that must never produce a 5xx: broken and odd images (made with Pillow) and
malformed request bodies.

Example:
    >>> for name, url in broken_images().items(): ...   # each must be a 400 naming the part
"""

from __future__ import annotations

import base64
import io
import random

from PIL import Image

WORDS = ("river stone lantern orbit velvet harbor copper meadow signal canyon ember quartz "
         "willow falcon prism tide cedar glacier nickel saffron").split()
TOKENS_PER_WORD = 1.05  # SmolLM2's tokenizer on WORDS (measured: 1,000 words -> 1,050 tokens)


def filler_text(rng: random.Random, approx_tokens: int) -> str:
    """About `approx_tokens` tokens of WORDS in random order (which defeats the prefix cache)."""
    return " ".join(rng.choice(WORDS) for _ in range(int(approx_tokens / TOKENS_PER_WORD)))


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (64, 48), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    return buffer.getvalue()


def palette_with_transparency() -> bytes:
    image = Image.new("P", (40, 30), 1)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    return encode(image, "PNG", transparency=0)


def broken_images() -> dict[str, str]:
    """Name -> URL of inputs that must be a 400 naming the part."""
    png = encode(Image.new("RGB", (300, 300), (1, 2, 3)), "PNG")
    jpeg = encode(Image.new("RGB", (300, 300), (9, 8, 7)), "JPEG")
    return {
        "invalid base64": "data:image/png;base64,@@not-base64@@",
        "text pretending to be PNG": data_url(b"hello, this is text pretending to be a PNG"),
        "wrong magic": data_url(b"\x89PNX" + png[4:]),
        "truncated PNG": data_url(png[:200]),
        "truncated JPEG": data_url(jpeg[: len(jpeg) // 2], "image/jpeg"),
        "zero bytes": "data:image/png;base64,",
        "SVG": data_url(b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>',
                        "image/svg+xml"),
        "decompression bomb": data_url(encode(Image.new("1", (20000, 20000)), "PNG")),
        "remote URL (not allowed)": "http://127.0.0.1:9/cat.png",
        "file URL": "file:///etc/passwd",
    }


def odd_images() -> dict[str, str]:
    """Name -> URL of unusual but valid images that must be answered (200)."""
    return {
        "palette with transparency": data_url(palette_with_transparency()),
        "16-bit PNG": data_url(encode(Image.new("I;16", (50, 40), 40000), "PNG")),
        "CMYK JPEG": data_url(encode(Image.new("CMYK", (60, 40), (0, 128, 255, 0)), "JPEG"),
                              "image/jpeg"),
        "animated GIF": data_url(animated_gif(), "image/gif"),
        "1x100000": data_url(encode(Image.new("L", (1, 100000), 128), "PNG")),
    }


def bad_bodies(model: str) -> list[tuple[str, bytes]]:
    """(name, raw body) of malformed chat requests; each must be a 4xx naming what is wrong."""
    def chat(**fields) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                **fields}

    import json

    cases = {
        "negative max_tokens": chat(max_tokens=-5),
        "temperature out of range": chat(temperature=7),
        "huge number": chat(max_tokens=10**40),
        "unknown role": {"model": model, "messages": [{"role": "wizard", "content": "hi"}]},
        # (A function without `parameters` is valid: OpenAI reads it as no parameters.)
        "tool without a name": chat(tools=[{"type": "function",
                                            "function": {"description": "no name"}}]),
        "empty messages": {"model": model, "messages": []},
        "image part without url": {"model": model, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    }
    raw = [(name, json.dumps(body).encode()) for name, body in cases.items()]
    return raw + [("invalid UTF-8", b'{"model": "\xff\xfe", "messages": []}'),
                  ("not JSON", b"{{{{"), ("JSON array", b"[1, 2]")]


# Speculative decoding workloads (`moonserve bench speculative`, greedy-equivalence tests).
RECORDS = [("Alice Moreau", "Lyon", "engineer", 34), ("Bruno Silva", "Porto", "pilot", 41),
           ("Chen Wei", "Suzhou", "chemist", 29), ("Dana Okafor", "Lagos", "architect", 38),
           ("Emil Novak", "Brno", "teacher", 52), ("Fatima Zahra", "Fez", "surgeon", 45),
           ("Gustav Berg", "Malmo", "baker", 27), ("Hana Sato", "Sendai", "designer", 31)]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n{text}",
    "Rewrite the following text with every sentence on its own line, changing nothing else:\n"
    "{text}",
    "Copy this list of records exactly, then stop:\n{records}",
    "Extract every line that contains a city from these records and print them unchanged:\n"
    "{records}",
    "Convert these records to JSON objects with keys name, city, job, age:\n{records}",
]
CHAT_TASKS = [
    "Why is the sky blue? Answer in two sentences.", "Give me three tips for sleeping better.",
    "What is a prime number?", "Write a haiku about autumn rain.",
    "Explain what a database index is to a new programmer.", "What should I pack for a hike?",
    "Name some famous painters and one painting by each.", "How do plants make food?",
    "Suggest a name for a friendly robot and explain it.", "What is the capital of Japan?",
]

# One-line questions with short answers (`short_chat`: 32 tokens each).
SHORT_CHAT_TASKS = [
    "What is 12 times 7?", "Who wrote Hamlet?", "What color is a ripe banana?",
    "How many days are in a leap year?", "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into French.", "What is the largest planet?", "Is a tomato a fruit?",
    "What does CPU stand for?", "Name a mammal that can fly.",
]


def copy_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` rewrite/extract prompts whose answers copy long spans from the prompt."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        records = rng.sample(RECORDS, 5)
        lines = "\n".join(f"{name}, {city}, {job}, {age}" for name, city, job, age in records)
        text = " ".join(f"{name} lives in {city} and works as a {job}." for name, city, job, _
                        in records)
        prompts.append(COPY_TASKS[i % len(COPY_TASKS)].format(text=text, records=lines))
    return prompts


def chat_prompts(n: int) -> list[str]:
    """`n` plain chat questions (little to copy from the prompt)."""
    return [CHAT_TASKS[i % len(CHAT_TASKS)] for i in range(n)]


def short_chat_prompts(n: int) -> list[str]:
    """`n` one-line questions whose answers are a sentence or two."""
    return [SHORT_CHAT_TASKS[i % len(SHORT_CHAT_TASKS)] for i in range(n)]
