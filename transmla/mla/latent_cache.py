"""LatentCache: a preallocated MLA cache, one row [c | k_r] (d_c + d_r values) per token per layer.

Each layer owns one buffer rows [B, capacity, d_c + d_r]; a step writes its new rows in place
(no per-step concatenation) and attention reads rows[:, :length] as a view. The latent c and the
rope key k_r sit side by side in one row, so absorbed scores are one matrix product against the
whole row: [q_lat | q_rope] . [c | k_r].

It speaks transformers' cache API: ``update(latent [B, 1, T, d_c], rope_key [B, 1, T, d_r],
layer_idx)`` returns the cached latent and rope key as views [B, 1, S, .] (as a DynamicCache
would), ``keys``/``values`` are those views (so counting them counts exactly the cached tokens),
and the mask sizes are the dynamic ones. ``MLAModel.generate`` builds one sized to the prompt plus
``max_new_tokens``; when a step outgrows the capacity the buffer doubles (one copy, amortised).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["LatentCache", "LatentLayer", "cache_kwargs", "cached_rows"]


@functools.cache
def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`cache` as a model forward's keyword: `cache` since transformers 5.24, `past_key_values` before
    (the name is looked up once: this sits in decode loops)."""
    return {_cache_kwarg(): cache}


class LatentLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int = 0, **kwargs) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.rows: torch.Tensor | None = None  # [B, capacity, d_c + d_r]
        self.d_c = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.d_c = key_states.shape[-1]
        batch, width = key_states.shape[0], key_states.shape[-1] + value_states.shape[-1]
        self.rows = torch.empty(batch, max(self.capacity, 1), width, dtype=self.dtype, device=self.device)
        self.capacity = self.rows.shape[1]
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        rows = self.rows.new_empty(self.rows.shape[0], capacity, self.rows.shape[2])
        rows[:, : self.length] = self.rows[:, : self.length]
        self.rows, self.capacity = rows, capacity

    def _publish(self) -> None:
        """keys/values: views of the filled part, [B, 1, S, d_c] and [B, 1, S, d_r]."""
        filled = self.rows[:, None, : self.length]
        self.keys, self.values = filled[..., : self.d_c], filled[..., self.d_c :]

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor) -> torch.Tensor:
        """Write latent [B, T, d_c] and rope key [B, T, d_r]; return all rows [B, S, d_c + d_r] (a view)."""
        if not self.is_initialized:
            self.lazy_initialization(latent, rope_key)
        T = latent.shape[1]
        end = self.length + T
        if end > self.capacity:
            self._grow(end)
        self.rows[:, self.length : end, : self.d_c] = latent
        self.rows[:, self.length : end, self.d_c :] = rope_key
        self.length = end
        self._publish()
        return self.rows[:, :end]

    def filled_rows(self) -> torch.Tensor:
        return self.rows[:, : self.length]  # [B, S, d_c + d_r]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.append(key_states[:, 0], value_states[:, 0])
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._publish()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._publish()

    def _reindex(self, index: torch.Tensor) -> None:
        if self.is_initialized:
            self.rows = self.rows.index_select(0, index.to(self.rows.device))
            self._publish()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.rows = self.rows.repeat_interleave(repeats, dim=0)
            self._publish()

    def offload(self):  # the buffer stays where it is: views cannot be moved independently
        pass

    def prefetch(self):
        pass


class LatentCache(Cache):
    """One LatentLayer per decoder layer, each preallocated for ``capacity`` tokens."""

    def __init__(self, num_layers: int, capacity: int = 0) -> None:
        super().__init__(layers=[LatentLayer(capacity) for _ in range(num_layers)])


def cached_rows(cache, layer_idx: int, latent: torch.Tensor, rope_key: torch.Tensor) -> torch.Tensor:
    """Append latent [B, T, d_c] and rope key [B, T, d_r] to any transformers cache; all rows [B, S, d_c + d_r].

    A LatentCache returns a view of its buffer; any other cache (e.g. a DynamicCache, which keeps
    the latent as "keys" and the rope key as "values") is updated through its own API and its
    contents are joined into a new tensor.
    """
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    if isinstance(layer, LatentLayer):
        return layer.append(latent, rope_key)
    keys, values = cache.update(latent[:, None], rope_key[:, None], layer_idx)
    return torch.cat((keys[:, 0], values[:, 0]), dim=-1)
