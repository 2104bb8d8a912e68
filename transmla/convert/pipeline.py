"""Stream a source checkpoint through a conversion method into a native MLA checkpoint.

`LayerStream` drives a method (method.py): its plan, the calibration tokens, the layer-by-layer
iteration (calibrated or not, as the plan needs) and the record of what was done.
`write_mla_checkpoint` reads, converts and writes one layer's attention tensors at a time; every
other tensor is copied through unchanged (cast to the output dtype). Output appears only when complete.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.files import copy_tokenizer_files
from ..checkpoint.reader import SafetensorsReader
from ..checkpoint.writer import ShardedWriter, atomic_output_dir
from ..dtypes import fast_bf16_matmul, torch_dtype
from ..families import attention_geometry, family_for, unwindowed_layers
from ..mla.config import MLAConfig
from ..mla.model import mla_config_for
from ..progress import progress_bar, stderr_console
from .assemble import mla_config
from .calibrate import calibrated_layers
from .layers import MLALayer, SourceAttention, source_layers
from .method import ConversionMethod
from .options import ConvertOptions
from .output_fit import DEFAULT_FIT_CALIBRATION, FitSettings, default_fit_samples, default_fit_settings, fit_layer
from .qk_norm import attach_pre_maps, linear_source


@dataclass
class ConvertResult:
    output: str
    method: str
    num_layers: int
    mla: MLAConfig  # config.json's "mla" block
    source_kv_elements_per_token_per_layer: int
    kv_elements_per_token_per_layer: int
    files: list[str] = field(default_factory=list)

    @property
    def cache_ratio(self) -> float:
        return self.kv_elements_per_token_per_layer / self.source_kv_elements_per_token_per_layer


def calibration_ids(source_dir: Path, text: str, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """[samples, seq_len] calibration tokens of `text` under the source's tokenizer."""
    from transformers import AutoTokenizer

    from ..data.calib import calibration_chunks

    tokenizer = AutoTokenizer.from_pretrained(str(source_dir))
    return calibration_chunks(tokenizer, text, samples, seq_len, seed)


# Spans of each fit sequence repeated later (data.calib.with_repeated_span), chosen on dev keys and dev32
# (benchmarks/results/retrieval_ladder.md): two at 25% (cli-25+fit-repeat2; four read keys better still
# but cost more perplexity than its rule allowed) and at 50% (rope-64+fit-repeat2).
REPEATED_SPANS = 2


def fit_sequences(source_dir: Path, text: str, seed: int, spans: int = REPEATED_SPANS,
                  samples: int | None = None) -> torch.Tensor:
    """The output-aware fit's sequences [N', T']: DEFAULT_FIT_CALIBRATION of `text` (`samples` sequences
    instead of its count when given), or what a short
    text has: the count halved until they fit (down to one per text of a mix), then the length, down
    to 16 tokens; the first error when even that does not fit. In each, `spans` spans are repeated
    later (data.calib.with_repeated_span: the fit sees the source read back far, as retrieval does;
    how many: REPEATED_SPANS)."""
    from ..data.calib import calibration_mix, with_repeated_span

    default_samples, seq_len = DEFAULT_FIT_CALIBRATION
    samples = samples or default_samples
    fewest = len(calibration_mix(text))
    first_error = None
    while True:
        try:
            return with_repeated_span(calibration_ids(source_dir, text, samples, seq_len, seed), seed, spans=spans)
        except ValueError as e:
            first_error = first_error or e
            if samples // 2 >= fewest:
                samples //= 2
            elif seq_len > 16:
                seq_len //= 2
            else:
                raise first_error from None


