"""Which part of a converted attention loses recall (issue 34): its scores or its values.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.recall_parts --model out/ladder/rope-64+fit-cli

recall_layers found the 50% conversion losing dev recall in layers 15-24 (and a little in 0-4); this asks
what inside those layers. Each layer's attention is replaced by a pair of the source's attention and the
conversion's, computed from their projections (fp32, causal SDPA, no cache), mixed in one of four ways:

- source: the source's softmax(q k^T) and values through its o_proj (equals the source layer);
- conversion: the conversion's softmax and values through its o_proj (equals the converted layer);
- conversion's scores: the conversion's attention weights over the source's values and o_proj: what the
  converted keys and queries (the shared rope key, the latent's key part) alone lose;
- source's scores: the source's attention weights over the conversion's values and o_proj: what the latent's
  value part (and the fitted o_proj) alone lose.

Heads pair up by index: a conversion keeps the source's query heads (head h of both reads query head h).
Every mix runs in the layers named (default: all) with the source elsewhere. Measure: the dev recall items
(retrieval_ladder.DEV_RECALL: 60 items, seed 1, 1K tokens of prose) scored on the cities' first tokens, all
distinct (one forward of the context per item, the next-token log-probabilities of the candidates' first
tokens): acc and nll (-log share of the true city among the candidates), the same protocol for every row.
Writes benchmarks/results/recall_parts_smollm2.{json,md} (`--stem` another name) with the CPU and load.

Measured (2026-12-07, an AMD EPYC with AVX-512 BF16, one thread per run; dev items): on the CLI's 50% (rope-64+fit-cli,
dev recall 50% / 1.205 by choice_tasks' scoring), in every layer: conversion 50% / nll 1.225, its scores over the
source's values 47% / 1.499, the source's scores over its values 48% / 1.189 (source 58% / 0.966): neither part
alone gives recall back, and each is tuned to the other. In layers 15-24 alone, where recall_layers put most of
the loss: conversion 57% / 1.181; its scores over the source's values 65% / 0.965, the source's; the source's
scores over its values 52% / 1.289. There the converted attention finds what to read as the source does (the fit's
far term on those layers, 2026-11-27, put the scores back) and loses what it reads: the latent's value part and
the fitted o_proj. Before the fit (rope-64 fit-free, the same plan): the source's scores over the converted values
in every layer 37% / 1.703; with the latent's PCA weighting value errors by W_o (pca_metric "output") 38% / 1.553; without the BKV balance 35% / 1.806;
with the PCA centred 35% / 1.676; with the PCA weighting key errors by the queries and value errors by W_o
(pca_metric "attention", the BKV balance then taken on the weighted blocks) **47% / 1.307**; a latent of 160 with
rope 32 (cli-50) 48% / 1.279. The truncation to 128 latent dims loses the values that recall reads, and the fit
gives back part of it; the attention-weighted PCA keeps before the fit about what the fit gives back.
With the CLI's fit (2026-12-07, second session; both rejected by their retrieval_ladder rules), in every layer:
the attention-weighted PCA (rope-64-attention+fit-cli) conversion 55% / 1.368, its scores over the source's values
35% / 1.867, the source's scores over its values 52% / 1.320: the fit undoes what the PCA kept; the fit's self term
(rope-64+fit-cli-self: each query reading only its own key fitted too) conversion 52% / 1.340, its scores 42% /
1.678, the source's scores over its values 52% / **1.135**, the best values of any conversion measured (the CLI's
1.189): the term does put the values back, and the fit then pays for them in the scores (1.678 against the CLI's
1.499), so the whole recalls no better. What to try next: the self term with a term that holds the scores (the
far term on every layer, or the attention weights' KL against the source's), judged by the same rule.
How large a change on these 60 items is real (`--paired`, each item's nll kept since 2026-12-07; the
recall_parts_smollm2_items_* results, the "conversion" mix of each saved 50% conversion against the CLI's): four
repeated spans +0.087 +- 0.044 (standard error of the paired difference), the self term +0.115 +- 0.057, the
attention-weighted PCA +0.142 +- 0.110; the CLI's 50% against the source +0.259 +- 0.114. The rules' 0.10 is
about two standard errors of a paired difference between conversions: none of the three came near it, each was
worse by one to two. The conversion's whole gap to the source is itself only 2.3 of its standard errors on these
items: a rule that must see half of that gap closed needs about four times the items (240) to see it at two.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager

import torch
from torch import nn

from .common import RESULTS, log, machine
from .retrieval_ladder import DEV_RECALL

STEM = "recall_parts_smollm2"
MIXES = ("source", "conversion", "conversion's scores", "source's scores")


def source_qkv(sa, x, position_embeddings):
    """The source layer's rotated queries and keys and its values, [B, H, T, d] each (KV heads repeated), and scale."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T, _ = x.shape
    d = sa.head_dim
    q = sa.q_proj(x).view(B, T, -1, d).transpose(1, 2)  # [B, H, T, d]
    k = sa.k_proj(x).view(B, T, -1, d).transpose(1, 2)  # [B, g, T, d]
    v = sa.v_proj(x).view(B, T, -1, d).transpose(1, 2)  # [B, g, T, d]
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), sa.scaling


