"""The online training loop of a learned head (`outrider train eagle3|dflash`).

Per step: the next global batch of examples (train/data.py, a pure function of the seed), the
frozen target's forward over this rank's share (train/target_pass.py), the head's step
(train/trainables.py: EAGLE-3's training-time test unroll, DFlash's random anchor blocks), AdamW (weight decay 0) under linear warmup then cosine decay,
gradients clipped to `clip`. Under torchrun (RANK / WORLD_SIZE set) every rank runs the same loop
on its contiguous share of each global batch (gloo); the ranks first add up each unrolled step's
valid rows, each rank's loss is its summed cross-entropy of step s over that global count, and the
gradients are summed with all_reduce: the update is the single-process one on the whole batch.
Rank 0 writes the log, checkpoints and the head.

    OUT/train_log.jsonl    one line a step: step, tokens, loss, step_acc (per unrolled step), lr, elapsed_s
    OUT/checkpoint/        every --checkpoint-every steps and at the end (train/checkpoint.py)
    OUT/config.json + model.safetensors   the head, EAGLE layout (heads/eagle3/format.py loads it)
    OUT/train_info.json    command, data, seed, tokens, time, final per-step acceptance
    OUT/snapshots/step-N/  with --snapshot-every: the head at step N (for tau against training tokens)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import current
from ..errors import ConfigError
from . import checkpoint
from .budget import PLAN_AFTER, plan_steps
from .init_head import init_head
from .outputs import export, trim_log, write_head
from .data import Encoder, Position, Stream, batches, load_corpus
from .target_pass import target_pass
from .vocab import check_draft_vocab, count_labels, draft_vocab, used_from_maps
from .options import OLD_RUNS, SAME_ON_RESUME, SCHEDULE, TrainOptions


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
    from .regenerate import Regenerator
    from .trainables import build

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
    check_draft_vocab(o.draft_vocab or vocab_size, vocab_size)
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

    init = init_head(o.init_from, target, o.head) if o.init_from and saved is None else None
    if saved is not None or init is not None:
        d2t = (saved.model if saved is not None else init[0]).get("d2t")
        used = used_from_maps(d2t) if d2t is not None else torch.arange(vocab_size)
    else:
        used = _choose_vocab(stream, o, vocab_size, say)
    layer_ids = saved.meta["config"].get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") \
        if saved is not None else init[1] if init is not None else None
    job = build(o, target, tokenizer, used, layer_ids)
    model = job.model.to(device)
    weights = job.weights()
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
        tb = target_pass(target, mine, taps, used, logits=job.needs_logits)
        if step == 0 and saved is None:  # fc's input scale, from the first batch (all ranks: the same rows)
            first = target_pass(target, examples, taps, used, logits=job.needs_logits) if dist.world > 1 else tb
            model.calibrate(first.features, first.valid, keep_function=init is not None)
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=o.precision == "bf16"):
            result = job.step(tb, step, dist.rank)
        K = len(weights)
        stats = dist.sum_(torch.tensor([result.rows[0]] + result.rows + [float(x.detach()) for x in result.sums]
                                       + result.hits + [result.accepted, result.blocks], dtype=torch.float64))
        total_rows = float(stats[0])
        global_rows = stats[1:1 + K]  # [K] scored rows of each position over all ranks
        # the loss of the whole global batch: sum_k w_k * (its summed loss over all ranks) / its rows
        loss = sum(weights[s] * part / float(global_rows[s])
                   for s, part in enumerate(result.sums) if float(global_rows[s]) > 0)
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
        sums_all, acc_all = stats[1 + K:1 + 2 * K], stats[1 + 2 * K:1 + 3 * K]
        global_loss = sum(weights[s] * float(sums_all[s]) / float(global_rows[s])
                          for s in range(K) if float(global_rows[s]) > 0)
        last = {"step": step, "tokens": tokens_seen, "loss": global_loss,
                "step_acc": [round(float(acc_all[s]) / max(float(global_rows[s]), 1.0), 5) for s in range(K)],
                "lr": o.lr_at(step - 1),
                "elapsed_s": round(elapsed, 3), "rows": int(total_rows)}
        if o.head == "dflash":  # slot k's accuracy is step_acc[k-1]; mean leading run of right slots per block
            last["accepted"] = round(float(stats[-2]) / max(float(stats[-1]), 1.0), 5)
        if dist.rank == 0:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(last) + "\n")
            if bar is not None:
                rate = (tokens_seen - (m["tokens"] if saved else 0)) / max(1e-9, time.perf_counter() - start)
                bar.set_postfix_str(f"loss {last['loss']:.3f} " + " ".join(
                    f"acc{k + job.first} {a:.2f}" for k, a in enumerate(last["step_acc"][:4]))
                    + (f" acc-len {last['accepted']:.2f}" if "accepted" in last else "") + f" {rate:.0f} tok/s")
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
    if o.draft_vocab is None or o.draft_vocab == vocab_size:
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
