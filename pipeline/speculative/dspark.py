"""The DraftService's DSpark drafter: one `DSparkModel` shared by every request's `DSparkState`.

The model, its checkpoint format and loading are `moonserve.pipeline.models.dspark`; this module is
the `Drafter` protocol over it (per-request context, KV cache, one block pass + the Markov head per
`propose`). The embedded build is `moonserve.pipeline.prepare.drafter`.

Example:
    >>> from moonserve.pipeline.models.dspark import DSparkConfig
    >>> config = DSparkConfig(hidden_size=32, vocab_size=100, num_hidden_layers=1,
    ...                       num_attention_heads=2, intermediate_size=64, attention_type="gqa",
    ...                       num_key_value_heads=1, head_dim=16, markov_rank=4)
    >>> state = DSparkDrafter(DSparkModel(config)).new_state("req-1")   # random weights
    >>> state.append([5, 6, 7])
    >>> len(state.propose(num_speculative_tokens=4))   # one block pass + 4 Markov steps
    4
    >>> state.num_cached_tokens                         # the query slots' KV is not kept
    3

    The embedded drafter: `DSparkDrafter.from_pretrained(prepare_drafter(lm_dir),
    shared=target_shared_tensors(lm_dir))`; its MXFP4 copy:
    `quantize_drafter_checkpoint(drafter_dir, mxfp4_dir)`, loaded the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from moonserve.pipeline.models.dspark import (
    DSparkConfig,
    DSparkModel,
    load_model,
    save_model,
)
from moonserve.pipeline.models.weights import CONFIG_FILE, load_tensors
from moonserve.pipeline.speculative.drafter import propose_by_appending


def block_room(config: DSparkConfig, max_model_len: int | None, num_tokens: int, k: int) -> int:
    """How many of `k` drafts fit after a context of `num_tokens` (0 for an empty context): the
    last query slot sits at position num_tokens + k - 2, within `max_position_embeddings`, and the
    drafts within `max_model_len`."""
    if num_tokens == 0:
        return 0
    k = min(k, config.max_position_embeddings - num_tokens + 1)
    if max_model_len is not None:
        k = min(k, max_model_len - num_tokens)
    return k


class TokensAndCache:
    """A request's token ids and its drafter cache, truncated together."""

    def __init__(self, model: DSparkModel):
        self._token_ids: list[int] = []
        self.cache = model.new_cache()

    @property
    def token_ids(self) -> Sequence[int]:
        return self._token_ids

    def append(self, token_ids: Sequence[int]) -> None:
        self._token_ids.extend(int(t) for t in token_ids)

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens from `num_tokens` on, and the cache rows of those positions."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        del self._token_ids[num_tokens:]
        self.cache.truncate(num_tokens)

    def propose_after(self, assumed: Sequence[int], num_speculative_tokens: int) -> list[int]:
        return propose_by_appending(self, assumed, num_speculative_tokens)


class DSparkState(TokensAndCache):
    """One request's context and KV cache (a `DrafterState`); `append` only records tokens."""

    def __init__(self, model: DSparkModel, max_model_len: int | None = None):
        super().__init__(model)
        self.model = model
        self.max_model_len = max_model_len

    @property
    def num_cached_tokens(self) -> int:
        return self.cache.num_tokens

    @torch.inference_mode()
    def propose(self, num_speculative_tokens: int) -> list[int]:
        """`num_speculative_tokens` greedy drafts from one block pass + the Markov head; fewer
        when `max_model_len` (or the drafter's `max_position_embeddings`) leaves less room,
        none for an empty context."""
        k = self._capped_k(num_speculative_tokens)
        if k <= 0:
            return []
        return self.model.markov_decode(self.block_logits(k), self._token_ids[-1])

    @torch.inference_mode()
    def block_logits(self, k: int) -> torch.Tensor:
        """Base logits at the anchor and `k - 1` query slots, `[k, vocab]`; caches the context."""
        num_tokens = len(self._token_ids)
        if num_tokens == 0 or k < 1:
            raise ValueError(f"a block needs a context and k >= 1, got {num_tokens} tokens, k={k}")
        # The anchor's hidden state is needed even when its KV is cached (a repeated propose).
        self.cache.truncate(num_tokens - 1)
        new_ids = self._token_ids[self.cache.num_tokens :]
        hidden = self.model(self.model.embed_block(new_ids, k - 1), self.cache)
        self.cache.truncate(num_tokens)  # keep the real tokens' KV, drop the query slots'
        return self.model.compute_logits(hidden[len(new_ids) - 1 :])

    def _capped_k(self, k: int) -> int:
        return block_room(self.model.config, self.max_model_len, len(self._token_ids), k)


class DSparkDrafter:
    """DSpark block `Drafter`: one model shared by every request's `DSparkState`.

    Example:
        >>> import tempfile
        >>> drafter = DSparkDrafter(DSparkModel(DSparkConfig(
        ...     hidden_size=32, vocab_size=100, num_hidden_layers=1, num_attention_heads=2,
        ...     intermediate_size=64, attention_type="gqa", num_key_value_heads=1, head_dim=16)))
        >>> with tempfile.TemporaryDirectory() as path:      # config.json + model.safetensors
        ...     drafter.save_pretrained(path)
        ...     loaded = DSparkDrafter.from_pretrained(path, max_model_len=5)
        >>> state = loaded.new_state("req-1")
        >>> state.append([1, 2, 3])
        >>> len(state.propose(4))   # capped by max_model_len - num_tokens
        2
    """

    name = "dspark"

    def __init__(self, model: DSparkModel, max_model_len: int | None = None):
        self.model = model.eval().requires_grad_(False)
        self.max_model_len = max_model_len

    def new_state(self, request_id: str) -> DSparkState:
        return DSparkState(self.model, self.max_model_len)

    @classmethod
    def from_pretrained(
        cls,
        path: Path | str,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,
        shared: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> DSparkDrafter:
        """Load `path/config.json` and `path/*.safetensors`; linear weights may be MXFP4
        (`X.weight_blocks` + `X.weight_scales`, see `load_model`).

        `shared`: the target's `embed_tokens.weight` (and `lm_head.weight` when untied), which
        the checkpoint omits when its config says `shares_target_embedding` (the embedded build)
        and which K3 DSpark drafts omit too (vLLM aliases the target's at load time); read them
        with `target_shared_tensors(target_dir)`. A tensor the checkpoint has wins over `shared`.
        `device`: where the weights and caches live (the tests run on CPU only).
        """
        path = Path(path)
        config = DSparkConfig.from_json(path / CONFIG_FILE)
        tensors = {**(shared or {}), **load_tensors(path)}
        model = load_model(config, tensors, source=str(path), dtype=dtype, device=device)
        return cls(model, max_model_len)

    def save_pretrained(self, path: Path | str) -> None:
        save_model(self.model, Path(path))