class LayerStream:
    """One method's converted layers, in order, computed one at a time while iterated.

    calib_ids [N, T] replaces the calibration text of the options, and `plan` the plan the method
    derives from them (tests, benchmarks); likewise fit_ids [N', T'] the output-aware fit's sequences
    (default: calib_ids when given, else other sequences of the calibration text) and `fit` its
    settings (None: from the options; FitSettings(steps=0) is the closed-form o_proj alone).
    keep_stages: also keep every layer's intermediate forms (method.stage_layers) in `stages`.
    After the iteration `record()` describes the conversion.
    """

    def __init__(self, method: ConversionMethod, source_dir: Path, config, options: ConvertOptions, *,
                 progress: bool = True, calib_ids: torch.Tensor | None = None, plan=None, keep_stages: bool = False,
                 fit_ids: torch.Tensor | None = None, fit: FitSettings | None = None):
        self.method, self.source_dir, self.config, self.progress = method, Path(source_dir), config, progress
        self.geometry = attention_geometry(config)
        self.plan = plan if plan is not None else method.plan(self.geometry, options.settings)
        self.needs = method.needs(self.plan)
        self.keep_stages = keep_stages
        self.infos: list[dict] = []
        self.stages: dict[str, list[MLALayer]] = {}
        self.calibration: dict | None = None
        self.calib_ids = self.fit_ids = None
        cal = options.calibration
        self.device = cal.resolved_device()
        self.propagate = cal.propagate or method.default_propagate
        if self.needs.calibration:
            if calib_ids is None:
                n, t = cal.size(method.default_calibration)
                calib_ids = calibration_ids(self.source_dir, cal.calib, n, t, cal.seed)
                self.calibration = {"text": cal.calib, "samples": n, "seq_len": t, "seed": cal.seed}
            else:
                self.calibration = {"ids": list(calib_ids.shape)}
            self.calibration |= {"tokens": int(calib_ids.numel()), "propagate": self.propagate}
            self.calib_ids = calib_ids
        steps = cal.fit_steps if cal.fit_steps is not None else method.default_fit_steps
        if (fit is not None or steps) and self.needs.calibration:
            cache_elements = method.cache_elements(self.plan)
            if fit_ids is None and self.calibration.get("text") is None:  # calib_ids were given: fit on them
                fit_ids = self.calib_ids
            spans = 0  # fit_ids given: used as they are
            if fit_ids is None:  # other sequences of the calibration text than the statistics'
                spans = REPEATED_SPANS
                samples = cal.fit_samples or default_fit_samples(self.geometry.hidden_size, cache_elements,
                                                                  self.geometry.kv_elements_per_token_per_layer)
                fit_ids = fit_sequences(self.source_dir, cal.calib, cal.seed + 1, spans, samples)
            if fit is None:
                fit = default_fit_settings(steps, cal.seed, fast_bf16_matmul(self.device),
                                           cache_elements, self.geometry.kv_elements_per_token_per_layer,
                                           self.geometry.num_layers, fit_ids.shape[1], unwindowed_layers(config))
            self.fit_ids = fit_ids
            self.calibration["fit"] = {"steps": fit.steps, "lr": fit.lr, "closed_form": fit.closed_form,
                                       "bf16": fit.bf16, "bf16_passes": fit.bf16_passes, "sequences": list(fit_ids.shape), "repeated_spans": spans,
                                       **({"far": fit.far, "far_weight": fit.far_weight, "far_layers": list(fit.far_layers)}
                                          if fit.far else {}),
                                       **({"relative_lr": True, "schedule": fit.schedule, "warmup": fit.warmup,
                                           "queries": fit.queries} if fit.relative_lr else {})}
        elif cal.fit_steps:
            raise ValueError(f"fit_steps needs a calibrated method; {method.name} converts without calibration")
        self.fit = fit
        self.fit_jobs = cal.fit_jobs

    def _convert(self, index: int, src: SourceAttention, stats) -> MLALayer:
        """The method sees a QK-norm source as its plain linear form (qk_norm.py)."""
        linear = linear_source(src)
        layer, info = self.method.convert_layer(self.plan, linear, stats)
        self.infos.append(info)
        if self.keep_stages:
            for name, staged in self.method.stage_layers(self.plan, linear, stats).items():
                self.stages.setdefault(name, []).append(attach_pre_maps(staged, src))
        return attach_pre_maps(layer, src)

    def _fit(self, index: int, layer: MLALayer, x: torch.Tensor, z: torch.Tensor, source_attention) -> MLALayer:
        layer, info = fit_layer(self.config, layer, x, z, self.fit, index, source_attention)
        self.infos[index] = {**self.infos[index], **info}
        return layer

    def _fit_jobs(self) -> int:
        """Worker processes for the fits: fit_jobs where the fits are independent (original propagation, on
        the CPU), else none (1: every fit in this process)."""
        return self.fit_jobs if self.fit_ids is not None and self.propagate == "original" and self.device == "cpu" else 1

    def _fitted_in_order(self, jobs: int, layers: Iterable) -> Iterator[MLALayer]:
        """The layers of `layers` (each a _PendingFit), fitted by a pool of `jobs` workers and yielded in order; at
        most jobs + 1 fits are pending (each holds its layer's fit sequences), so this process streams the
        next layer while the workers fit."""
        pending: deque[_PendingFit] = deque()
        for item in layers:
            pending.append(item)
            while pending and (len(pending) > jobs or pending[0].future.done()):
                yield self._resolved(pending.popleft())
        while pending:
            yield self._resolved(pending.popleft())

    def _resolved(self, item: "_PendingFit") -> MLALayer:
        layer, info = item.future.result()
        self.infos[item.index] = {**self.infos[item.index], **info}
        return layer

    def __iter__(self) -> Iterator[MLALayer]:
        start = time.perf_counter()
        if self.needs.calibration:
            jobs = self._fit_jobs()
            with _fit_pool(jobs) as pool:
                def submit(index, layer, x, z, source_attention) -> _PendingFit:
                    return _PendingFit(index, pool.submit(_fit_one_thread, self.config, layer, x, z, self.fit, index,
                                                          source_attention))

                layers = calibrated_layers(
                    self.source_dir, self.config, self.calib_ids, self._convert, propagate=self.propagate,
                    pair_norms=self.needs.pair_norms, device=self.device, progress=self.progress,
                    fit_ids=self.fit_ids, bf16=self.fit is not None and self.fit.bf16_passes,
                    fit_layer=None if self.fit_ids is None else self._fit if pool is None else submit,
                )
                yield from (layers if pool is None else self._fitted_in_order(jobs, layers))
        else:
            for i, src in enumerate(source_layers(self.source_dir, self.config)):
                yield self._convert(i, src, None)
        self.method.summarize(self.geometry, self.plan, self.infos, time.perf_counter() - start)
        errors = [info["output_error"] for info in self.infos if "output_error" in info]
        if errors:
            before, after = (sum(e[k] for e in errors) / len(errors) for k in (0, 1))
            stderr_console.print(f"output-aware fit ({self.fit.steps} steps per layer): mean relative attention-output "
                                 f"error {before:.3f} -> {after:.3f}")

    def record(self) -> dict:
        """The method's part of config.json's "mla.method" block."""
        return method_record(self.method, self.plan, self.infos, self.calibration)