def mla_qkv(ma, x):
    """The converted layer's queries and keys [B, H, T, d_nope + d_r] and values [B, H, T, d_v] in the expanded form
    (the shared rope key repeated for every head), and its scale."""
    from transmla.mla.attention import rotate_half

    c = ma.config
    B, T, _ = x.shape
    latent, k_rope = ma.compress(x)  # [B, T, d_c], [B, T, d_r]
    cos, sin = ma._rope(torch.arange(T)[None].expand(B, -1), latent.dtype)
    k_rope = k_rope * cos + rotate_half(k_rope) * sin
    q_nope, q_rope = ma._query(x, cos, sin)  # [B, T, H, d_nope], [B, T, H, d_r]
    kv = ma.kv_b_proj(latent).view(B, T, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_rope[:, :, None].expand(-1, -1, c.num_heads, -1)), dim=-1)  # [B, T, H, d_qk]
    q = torch.cat((q_nope, q_rope), dim=-1)  # [B, T, H, d_qk]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), c.softmax_scale


class MixedAttention(nn.Module):
    """A source attention `sa` and a converted one `ma`, mixed as `mix` (MIXES); a module in the source's place.
    softmax(q k^T * scale) of one over the values and o_proj of the other: one causal SDPA call (the values
    zero-padded to the keys' width where narrower: the same first columns)."""

    def __init__(self, sa, ma, mix: str) -> None:
        super().__init__()
        self.sa, self.ma, self.mix = sa, ma, mix

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        B, T, _ = hidden_states.shape
        src = source_qkv(self.sa, hidden_states, position_embeddings) if self.mix != "conversion" else None
        mla = mla_qkv(self.ma, hidden_states) if self.mix != "source" else None
        q, k, _, scale = src if self.mix in ("source", "source's scores") else mla
        v_from_source = self.mix in ("source", "conversion's scores")
        v, o_proj = (src[2], self.sa.o_proj) if v_from_source else (mla[2], self.ma.o_proj)  # [B, H, T, d_v]
        d_v = v.shape[-1]
        if d_v < q.shape[-1]:
            v = nn.functional.pad(v, (0, q.shape[-1] - d_v))
        elif d_v > q.shape[-1]:  # SDPA's fused kernel wants values no wider than the keys: pad q and k instead
            q, k = (nn.functional.pad(t, (0, d_v - t.shape[-1])) for t in (q, k))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :d_v]
        return o_proj(out.transpose(1, 2).reshape(B, T, -1)), None


def first_token_scores(model, items) -> dict:
    """acc and nll over the items, each scored by the next-token log-probabilities of its candidates' first tokens."""
    hits, nlls = 0, []
    for item in items:
        hidden = model.model(torch.tensor([item.context]), use_cache=False).last_hidden_state[0, -1]  # [D]
        logits = model.lm_head(hidden).float()  # [V]: the last position's only
        firsts = [c[0] for c in item.candidates]
        ll = torch.log_softmax(logits, -1)[firsts]  # [choices]
        hits += int(ll.argmax().item() == item.answer)
        nlls.append(-(ll[item.answer] - torch.logsumexp(ll, 0)).item())
    return {"acc": hits / len(items), "nll": sum(nlls) / len(items), "item_nll": [round(x, 5) for x in nlls]}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of b - a over the same items and its standard error (sd / sqrt(n)): how far two models' recall nll
    differ beyond what the items alone would make of it."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = sum(d) / n
    sd = (sum((x - mean) ** 2 for x in d) / (n - 1)) ** 0.5
    return mean, sd / n**0.5


@contextmanager
def mixed(source, converted, mix: str, layers: list[int] | None = None):
    """The source model with MixedAttention(mix) in `layers` (default: all), restored on exit."""
    own = [layer.self_attn for layer in source.model.layers]
    try:
        for i, (layer, conv) in enumerate(zip(source.model.layers, converted.model.layers)):
            if layers is None or i in layers:
                layer.self_attn = MixedAttention(own[i], conv.self_attn, mix)
        yield source
    finally:
        for layer, attn in zip(source.model.layers, own):
            layer.self_attn = attn


