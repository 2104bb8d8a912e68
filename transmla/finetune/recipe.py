"""Fine-tuning recipes: a YAML file, validated once, with `--set key=value` overrides.

A recipe names the model, the data, what trains and how, evaluation, checkpointing and the
output directory. Every section forbids unknown keys and checks types, so a typo fails before
any work starts, with a one-line message naming the key (``load_recipe`` raises ValueError).

    model:      {path: CONVERTED_MLA_DIR}  or  {source: SRC, convert: {flat conversion settings}}
    data:       train/eval texts, sequence length, documents and packing
    train:      objective (lm | distill), trainable parameters, steps or a token budget, batch,
                accumulation, precision
    distill:    train.objective distill: the teacher (default model.source), temperature, alpha
    optimizer:  AdamW settings;  schedule: constant | cosine | linear with warmup
    eval:       every N steps on held-out text (transmla.eval.perplexity protocol)
    checkpoint: every N steps, how many to keep, resume
    output_dir: where everything goes (relative paths: relative to the current directory)

Overrides: ``--set output_dir=DIR``, ``--set train.steps=50``, ``--set model.convert.kv_budget=0.5``;
the value is read as a YAML scalar (``50`` an int, ``2e-4`` a float, ``true`` a bool,
``null`` None, ``[0.9, 0.95]`` a list) and then validated like the file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from ..convert.options import flat_fields

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "DistillSpec",
    "EvalSpec",
    "ModelSpec",
    "OptimizerSpec",
    "Recipe",
    "ScheduleSpec",
    "TrainSpec",
    "apply_overrides",
    "load_recipe",
    "parse_recipe",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _convert_settings_model() -> type[BaseModel]:
    """A strict pydantic model with exactly the flat conversion settings (convert.options.flat_fields);
    a method's own settings default to None (the method's default)."""
    fields = {name: spec for name, spec in flat_fields().items() if name != "force"}
    return create_model("ConvertSettings", __config__=ConfigDict(extra="forbid", coerce_numbers_to_str=True), **fields)


ConvertSettings = _convert_settings_model()


class ModelSpec(_Strict):
    """A converted MLA checkpoint (``path``), or a source plus conversion settings run first."""

    path: str | None = None  # a converted MLA folder
    source: str | None = None  # a source model (folder, .gguf, hub id, 'smollm2-135m')
    convert: ConvertSettings | None = None  # type: ignore[valid-type]  # run into output_dir/converted

    @model_validator(mode="after")
    def _one_model(self) -> "ModelSpec":
        if (self.path is None) == (self.source is None):
            raise ValueError("give exactly one of model.path (a converted MLA checkpoint) or model.source")
        if self.path is not None and self.convert is not None:
            raise ValueError("model.convert applies to model.source, not to an already converted model.path")
        if self.source is not None and self.convert is None:
            raise ValueError("model.source needs model.convert settings (e.g. {method: transmla, kv_budget: 0.25})")
        return self


class DataSpec(_Strict):
    """Training and held-out text; documents are packed without attention across them."""

    train: str = "wiki"  # built-in 'wiki'/'lee'/'code', a local .txt/.jsonl file, or a datasets spec
    train_part: Literal["calib", "eval", "all"] = "calib"  # which part of a built-in text
    text_field: str = "text"  # JSONL / datasets field
    # How a text splits into documents: "auto" (JSONL rows; else " = Title = " headings when the
    # text has them; else blank-line paragraphs), "headings", "paragraphs", "none" (one document).
    documents: Literal["auto", "headings", "paragraphs", "none"] = "auto"
    seq_len: int = Field(256, ge=2)
    # true: documents packed end to end into full sequences, each attending only within itself
    # (block-diagonal causal mask, positions restart per document); false: every sequence holds
    # one document's piece, padded at the end.
    packing: bool = True
    min_document_tokens: int = Field(2, ge=2)  # shorter documents are dropped
    max_sequences: int | None = Field(None, ge=1)  # cap on the packed training sequences (smoke runs)
    # Spans of 32-128 tokens copied over a later place of each training sequence (the conversion's
    # fit sequences carry them too: data.calib.with_repeated_span), so that part of the teacher's
    # signal is reading back far, as copying a fact stated long before needs. Needs documents
    # "none" (one text, so every sequence is one piece of it and a copy never crosses a boundary).
    repeated_spans: int = Field(0, ge=0)
    # Groups of four people's facts (one attribute each: "Anna plays the cello.") written over the
    # first half of each training sequence, two of each group asked and answered in its second half
    # (data.facts.with_stated_facts), so that part of the teacher's signal is recalling a value
    # stated far back among similar ones. Needs documents "none", as repeated_spans.
    stated_facts: int = Field(0, ge=0)
    # How many times the loss at the stated facts' answers counts (the labels that are an answer's value
    # tokens); 1: as any other token. The answers are a few tokens of each sequence, so most of the
    # teacher's signal is on the prose around them. Needs stated_facts.
    answer_weight: float = Field(1.0, ge=1.0)

    @model_validator(mode="after")
    def _written_data_needs_one_document(self):
        for name in ("repeated_spans", "stated_facts"):
            if getattr(self, name) and self.documents != "none":
                raise ValueError(f"data.{name} needs data.documents: none (got {self.documents!r}): "
                                 "what it writes must stay inside one document")
        if self.answer_weight != 1 and not self.stated_facts:
            raise ValueError(f"data.answer_weight {self.answer_weight:g} needs data.stated_facts (the answers it weights)")
        if self.repeated_spans:
            from ..data.calib import SHORTEST_SPAN, longest_repeatable_span

            if longest_repeatable_span(self.seq_len) < SHORTEST_SPAN:  # else with_repeated_span writes nothing
                raise ValueError(f"data.repeated_spans needs data.seq_len of at least {2 * SHORTEST_SPAN + 1} (got "
                                 f"{self.seq_len}): a span of {SHORTEST_SPAN} tokens and its copy must fit")
        return self


class TrainSpec(_Strict):
    """What trains, towards what, and for how long."""

    # lm: the next-token NLL on the training text. distill: KL(teacher || student) on the same
    # tokens, the teacher being the unconverted source model (the distill section).
    objective: Literal["lm", "distill"] = "lm"
    trainable: Literal["all", "attention", "mla"] = "mla"  # mla: q_proj|q_a/q_b, kv_a_proj, kv_a_norm, kv_b_proj
    steps: int | None = Field(None, ge=1)  # optimizer steps, or:
    tokens: int | None = Field(None, ge=1)  # a training-token budget (rounded up to whole steps)
    micro_batch_size: int = Field(1, ge=1)  # sequences per forward pass (per process)
    grad_accum: int = Field(1, ge=1)  # forward passes per optimizer step
    # bf16: autocast; trainable weights and AdamW state stay fp32. auto: bf16 where bf16 products
    # pay on the device (a CUDA GPU with bf16, a CPU with AMX, or with
    # AVX-512 BF16 where a probe measures bf16 faster: dtypes.fast_bf16_matmul), else fp32.
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward pass
    recompute_kv: bool = False  # MLA: recompute the K/V up-projection (and attention) in the backward pass
    device: Literal["auto", "cpu", "cuda"] = "auto"  # under `accelerate launch` the launcher decides
    threads: int | None = Field(None, ge=1)  # torch CPU threads (None: torch's default)
    seed: int = 0
    log_every: int = Field(10, ge=1)
    timeout_seconds: int = Field(600, ge=1)  # several processes: how long one waits for the others before failing
    fsdp: bool = False  # several processes: shard parameters, gradients and AdamW state across them (torch FSDP2)

    @model_validator(mode="after")
    def _one_length(self) -> "TrainSpec":
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("give exactly one of train.steps or train.tokens")
        return self


class DistillSpec(_Strict):
    """train.objective distill: the student learns the teacher's next-token distribution."""

    teacher: str | None = None  # a source model as model.source takes it; None: model.source itself
    temperature: float = Field(1.0, gt=0)  # both distributions softened by it; the KL is scaled by T^2
    alpha: float = Field(1.0, ge=0, le=1)  # loss = alpha * T^2 * KL + (1 - alpha) * NLL


