"""Which serving engines load a DeepSeek-format folder, and why the others do not.

Rules read from the engines' own DeepSeek code (vllm/model_executor/models/deepseek_v2.py and its
MLA backends, sglang/srt/models/deepseek_v2.py; not run here: both need a GPU); each rule names
what the engine does with a config that breaks it. Beyond these: vLLM's FlashMLA, CUTLASS,
FlashInfer and CPU MLA backends take only 512 + 64 (320 runs on its Triton MLA backend), and on
Hopper its prefill pairs qk_head_dim with v_head_dim (equal, or 128 < qk <= 192 with 96 < v <= 128,
or qk <= 64): README "Serve it" lists them. Scaled ropes: see _rope_rule. A sparse MoE: vLLM's DeepseekV2MoE (used for V2 and V3)
routes with `scoring_func` (softmax or sigmoid), `norm_topk_prob` (renormalise the top k),
`n_group`/`topk_group` (1/1: plain top-k), `routed_scaling_factor` and, only for `topk_method`
noaux_tc, a score-correction bias. transformers 5's config takes `n_shared_experts` only as an
integer, so "no shared expert" is written as 0 (absent would mean its default, 1): vLLM then builds
a shared MLP of zero width whose weights its strict loader requires (default_loader.py: "weights
were not initialized from checkpoint"), so the export writes them as zero-size tensors; vLLM's CUDA
silu_and_mul (csrc/activation_kernels.cu, used when its custom ops are on) divides by that width,
its torch-native path does not (not run here). `engine_report` is used by `export` (to refuse) and
by `inspect` (to tell); `source_report` by `convert --format deepseek` before converting.
"""

from __future__ import annotations

import math

ENGINES = ("transformers", "vllm", "sglang")
# vLLM's MLA attention backends take only these latent + rope widths (kv_lora_rank +
# qk_rope_head_dim); its FlashMLA and CPU backends take only 576 (DeepSeek's 512 + 64).
VLLM_MLA_WIDTHS = (320, 576)


def padded_latent_size(kv_lora_rank: int, rope_dim: int, width: int | None = None) -> int:
    """The kv_lora_rank >= the given one whose width with the rope key is `width`, or (None) the
    smallest width vLLM accepts that holds it."""
    for w in (width,) if width else VLLM_MLA_WIDTHS:
        if kv_lora_rank + rope_dim <= w:
            return w - rope_dim
    raise ValueError(
        f"latent {kv_lora_rank} + rope {rope_dim} is wider than "
        + (f"the pad width {width}" if width else f"every MLA width vLLM accepts ({', '.join(map(str, VLLM_MLA_WIDTHS))})")
    )


def _routes_softmax(config: dict) -> bool:
    """The config has sparse MoE layers scored with a softmax over all experts (Mixtral's router)."""
    sparse = config.get("first_k_dense_replace", 0) < config.get("num_hidden_layers", 0)
    return sparse and config.get("scoring_func", "sigmoid") == "softmax"


# engine -> why its DeepSeek MoE cannot serve a softmax router with no shared expert (Mixtral's);
# absent: it can. SGLang (python/sglang/srt/models/deepseek_v2.py, layers/moe/topk.py) routes exactly
# so (grouped_topk: softmax, one group, top k, renormalised by norm_topk_prob; no correction bias
# unless topk_method noaux_tc), but it always builds the shared expert: n_shared_experts 0 gives a
# zero-width MLP whose sgl_kernel silu_and_mul divides by that width, absent means transformers'
# default 1 (a shared expert with no weights), and transformers 5 rejects null.
SOFTMAX_ROUTER_REASONS = {
    "transformers": "its DeepseekV3 always scores experts with a sigmoid (it ignores scoring_func softmax) and "
                    "its DeepseekV2 does not renormalise the top-k weights: no stock router equals this one "
                    "(serve it with --engines vllm)",
    "sglang": "SGLang routes softmax top-k renormalised like this, but always builds a shared expert: with "
              "n_shared_experts 0 it is zero-wide and sgl_kernel's silu_and_mul divides by its width "
              "(serve it with --engines vllm)",
}


