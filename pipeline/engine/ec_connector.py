"""The vLLM EC connector over moonserve's encoder-cache store (`pipeline/engine/ec_store.py`).

vLLM's disaggregated encoder (`ECTransferConfig`): an `ec_producer` engine runs only the vision
tower + projector and saves each item's output, keyed by the item's identifier (its
`multi_modal_uuids` entry when the request has one, else vLLM's content hash); an `ec_consumer`
engine that finds the key loads that tensor into its encoder cache instead of running the tower,
and falls back to running it on a miss. `MoonserveECConnector` is vLLM's `ECExampleConnector`
(vllm/distributed/ec_transfer/ec_connector/example_connector.py) with three changes: the store
defaults to `/dev/shm` (node-local shared memory, so producer and consumer must share a node),
writes are atomic (a reader never sees half a file), and checking a key creates nothing (the
example connector makes an empty directory for every hash it looks up).

API (all that other modules should use):

- `ec_transfer_config(role, store=DEFAULT_STORE, max_bytes=None) -> ECTransferConfig`: what an
  engine passes to vLLM (`role` "ec_producer", "ec_consumer" or "ec_both"); vLLM's
  `ECConnectorFactory` imports this module by `ec_connector_module_path`, in every engine process.
  With `max_bytes`, the producer evicts the least recently used entries after each save.
"""

from __future__ import annotations

from pathlib import Path

from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from moonserve.pipeline.engine.ec_store import DEFAULT_STORE, evict, put, store_path, touch


def ec_transfer_config(role: str, store: str | Path = DEFAULT_STORE,
                       max_bytes: int | None = None) -> ECTransferConfig:
    """The `ec_transfer_config` engine argument that selects `MoonserveECConnector`."""
    extra: dict = {"shared_storage_path": str(store)}
    if max_bytes is not None:
        extra["max_bytes"] = max_bytes
    return ECTransferConfig(ec_connector=MoonserveECConnector.__name__, ec_role=role,
                            ec_connector_module_path=__name__, ec_connector_extra_config=extra)


class MoonserveECConnector(ECExampleConnector):
    """ECExampleConnector on `put`/`has`/`get`'s store. Extra config: `shared_storage_path`
    (default `DEFAULT_STORE`), `max_bytes` (the producer's LRU bound; none by default)."""

    def __init__(self, vllm_config, role):
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        self._storage_path = transfer.get_from_extra_config("shared_storage_path",
                                                            str(DEFAULT_STORE))
        self._max_bytes = transfer.get_from_extra_config("max_bytes", None)

    def has_cache_item(self, identifier: str) -> bool:
        # Scheduler side; a hit counts as a use, so `evict` spares what the worker will load.
        return touch(store_path(self._storage_path, identifier))

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        if not self.is_producer:
            return
        put(self._storage_path, mm_hash, encoder_cache[mm_hash])
        if self._max_bytes is not None:
            evict(self._storage_path, self._max_bytes)

    def _generate_filename_debug(self, mm_hash: str) -> str:
        # The base's version creates the folder; start_load_caches only reads found entries.
        return str(store_path(self._storage_path, mm_hash))
