"""The fine-tuning loop (accelerate): one GPU, several through `accelerate launch`, or the CPU.

    output_dir/
      recipe.yaml            the resolved recipe (overrides applied)
      converted/             the conversion, when the recipe names a source (reused if unchanged)
      checkpoints/step-N/    model, AdamW, schedule, RNG and trainer state (safetensors + JSON, no pickle)
      model/                 the fine-tuned model: native MLA format, loadable like any conversion
      train_log.csv          loss (distill: and its kl, nll), lr, grad norm, tokens, time per optimizer step
      eval_log.csv           held-out perplexity per evaluation
      metrics.json           both logs and the summary;  curves.png  the two curves

One optimizer step = grad_accum forward/backward passes of micro_batch_size packed sequences on
every process. The loss is the mean next-token NLL over the step's scored tokens (labels that
cross a document boundary are dropped, see data.py), or with train.objective distill the mean KL
from the source model's distribution on the same tokens (distill.py; the teacher is not part of
a checkpoint); with data.answer_weight each answer token's term counts that many times in the sum (the
mean still over the scored tokens). The data order is a function of (seed, step), and a checkpoint holds everything
else, so a resumed run repeats the losses of an uninterrupted one exactly (tested on the CPU).
With train.fsdp the model is sharded over the processes (FSDP2, processes.shard_model).
The pieces around the loop: converted_model (the model to train, converted on demand),
checkpoints (trainer state, saving and resuming), processes (what the processes share, FSDP),
held_out (perplexity during the run), outputs (output_dir's check, the logs, the final model).
"""

from __future__ import annotations

import math
import re
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch

from ..checkpoint.finite import require_finite_number
from ..data.calib import with_repeated_span
from ..data.facts import with_stated_facts
from ..dtypes import fast_bf16_matmul
from .checkpoints import (
    TrainerState,
    check_resume_layout,
    check_resume_model,
    resume_dir,
    save_checkpoint,
    start_model_fingerprint,
)
from .converted_model import converted_dir
from .data import (
    IGNORE,
    PackedSequences,
    StepSampler,
    document_token_ids,
    load_documents,
    pack_documents,
    segment_labels,
)
from .distill import distill_objective, load_teacher, scored_kl_sum, scored_nll_sum
from .held_out import held_out_ids, held_out_perplexity
from .outputs import FinetuneResult, check_output_dir, save_model, write_logs
from .processes import hardware, log_main, shard_model, sum_over_processes
from .recipe import Recipe
from .state import load_training_state

__all__ = ["FinetuneResult", "run_finetune", "resolve_precision", "select_trainable", "TRAINABLE_PATTERNS", "lr_factor"]

# Which parameters train, by name. "mla": the projections the conversion created or changed
# (query, latent down-projection with the shared rope key, latent norm, K/V up-projection).
TRAINABLE_PATTERNS: dict[str, str] = {
    "all": r".",
    "attention": r"\.self_attn\.",
    "mla": r"\.self_attn\.(q_proj|q_a_proj|q_a_norm|q_b_proj|kv_a_proj|kv_a_norm|kv_b_proj)\.",
}


# --- pieces --------------------------------------------------------------------------------------


def select_trainable(model: torch.nn.Module, preset: str) -> tuple[int, int]:
    """Freeze every parameter not matched by the preset; returns (trainable, total) counts."""
    pattern = re.compile(TRAINABLE_PATTERNS[preset])
    trainable = total = 0
    for name, p in model.named_parameters():
        p.requires_grad_(bool(pattern.search(name)))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    if trainable == 0:
        raise ValueError(f"train.trainable={preset} matches no parameter of this model")
    return trainable, total