class OptimizerSpec(_Strict):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)  # applied to matrices only (not norms, biases)
    grad_clip: float | None = Field(1.0, gt=0)  # max global grad norm; null: no clipping


class ScheduleSpec(_Strict):
    kind: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = Field(0, ge=0)  # linear warmup from 0
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # cosine/linear decay to lr * min_lr_ratio


class EvalSpec(_Strict):
    """Held-out perplexity (non-overlapping windows, transmla.eval.perplexity)."""

    data: str | None = "wiki"  # null: no evaluation
    part: Literal["calib", "eval", "all"] = "eval"
    text_field: str = "text"
    every: int = Field(0, ge=0)  # steps between evaluations; 0: only before and after training
    seq_len: int = Field(512, ge=2)
    windows: int = Field(8, ge=1)  # windows during training
    final_windows: int | None = Field(32, ge=1)  # windows at the start and the end (null: all)
    at_start: bool = True  # evaluate the model before training too
    batch_size: int = Field(4, ge=1)


class CheckpointSpec(_Strict):
    every: int = Field(0, ge=0)  # steps between checkpoints; 0: none (the final model is always saved)
    keep: int = Field(2, ge=1)  # newest checkpoints kept
    resume: str = "auto"  # auto: the newest checkpoint in output_dir/checkpoints; never; or a checkpoint folder