def measure(model_dir: str, layers: list[int] | None, limit: int | None, mixes: tuple[str, ...] = MIXES) -> dict:
    from transmla.checkpoint.resolve import load_model
    from transmla.eval.choice_tasks import ChoiceSettings, recall_items

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    src, tok = load_model("smollm2-135m")
    conv, _ = load_model(model_dir)
    items = recall_items(tok, ChoiceSettings(**DEV_RECALL))[:limit]
    chosen = list(range(len(src.model.layers))) if layers is None else layers
    rows = {}
    with torch.no_grad():
        check = _check_mixes(src, conv, items[0].context[:96])
        for mix in mixes:
            start = time.perf_counter()
            with mixed(src, conv, mix, chosen) as model:
                rows[mix] = first_token_scores(model, items) | {"seconds": round(time.perf_counter() - start, 1)}
            log(f"{mix}: {rows[mix]}")
    return {"model": model_dir, "items": DEV_RECALL | {"scored": len(items)}, "layers": chosen, "rows": rows,
            "check": check, "machine": machine(), "load_after": os.getloadavg()[0]}


def _check_mixes(src, conv, ids) -> dict:
    """The "source" and "conversion" mixes against the models themselves (the largest |logit difference| on a
    short prefix): the products above compute what the layers compute."""
    x = torch.tensor([ids])
    out = {}
    for mix, ref in (("source", src(x, use_cache=False).logits), ("conversion", conv(x, use_cache=False).logits)):
        with mixed(src, conv, mix) as model:
            out[mix] = (model(x, use_cache=False).logits - ref).abs().max().item()
    log(f"check (max |logit difference| of the mixes against the models): {out}")
    if max(out.values()) > 1e-3:
        raise SystemExit(f"the mixes do not compute the layers: {out}")
    return out


def report(result: dict) -> str:
    rows = result["rows"]
    src = rows["source"]["nll"] if "source" in rows else None
    L = ["# Which part of a converted attention loses recall: scores or values", "",
         (__doc__ or "").split("\n\n")[2].strip(), "", (__doc__ or "").split("\n\n")[3].strip(), "",
         f"Conversion: {result['model']}; mixed layers: {_span(result['layers'])}; items scored: "
         f"{result['items']['scored']}. Check: {', '.join(f'{k} {v:.1e}' for k, v in result['check'].items())} "
         "(largest |logit difference| of the mix against the model itself).", "",
         "| attention | accuracy | nll | nll added | seconds |", "|---|---|---|---|---|"]
    measured = [p.strip() for p in (__doc__ or "").split("\n\n") if p.startswith("Measured")]
    for name, r in rows.items():
        added = "-" if src is None else f"{r['nll'] - src:+.3f}"
        L.append(f"| {name} | {r['acc']:.0%} | {r['nll']:.3f} | {added} | {r['seconds']:.0f} |")
    m = result["machine"]
    L += ["", *(f"{p}\n" for p in measured), f"CPU: {m['machine']}, {m['threads']} thread(s), load {m['load_average']}-{result['load_after']:.2f}; {m['date']}."]
    return "\n".join(L) + "\n"


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="out/ladder/rope-64+fit-cli", help="a converted SmolLM2 folder")
    ap.add_argument("--layers", default=None, help="mixed layers, e.g. 15-24 (default: all)")
    ap.add_argument("--limit", type=int, default=None, help="score only the first N items (a quick look)")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of: {', '.join(MIXES)}")
    ap.add_argument("--stem", default=STEM, help="results file stem")
    ap.add_argument("--report", action="store_true", help="only rewrite the table")
    ap.add_argument("--paired", metavar="STEM_A,STEM_B", help="print the paired difference (B - A, and its standard "
                    "error) of two results' item nll, mix by mix, and stop")
    args = ap.parse_args(argv)
    if args.paired:
        a, b = (json.loads((RESULTS / f"{s.strip()}.json").read_text())["rows"] for s in args.paired.split(","))
        for mix in [m for m in a if m in b and "item_nll" in a[m] and "item_nll" in b[m]]:
            mean, se = paired(a[mix]["item_nll"], b[mix]["item_nll"])
            print(f"{mix}: nll {b[mix]['nll'] - a[mix]['nll']:+.3f} (paired {mean:+.3f} +- {se:.3f} s.e.)")
        return 0
    path = RESULTS / f"{args.stem}.json"
    if not args.report:
        layers = None
        if args.layers:
            a, _, b = args.layers.partition("-")
            layers = list(range(int(a), int(b or a) + 1))
        mixes = tuple(m.strip() for m in args.mixes.split(","))
        if unknown := [m for m in mixes if m not in MIXES]:
            ap.error(f"unknown mix {unknown[0]!r}; choose from {', '.join(MIXES)}")
        path.write_text(json.dumps(measure(args.model, layers, args.limit, mixes), indent=1) + "\n")
    (RESULTS / f"{args.stem}.md").write_text(report(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
