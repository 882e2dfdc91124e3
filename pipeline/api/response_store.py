"""Stored Responses (`store: true`): one SQLite database that every Router replica of the node
opens (`router.responses.database`), so a turn stored by one replica is read by any other, and
survives a replica's restart.

Each row is one turn: the Response, its input items (`GET /v1/responses/{id}/input_items`), the
chat messages of its input and answer, and the turn it continued. A continuing turn's history is
the chain of its predecessors' messages, so earlier images are never sent again. A row is
visible only to the API key that made it (a digest; "" when auth is off) and until its retention
ends; expired rows are deleted as new ones are written.

Example:
    >>> store = ResponseStore(Path("/tmp/r.sqlite3"), retention_s=86400)
    >>> store.put("owner", response, items, messages)
    >>> messages, session = store.history("owner", response["id"])  # what a next turn continues
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from moonserve.pipeline.api.errors import APIError

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
# A continuation chain longer than this is refused (a loop cannot happen: ids are new per turn).
MAX_CHAIN = 10_000


class ResponseStore:
    def __init__(self, path: Path, retention_s: float):
        self.path = Path(path).expanduser()
        self.retention_s = retention_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self.connect()) as db:
            db.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer
            db.executescript(SCHEMA)

    def connect(self) -> sqlite3.Connection:
        # One connection per call: calls run in worker threads, and replicas share the file.
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA busy_timeout = 30000")
        return db

    def put(self, owner: str, response: dict, input_items: list[dict],
            messages: list[dict]) -> None:
        now = time.time()
        with closing(self.connect()) as db:
            db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.retention_s,))
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (response["id"], owner, now, response.get("previous_response_id"),
                        json.dumps(response), json.dumps(input_items), json.dumps(messages)))

    def row(self, db: sqlite3.Connection, owner: str, response_id: str) -> tuple | None:
        return db.execute(
            "SELECT previous_id, response, input_items, messages FROM responses "
            "WHERE id = ? AND owner = ? AND created_at >= ?",
            (response_id, owner, time.time() - self.retention_s)).fetchone()

    def get(self, owner: str, response_id: str) -> dict:
        """The stored Response; 404 when there is none for this key (or it expired)."""
        with closing(self.connect()) as db:
            row = self.row(db, owner, response_id)
        if row is None:
            raise not_found(response_id)
        return json.loads(row[1])

    def input_items(self, owner: str, response_id: str) -> list[dict]:
        with closing(self.connect()) as db:
            row = self.row(db, owner, response_id)
        if row is None:
            raise not_found(response_id)
        return json.loads(row[2])

    def history(self, owner: str, response_id: str) -> tuple[list[dict], str]:
        """The chat messages of every turn up to `response_id`, oldest first, and the id of the
        first turn (the session's); a 404 naming `previous_response_id` when it (or a turn it
        continued) is not stored for this key."""
        turns = []
        with closing(self.connect()) as db:
            current: str | None = response_id
            while current is not None and len(turns) < MAX_CHAIN:
                row = self.row(db, owner, current)
                if row is None:
                    raise not_found(current, "previous_response_id")
                turns.append(json.loads(row[3]))
                first, current = current, row[0]
        return [m for messages in reversed(turns) for m in messages], first

    def delete(self, owner: str, response_id: str) -> None:
        with closing(self.connect()) as db:
            deleted = db.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                                 (response_id, owner)).rowcount
        if not deleted:
            raise not_found(response_id)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'", type="invalid_request_error",
                    param=param, code="response_not_found")