def source_report(config: dict) -> dict[str, str | None]:
    """engine -> the reason it cannot load the export, for the rules a source already decides (its
    MoE router, its rope scaling); `config` holds DeepSeek's names (first_k_dense_replace,
    num_hidden_layers, scoring_func, rope_parameters). None: not decided yet."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    names = {"vllm": "vLLM", "sglang": "SGLang"}
    report: dict[str, str | None] = {}
    for engine in ENGINES:
        reason = SOFTMAX_ROUTER_REASONS.get(engine) if _routes_softmax(config) else None
        if reason is None and engine in names:
            rope_reason = _rope_rule(rope)
            reason = f"{names[engine]} {rope_reason}" if rope_reason else None
        report[engine] = reason
    return report


def _transformers(config: dict) -> str | None:
    try:
        from transformers import DeepseekV3ForCausalLM  # noqa: F401
    except ImportError:
        return "the installed transformers has no DeepseekV3 (needs 4.51 or later)"
    return None


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_rule(rope: dict) -> str | None:
    """vLLM and SGLang compute every scaled DeepSeek rope as DeepSeek-YaRN (rope_type forced to
    deepseek_yarn: YaRN frequencies on qk_rope_head_dim with floor/ceil-truncated correction range,
    cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim), mscale defaulting to 1 and
    mscale_all_dim to 0). transformers' yarn computes the same frequencies, but its cos/sin factor is
    `attention_factor` if given, else that ratio only when both mscale and mscale_all_dim are set,
    else mscale(factor, 1). A yarn rope loads exactly where the two factors agree."""
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("default", "deepseek_yarn"):
        return None
    if rope_type != "yarn":
        return f"computes every scaled DeepSeek rope as DeepSeek-YaRN, not {rope_type}"
    if rope.get("truncate") is False:
        return "always truncates the YaRN correction range (the rope has truncate: false)"
    factor, m, m_all = float(rope["factor"]), rope.get("mscale"), rope.get("mscale_all_dim")
    ours = rope.get("attention_factor")
    if ours is None:
        ours = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor, 1.0)
    theirs = _yarn_mscale(factor, float(m if m is not None else 1.0)) / _yarn_mscale(factor, float(m_all or 0.0))
    if not math.isclose(ours, theirs, rel_tol=1e-9):
        return (f"scales the yarn rope's cos/sin by {theirs:.6g} (DeepSeek-YaRN's mscale ratio), "
                f"transformers by {ours:.6g}")
    return None


def _common_serving(config: dict, name: str) -> str | None:
    if config.get("attention_bias"):
        return f"{name} has no attention biases and drops them silently (export with --drop-biases)"
    if config.get("num_key_value_heads") != config.get("num_attention_heads"):
        return f"{name} expects num_key_value_heads == num_attention_heads"
    if not isinstance(config.get("n_routed_experts"), int):
        return f"{name} reads n_routed_experts as an integer"
    if config.get("qk_nope_head_dim") == 0:
        return f"{name}'s MLA kernels need a no-rope query/key part (qk_nope_head_dim is 0)"
    return None


def _vllm(config: dict) -> str | None:
    reason = _common_serving(config, "vLLM")
    if reason:
        return reason
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    if width not in VLLM_MLA_WIDTHS:
        return (
            f"vLLM's MLA backends accept kv_lora_rank + qk_rope_head_dim of "
            f"{' or '.join(map(str, VLLM_MLA_WIDTHS))}, not {width} (export with --pad-latent)"
        )
    return None


def _sglang(config: dict) -> str | None:
    return _common_serving(config, "SGLang")


def parse_engines(text: str) -> tuple[str, ...]:
    """`--engines` (comma-separated names or all) as a tuple of engine names; unknown names refused."""
    names = tuple(e.strip() for e in text.split(",") if e.strip())
    names = ENGINES if "all" in names else names
    unknown = [e for e in names if e not in ENGINES]
    if unknown or not names:
        raise ValueError(f"unknown engine {unknown[0] if unknown else text!r}; choose from {', '.join(ENGINES)} or all")
    return names


_RULES = {"transformers": _transformers, "vllm": _vllm, "sglang": _sglang}


def engine_report(config: dict) -> dict[str, str | None]:
    """engine -> None when it loads this DeepSeek config exactly, else the reason it does not."""
    decided = source_report(config)  # what the source decides (router, rope), then each engine's own rules
    return {name: decided[name] or rule(config) for name, rule in _RULES.items()}


# ---------------------------------------------------------------------------------------------
# Which engine runs an MLA shape's attention on a fast kernel (not only whether it loads it)
# ---------------------------------------------------------------------------------------------

# ik_llama.cpp's CPU flash attention kernels, (K, V) head widths (ggml/src/iqk/iqk_mul_mat.cpp,
# iqk_flash_attn_impl, ik-llama-cpp-python 0.1.5), used with a mask and a cache length that is a
# multiple of 32. In MLA mode 3 decode K = d_r + d_c (the rope key first) and V = d_c (a view of
# the latent), and all heads are rows of one Q matrix against each cache block, so each cached row
# is read once (iqk_flash_attn.cpp); other widths fall back to ggml's loop, which re-reads every row
# once per head. Prompts of 128+ tokens decompress the cache and run it at (d_nope + d_r, d_v) in mode 3
# and stay absorbed, at the decode widths, in mode 1 with flash attention.
IK_FLASH_WIDTHS = ((576, 512), (512, 512), (320, 256), (192, 128), (192, 192), (256, 256), (128, 128), (96, 96), (64, 64))
FAST_MLA_SHAPES = "rope 64 with latent 128, 256 or 512"
FAST_ENGINES = ("ik_llama.cpp flash MLA", "ik_llama.cpp prompts", "vLLM MLA", "llama.cpp")


def fast_kernel_report(d_c: int, d_r: int, d_nope: int, d_v: int) -> dict[str, tuple[bool, str]]:
    """engine -> (whether it runs this MLA shape's attention on a fast kernel, why or why not)."""
    decode, prompt = (d_c + d_r, d_c), (d_nope + d_r, d_v)
    widths = ", ".join(f"{k}/{v}" for k, v in IK_FLASH_WIDTHS)
    ik = (decode in IK_FLASH_WIDTHS,
          f"-mla 1|3 -fa 1 decode runs (K, V) = {decode[0]}/{decode[1]}: "
          + ("a kernel reading each cached row once for all heads" if decode in IK_FLASH_WIDTHS else
             f"no kernel (it has {widths}; MLA: {FAST_MLA_SHAPES}), so ggml's loop re-reads the latent per head; "
             "-mla 1 -fa 0 (GEMM over all heads) shares it at any width"))
    # -mla 1 -fa 1 keeps prompts absorbed too: the decode widths (src/llama-build-context.cpp ~7649)
    absorbed = "a kernel" if decode in IK_FLASH_WIDTHS else "no kernel"
    ik_prompt = (prompt in IK_FLASH_WIDTHS or decode in IK_FLASH_WIDTHS,
                 f"prompts of 128+ tokens in -mla 3 -fa 1 decompress the cache and run (K, V) = {prompt[0]}/{prompt[1]}: "
                 + ("a kernel" if prompt in IK_FLASH_WIDTHS else "no kernel (ggml's generic loop)")
                 + f"; in -mla 1 -fa 1 they stay absorbed, {decode[0]}/{decode[1]}: {absorbed}")
    width = d_c + d_r
    vllm = (width in VLLM_MLA_WIDTHS,
            f"latent + rope = {width}: " + ("FlashMLA, CUTLASS and CPU MLA backends" if width == 576 else
                                           "the Triton MLA backend only" if width == 320 else
                                           "no MLA backend takes it (320 or 576; --pad-latent pads to one, "
                                           "--pad-width 576 to the one FlashMLA and its CPU backend take)"))
    mainline = (False, "its CPU flash attention runs each query head over the cache on its own (the latent is "
                       "re-read per head); widths that are multiples of 64 only keep its f16 dot product vectorised")
    return dict(zip(FAST_ENGINES, (ik, ik_prompt, vllm, mainline)))


ENGINE_LATENTS = (128, 256, 512)  # with rope 64: the MLA shapes of FAST_MLA_SHAPES


def engine_shape_note(d_c: int, d_r: int, d_nope: int, d_v: int, source_elements: int) -> str:
    """For `convert`'s summary: the engines that run this shape's decode on a fast kernel, or the engine
    shape nearest to its cache (d_c + d_r per token per layer) with its fraction of the source's."""
    fast = [engine for engine, (ok, _) in fast_kernel_report(d_c, d_r, d_nope, d_v).items() if ok]
    if fast:
        return "fast kernels in " + ", ".join(fast)
    R = min(ENGINE_LATENTS, key=lambda latent: abs(latent + 64 - (d_c + d_r)))
    return (f"no engine's fast MLA kernel takes {d_c} + {d_r} ({FAST_MLA_SHAPES}); the nearest: -R {R} -r 64, "
            f"{(R + 64) / source_elements:.1%} of the source's cache (`transmla inspect` says why)")


def kernel_report(config) -> dict[str, str]:
    """For `inspect`: "fast kernel in ENGINE" -> "yes: ..." / "no: ..." for a converted model (native, its
    transformers config) or a DeepSeek export; {} for other models. A native model whose rope cannot
    be exported (per-layer frequencies) runs in none of these engines: that reason comes first."""
    from ..mla.config import MLAConfig
    from ..mla.model import is_mla_config

    blocker = None
    if is_mla_config(config):
        from .deepseek_rope import shared_rope_grid, source_rope_parameters
        from .errors import ExportError

        mla = MLAConfig.from_dict(config.mla)
        d_c, d_r, d_nope, d_v = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
        cfg = config.to_dict()
        try:
            shared_rope_grid(mla, source_rope_parameters(cfg), int(cfg.get("max_position_embeddings", 4096)))
        except ExportError as e:
            blocker = f"not exportable: {e}"
    elif getattr(config, "model_type", None) == "deepseek_v3":
        d_c, d_r, d_nope, d_v = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    else:
        return {}
    return {f"fast kernel in {engine}": blocker and f"no: {blocker}" or f"{'yes' if fast else 'no'}: {why}"
            for engine, (fast, why) in fast_kernel_report(d_c, d_r, d_nope, d_v).items()}
