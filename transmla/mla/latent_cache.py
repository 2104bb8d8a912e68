"""LatentCache: a preallocated MLA cache, one row [c | k_r] (d_c + d_r values) per token per layer.

Each layer owns one buffer rows [B, capacity, d_c + d_r]; a step writes its new rows in place
(no per-step concatenation) and attention reads the held rows as a view. The latent c and the
rope key k_r sit side by side in one row, so absorbed scores are one matrix product against the
whole row: [q_lat | q_rope] . [c | k_r].

A global layer holds every token: ``MLAModel.generate`` sizes it to the prompt plus
``max_new_tokens``; when a step outgrows the capacity the buffer doubles (one copy, amortised).
A sliding-window layer (window w: a query at index i sees the rows i - w < j <= i) is bounded: no
later query sees more than the last w - 1 rows of the past, so its buffer holds 2w rows (or w - 1
plus a longer call's tokens); when a write would overflow it, the last w - 1 rows move to the
start and the rest are dropped (one copy of w - 1 rows per w + 1 tokens in decode). After a call
it holds at most max(2w, w - 1 + T) rows, whatever the context; ``length`` (the tokens seen, which
sets positions) and ``held`` (the rows kept: the last ``held`` tokens) are then apart.

It speaks transformers' cache API: ``update(latent [B, 1, T, d_c], rope_key [B, 1, T, d_r],
layer_idx)`` returns the held latent and rope key as views [B, 1, S, .] (as a DynamicCache
would), ``keys``/``values`` are those views (so counting them counts exactly the held tokens).
A sliding layer says ``is_sliding`` and its mask sizes are its held rows plus the call's queries
(kv_offset = the dropped tokens), so transformers' sliding-window mask has a column per row held
before the call and per query: at least the S rows a call returns, which are the mask's last S
columns (the attention reads them so; a full-width mask would do as well).
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
    is_compileable = False

    def __init__(self, capacity: int = 0, window: int = 0, **kwargs) -> None:
        super().__init__()
        self.window = window  # 0: a global layer, every token held
        # transformers sizes its sliding-window mask by a layer that says so (get_mask_sizes)
        self.is_sliding = window > 0
        self.is_croppable = not window  # a bounded layer cannot always put back dropped rows
        self.capacity = min(capacity, 2 * window) if window else capacity
        self.length = 0  # tokens seen
        self.held = 0  # rows in the buffer: the last `held` tokens' (all of them on a global layer)
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
        rows[:, : self.held] = self.rows[:, : self.held]
        self.rows, self.capacity = rows, capacity

    def _drop_unseen(self, q_len: int) -> None:
        """Keep the last window - 1 rows (all a later query sees) at the start of a buffer of 2 * window
        rows, or of room for them and the call's q_len rows; drop the rest."""
        keep = min(self.held, self.window - 1)
        kept = self.rows[:, self.held - keep : self.held]  # [B, keep, d_c + d_r]
        capacity = max(2 * self.window, keep + q_len)
        if capacity != self.capacity or self.held - keep < keep:  # resized, or the move would overlap itself
            self.rows, self.capacity = kept.new_empty(kept.shape[0], capacity, kept.shape[2]), capacity
        self.rows[:, :keep] = kept
        self.held = keep

    def _publish(self) -> None:
        """keys/values: views of the held rows, [B, 1, S, d_c] and [B, 1, S, d_r]."""
        filled = self.rows[:, None, : self.held]
        self.keys, self.values = filled[..., : self.d_c], filled[..., self.d_c :]

    def append(self, latent: torch.Tensor, rope_key: torch.Tensor) -> torch.Tensor:
        """Write latent [B, T, d_c] and rope key [B, T, d_r]; return the held rows [B, S, d_c + d_r] (a view),
        the last S tokens': all of them on a global layer, at least the last T + window - 1 on a sliding one."""
        if not self.is_initialized:
            self.lazy_initialization(latent, rope_key)
        T = latent.shape[1]
        if self.held + T > self.capacity:
            if self.window:
                self._drop_unseen(T)
            else:
                self._grow(self.held + T)
        end = self.held + T
        self.rows[:, self.held : end, : self.d_c] = latent
        self.rows[:, self.held : end, self.d_c :] = rope_key
        self.held, self.length = end, self.length + T
        self._publish()
        return self.rows[:, :end]

    def filled_rows(self) -> torch.Tensor:
        return self.rows[:, : self.held]  # [B, S, d_c + d_r]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.append(key_states[:, 0], value_states[:, 0])
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(mask columns, the token index of the first): the held rows and the call's queries."""
        return self.held + query_length, self.length - self.held

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = self.held = 0
        if self.is_initialized:
            self._publish()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens. A sliding layer raises ValueError when fewer than
        window - 1 rows of what is left would stay held (it dropped the rows a later query needs)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if not self.is_initialized:
            return
        removed = min(-tokens_to_remove, self.length)
        length, held = self.length - removed, max(0, self.held - removed)
        if self.window and held < min(length, self.window - 1):
            raise ValueError(f"cannot crop {removed} tokens from a sliding-window layer (window {self.window}) "
                             f"that holds only the last {self.held} of its {self.length} tokens")
        self.length, self.held = length, held
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
    """One LatentLayer per decoder layer, each preallocated for ``capacity`` tokens; a layer with a
    window (``windows[layer]`` > 0, as MLAConfig.sliding_windows) is bounded to about 2 * window rows."""

    def __init__(self, num_layers: int, capacity: int = 0, windows: list[int] | tuple[int, ...] = ()) -> None:
        if windows and len(windows) != num_layers:
            raise ValueError(f"windows needs one window per layer ({num_layers}), got {list(windows)}")
        windows = windows or [0] * num_layers
        super().__init__(layers=[LatentLayer(capacity, window) for window in windows])


def cached_rows(cache, layer_idx: int, latent: torch.Tensor, rope_key: torch.Tensor) -> torch.Tensor:
    """Append latent [B, T, d_c] and rope key [B, T, d_r] to any transformers cache; the rows it holds,
    the last S tokens' [B, S, d_c + d_r] (all of them but on a sliding layer).

    A LatentCache returns a view of its buffer; any other cache (e.g. a DynamicCache, which keeps
    the latent as "keys" and the rope key as "values") is updated through its own API and its
    contents are joined into a new tensor.
    """
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    if isinstance(layer, LatentLayer):
        return layer.append(latent, rope_key)
    keys, values = cache.update(latent[:, None], rope_key[:, None], layer_idx)
    return torch.cat((keys[:, 0], values[:, 0]), dim=-1)