@dataclass
class _PendingFit:
    """One layer's fit, submitted to the fit pool (LayerStream, fit_jobs > 1)."""

    index: int
    future: Future


def _fit_one_thread(config, layer: MLALayer, x, z, settings: FitSettings, index: int, source_attention):
    """output_fit.fit_layer in a worker process, on one thread (so the fitted tensors equal a one-thread run's)."""
    torch.set_num_threads(1)
    return fit_layer(config, layer, x, z, settings, index, source_attention)


@contextmanager
def _fit_pool(jobs: int):
    """A pool of `jobs` worker processes (spawned: a forked child of a process that ran OpenMP threads may hang),
    or None for jobs 1; meanwhile this process computes on one thread. Leaving it cancels the fits not yet started
    (a failed or interrupted conversion)."""
    if jobs <= 1:
        yield None
        return
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take the cores; this process streams on one thread beside them
    try:
        yield pool
    finally:
        torch.set_num_threads(threads)
        pool.shutdown(wait=True, cancel_futures=True)


def method_record(method: ConversionMethod, plan, infos: list[dict] = (), calibration: dict | None = None) -> dict:
    """config.json's "mla.method" block (the method's part) for layers converted by `method` with
    `plan`: its name, its description of the plan, each layer's info and the calibration record."""
    meta = {"name": method.name, **method.describe(plan)}
    if any(infos):
        meta["layers"] = list(infos)
    if calibration is not None:
        meta["calibration"] = calibration
    return meta


def _shape_signature(layer: MLALayer) -> dict[str, tuple | None]:
    return {k: (None if v is None else tuple(v.shape)) for k, v in layer.__dict__.items()}


def write_mla_checkpoint(
    source_dir: Path,
    config,
    output: Path,
    layers: Iterable[MLALayer],
    method: dict | Callable[[], dict],
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """Write the checkpoint in `source_dir` with its attention replaced by `layers` (one per layer, in order).

    `layers` is consumed lazily, so a method may read, calibrate and convert one layer at a time;
    `method` (config.json's "mla.method" block) may be a callable, called once every layer is written.
    """
    family = family_for(config)
    geo = attention_geometry(config)
    out_dtype = torch_dtype(dtype) if dtype else None
    with SafetensorsReader(source_dir) as reader, atomic_output_dir(output, force=force) as tmp:
        writer = ShardedWriter(tmp, max_shard_size)
        attention_names = {n for i in range(geo.num_layers) for n in family.attention_names(config, i).values()}
        src_dtype = reader.dtype_of(family.attention_names(config, 0)["q"])
        cast = lambda t: t.to(out_dtype or src_dtype) if t.is_floating_point() else t  # noqa: E731
        for name in reader.keys():
            if name not in attention_names:
                writer.add(name, cast(reader.get(name)))
        first, inv_freqs = None, []  # only layer 0's shapes and each layer's frequencies are kept
        count = 0
        for i, layer in enumerate(progress_bar(layers, "converting layers", enabled=progress, total=geo.num_layers)):
            count += 1
            if first is None:
                first = layer
            elif _shape_signature(layer) != _shape_signature(first):
                raise ValueError(f"layer {i} converted to different shapes than layer 0")
            inv_freqs.append(layer.rope_inv_freq.tolist())
            for name, tensor in layer.state_dict(family.attention_prefix(i)).items():
                writer.add(name, cast(tensor))
        if count != geo.num_layers:
            raise ValueError(f"the method produced {count} layers for a {geo.num_layers}-layer model")
        files = writer.close()
        if callable(method):
            method = method()
        mla = mla_config(config, first, inv_freqs, method)
        out_config = mla_config_for(config, mla)
        out_config.dtype = out_dtype or src_dtype
        out_config.save_pretrained(tmp)
        copy_tokenizer_files(source_dir, tmp)
    return ConvertResult(
        output=str(output),
        method=method.get("name", "?"),
        num_layers=geo.num_layers,
        mla=mla,
        source_kv_elements_per_token_per_layer=geo.kv_elements_per_token_per_layer,
        kv_elements_per_token_per_layer=mla.kv_elements_per_token_per_layer,
        files=files,
    )
