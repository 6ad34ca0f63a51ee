"""The online training loop of an EAGLE-3 head (`outrider train eagle3`).

Per step: the next global batch of examples (train/data.py, a pure function of the seed), the
frozen target's forward over this rank's share (train/target_pass.py), the head's training-time
test unroll (`Eagle3Trainable.ttt`), AdamW (weight decay 0) under linear warmup then cosine decay,
gradients clipped to `clip`. Under torchrun (RANK / WORLD_SIZE set) every rank runs the same loop
on its contiguous share of each global batch (gloo); the ranks first add up each unrolled step's
valid rows, each rank's loss is its summed cross-entropy of step s over that global count, and the
gradients are summed with all_reduce: the update is the single-process one on the whole batch.
Rank 0 writes the log, checkpoints and the head.

    OUT/train_log.jsonl    one line a step: step, tokens, loss, step_acc (per unrolled step), lr, elapsed_s
    OUT/checkpoint/        every --checkpoint-every steps and at the end (train/checkpoint.py)
    OUT/config.json + model.safetensors   the head, EAGLE layout (heads/eagle3_format.py loads it)
    OUT/train_info.json    command, data, seed, tokens, time, final per-step acceptance
    OUT/snapshots/step-N/  with --snapshot-every: the head at step N (for tau against training tokens)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import current
from ..errors import ConfigError
from . import checkpoint
from .budget import BUDGET_WARMUP, PLAN_AFTER, plan_steps
from .init_head import init_head
from .outputs import export, trim_log, write_head
from .data import Encoder, Position, Stream, batches, load_corpus, parse_sources
from .target_pass import target_pass
from .vocab import check_draft_vocab, count_labels, draft_vocab, used_from_maps

# arguments a resumed run must share with the run it continues (the batches depend on them)
SAME_ON_RESUME = ("target", "data", "seq_len", "batch_size", "seed", "draft_vocab", "regenerate",
                  "max_response_tokens", "ttt_steps", "decay", "vocab_tokens", "target_dtype", "precision",
                  "init_from", "length_group", "code_roots")
OLD_RUNS = {"length_group": 1}  # what a checkpoint written before an option existed ran with
# arguments that fix the learning-rate schedule (lr_at): a resumed run with others would jump in it
SCHEDULE = ("steps", "tokens", "warmup_steps", "lr")
PRECISIONS = ("fp32", "bf16")  # the head's arithmetic: fp32, or bf16 autocast (weights and optimizer fp32)
TARGET_DTYPES = ("float32", "bfloat16")


@dataclass
class TrainOptions:
    target: str
    data: str
    out: str
    steps: int | None = None
    tokens: int | None = None
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int | None = None  # None: 5% of the steps
    clip: float = 0.5
    ttt_steps: int = 7
    decay: float = 0.8
    draft_vocab: int = 8192
    seed: int = 0
    resume: bool = False
    regenerate: bool = False
    max_response_tokens: int = 256
    checkpoint_every: int = 100
    vocab_tokens: int = 2_000_000  # labels counted to choose the draft vocabulary
    threads: int | None = None
    device: str | None = None
    target_dtype: str = "float32"  # the frozen target's weights (bfloat16: ~2x faster on CPUs with AMX)
    precision: str = "fp32"
    snapshot_every: int | None = None  # also write the head to OUT/snapshots/step-N every N steps
    regenerate_batch: int | None = None  # prompts regenerated together (None: 16 on a CPU, 512 on a GPU)
    time_budget: float | None = None  # seconds of training steps: the step count is planned from the first ones
    init_from: str | None = None  # start from this head's weights (a folder or a shipped head's name)
    length_group: int = 8  # batches whose examples are sorted by length together (1: stream order)
    code_roots: list[str] | None = None  # folders the code sources read (None: this Python's stdlib)
    responses: str | None = None  # another run's regenerated.jsonl: responses not generated again
    regenerate_only: bool = False  # write OUT/regenerated.jsonl and stop (a later run takes it as --responses)
    progress: bool = True
    command: list[str] = field(default_factory=list)

    def check(self) -> "TrainOptions":
        """One-line ConfigErrors for bad values, before anything is loaded."""
        if sum(x is not None for x in (self.steps, self.tokens, self.time_budget)) > 1:
            raise ConfigError("give one of --steps, --tokens and --time-budget")
        if self.time_budget is not None:
            if not (isinstance(self.time_budget, (int, float)) and self.time_budget > 0
                    and math.isfinite(self.time_budget)):
                raise ConfigError(f"--time-budget must be a positive number of seconds, got {self.time_budget}")
            if self.warmup_steps is None:
                self.warmup_steps = BUDGET_WARMUP  # 5% of a step count not known yet: a fixed warmup
            if self.warmup_steps < PLAN_AFTER:
                raise ConfigError(f"--time-budget plans the step count after {PLAN_AFTER} steps: give "
                                  f"--warmup-steps >= {PLAN_AFTER} (default {BUDGET_WARMUP})")
            if self.resume:
                raise ConfigError("--time-budget plans a new run; resume with the --steps its train_info.json records")
        elif self.steps is None and self.tokens is None:
            self.steps = 1000
        positive = {"steps": self.steps, "tokens": self.tokens, "batch_size": self.batch_size,
                    "ttt_steps": self.ttt_steps, "draft_vocab": self.draft_vocab, "threads": self.threads,
                    "max_response_tokens": self.max_response_tokens, "checkpoint_every": self.checkpoint_every,
                    "vocab_tokens": self.vocab_tokens, "regenerate_batch": self.regenerate_batch,
                    "length_group": self.length_group}
        for key, value in positive.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
        if not isinstance(self.seq_len, int) or self.seq_len < self.ttt_steps + 2:
            raise ConfigError(f"--seq-len must be at least --ttt-steps + 2 = {self.ttt_steps + 2}, got {self.seq_len}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ConfigError(f"--clip must be a positive number, got {self.clip}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"--decay must be in (0, 1], got {self.decay}")
        if self.target_dtype not in TARGET_DTYPES:
            raise ConfigError(f"--target-dtype must be one of {', '.join(TARGET_DTYPES)}, got {self.target_dtype!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.snapshot_every is not None and (not isinstance(self.snapshot_every, int) or self.snapshot_every < 1):
            raise ConfigError(f"--snapshot-every must be a positive integer, got {self.snapshot_every}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        parse_sources(self.data)
        if self.regenerate_only and not self.regenerate:
            raise ConfigError("--regenerate-only needs --regenerate (it writes the target's responses and stops)")
        if self.responses is not None and not (self.regenerate and Path(self.responses).is_file()):
            raise ConfigError(f"--responses {self.responses}: " + ("no such file" if self.regenerate else
                              "only with --regenerate (the responses stand in for the target's own)"))
        if self.responses is not None:  # a file that is not a regenerated.jsonl: refused before loading
            from .regenerate import read_responses

            read_responses(Path(self.responses))
        for root in self.code_roots or ():
            if not Path(root).expanduser().is_dir():
                raise ConfigError(f"--code-root {root}: no such folder; give a folder of .py files")
        if self.init_from is not None:  # a head that is not there: refused before anything loads
            from ..heads.catalog import resolve_head
            from ..heads.eagle3_format import read_config

            read_config(resolve_head(self.init_from))
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is a file; give a folder")
        if self.resume and not checkpoint.exists(out):
            raise ConfigError(f"--resume: {out} holds no checkpoint; run without --resume to start")
        if not self.resume and out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"--out {out} is not empty; add --resume to continue its run, or give a new folder")
        return self

    @property
    def total_steps(self) -> int:
        """The planned steps; under --time-budget, before the plan (PLAN_AFTER steps), an upper bound."""
        if self.steps is None and self.tokens is None:
            return 10**9
        return self.steps or math.ceil(self.tokens / (self.batch_size * self.seq_len))

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr over warmup_steps, then cosine decay to 0 at total_steps."""
        total = self.total_steps
        warmup = self.warmup_steps if self.warmup_steps is not None else max(1, total // 20)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class _Dist:
    """rank / world from torchrun's environment; gloo when more than one process."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            self.dist = dist

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self.dist.all_reduce(tensor)
        return tensor

    def close(self):
        """All ranks meet before the group goes: a rank that tore its group down while another
        was still using the store it hosts aborted that one at exit (seen once under load)."""
        if self.world > 1 and self.dist.is_initialized():
            self.dist.barrier()
            self.dist.destroy_process_group()


def train(options: TrainOptions, log=None, on_step=None) -> dict:
    """Run (or resume) a training run; returns train_info (also written to OUT/train_info.json).

    log(message): progress lines (default: stderr, rank 0 only). on_step(record): called after
    each step (and its checkpoint) with the log record; an exception it raises stops the run there,
    as an interruption would."""
    from ..weights.tokenizer import eos_ids_of, load_tokenizer
    from ..catalog.resolve import resolve_model
    from ..models.config import ModelConfig
    from ..weights.loader import load_decoder, resolve_device
    from .eagle3_model import Eagle3Trainable
    from .regenerate import Regenerator

    o = options.check()
    dist = _Dist()
    say = (log or (lambda msg: print(msg, file=sys.stderr))) if dist.rank == 0 else (lambda msg: None)
    if o.batch_size % dist.world:
        raise ConfigError(f"--batch-size {o.batch_size} must be a multiple of the {dist.world} torchrun processes")
    if o.threads:
        torch.set_num_threads(o.threads)
    out = Path(o.out)
    device = resolve_device(o.device or "cpu")
    corpus = load_corpus(o.data, regenerate=o.regenerate, roots=o.code_roots,
                         fixtures=current().bench_fixtures)
    path = resolve_model(o.target)
    vocab_size = ModelConfig.load(path).vocab_size
    check_draft_vocab(o.draft_vocab, vocab_size)
    saved = checkpoint.load(out) if o.resume else None
    if saved is not None:
        before = saved.meta["options"]
        changed = [k for k in SAME_ON_RESUME if before.get(k, OLD_RUNS.get(k)) != asdict(o).get(k)]
        if changed:
            raise ConfigError(f"--resume: {', '.join('--' + k.replace('_', '-') for k in changed)} differ from the "
                              f"run in {out} ({', '.join(f'{before.get(k)!r}' for k in changed)}); use its values")
        _check_schedule(before, o, out)
    for line in corpus.sources:
        say(f"data {line}")
    if corpus.skipped:
        say(f"data: skipped {corpus.skipped} items that carry no response (add --regenerate to train on them)")
    target = load_decoder(path, device, getattr(torch, o.target_dtype))
    tokenizer = load_tokenizer(path)
    encoder = Encoder(tokenizer, o.seq_len)
    out.mkdir(parents=True, exist_ok=True)
    responder = None
    if o.regenerate:
        responder = Regenerator(target, encoder, eos_ids_of(path, tokenizer), o.max_response_tokens,
                                out / "regenerated.jsonl", write=dist.rank == 0, log=say,
                                batch=o.regenerate_batch or (512 if device.type == "cuda" else 16),
                                responses=Path(o.responses) if o.responses else None)
    stream = Stream(corpus, encoder, o.seed, responder)
    if responder is not None:
        began = time.perf_counter()
        needed = stream.respond_all()
        say(f"responses: {needed} items, {responder.generated} generated now in {time.perf_counter() - began:.1f} s, "
            f"{responder.too_long} prompts too long for --seq-len, the rest from {out / 'regenerated.jsonl'}")
        if o.regenerate_only:
            dist.close()
            return {"responses": needed, "generated": responder.generated, "too_long": responder.too_long,
                    "file": str(out / "regenerated.jsonl")}

    init = init_head(o.init_from, target) if o.init_from and saved is None else None
    if saved is not None or init is not None:
        d2t = (saved.model if saved is not None else init[0]).get("d2t")
        used = used_from_maps(d2t) if d2t is not None else torch.arange(vocab_size)
    else:
        used = _choose_vocab(stream, o, vocab_size, say)
    layer_ids = saved.meta["config"].get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") \
        if saved is not None else init[1] if init is not None else None
    model = Eagle3Trainable.for_target(target, used, seed=o.seed, layer_ids=layer_ids).to(device)
    if saved is not None:
        model.load_state_tensors({k: v.to(device) for k, v in saved.model.items()})
    elif init is not None:
        model.load_state_tensors({k: v.to(device) for k, v in init[0].items()})
        say(f"starting from the head {o.init_from} (its weights and draft vocabulary; a new optimizer)")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=0.0)
    step, tokens_seen, position, elapsed0 = 0, 0, Position(), 0.0
    if saved is not None:
        optimizer.load_state_dict(saved.optim)
        m = saved.meta
        step, tokens_seen, position, elapsed0 = m["step"], m["tokens"], Position(*m["position"]), m["elapsed_s"]
        say(f"resuming at step {step} ({tokens_seen} tokens seen)")
    taps = model.taps(target.config.num_layers)
    log_path = out / "train_log.jsonl"
    if dist.rank == 0:
        trim_log(log_path, step)
    bar = _progress(o, dist, step)
    start = time.perf_counter()
    last = {}
    share = o.batch_size // dist.world
    data = batches(stream, o.batch_size, position, group=o.length_group)
    timed_from = start
    while step < o.total_steps and (o.tokens is None or tokens_seen < o.tokens):
        position, examples = next(data)
        mine = examples[dist.rank * share:(dist.rank + 1) * share]
        for group in optimizer.param_groups:
            group["lr"] = o.lr_at(step)
        tb = target_pass(target, mine, taps, used)
        if step == 0 and saved is None:  # fc's input scale, from the first batch (all ranks: the same rows)
            first = target_pass(target, examples, taps, used) if dist.world > 1 else tb
            model.calibrate(first.features, first.valid, keep_function=init is not None)
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=o.precision == "bf16"):
            result = model.ttt(tb.features, tb.tokens, tb.draft_logits, tb.valid, steps=o.ttt_steps, decay=o.decay)
        K = o.ttt_steps
        pad = lambda xs: list(xs) + [0.0] * (K - len(xs))  # noqa: E731 (steps past a short sequence)
        rows_s = pad(result.step_rows)
        stats = dist.sum_(torch.tensor([result.rows] + rows_s + pad([float(x.detach()) for x in result.step_sums])
                                       + pad([r * a for r, a in zip(result.step_rows, result.step_acc)]),
                                       dtype=torch.float64))
        total_rows = float(stats[0])
        global_rows = stats[1:1 + K]  # [K] valid rows of each step over all ranks
        # the loss of the whole global batch: sum_s decay^s * (its summed CE over all ranks) / its rows
        loss = sum((o.decay ** s) * part / float(global_rows[s])
                   for s, part in enumerate(result.step_sums) if float(global_rows[s]) > 0)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.sum_(p.grad)
        torch.nn.utils.clip_grad_norm_(params, o.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += sum(len(e.tokens) for e in examples)
        elapsed = elapsed0 + time.perf_counter() - start
        if o.time_budget is not None:
            if step == 2:
                timed_from = time.perf_counter()  # steps 1 and 2 warm kernels and allocators up
            elif step == PLAN_AFTER:
                plan = plan_steps(o, step, (time.perf_counter() - timed_from) / (step - 2), elapsed)
                say(f"time budget {o.time_budget:.0f} s: {plan} steps in all "
                    f"({(time.perf_counter() - timed_from) / (step - 2):.3f} s a step)")
        sums_all, acc_all = stats[1 + K:1 + 2 * K], stats[1 + 2 * K:]
        global_loss = sum((o.decay ** s) * float(sums_all[s]) / float(global_rows[s])
                          for s in range(K) if float(global_rows[s]) > 0)
        last = {"step": step, "tokens": tokens_seen, "loss": global_loss,
                "step_acc": [round(float(acc_all[s]) / max(float(global_rows[s]), 1.0), 5) for s in range(K)],
                "lr": o.lr_at(step - 1),
                "elapsed_s": round(elapsed, 3), "rows": int(total_rows)}
        if dist.rank == 0:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(last) + "\n")
            if bar is not None:
                rate = (tokens_seen - (m["tokens"] if saved else 0)) / max(1e-9, time.perf_counter() - start)
                bar.set_postfix_str(f"loss {last['loss']:.3f} " + " ".join(
                    f"acc{k} {a:.2f}" for k, a in enumerate(last["step_acc"][:4])) + f" {rate:.0f} tok/s")
                bar.update(1)
            if step % o.checkpoint_every == 0:
                _checkpoint(out, o, model, optimizer, step, tokens_seen, position, elapsed)
            if o.snapshot_every and step % o.snapshot_every == 0:
                write_head(out / "snapshots" / f"step-{step:06d}", model, {"step": step, "tokens": tokens_seen,
                                                                             "elapsed_s": elapsed, "last": last})
        if on_step is not None:
            on_step(last)
    if bar is not None:
        bar.close()
    info = {}
    if dist.rank == 0:
        elapsed = last.get("elapsed_s", elapsed0)
        _checkpoint(out, o, model, optimizer, step, tokens_seen, position, elapsed)
        info = export(out, o, model, corpus, step, tokens_seen, elapsed, last)
        say(f"head written to {out} ({step} steps, {tokens_seen} tokens, {elapsed:.0f} s)")
    dist.close()
    return info




def _check_schedule(before: dict, o: TrainOptions, out: Path) -> None:
    """--resume: refuse options that define the learning-rate schedule (SCHEDULE) other than the
    checkpoint's, in one line with the recorded values to pass. A --time-budget run checkpointed
    before its plan recorded no step count yet: any --steps continues it (its lr so far was the warmup's)."""
    now = asdict(o)
    unplanned = before.get("time_budget") is not None and before.get("steps") is None
    changed = [k for k in SCHEDULE if before.get(k) != now.get(k) and not (unplanned and k == "steps")]
    if not changed:
        return
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    given = ", ".join(f"{flag(k)} {now[k]}" if now.get(k) is not None else f"no {flag(k)}" for k in changed)
    recorded = " ".join(f"{flag(k)} {before[k]}" for k in changed if before.get(k) is not None)
    dropped = [flag(k) for k in changed if before.get(k) is None]
    fix = " and ".join(filter(None, [f"with {recorded}" if recorded else "",
                                     f"without {' '.join(dropped)}" if dropped else ""]))
    raise ConfigError(f"--resume: the run in {out} was recorded with another learning-rate schedule than this "
                      f"command's ({given}); resume it {fix}, or to train longer let it finish and start a new "
                      f"run with --init-from {out}")


def _choose_vocab(stream: Stream, o: TrainOptions, vocab_size: int, say) -> torch.Tensor:
    """Top draft_vocab ids by label count over the first labels of the stream (vocab.py): up to the
    planned labels (at most vocab_tokens), each item counted once (the first epoch: a corpus smaller
    than the budget is not cycled, so the coverage said is over the labels of distinct items)."""
    if o.draft_vocab == vocab_size:
        return torch.arange(vocab_size)
    planned = o.tokens if o.tokens is not None else o.steps * o.batch_size * o.seq_len if o.steps else o.vocab_tokens
    budget = min(o.vocab_tokens, planned)
    chosen, labels, items = [], 0, set()
    for after, example in stream.examples():
        if after.epoch > 0:  # every item seen once: the next ones repeat them
            break
        chosen.append(example)
        items.add(after.item - (after.chunk == 0))  # the item this example is a chunk of
        labels += sum(example.mask)
        if labels >= budget:
            break
    counts = count_labels(chosen, vocab_size)
    used = draft_vocab(counts, o.draft_vocab)
    covered = float(counts[used].sum()) / max(1, int(counts.sum()))
    every = f"all {len(items)} items" if len(items) == len(stream.corpus.items) else f"{len(items)} items"
    say(f"draft vocabulary: {o.draft_vocab} of {vocab_size} ids, covering {covered:.1%} of the {labels} labels "
        f"of {every} (each counted once)")
    return used


def _checkpoint(out, o, model, optimizer, step, tokens, position, elapsed) -> None:
    meta = {"step": step, "tokens": tokens, "position": position.to_json(), "elapsed_s": elapsed, "seed": o.seed,
            "options": {k: v for k, v in asdict(o).items() if k != "command"}, "command": o.command,
            "config": model.export_config()}
    checkpoint.save(out, meta, model.state_tensors(training=True), optimizer)


def _progress(o: TrainOptions, dist: _Dist, step: int):
    if dist.rank != 0 or not o.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=o.total_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr)