def lr_factor(kind: str, step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warmup, then constant/cosine/linear decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * decay


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def resolve_precision(recipe: Recipe) -> Recipe:
    """The recipe with train.precision auto made fp32 or bf16 for the device the run will use."""
    tr = recipe.train
    if tr.precision != "auto":
        return recipe
    device = "cuda" if tr.device != "cpu" and torch.cuda.is_available() else "cpu"  # as Accelerator picks
    precision = "bf16" if fast_bf16_matmul(device) else "fp32"
    return recipe.model_copy(update={"train": tr.model_copy(update={"precision": precision})})


def _load_dtype(recipe: Recipe) -> torch.dtype:
    """The dtype models load in: bf16 under bf16 training (trainable weights then go to fp32)."""
    return torch.bfloat16 if recipe.train.precision == "bf16" else torch.float32


def _load_model(model_dir: Path, recipe: Recipe):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..mla.model import register

    register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_load_dtype(recipe), attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model.config.use_cache = False
    return model, tokenizer


def _prepare_model(model, recipe: Recipe) -> tuple[int, int]:
    from ..mla.recompute import enable_kv_recompute

    counts = select_trainable(model, recipe.train.trainable)
    for p in model.parameters():  # trainable weights (and so AdamW state) in fp32, always
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    if recipe.train.recompute_kv and enable_kv_recompute(model) == 0:
        raise ValueError("train.recompute_kv: the model has no MLA attention layer")
    if recipe.train.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return counts


def _logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token logits [B, T, V] of a packed batch (block-diagonal mask, restarting positions)."""
    return model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"], use_cache=False,
    ).logits


# --- data ----------------------------------------------------------------------------------------


def _training_data(recipe: Recipe, tokenizer) -> PackedSequences:
    d = recipe.data
    docs = load_documents(d.train, d.train_part, d.text_field, d.documents)
    ids = document_token_ids(tokenizer, docs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packed = pack_documents(ids, d.seq_len, packing=d.packing, pad_id=pad, min_tokens=d.min_document_tokens)
    if d.max_sequences is not None and len(packed) > d.max_sequences:
        keep = slice(0, d.max_sequences)
        packed = PackedSequences(
            packed.input_ids[keep], packed.segment_ids[keep], packed.position_ids[keep], packed.labels[keep],
            packed.documents, int((packed.segment_ids[keep] >= 0).sum()),
        )
    if d.repeated_spans or d.stated_facts:  # one segment per sequence (documents "none"): labels stay the next token
        ids = packed.input_ids  # [N, T]
        if d.repeated_spans:
            ids = with_repeated_span(ids, recipe.train.seed, spans=d.repeated_spans)
        weights = None
        if d.stated_facts:
            plain, (ids, answers) = ids, with_stated_facts(ids, tokenizer, recipe.train.seed, groups=d.stated_facts,
                                                           answers=True)
            if torch.equal(ids, plain):
                raise ValueError(f"data.stated_facts: {d.stated_facts} groups of facts do not fit in sequences of "
                                 f"data.seq_len {d.seq_len} tokens: give fewer groups or longer sequences")
            if d.answer_weight != 1:  # the label at t - 1 is the token at t: the positions that predict a value
                weights = torch.ones(ids.shape)  # [N, T]
                weights[:, :-1][answers[:, 1:]] = d.answer_weight
        packed = PackedSequences(ids, packed.segment_ids, packed.position_ids, segment_labels(ids, packed.segment_ids),
                                 packed.documents, packed.tokens, weights)
    return packed


# --- the loop ------------------------------------------------------------------------------------


def run_finetune(recipe: Recipe, *, stop_after: int | None = None, progress: bool = True, force: bool = False) -> FinetuneResult:
    """Train as the recipe says; ``stop_after`` ends this run after that many optimizer steps in
    total (a checkpoint is written there), as an interruption would. ``force`` allows an
    output_dir that holds other files (see check_output_dir)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    threads = torch.get_num_threads()
    recipe = resolve_precision(recipe)
    check_output_dir(recipe.output_dir, force)
    created = not recipe.output_dir.exists()
    try:
        try:
            return _run(recipe, stop_after, progress)
        except RuntimeError as e:  # gloo/NCCL/the c10d store word a peer that never answered in their own terms
            if not any(word in str(e).lower() for word in ("timed out", "timeout")):  # store: "wait timeout after"
                raise
            raise TimeoutError(
                f"another process did not answer within train.timeout_seconds ({recipe.train.timeout_seconds} s): "
                f"it hangs or died ({str(e).strip().splitlines()[0]})"
            ) from e
    except BaseException:
        if created and recipe.output_dir.is_dir() and not any(recipe.output_dir.iterdir()):
            recipe.output_dir.rmdir()  # a run that failed before writing anything leaves nothing
        raise
    finally:
        torch.set_num_threads(threads)
        # let a later run in this process pick other settings; a state whose set-up failed part way (a peer
        # that hung during it) has no num_processes, and must not hide the error on its way out
        if getattr(PartialState(), "num_processes", 1) == 1:
            AcceleratorState._reset_state()
            GradientState._reset_state()


def _run(recipe: Recipe, stop_after: int | None, progress: bool) -> FinetuneResult:
    trainer = Trainer(recipe, progress)
    trainer.evaluate_at_start()
    interrupted = trainer.train(stop_after)
    return trainer.finish(interrupted)


class Trainer:
    """One fine-tuning run in torchtune's recipe shape: setup (``__init__``: accelerator, model,
    data, optimizer, resume), ``step`` (one optimizer step), ``evaluate``, ``finish`` (the final
    evaluation, the model, the logs and the result)."""

    def __init__(self, recipe: Recipe, progress: bool):
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs, set_seed

        self.t_wall, self.t_cpu = time.perf_counter(), time.process_time()
        self.recipe = recipe
        tr = recipe.train
        if tr.threads:
            torch.set_num_threads(tr.threads)
        if tr.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("train.device is cuda, but no CUDA GPU is available")
        # A process that dies leaves the others waiting in a collective: they give up after the timeout.
        accelerator = self.accelerator = Accelerator(
            cpu=tr.device == "cpu", mixed_precision="bf16" if tr.precision == "bf16" else "no",
            step_scheduler_with_optimizer=False,
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=tr.timeout_seconds))],
        )
        set_seed(tr.seed)
        if accelerator.is_main_process:
            recipe.output_dir.mkdir(parents=True, exist_ok=True)

        self.model_dir, self.converted = converted_dir(recipe, accelerator, progress)
        model, tokenizer = _load_model(self.model_dir, recipe)
        self.trainable, self.total = _prepare_model(model, recipe)
        self.teacher = self._load_teacher(model.config.vocab_size)
        self.data = _training_data(recipe, tokenizer)
        self.eval_ids = held_out_ids(recipe, tokenizer)
        self.world = world = accelerator.num_processes
        self.total_steps = recipe.total_steps(world)
        B, A = tr.micro_batch_size, tr.grad_accum
        self.sampler = StepSampler(len(self.data), B * A * world, seed=tr.seed)
        self.held = shard_model(model, accelerator) if tr.fsdp else None
        log_main(accelerator, (
            f"model {self.model_dir} | trainable {self.trainable:,} of {self.total:,} parameters ({tr.trainable}) | "
            f"{len(self.data)} sequences x {recipe.data.seq_len} tokens from {self.data.documents} documents | "
            f"{self.total_steps} steps x {B * A * world} sequences = {self.total_steps * B * A * world * recipe.data.seq_len:,} tokens | "
            f"{hardware(accelerator)}"
        ))
        if self.held is not None:
            log_main(accelerator, f"fsdp: trainable values held by each of the {world} processes: {self.held} (of {self.trainable:,})")

        opt = recipe.optimizer
        optimizer = torch.optim.AdamW(
            _param_groups(model, opt.weight_decay), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
            foreach=accelerator.device.type == "cuda",
        )
        sch = recipe.schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(sch.kind, s, self.total_steps, sch.warmup_steps, sch.min_lr_ratio)
        )
        if tr.fsdp:  # already sharded; accelerate must not wrap it in DDP as well
            optimizer = accelerator.prepare(optimizer)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.state = state = TrainerState()

        fingerprint = start_model_fingerprint(self.model_dir)
        self.resume = resume = resume_dir(recipe)
        if resume is not None and tr.fsdp:
            raise ValueError(f"train.fsdp: cannot resume from {resume} (sharded runs write no checkpoints yet); "
                             "use another output_dir or train without fsdp")
        if resume is not None:
            state.load_state_dict(load_training_state(
                resume, accelerator.unwrap_model(model), optimizer, self.scheduler, rank=accelerator.process_index
            ))
            check_resume_layout(resume, state, world, B, A)
            check_resume_model(resume, state, fingerprint, self.model_dir, recipe.output_dir)
            log_main(accelerator, f"resumed from {resume} at step {state.step} ({state.tokens:,} tokens)")
        state.processes, state.sequences_per_step = world, B * A * world
        state.start_model = fingerprint  # a resumed run has been checked to share it
        self.train_wall = 0.0  # this run's training steps: seconds and tokens
        self.train_tokens = 0

    def _load_teacher(self, vocab_size: int) -> torch.nn.Module | None:
        """train.objective distill: the source model, on this process's device (the first process
        loads it first, so a built-in model is unpacked once)."""
        spec = self.recipe.teacher()
        if spec is None:
            return None
        d = self.recipe.distill
        log_main(self.accelerator, f"distilling from {spec} (temperature {d.temperature}, alpha {d.alpha})")
        with self.accelerator.main_process_first():
            return load_teacher(spec, _load_dtype(self.recipe), self.accelerator.device, vocab_size,
                                self.recipe.data.seq_len)

    def evaluate(self, windows: int | None, tag: str) -> dict | None:
        """Held-out perplexity on the first ``windows`` windows, logged by the main process."""
        if self.eval_ids is None:
            return None
        accelerator, state, recipe = self.accelerator, self.state, self.recipe
        row = None
        # FSDP: every process runs the forward (each layer is gathered from all); only the main one logs.
        if accelerator.is_main_process or recipe.train.fsdp:
            net = accelerator.unwrap_model(self.model)
            for r in held_out_perplexity(net, self.eval_ids, recipe, accelerator, windows):
                row = {"step": state.step, "tokens": state.tokens, "tag": tag, "seq_len": recipe.eval.seq_len, **r}
                if accelerator.is_main_process:
                    state.eval_log.append(row)
        if accelerator.is_main_process:
            log_main(accelerator, f"step {state.step}: held-out perplexity {row['perplexity']:.3f} ({row['windows']} windows, {tag})")
        accelerator.wait_for_everyone()
        return row

    def evaluate_at_start(self) -> None:
        if self.state.step == 0 and self.recipe.eval.at_start and not self.state.eval_log:
            self.evaluate(self.recipe.eval.final_windows, "start")

    def train(self, stop_after: int | None) -> bool:
        """Optimizer steps until the end (or ``stop_after``), with the evaluations and checkpoints
        the recipe asks for; True when a KeyboardInterrupt stopped it."""
        recipe, state = self.recipe, self.state
        self.model.train()
        try:
            while state.step < self.total_steps and (stop_after is None or state.step < stop_after):
                self.step()
                if recipe.eval.every and state.step % recipe.eval.every == 0 and state.step < self.total_steps:
                    self.evaluate(recipe.eval.windows, "train")
                if recipe.checkpoint.every and state.step % recipe.checkpoint.every == 0:
                    self._save_checkpoint()
        except KeyboardInterrupt:
            log_main(self.accelerator, f"interrupted: saving a checkpoint at step {state.step}")
            return True
        return False

    def step(self) -> None:
        """One optimizer step: grad_accum forward/backward passes of this process's slice."""
        accelerator, recipe, state, model = self.accelerator, self.recipe, self.state, self.model
        tr, opt = recipe.train, recipe.optimizer
        B, A, world = tr.micro_batch_size, tr.grad_accum, self.world
        device = accelerator.device
        t0 = time.perf_counter()
        idx = self.sampler.indices(state.step).view(A, world, B)[:, accelerator.process_index]  # [A, B]
        batches = [self.data.batch(i) for i in idx]
        # The step's loss is the mean NLL over the scored tokens of every process. DDP averages
        # gradients over the processes, so each one scales its sum by world / (all scored
        # tokens): the gradient is then the one a single process would get for the whole batch.
        scored = sum_over_processes(accelerator, sum(int((b["labels"] != IGNORE).sum()) for b in batches))
        sums: dict[str, float] = {}
        for a, batch in enumerate(batches):
            batch = {k: v.to(device) for k, v in batch.items()}
            sync = nullcontext() if a == A - 1 or tr.fsdp else accelerator.no_sync(model)
            with sync, accelerator.autocast():
                terms = self._loss_sums(batch)
                accelerator.backward(self._objective(terms) * world / max(1, scored))
            for name, value in terms.items():
                sums[name] = sums.get(name, 0.0) + value.item()
        means = {name: sum_over_processes(accelerator, value) / max(1, scored) for name, value in sums.items()}
        grad_norm = None
        if opt.grad_clip is not None:
            norm = accelerator.clip_grad_norm_(model.parameters(), opt.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_tokens = B * A * world * recipe.data.seq_len
        state.step += 1
        state.tokens += step_tokens
        dt = time.perf_counter() - t0
        self.train_wall += dt
        self.train_tokens += step_tokens
        loss = require_finite_number(self._objective(means), f"the training loss at step {state.step}")
        distilled = means if self.teacher is not None else {}  # its terms: kl, and nll on the same tokens
        state.train_log.append({
            "step": state.step, "tokens": state.tokens, "loss": loss, **distilled, "lr": lr, "grad_norm": grad_norm,
            "seconds": dt, "epoch": round(self.sampler.epoch(state.step), 4),
        })
        if state.step % tr.log_every == 0 or state.step == 1:
            log_main(accelerator, (
                f"step {state.step}/{self.total_steps} loss {loss:.4f} "
                + "".join(f"{name} {value:.4f} " for name, value in distilled.items())
                + f"lr {lr:.3g} "
                f"grad-norm {grad_norm if grad_norm is None else round(grad_norm, 3)} "
                f"{self.train_tokens / self.train_wall:,.0f} tok/s"
            ))

    def _loss_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss terms summed over the micro-batch's scored tokens: nll, and kl when distilling."""
        logits = _logits(self.model, batch)  # [B, T, V]
        labels = batch["labels"]  # [B, T]
        # pure distillation (alpha 1) only logs the NLL: no graph kept for it
        logged_only = self.teacher is not None and self.recipe.distill.alpha == 1
        nll_logits = logits.detach() if logged_only else logits  # [B, T, V]
        weights = batch.get("weights")  # [B, T] or None (every label counts once)
        terms = {"nll": scored_nll_sum(nll_logits, labels, weights)}
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = _logits(self.teacher, batch)  # [B, T, V]
            terms["kl"] = scored_kl_sum(logits, teacher_logits, labels, self.recipe.distill.temperature, weights)
        return terms

    def _objective(self, terms: dict):
        """The minimized loss from its terms (sums or means, tensors or numbers): linear in them."""
        if self.teacher is None:
            return terms["nll"]
        return distill_objective(terms["kl"], terms["nll"], self.recipe.distill)

    def _save_checkpoint(self) -> Path:
        return save_checkpoint(self.accelerator, self.recipe, self.state, self.model, self.optimizer, self.scheduler)

    def finish(self, interrupted: bool) -> FinetuneResult:
        """A stopped run: a checkpoint and the logs (re-raising an interruption). A finished one:
        the final evaluation and the model. Both: the result, in metrics.json too."""
        accelerator, recipe, state = self.accelerator, self.recipe, self.state
        done = state.step >= self.total_steps and not interrupted
        if not done:
            if recipe.checkpoint.every == 0 or state.step % recipe.checkpoint.every:
                self._save_checkpoint()
            if accelerator.is_main_process:
                write_logs(recipe, state)
            if interrupted:
                raise KeyboardInterrupt
            final = None
        else:
            final = self.evaluate(recipe.eval.final_windows, "final")
        start_row = next((r for r in state.eval_log if r["tag"] == "start" and (final is None or r["windows"] == final["windows"])), None)
        last_loss = state.train_log[-1]["loss"] if state.train_log else None
        result = FinetuneResult(
            output_dir=str(recipe.output_dir),
            model_dir=None,
            completed=done,
            steps=state.step,
            total_steps=self.total_steps,
            tokens=state.tokens,
            trained_parameters=self.trainable,
            total_parameters=self.total,
            start_perplexity=start_row["perplexity"] if start_row else None,
            final_perplexity=final["perplexity"] if final else None,
            eval_tokens=final["tokens"] if final else None,
            final_loss=last_loss,
            wall_seconds=0.0,
            cpu_seconds=0.0,
            tokens_per_second=self.train_tokens / self.train_wall if self.train_wall else None,
            hardware=hardware(accelerator),
            resumed_from=str(self.resume) if self.resume is not None else None,
            converted_dir=self.converted,
            train_sequences=len(self.data),
            epochs=round(self.sampler.epoch(state.step), 4),
            trainable_per_process=self.held,
        )
        if done:
            result.model_dir = str(save_model(accelerator, self.model, recipe, self.model_dir, state))
        result.wall_seconds = time.perf_counter() - self.t_wall
        result.cpu_seconds = time.process_time() - self.t_cpu
        if accelerator.is_main_process:
            write_logs(recipe, state, result.to_dict())
        accelerator.end_training()
        return result
