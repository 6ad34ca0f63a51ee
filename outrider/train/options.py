"""The options of a training run (`outrider train eagle3|dflash`), checked before anything loads.

One dataclass for both heads: the data, schedule and run options every head shares, then each
head's own (`ttt_steps`/`decay` for EAGLE-3; `layers`, `block_size`, `anchors`, `gamma`,
`mask_token`, `target_layers` for DFlash). train/loop.py runs them; train/cli.py parses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from . import checkpoint
from .budget import BUDGET_WARMUP, PLAN_AFTER
from .data import parse_sources

HEADS = ("eagle3", "dflash", "mtp")
OBJECTIVES = ("sft", "opd", "length")  # DFlash: hard labels; AdaFlash's on-policy reverse KL; its length head

SAME_ON_RESUME = ("target", "data", "seq_len", "batch_size", "seed", "draft_vocab", "regenerate",
                  "max_response_tokens", "ttt_steps", "decay", "vocab_tokens", "target_dtype", "precision",
                  "init_from", "length_group", "code_roots", "head", "layers", "block_size", "anchors", "gamma",
                  "mask_token", "target_layers", "objective")
# what a checkpoint written before an option existed ran with
OLD_RUNS = {"length_group": 1, "head": "eagle3", "layers": 1, "block_size": 16, "anchors": 32, "gamma": 7.0,
            "objective": "sft"}
# arguments that fix the learning-rate schedule (lr_at): a resumed run with others would jump in it
SCHEDULE = ("steps", "tokens", "warmup_steps", "lr")
HEADS = HEADS + ("dspark",)  # DSpark (heads/dspark/trainable.py): DFlash's options and its own
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
    draft_vocab: int | None = 8192  # None: the target's whole vocabulary (DFlash's default)
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
    head: str = "eagle3"  # which head: "eagle3" or "dflash"
    layers: int = 1  # DFlash: draft layers
    block_size: int = 16  # DFlash: B, the root and B-1 masked slots
    anchors: int = 32  # DFlash: random anchor blocks per sequence and step
    gamma: float = 7.0  # DFlash: slot k's loss weight is exp(-(k-1)/gamma)
    mask_token: int | None = None  # DFlash: the MASK token id (None: heads/dflash/trainable.default_mask_token)
    target_layers: list[int] | None = None  # DFlash ids (output of layer l, 0-based); None: DFlash's default
    objective: str = "sft"  # DFlash: sft, opd (AdaFlash's on-policy distillation) or length (its length head)
    markov: str = "vanilla"  # DSpark: the Markov head's variant (vanilla, gated, rnn)
    markov_rank: int = 64  # DSpark: its rank r
    backbone: str | None = None  # DSpark: start the backbone from this DFlash head
    backbone_mode: str = "paper"  # DSpark: paper (all trained, the anchor a position) or frozen
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
        self._check_head()
        positive = {"steps": self.steps, "tokens": self.tokens, "batch_size": self.batch_size,
                    "ttt_steps": self.ttt_steps, "draft_vocab": self.draft_vocab, "threads": self.threads,
                    "max_response_tokens": self.max_response_tokens, "checkpoint_every": self.checkpoint_every,
                    "vocab_tokens": self.vocab_tokens, "regenerate_batch": self.regenerate_batch,
                    "length_group": self.length_group}
        for key, value in positive.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {value}")
        shortest = self.ttt_steps + 2 if self.head in ("eagle3", "mtp") else 3
        if not isinstance(self.seq_len, int) or self.seq_len < shortest:
            raise ConfigError(f"--seq-len must be at least {shortest}" + (" (--ttt-steps + 2)" if self.head in ("eagle3", "mtp")
                              else "") + f", got {self.seq_len}")
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

            if self.head == "dflash":
                from ..heads.dflash.format import read_config as read_dflash

                read_dflash(resolve_head(self.init_from, kind="dflash"))
            else:
                from ..heads.eagle3.format import read_config

                read_config(resolve_head(self.init_from))
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is a file; give a folder")
        if self.resume and not checkpoint.exists(out):
            raise ConfigError(f"--resume: {out} holds no checkpoint; run without --resume to start")
        if not self.resume and out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"--out {out} is not empty; add --resume to continue its run, or give a new folder")
        return self

    def _check_head(self) -> None:
        """The head's own options (one-line ConfigErrors)."""
        if self.head not in HEADS:
            raise ConfigError(f"unknown head {self.head!r}: train one of {', '.join(HEADS)}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.head not in ("dflash", "dspark"):
            if self.objective != "sft":
                raise ConfigError(f"--objective {self.objective} trains DFlash heads (AdaFlash); use outrider train dflash")
            return
        for key, low in (("layers", 1), ("block_size", 2), ("anchors", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"--{key.replace('_', '-')} must be an integer >= {low}, got {value}")
        if not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise ConfigError(f"--gamma must be a positive number, got {self.gamma}")
        if self.mask_token is not None and (not isinstance(self.mask_token, int) or self.mask_token < 0):
            raise ConfigError(f"--mask-token must be a token id >= 0, got {self.mask_token}")
        ids = self.target_layers
        if ids is not None and (not ids or not all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ConfigError(f"--target-layers must be comma-separated layer ids >= 0, got {ids}")
        if self.objective == "length" and self.init_from is None:
            raise ConfigError("--objective length trains AdaFlash's length head on a frozen DFlash head: "
                              "give it with --init-from HEAD")

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
