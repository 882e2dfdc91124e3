"""Stored Responses (`store: true`): a database every Router replica opens
(`router.responses.database`), so a turn stored by one replica is read by any other and survives
a replica's restart.

- A file path: one SQLite database for the Router replicas of a node (the embedded default).
- A `redis://` URL: one Redis server for every node of a cluster. Redis expires each turn at the
  end of its retention by itself (a key TTL), keeps a turn in one hash read by one round trip,
  and is one Debian package (`redis-server`) to run; PostgreSQL would add a schema to migrate and
  a connection pool per replica for rows that are only ever read whole by id.

Each turn holds its Response, its input items (`GET /v1/responses/{id}/input_items`), the chat
messages of its input and answer, and the turn it continued. A continuing turn's history is the
chain of its predecessors' messages, so earlier images are never sent again. A turn is visible
only to the API key that made it (its digest; "" when auth is off) and until its retention ends.

Example:
    >>> store = open_store("/tmp/r.sqlite3", retention_s=86400)   # or "redis://host:6379/0"
    >>> store.put("owner", response, items, messages)
    >>> messages, session = store.history("owner", response["id"])  # what a next turn continues
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import NamedTuple

from moonserve.pipeline.api.errors import APIError
from moonserve.pipeline.config import is_redis_url

logger = logging.getLogger("moonserve.router")
# A continuation chain longer than this is refused (a loop cannot happen: ids are new per turn).
MAX_CHAIN = 10_000


def unavailable(errors):
    """A database call whose failure (an exception of `errors()`) is a 503 with Retry-After,
    not a 500."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args):
            try:
                return fn(self, *args)
            except errors() as exc:
                logger.warning("response store: %s: %s", type(exc).__name__, exc)
                raise APIError(503, f"the response store is unavailable ({type(exc).__name__}); "
                               "retry, or send store: false", type="service_unavailable",
                               code="store_unavailable", headers={"Retry-After": "1"}) from None
        return call
    return wrap


def sqlite_errors() -> tuple[type[Exception], ...]:
    return (sqlite3.Error, OSError)


def redis_errors() -> tuple[type[Exception], ...]:
    import redis

    return (redis.RedisError, OSError)


class Turn(NamedTuple):
    previous_id: str | None
    response: str  # JSON
    input_items: str
    messages: str


class ResponseStore:
    """What both databases share: reads by id for one owner, the chain walk, the 404s."""

    def __init__(self, retention_s: float):
        self.retention_s = retention_s

    def put(self, owner: str, response: dict, input_items: list[dict],
            messages: list[dict]) -> None:
        self.write(owner, response["id"], Turn(response.get("previous_response_id"),
                                               json.dumps(response), json.dumps(input_items),
                                               json.dumps(messages)))

    def get(self, owner: str, response_id: str) -> dict:
        """The stored Response; 404 when there is none for this key (or it expired)."""
        return json.loads(self.turn(owner, response_id).response)

    def input_items(self, owner: str, response_id: str) -> list[dict]:
        return json.loads(self.turn(owner, response_id).input_items)

    def turn(self, owner: str, response_id: str, param: str | None = None) -> Turn:
        turn = self.read(owner, response_id)
        if turn is None:
            raise not_found(response_id, param)
        return turn

    def history(self, owner: str, response_id: str) -> tuple[list[dict], str]:
        """The chat messages of every turn up to `response_id`, oldest first, and the id of the
        first turn (the session's); a 404 naming `previous_response_id` when it (or a turn it
        continued) is not stored for this key."""
        turns = []
        current: str | None = response_id
        while current is not None and len(turns) < MAX_CHAIN:
            turn = self.turn(owner, current, "previous_response_id")
            turns.append(json.loads(turn.messages))
            first, current = current, turn.previous_id
        return [m for messages in reversed(turns) for m in messages], first

    def delete(self, owner: str, response_id: str) -> None:
        if not self.remove(owner, response_id):
            raise not_found(response_id)

    # What each database implements; its own errors become `unavailable` (503).
    def write(self, owner: str, response_id: str, turn: Turn) -> None:
        raise NotImplementedError

    def read(self, owner: str, response_id: str) -> Turn | None:
        raise NotImplementedError

    def remove(self, owner: str, response_id: str) -> bool:
        raise NotImplementedError


def open_store(database: str, retention_s: float) -> ResponseStore:
    """`router.responses.database`: a Redis URL (`redis://`, `rediss://`, `unix://`), else a
    SQLite file."""
    if is_redis_url(database):
        return RedisStore(database, retention_s)
    return SqliteStore(Path(database), retention_s)


SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    previous_id TEXT,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


class SqliteStore(ResponseStore):
    """One file for the replicas of a node; expired rows are deleted as new ones are written."""

    def __init__(self, path: Path, retention_s: float):
        super().__init__(retention_s)
        self.path = Path(path).expanduser()
        self.made = False

    def connect(self) -> sqlite3.Connection:
        """One connection per call: calls run in worker threads, and replicas share the file.
        The file is made by the first call, so a Router whose path cannot be written still
        serves everything but stored Responses (which get a 503 naming the error)."""
        if not self.made:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA busy_timeout = 30000")
        if not self.made:
            db.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer
            db.executescript(SCHEMA)
            self.made = True
        return db

    @unavailable(sqlite_errors)
    def write(self, owner: str, response_id: str, turn: Turn) -> None:
        now = time.time()
        with closing(self.connect()) as db:
            db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.retention_s,))
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (response_id, owner, now, *turn))

    @unavailable(sqlite_errors)
    def read(self, owner: str, response_id: str) -> Turn | None:
        with closing(self.connect()) as db:
            row = db.execute(
                "SELECT previous_id, response, input_items, messages FROM responses "
                "WHERE id = ? AND owner = ? AND created_at >= ?",
                (response_id, owner, time.time() - self.retention_s)).fetchone()
        return None if row is None else Turn(*row)

    @unavailable(sqlite_errors)
    def remove(self, owner: str, response_id: str) -> bool:
        with closing(self.connect()) as db:
            return db.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                              (response_id, owner)).rowcount > 0


class RedisStore(ResponseStore):
    """One hash per turn, `moonserve:response:<id>`, expiring after the retention."""

    PREFIX = "moonserve:response:"

    def __init__(self, url: str, retention_s: float):
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        super().__init__(retention_s)
        # A lost connection is retried twice within ~0.2 s; a server that stays away is a 503.
        self.redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=10, socket_connect_timeout=2,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 2))

    @unavailable(redis_errors)
    def write(self, owner: str, response_id: str, turn: Turn) -> None:
        key = self.PREFIX + response_id
        fields = {"owner": owner, **{k: v for k, v in turn._asdict().items() if v is not None}}
        with self.redis.pipeline() as pipe:  # MULTI: the hash and its expiry together
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, max(1, round(self.retention_s * 1000)))
            pipe.execute()

    @unavailable(redis_errors)
    def read(self, owner: str, response_id: str) -> Turn | None:
        fields = self.redis.hgetall(self.PREFIX + response_id)
        if not fields or fields["owner"] != owner:
            return None
        return Turn(fields.get("previous_id"), fields["response"], fields["input_items"],
                    fields["messages"])

    @unavailable(redis_errors)
    def remove(self, owner: str, response_id: str) -> bool:
        if self.read(owner, response_id) is None:
            return False
        return self.redis.delete(self.PREFIX + response_id) > 0


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'", type="invalid_request_error",
                    param=param, code="response_not_found")