class Recipe(_Strict):
    model: ModelSpec
    data: DataSpec = DataSpec()
    train: TrainSpec
    distill: DistillSpec = DistillSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    eval: EvalSpec = EvalSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    output_dir: Path
    save_dtype: Literal["fp32", "bf16", "fp16"] | None = None  # final model dtype (None: fp32, or bf16 under bf16)
    notes: str | None = None  # free text carried into the output (what this recipe should reach)

    @model_validator(mode="after")
    def _fsdp_without_checkpoints(self) -> "Recipe":
        if self.train.fsdp and self.checkpoint.every:
            raise ValueError("train.fsdp writes no checkpoints of its sharded state yet: set checkpoint.every to 0")
        return self

    @model_validator(mode="after")
    def _distill_settings(self) -> "Recipe":
        if self.train.objective == "lm" and self.distill != DistillSpec():
            raise ValueError("distill: its settings apply only with train.objective: distill")
        if self.train.objective == "distill" and self.distill.teacher is None and self.model.source is None:
            raise ValueError("distill.teacher: required with model.path (the source model the conversion came from)")
        return self

    def teacher(self) -> str | None:
        """The model train.objective distill learns from: distill.teacher, else model.source."""
        if self.train.objective != "distill":
            return None
        return self.distill.teacher or self.model.source

    def total_steps(self, world_size: int = 1) -> int:
        """Optimizer steps: train.steps, or the token budget over tokens per step."""
        if self.train.steps is not None:
            return self.train.steps
        per_step = self.data.seq_len * self.train.micro_batch_size * self.train.grad_accum * world_size
        return max(1, math.ceil(self.train.tokens / per_step))

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=False)


# --- overrides ---------------------------------------------------------------------------------

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """A copy of ``data`` with each ``key=value`` set (dotted keys reach nested sections)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not _KEY.match(key):
            raise ValueError(f"--set: bad key {key!r} (dotted names, e.g. train.steps)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ValueError(f"--set {key}: value {raw!r} is not a YAML scalar ({e.problem})") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ValueError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


# --- loading -----------------------------------------------------------------------------------


def _describe(err: dict, source: str) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown key {loc!r}"
    if kind == "missing":
        return f"{source}: missing key {loc!r}"
    msg = err["msg"].removeprefix("Value error, ")
    given = err.get("input")
    shown = "" if isinstance(given, dict) or given is None else f" (got {given!r})"
    return f"{source}: {loc + ': ' if loc else ''}{msg}{shown}"


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    """Validate a recipe dict; ValueError with one line naming every bad key."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a recipe is a YAML mapping of sections, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise ValueError("; ".join(_describe(err, source) for err in e.errors())) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply ``--set`` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such recipe: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{where}") from None
    return parse_recipe(apply_overrides(data or {}, overrides), source=path.name)
