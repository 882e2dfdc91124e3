"""LaneAdmission deployment: the lanes of the whole application, when the Router has replicas.

One replica holds the book (`moonserve.pipeline.api.application_lanes.AdmissionBook`): every
Router replica admits each request through `admit` (which waits while the request's lane is full),
frees slots with `release`, and lists what it holds with `sync` every second. Lane counts go to the
same Ray metrics the Routers' own lanes report (`moonserve_lane_*`), so the dashboard's sums hold
either way.

Example (without Serve):
    >>> admission = LaneAdmission(LanesConfig())
    >>> await admission.admit("router-a", "ticket-1", "interactive")    # None: admitted
    >>> await admission.release("router-a", ["ticket-1"])
"""

from __future__ import annotations

import asyncio

from moonserve.pipeline.api.application_lanes import HEARTBEAT_S, AdmissionBook
from moonserve.pipeline.config import LanesConfig
from moonserve.pipeline.metrics import RouterMetrics


class LaneAdmission:
    def __init__(self, config: LanesConfig):
        self.book = AdmissionBook(config, observer=RouterMetrics())
        self.expiry: asyncio.Task | None = None

    async def admit(self, holder: str, ticket: str, lane: str) -> str | None:
        self.watch_leases()
        return await self.book.admit(holder, ticket, lane)

    async def release(self, holder: str, tickets: list[str]) -> None:
        self.book.release(holder, tickets)

    async def sync(self, holder: str, tickets: dict[str, str]) -> dict[str, dict[str, int]]:
        self.watch_leases()
        return self.book.sync(holder, tickets)

    def watch_leases(self) -> None:
        """Expire silent holders every heartbeat, also while no Router calls (they all died)."""
        if self.expiry is None:
            self.expiry = asyncio.get_running_loop().create_task(self.expire_forever())

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            self.book.expire()

    async def lane_stats(self) -> dict[str, dict[str, int]]:
        return await self.book.stats()

    async def holders(self) -> dict[str, int]:
        """Router replicas known to the book, and slots released for them since start (not
        listed, or their lease ran out)."""
        return {"holders": len(self.book.holders), "reclaimed": self.book.reclaimed}
