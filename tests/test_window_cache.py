"""A LatentCache bounded on sliding-window layers: a tiny Gemma 3 conversion (window 6, prompts of
several windows) decodes through it exactly as through an unbounded cache and as one pass without
a cache, while each sliding layer holds at most twice its window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import assert_logits_close, make_tiny_model
from test_gemma3 import GEMMA3, WINDOW

import transmla  # noqa: F401  (registers the MLA models)
from transmla.convert.api import convert
from transmla.convert.options import ConvertOptions
from transmla.mla.latent_cache import LatentCache, LatentLayer, cache_kwargs
from transmla.mla.model import new_latent_cache, set_decode_mode

PROMPT, STEPS = 40, 12  # the prompt is 6 2/3 windows
SLIDING = [i for i, kind in enumerate(GEMMA3["layer_types"]) if kind == "sliding_attention"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    make_tiny_model("gemma3_text", path / "src", **GEMMA3)
    convert(str(path / "src"), path / "mla", ConvertOptions.of(method="lossless"), progress=False)
    model = AutoModelForCausalLM.from_pretrained(path / "mla", dtype=torch.float32).eval()
    yield model
    set_decode_mode(model, "auto")


def ids_of(seed: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def feed(model, cache, ids: torch.Tensor, chunk: int, mask: bool) -> torch.Tensor:
    """The prompt in one call, then the rest `chunk` tokens a call through `cache`; the logits
    [B, L - PROMPT, vocab] of the tokens after the prompt. `mask`: pass the all-ones 2D attention
    mask, so transformers builds the masks from the cache's mask sizes."""
    out = []
    for start, end in [(0, PROMPT), *((t, min(t + chunk, ids.shape[1])) for t in range(PROMPT, ids.shape[1], chunk))]:
        kwargs = {"attention_mask": torch.ones_like(ids[:, :end])} if mask else {}
        out.append(model(ids[:, start:end], **cache_kwargs(cache), use_cache=True, **kwargs).logits)
    return torch.cat(out, dim=1)[:, PROMPT:]


def held_rows(cache) -> list[int]:
    return [layer.keys.shape[2] for layer in cache.layers]


@pytest.mark.parametrize("mode", ["auto", "expanded"])
@pytest.mark.parametrize("chunk", [1, 5, 11])
@pytest.mark.parametrize("mask", [False, True])
def test_bounded_cache_equals_unbounded_and_no_cache(model, mode, chunk, mask):
    """Token-by-token decode (absorbed: the C kernel; or expanded) and chunks of 5 or 11 tokens
    (moves that overlap, buffers resized): every logit equal to an unbounded LatentCache's, a
    DynamicCache's and one pass without a cache (fp32, 1e-5); the sliding layers hold <= 2w rows."""
    set_decode_mode(model, mode)
    ids = ids_of(0, 2, PROMPT + 3 * WINDOW + 1)
    with torch.no_grad():
        want = model(ids).logits[:, PROMPT:]
        bounded = new_latent_cache(model, ids.shape[1])
        got = feed(model, bounded, ids, chunk, mask)
        assert_logits_close(got, want)
        for unbounded in (LatentCache(model.config.num_hidden_layers, ids.shape[1]), DynamicCache()):
            assert_logits_close(got, feed(model, unbounded, ids, chunk, mask))
    held = held_rows(bounded)
    assert all(held[i] <= max(2 * WINDOW, WINDOW - 1 + chunk) for i in SLIDING)
    assert [h for i, h in enumerate(held) if i not in SLIDING] == [ids.shape[1]]
    assert bounded.get_seq_length() == ids.shape[1]


def test_generate_keeps_sliding_layers_bounded(model):
    """generate() builds the bounded cache itself: greedy logits equal one pass over the sequence,
    each sliding layer ends with at most 2w rows, the global layer with every token."""
    set_decode_mode(model, "auto")
    ids = ids_of(1, 2, PROMPT)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        ref = model(gen.sequences).logits
    for step, logits in enumerate(gen.logits):
        assert_logits_close(logits, ref[:, PROMPT - 1 + step])
    cache = gen.past_key_values
    assert isinstance(cache, LatentCache) and cache.is_sliding == [True, False, True]
    held = held_rows(cache)
    assert all(held[i] <= 2 * WINDOW for i in SLIDING) and held[1] == PROMPT + STEPS - 1


def test_left_padded_batch_equals_one_by_one(model):
    """Two prompts (40 and 29 tokens) left-padded into one batch with an attention mask: each step's
    logits equal the prompt's own generate() (the padding mask sliced to the held rows)."""
    set_decode_mode(model, "auto")
    long, short = ids_of(2, 1, PROMPT), ids_of(3, 1, PROMPT - 11)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 11, dtype=torch.long), short], dim=1)])  # [2, 40]
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    run = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **run)
        alone = [model.generate(p, attention_mask=torch.ones_like(p), **run) for p in (long, short)]
    for b, single in enumerate(alone):
        for step, logits in enumerate(single.logits):
            assert_logits_close(batched.logits[step][b : b + 1], logits)


def rows_of(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, count, 3, generator=gen), torch.randn(2, count, 2, generator=gen)


def test_latent_layer_moves_the_last_window_rows():
    """Window 4: a buffer of 8 rows; an overflowing write moves the last 3 rows to the start (in place
    when they do not overlap their new place), a longer call gets a buffer of its own size, and every
    call returns the last rows of the sequence, at least its own plus the 3 before."""
    layer = LatentLayer(capacity=100, window=4)
    seen = []

    def write(count: int) -> torch.Tensor:
        latent, rope_key = rows_of(count, len(seen))
        seen.append(torch.cat((latent, rope_key), dim=-1))
        rows = layer.append(latent, rope_key)  # [B, S, 5]
        every = torch.cat(seen, dim=1)
        assert rows.shape[1] >= min(every.shape[1], count + 3)
        torch.testing.assert_close(rows, every[:, -rows.shape[1] :], rtol=0, atol=0)
        return rows

    write(3)
    buffer = layer.rows.data_ptr()
    write(5)
    assert (layer.capacity, layer.held, layer.rows.data_ptr()) == (8, 8, buffer)
    assert write(1).shape[1] == 4 and layer.rows.data_ptr() == buffer  # moved in place: rows 5..7 to 0..2
    assert write(4).shape[1] == 8 and layer.rows.data_ptr() == buffer  # 4 + 4 rows: no move
    write(1)  # keep 3 + 1: rows 10..12 moved, in place
    assert write(5).shape[1] == 8 and layer.rows.data_ptr() != buffer  # rows 1..3 onto 0..2 would overlap
    assert write(9).shape[1] == 12 and layer.capacity == 12  # a long call: its own buffer
    assert write(1).shape[1] == 4 and layer.capacity == 8  # back to 2 * window
    assert layer.get_seq_length() == 29 and layer.get_mask_sizes(1) == (5, 25)
    layer.crop(-1)  # 3 rows left: all a later query sees
    assert (layer.get_seq_length(), layer.held) == (28, 3)
    with pytest.raises(ValueError, match="holds only the last 3 of its 28 tokens"):
        layer.crop(-1)
    layer.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(layer.filled_rows(), torch.cat(seen, dim=1)[1:, 25:28], rtol=0, atol=0)
    assert LatentLayer(capacity=100).capacity == 100 and not LatentLayer().is_sliding
