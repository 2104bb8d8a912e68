"""Where a conversion's time goes (issue 36): `transmla convert` run in this process with every stage
timed, on the built-in SmolLM2-135M, and the output fit's cost per layer under its settings.

    .venv/bin/python -m benchmarks.fit_cost                 # the default 25% conversion (exportable shape), then the report
    .venv/bin/python -m benchmarks.fit_cost --budget 0.5 --per-layer-rope   # the native shape
    .venv/bin/python -m benchmarks.fit_cost --variants      # also the fit of layers 2 and 12 under each setting
    .venv/bin/python -m benchmarks.fit_cost --attention     # expanded attention's values padded or not
    .venv/bin/python -m benchmarks.fit_cost --report        # only rewrite the table
    .venv/bin/python -m benchmarks.fit_cost --jobs 1,2      # the CLI's conversion with --fit-jobs 1 and 2, wall and memory

Stages (seconds summed over the layers, wall time of this process):
- statistics: the calibration grams (calibrate._StatsAccumulator.add);
- method: the method's own algebra per layer (RoRoPE, FreqFold, BKV-PCA);
- fit targets: the source attention's input and output on the fit sequences (_source_attention_io);
- fit Adam: the Adam steps (output_fit.adam_fit); fit closed forms: o_proj's ridge solutions and the
  output errors (refit_o_proj_errors, output_error);
- the rest: reading weights, the source layers' forward on the calibration and fit streams (the
  propagation), writing the checkpoint.
--variants fits layers 2 and 12 of the same conversion again under each FIT_VARIANTS setting (the same
x, z and start layer) and records seconds and the relative output error on the fit tokens.

--attention times PyTorch's SDPA at the expanded path's shapes for SmolLM2 at 50% (9 heads, keys
128 wide, values 64) against the same call with the values zero-padded to 128 (SDPA's fused CPU kernel
takes only values as wide as the keys): forward and backward over 2048 tokens per call (the fit's
minibatch), and the forward alone of one sequence; best of 3. It set mla/attention.PAD_VALUES_MIN_ROWS.
The machine (CPU, whether it has AMX or AVX-512 BF16), its threads and load are recorded with every row.
--jobs J1,J2 runs `transmla convert smollm2-135m OUT --method transmla --kv-budget B --force --fit-jobs J` as a
user does (its own process, torch's default threads, every core of the machine), one after another, and records
its wall time, the peak memory of its process tree (the conversion and its fit workers: PSS summed, sampled every
0.2 s) and the fit's mean output error after (config.json's record).
Rule for --fit-jobs's default, written before measuring (session of 2026-11-29): 2 becomes the CLI's default on
CPUs with two or more cores if, on the idle 2-core CPU, the default 25% conversion with --fit-jobs 2 takes at most
75% of the wall time of --fit-jobs 1 with the fit's mean output error after within 2% of it and its process tree
under 4 GB; otherwise --fit-jobs stays an option with these numbers. (The fits differ only by rounding: a worker
computes on one thread, --fit-jobs 1 on torch's threads; on one thread the tensors are equal,
tests/test_output_fit.py.)
Measured (2026-11-29, the 2-core Xeon with AMX, idle but for the other run's sampler; both runs' fit in bf16):
--fit-jobs 1 (two torch threads) 13.3 min, --fit-jobs 2 10.9 min (82%: the rule asks 75% or less), the fit's mean
output error after 0.13654 and 0.13653; memory 1.45 GB against 3.05 GB (PSS summed over the tree, sampled every
2 s beside the run: the row's 4,403 MiB is the RSS sum, which counts the shared fit sequences twice; the
sampler's code is what _tree_memory_mib now does). The rule fails: --fit-jobs stays an option, default 1. Two
torch threads already split the fit's products well on this CPU, so two one-thread workers buy less than the
cores' count suggests.
Written next, before measuring (same session, 13:43): the same rule for --fit-jobs 2 with the converting process
itself on one thread while its workers fit (it had kept torch's two threads: three busy processes on two cores).
Measured: 10.9 min again (82% of 13.3), error 0.13653, 3.12 GB (PSS, the table's row): the rule fails again, the
default stays 1. The conversion's own streaming was not what held the workers back; the two workers' fits take
about as long as one process's fits on two threads.
Rule for bf16 on CPUs with AVX-512 BF16 and no AMX, written before measuring (session of 2026-12-05, an AMD
EPYC with AVX-512 BF16, where a bare bf16 product ran 4-8x faster than fp32 at the fit's shapes): the CLI fits
in bf16 on such a CPU when dtypes.cpu_bf16_speedup() (a product and its backward, timed at start) is at least
1.5x; this stays if, in `--variants` on that EPYC, the bf16 fits of layers 2 and 12 are at least 1.3x faster than
fp32 at the same tokens with output errors within 0.005 of fp32's (as on AMX); otherwise the probe goes.
Measured (2026-12-05, that EPYC, one thread, the other core building ik_llama.cpp, load 1.7): the probe 5-8x;
the variants' bf16 fits 1.48-1.60x faster than fp32 (layer 2: 53.7 against 85.3 s at 2048 tokens, 34.4 against
51.3 s at 1024; layer 12: 53.3 / 85.6, 32.2 / 47.7), output errors 0.0912 / 0.0965, 0.1044 / 0.1039,
0.1486 / 0.1482, 0.1600 / 0.1591 (within 0.005): the rule holds, the probe stays. The CLI's 25% conversion
there: 17.3 min (Adam 460 s, closed forms 280 s, the rest 281 s), against 31.3 min in fp32 on the AVX2 EPYC.
With every pass of the compressing conversion in bf16 (FitSettings.bf16_passes: the source streams, the closed
forms, the far targets; chosen by retrieval_ladder's cli-25-unitary+fit-bf16 rule), the same EPYC, one thread, the
other core converting the 1.5B: 13.4 min (Adam 477 s, closed forms 189 s, the rest 125 s). Adam is now most of it,
and most of Adam is SDPA's CPU flash kernel (its forward and backward over 256 sampled queries x 1024 keys, 57 of
77 ms a step, about 60-90 GFLOP/s in bf16); the math backend was no faster (72 against 65 ms, fwd+bwd).
The `--jobs 1` row of the AMD EPYC (2026-12-06, one thread pinned to one core, the other core converting the 1.5B):
another EPYC with AVX-512 BF16 whose startup probe measured bf16 2.2x faster (not 5-8x), after c1ccd2b (the fit's x,
z and far targets stored in bf16 when its passes run in bf16: the same fitted layers bit for bit, `make demo`'s 25%
wiki-test 33.63 as before): 20.9 min, 1137 MiB peak PSS. Its memory is not comparable with the Xeon's rows (two
threads, RSS summed, the fit sequences in float32 then).
`--layers N` (session of 2026-12-06) times a source's first N layers (the conversion stops at layer N and writes
nothing) and "source forward" (the source layers' forward over the calibration and fit streams, hooked on each
layer) is a stage of its own. The 1.5B at 25% (`--model qwen2.5-coder-1.5b --layers 3`, one thread of that slower
EPYC): per layer Adam 59 s, closed forms 33 s, source forward 55 s, statistics 3.5 s (the 97K tokens of the two
streams through the layer's MLP in bf16, about 166 GFLOP/s), and 1.9 min before layer 0 (tokenizing and building the
streams); about 72 min for 28 layers, as its CLI conversion took (4,294 s). Adam's attention then moved to the
absorbed form (mla.attention.attend_rows_differentiable; kept by retrieval_ladder's cli-25-unitary+fit-absorbed rule): Adam 59 ->
43 s per layer on the 1.5B (8.8 min for 3 layers against 9.4) and 720 -> 608 s for SmolLM2's whole 25% conversion
(18.1 min against 19.8, the two run side by side, one core each; the labelled rows). `--label` tells apart rows of
the same command on CPUs with the same name (the two EPYCs) or code of another day.
`--attention-blocks` (session of 2026-12-07) times Adam's absorbed attention (mla.attention.attend_rows_differentiable,
forward and backward under bf16 autocast, 2 x 256 sampled queries over 1024 keys) with its queries in blocks of 16 to
128, each block against the span of rows its mask reaches, or in one block as before. The sampled positions are
sorted, so a causal block of 64 stops at its last query's row: the result is the one product's (keys no query of a
block sees add exactly zero to its softmax; tests/test_mla_attention.py holds it to fp64) in about half the work.
On the slower AMD EPYC, one thread: 38 ms against 98 at the 25% shape (64 + 32), 66 against 124 at 50% (128 + 64),
the far term's mask 31 / 55 against 49 / 80; 64 was best or within 3 ms of it everywhere, so QUERY_BLOCK = 64. The
CLI's 25% conversion then took 16.5 min against 20.6 min for the one-block code (da6eab4), the two side by side on
one core each of that EPYC (Adam 494 s against 751 s; the closed forms and the source forward unchanged), and its
wiki-test 32 perplexity is 33.60 (`make demo`'s 33.57-33.63 before): the same conversion, faster.
Writes benchmarks/results/fit_cost.json (one row per machine and setting) and fit_cost.md.

Measured on a Xeon with AMX (2026-11-29, `--variants`, one thread; the load column is the start's, 0.9: from the
third minute the other core built ik_llama.cpp and ran benchmarks.public_transmla, load 2-3): the CLI's 25%
conversion, its fit under bf16 autocast (dtypes.fast_bf16_matmul), 23.4 min of its own stages (the variants' fits
excluded), against 31.3 min in fp32 on the idle AMD EPYC; Adam 691 s, the closed forms 348 s, the rest (the source
layers' forward, reading and writing) 349 s. The variants on the same layers and load: bf16 autocast 1.4-1.7x
faster than fp32 at 1024 and 2048 tokens per step (55.6 s against 90.9 s at 2048 on layer 2), output errors equal
within 0.005, so AMX is where bf16 pays, as the CLI chooses; on the Xeon without AMX it ran 1.3-1.4x slower.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import transmla.convert.calibrate as calibrate
import transmla.convert.output_fit as output_fit
import transmla.convert.pipeline as pipeline

from transmla.dtypes import fast_bf16_matmul

from .common import RESULTS, ResultCache, log, machine

OUT_JSON = RESULTS / "fit_cost.json"
OUT_MD = RESULTS / "fit_cost.md"
MODEL = "smollm2-135m"
VARIANT_LAYERS = (2, 12)
FIT_VARIANTS = (  # (name, minibatch tokens, bf16 autocast)
    ("2048 tokens, bf16 autocast", 2048, True),
    ("2048 tokens, fp32", 2048, False),
    ("1024 tokens, bf16 autocast", 1024, True),
    ("1024 tokens, fp32", 1024, False),
    ("512 tokens, fp32", 512, False),
)
STAGES = ("statistics", "method", "fit targets", "fit Adam", "fit closed forms", "source forward")


def cpu_flags() -> dict:
    return {"amx": bool(torch.cpu._is_amx_tile_supported()), "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported())}


class StageClock:
    """Seconds per stage, by wrapping the module functions each stage runs (restored on exit)."""

    def __init__(self, layers: int = 0) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.variants: list[dict] = []
        self.layers = layers  # > 0: stop the conversion when it reaches this layer (the first `layers` timed)
        self.stopped = False
        self.fit: output_fit.FitSettings | None = None  # the settings of the fit that ran

    def _timed_forward(self, module) -> None:
        """Time every forward of `module` (a source decoder layer: the streams' propagation) as "source forward"."""
        start = [0.0]

        def pre(*_):
            start[0] = time.perf_counter()

        def post(*_):
            self.seconds["source forward"] += time.perf_counter() - start[0]

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def _wrap(self, owner, name: str, stage: str, undo: list) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start

        undo.append((owner, name, fn))
        setattr(owner, name, timed)

    @contextmanager
    def installed(self, variants: bool):
        undo: list = []
        self._wrap(calibrate._StatsAccumulator, "add", "statistics", undo)
        self._wrap(pipeline.LayerStream, "_convert", "method", undo)
        self._wrap(calibrate, "_source_attention_io", "fit targets", undo)
        self._wrap(output_fit, "adam_fit", "fit Adam", undo)
        self._wrap(output_fit, "refit_o_proj_errors", "fit closed forms", undo)
        self._wrap(output_fit, "output_error", "fit closed forms", undo)
        load_layer = calibrate._load_decoder_layer

        def load_timed(reader, config, layer, device):
            if self.layers and layer >= self.layers:
                self.stopped = True
                raise EnoughLayers(f"stopped at layer {layer}: the first {self.layers} timed")
            module = load_layer(reader, config, layer, device)
            self._timed_forward(module)
            return module

        undo.append((calibrate, "_load_decoder_layer", load_layer))
        calibrate._load_decoder_layer = load_timed
        fit_layer_untimed = pipeline.fit_layer

        def fit_recorded(config, layer, x, z, settings, *args, **kwargs):
            self.fit = settings
            return fit_layer_untimed(config, layer, x, z, settings, *args, **kwargs)

        undo.append((pipeline, "fit_layer", fit_layer_untimed))
        pipeline.fit_layer = fit_recorded
        if variants:
            fit_layer = pipeline.fit_layer

            def fit_with_variants(config, layer, x, z, settings, index=0, source_attention=None):
                if index in VARIANT_LAYERS:
                    counted = dict(self.seconds)  # the variants' own stages are not the conversion's
                    for name, tokens, bf16 in FIT_VARIANTS:
                        s = output_fit.FitSettings(steps=settings.steps, lr=settings.lr, seed=settings.seed,
                                                   minibatch_tokens=tokens, bf16=bf16)
                        start = time.perf_counter()
                        _, info = output_fit.fit_layer(config, layer, x, z, s, index)
                        self.variants.append({"layer": index, "setting": name, "seconds": time.perf_counter() - start,
                                              "output_error": info["output_error"], "fit_lr": info.get("fit_lr")})
                    self.seconds = counted
                return fit_layer(config, layer, x, z, settings, index, source_attention)

            undo.append((pipeline, "fit_layer", fit_layer))
            pipeline.fit_layer = fit_with_variants
        try:
            yield self
        finally:
            for owner, name, fn in reversed(undo):
                setattr(owner, name, fn)


class EnoughLayers(Exception):
    """Raised inside the conversion when --layers have been timed (the CLI then writes nothing)."""


def fit_summary(fit: output_fit.FitSettings | None) -> dict:
    """What a record says of the fit that ran: its bf16 passes and Adam's rates."""
    if fit is None:
        return {"fit_rates": "constant", "fit_bf16_passes": False}
    return {"fit_rates": "relative" if fit.relative_lr else "constant", "fit_bf16_passes": bool(fit.bf16_passes)}


def run(budget: float, per_layer_rope: bool, variants: bool, out: Path, model: str = MODEL, layers: int = 0,
        options: tuple[str, ...] = ()) -> dict:
    """The CLI's conversion of `model` (with `options` besides the CLI's defaults) with every stage timed."""
    from transmla.cli.app import main as cli_main

    argv = ["convert", str(model), str(out), "--method", "transmla", "--kv-budget", str(budget), "--force"]
    argv += (["--per-layer-rope"] if per_layer_rope else []) + list(options)
    clock = StageClock(layers)
    load = os.getloadavg()[0]
    with clock.installed(variants):
        start = time.perf_counter()
        code = cli_main(argv)
        wall = time.perf_counter() - start
    if code and not clock.stopped:
        raise SystemExit(f"transmla convert failed with exit code {code}")
    if variants:  # the variant fits ran inside the wall time: the stages only count what the default ran
        wall -= sum(v["seconds"] for v in clock.variants)
    stages = {k: round(v, 3) for k, v in clock.seconds.items()}
    stages["the rest"] = round(wall - sum(stages.values()), 3)
    return {
        "command": "transmla " + " ".join(argv[:2] + ["OUT"] + argv[3:]),
        "wall_seconds": round(wall, 1), "stages": stages, "variants": clock.variants,
        "layers_timed": layers or "all",
        "machine": machine() | {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "load_before": load,
                                "load_after": os.getloadavg()[0]},
        "fit_bf16": fast_bf16_matmul("cpu"),  # what the CLI's fit ran under
        **fit_summary(clock.fit),
    }


def _tree_memory_mib(root: int) -> float:
    """Memory of process `root` and its descendants, MiB: their PSS summed (/proc/PID/smaps_rollup; RSS would
    count twice the pages they share: the fit sequences a worker receives are shared memory)."""
    children: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields["PPid"]), []).append(int(status.parent.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total / 1024


def jobs_row(budget: float, jobs: int, out: Path) -> dict:
    """The CLI's conversion with --fit-jobs `jobs` in a process of its own: wall, peak tree memory, fit error."""
    import json
    import subprocess
    import sys

    cli = Path(sys.executable).with_name("transmla")
    argv = ["convert", MODEL, str(out), "--method", "transmla", "--kv-budget", str(budget), "--force",
            "--fit-jobs", str(jobs)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen([str(cli), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, _tree_memory_mib(proc.pid))
        time.sleep(0.2)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"transmla {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    layers = json.loads((out / "config.json").read_text())["mla"]["method"]["layers"]
    errors = [layer["output_error"] for layer in layers]
    return {"command": "transmla " + " ".join(argv[:2] + ["OUT"] + argv[3:]), "fit_jobs": jobs,
            "wall_seconds": round(wall, 1), "peak_tree_pss_mib": round(peak), "output_error_after": round(
                sum(e[1] for e in errors) / len(errors), 5),
            "machine": machine() | {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "load_before": load,
                                    "load_after": os.getloadavg()[0]}}


def _tree_memory_cell(row: dict) -> str:
    if "peak_tree_pss_mib" in row:
        return str(row["peak_tree_pss_mib"])
    return f"{row['peak_tree_mib']} (RSS summed: the pages a worker shares counted twice)"


ATTENTION_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def sdpa_seconds(T: int, padded: bool, backward: bool, heads: int = 9, d_qk: int = 128, d_v: int = 64) -> float:
    """Best of 3: causal SDPA over [B, heads, T, .] (B = 2048 // T sequences with backward, else 1)."""
    import torch.nn.functional as F

    B = max(1, 2048 // T) if backward else 1
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, heads, T, d_qk, generator=gen, requires_grad=backward) for _ in range(2))
    v = torch.randn(B, heads, T, d_v, generator=gen, requires_grad=backward)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            vv = F.pad(v, (0, d_qk - d_v)) if padded else v
            out = F.scaled_dot_product_attention(q, k, vv, is_causal=True)[..., :d_v]
            if backward:
                out.pow(2).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def timed_row(measure) -> dict:
    """{"timings": measure(), "machine": ...} with the CPU's flags, torch's threads and the load before and after."""
    load = os.getloadavg()[0]
    timings = measure()
    return {"timings": timings, "machine": machine() | {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
                                                        "load_before": load, "load_after": os.getloadavg()[0]}}


def attention_rows() -> dict:
    return timed_row(lambda: {f"{T}|{mode}": {"plain": sdpa_seconds(T, False, mode == "fwd+bwd"),
                                              "padded": sdpa_seconds(T, True, mode == "fwd+bwd")}
                              for T in ATTENTION_LENGTHS for mode in ("fwd+bwd", "fwd")})


BLOCK_SIZES = (0, 128, 64, 32, 16)  # 0: every query in one block (the one product, as before 2026-12-07)
BLOCK_SHAPES = {"25%": (64, 32), "50%": (128, 64)}  # SmolLM2's exportable shapes: (d_c, d_r)


def attend_block_seconds(block: int, d_c: int, d_r: int, far: int = 0, batch: int = 2, queries: int = 256,
                         T: int = 1024, heads: int = 9) -> float:
    """Best of 3: attend_rows_differentiable forward and backward under bf16 autocast as Adam's step calls it
    (batch sequences of T keys, `queries` sorted random query positions each, causal or the far mask), with
    QUERY_BLOCK = block (0: all queries in one block)."""
    import transmla.mla.attention as attention

    gen = torch.Generator().manual_seed(0)
    at = (torch.randperm(T - far - 1, generator=gen)[:queries].sort().values + far + 1)  # [m]
    mask = (output_fit.far_mask(T, far)[at] if far else torch.arange(T)[None] <= at[:, None])[None, None]
    q0 = torch.randn(batch, queries, heads, d_c + d_r, generator=gen).bfloat16()
    rows0 = torch.randn(batch, T, d_c + d_r, generator=gen).bfloat16()
    saved, attention.QUERY_BLOCK = attention.QUERY_BLOCK, block or queries
    try:
        best = float("inf")
        for _ in range(3):
            q, rows = q0.clone().requires_grad_(), rows0.clone().requires_grad_()
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attention.attend_rows_differentiable(q, rows, d_c, (d_c + d_r) ** -0.5, mask)
            out.float().pow(2).sum().backward()
            best = min(best, time.perf_counter() - start)
    finally:
        attention.QUERY_BLOCK = saved
    return best


def attention_block_rows() -> dict:
    return timed_row(lambda: {f"{shape}|{far}|{block}": attend_block_seconds(block, *BLOCK_SHAPES[shape], far)
                              for shape in BLOCK_SHAPES for far in (0, output_fit.FAR_TOKENS) for block in BLOCK_SIZES})


def report(rows: dict) -> str:
    attention = {k: r for k, r in rows.items() if k.startswith("attention|")}
    blocks = {k: r for k, r in rows.items() if k.startswith("blocks|")}
    jobs = {k: r for k, r in rows.items() if k.startswith("jobs|")}
    rows = {k: r for k, r in rows.items() if k not in attention and k not in jobs and k not in blocks}
    lines = ["# Where a conversion's time goes (TransMLA, the CLI's defaults)", "",
             "Made by `python -m benchmarks.fit_cost` (stages in its docstring). Seconds are wall time of the",
             "conversion process, over the layers timed (all, or the first N with `--layers N`); threads and load as",
             "recorded. Rows without a source forward column counted it in the rest.", "",
             "| conversion | CPU (AMX, AVX-512 BF16) | threads, load | fit under | layers timed | total min | "
             + " | ".join(STAGES) + " | the rest |", "|---" * (7 + len(STAGES)) + "|"]
    for key, r in rows.items():
        m, f = r["machine"], r["machine"]["cpu_flags"]
        st = r["stages"]
        label = f" ({r['label']})" if r.get("label") else ""
        lines.append(f"| {r['command']}{label} | {m.get('cpu', m.get('machine'))} ({'yes' if f['amx'] else 'no'}, "
                     f"{'yes' if f['avx512_bf16'] else 'no'}) | {m['threads']}, {m['load_before']:.1f} | "
                     f"{'bf16 (every pass)' if r.get('fit_bf16_passes') else 'bf16' if r['fit_bf16'] else 'fp32'}, "
                     f"{r.get('fit_rates', 'constant')} rates | {r.get('layers_timed', 'all')} | {r['wall_seconds'] / 60:.1f} | "
                     + " | ".join(f"{st[s]:.0f}" if s in st else "-" for s in STAGES) + f" | {st['the rest']:.0f} |")
    variant_rows = [(key, v) for key, r in rows.items() for v in r["variants"]]
    if variant_rows:
        lines += ["", "## The fit of one layer under each setting (same layer, inputs and targets; 200 Adam steps)", "",
                  "| CPU (AMX) | layer | setting | seconds | output error before -> after | lr |", "|---|---|---|---|---|---|"]
        for key, v in variant_rows:
            m = rows[key]["machine"]
            lines.append(f"| {m.get('cpu', m.get('machine'))} ({'yes' if m['cpu_flags']['amx'] else 'no'}) | {v['layer']} | "
                         f"{v['setting']} | {v['seconds']:.1f} | {v['output_error'][0]:.4f} -> {v['output_error'][1]:.4f} | {v['fit_lr']} |")
    if jobs:
        lines += ["", "## Fit jobs (`--jobs`): the CLI's conversion as a user runs it, with --fit-jobs 1 and 2", "",
                  "| conversion | CPU | torch threads, load | wall min | peak memory of the process tree (PSS) MiB | "
                  "fit's mean output error after |", "|---|---|---|---|---|---|"]
        for r in jobs.values():
            m = r["machine"]
            lines.append(f"| {r['command']} | {m.get('cpu', m.get('machine'))} | {m['threads']}, {m['load_before']:.1f}-"
                         f"{m['load_after']:.1f} | {r['wall_seconds'] / 60:.1f} | {_tree_memory_cell(r)} | "
                         f"{r['output_error_after']:.4f} |")
    for key, r in attention.items():
        m = r["machine"]
        lines += ["", "## Expanded attention: values as they are or zero-padded to the keys' width (`--attention`)", "",
                  f"SDPA, 9 heads, keys 128, values 64, causal; fwd+bwd over 2048 tokens per call, fwd of one sequence; "
                  f"best of 3 s. {m.get('cpu', m.get('machine'))}, {m['threads']} thread(s), load {m['load_before']:.1f}-"
                  f"{m['load_after']:.1f}.", "",
                  "| tokens per sequence | fwd+bwd plain | fwd+bwd padded | fwd plain | fwd padded |", "|---|---|---|---|---|"]
        for T in ATTENTION_LENGTHS:
            t = r["timings"]
            lines.append(f"| {T} | {t[f'{T}|fwd+bwd']['plain']:.3f} | {t[f'{T}|fwd+bwd']['padded']:.3f} | "
                         f"{t[f'{T}|fwd']['plain']:.4f} | {t[f'{T}|fwd']['padded']:.4f} |")
    for key, r in blocks.items():
        m = r["machine"]
        lines += ["", "## Adam's absorbed attention in query blocks (`--attention-blocks`)", "",
                  "attend_rows_differentiable forward and backward under bf16 autocast as one Adam step calls it: 2 "
                  "sequences of 1024 keys, 256 sorted random query positions each, 9 heads; each block of QUERY_BLOCK "
                  "queries against the rows its mask reaches (causal, or the far term's keys 256+ back). Best of 3, "
                  f"ms. {m.get('cpu', m.get('machine'))}, {m['threads']} thread(s), load {m['load_before']:.1f}-"
                  f"{m['load_after']:.1f}.", "",
                  "| shape (d_c + d_r) | mask | " + " | ".join("one block" if b == 0 else f"{b} queries" for b in BLOCK_SIZES)
                  + " |", "|---|---|" + "---|" * len(BLOCK_SIZES)]
        for shape, (d_c, d_r) in BLOCK_SHAPES.items():
            for far in (0, output_fit.FAR_TOKENS):
                lines.append(f"| {shape} ({d_c} + {d_r}) | {'far' if far else 'causal'} | "
                             + " | ".join(f"{1000 * r['timings'][f'{shape}|{far}|{b}']:.1f}" for b in BLOCK_SIZES) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--model", default=MODEL, help="the source to convert (default: the built-in SmolLM2-135M)")
    parser.add_argument("--label", default="",
                        help="what tells this run from another of the same command on the same CPU name (kept in its row)")
    parser.add_argument("--layers", type=int, default=0,
                        help="time the first N layers only (the conversion stops there and writes nothing)")
    parser.add_argument("--per-layer-rope", action="store_true", help="the native shape (default: the CLI's exportable one)")
    parser.add_argument("--variants", action="store_true", help="also fit layers 2 and 12 under each FIT_VARIANTS setting")
    parser.add_argument("--attention", action="store_true", help="only time SDPA with values padded or not")
    parser.add_argument("--attention-blocks", action="store_true",
                        help="only time Adam's absorbed attention at each query block size (mla.attention.QUERY_BLOCK)")
    parser.add_argument("--jobs", help="comma-separated --fit-jobs values: the CLI's conversion with each, in a process of its own")
    parser.add_argument("--report", action="store_true", help="only rewrite the table")
    parser.add_argument("--out", type=Path, default=Path(".cache/fit-cost"))
    args = parser.parse_args(argv)
    cache = ResultCache(OUT_JSON)  # merges with rows another run saved meanwhile
    rows = cache.results
    if args.attention_blocks:
        row = attention_block_rows()
        rows[f"blocks|{row['machine'].get('cpu', row['machine'].get('machine'))}|{row['machine']['threads']}"] = row
        cache.save()
    elif args.attention:
        row = attention_rows()
        rows[f"attention|{row['machine'].get('cpu', row['machine'].get('machine'))}|{row['machine']['threads']}"] = row
        cache.save()
    elif args.jobs and not args.report:
        for jobs in (int(j) for j in args.jobs.split(",")):
            row = jobs_row(args.budget, jobs, args.out)
            rows[f"jobs|{row['machine'].get('cpu', row['machine'].get('machine'))}|{row['command']}"] = row
            cache.save()
            log(f"{row['command']}: {row['wall_seconds'] / 60:.1f} min, {row['peak_tree_pss_mib']} MiB, "
                f"error after {row['output_error_after']}")
    elif not args.report:
        row = run(args.budget, args.per_layer_rope, args.variants, args.out, args.model, args.layers)
        key = f"{row['machine'].get('cpu', row['machine'].get('machine'))}|{row['command']}|{row['machine']['threads']}"
        key += "" if row["fit_rates"] == "constant" else f"|{row['fit_rates']} rates"
        key += "|bf16 passes" if row["fit_bf16_passes"] else ""
        key += f"|{args.layers} layers" if args.layers else ""
        if args.label:
            row["label"] = args.label
            key += f"|{args.label}"
        if not row["variants"] and key in rows:  # a run without --variants keeps the earlier run's
            row["variants"] = rows[key]["variants"]
        rows[key] = row
        cache.save()
        log(f"{row['command']}: {row['wall_seconds'] / 60:.1f} min {row['stages']}")
    OUT_MD.write_text(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
