"""`outrider train eagle3|dflash ...`: argparse and run code of the training sub-commands (train/loop.py)."""

from __future__ import annotations

import os
import sys

from .data import SOURCES


def add_parser(sub) -> None:
    """Register `train` (with its `eagle3`, `dflash`, `dartree` and `lilicorr` sub-commands) on the
    `outrider` sub-parsers."""
    train = sub.add_parser("train", help="train a learned drafter for a target (online, on this machine)")
    tsub = train.add_subparsers(dest="train_command", required=True)
    p = tsub.add_parser("eagle3", help="train an EAGLE-3 head (fused target features + one decoder layer); "
                        "run under torchrun for data parallelism")
    _common(p)
    p.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps of the training-time test (default 7)")
    p.add_argument("--decay", type=float, default=0.8, help="loss weight of unrolled step k is decay**k (default 0.8)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size Vd (default 8192)")
    p.add_argument("--init-from", default=None, metavar="HEAD",
                   help="start from this head's weights and draft vocabulary (a head folder in the EAGLE or "
                        "speculators layout, or a shipped head's name), with a new optimizer and schedule")
    p = tsub.add_parser("dflash", help="train a DFlash block head (target features injected as K/V, a block of "
                        "masked slots drafted in one forward); run under torchrun for data parallelism")
    _common(p)
    p.add_argument("--layers", type=int, default=1, help="draft layers (default 1)")
    p.add_argument("--block-size", type=int, default=16, help="block size B: the root and B-1 drafted slots "
                   "(default 16, DFlash's)")
    p.add_argument("--anchors", type=int, default=32, help="random anchor blocks per sequence and step (default 32; "
                   "SpecForge uses 512)")
    p.add_argument("--gamma", type=float, default=7.0, help="slot k's loss weight is exp(-(k-1)/gamma) (default 7)")
    p.add_argument("--mask-token", type=int, default=None, help="the MASK token id (default: the highest-id special "
                   "token the tokenizer adds that text never holds; SmolLM2: 16 <empty_output>)")
    p.add_argument("--target-layers", type=_ids, default=None, metavar="IDS",
                   help="comma-separated target layers the head reads (DFlash's convention: the output of layer l, "
                        "0-based; default: DFlash's, one per draft layer spread over 1..N-3, the middle one for 1)")
    p.add_argument("--draft-vocab", type=int, default=None, help="a reduced draft vocabulary Vd with its own lm_head "
                   "(only vLLM loads it; default: the target's vocabulary through its own lm_head)")
    p.add_argument("--objective", default="sft", choices=("sft", "opd", "length"),
                   help="sft: cross-entropy on the data's tokens (default); opd: AdaFlash's on-policy distillation "
                        "(the head drafts its blocks, the target scores them along the drafted prefix, reverse KL "
                        "per slot); length: AdaFlash's adaptive length head on the frozen --init-from head "
                        "(docs/methods.md#adaflash)")
    p.add_argument("--init-from", default=None, metavar="HEAD",
                   help="start from this DFlash head (a folder or a shipped head's name): its weights, layers, "
                        "block size, MASK token and taps, with a new optimizer and schedule")

    p = tsub.add_parser("dspark", help="train a DSpark head (DFlash's backbone with the anchor as first prediction, "
                        "a Markov head and a confidence head; docs/methods.md#dspark)")
    _common(p)
    p.set_defaults(run=run_dspark)
    p.add_argument("--backbone", default=None, metavar="HEAD", help="start the backbone from this DFlash head (a folder "
                   "or a shipped head's name): its weights, layers, block size, MASK token and taps")
    p.add_argument("--backbone-mode", default="paper", choices=("paper", "frozen"), help="paper: the anchor is the "
                   "first prediction, every weight trained from the backbone (DSpark's); frozen: the DFlash backbone "
                   "kept as it drafts (slots 1..B-1), only the Markov and confidence heads trained (needs --backbone)")
    p.add_argument("--markov", default="vanilla", choices=("vanilla", "gated", "rnn"), help="the Markov head's variant")
    p.add_argument("--markov-rank", type=int, default=64, help="its rank r (default 64; the paper's 256)")
    p.add_argument("--layers", type=int, default=1, help="draft layers without --backbone (default 1)")
    p.add_argument("--block-size", type=int, default=8, help="gamma: the anchor and gamma-1 masked slots, every one "
                   "a prediction (default 8; --backbone: the backbone's)")
    p.add_argument("--anchors", type=int, default=32, help="random anchor blocks per sequence and step (default 32)")
    p.add_argument("--gamma", type=float, default=7.0, help="slot j's TV weight is exp(-j/gamma) (default 7)")
    p.add_argument("--mask-token", type=int, default=None, help="the MASK token id without --backbone")
    p.add_argument("--target-layers", type=_ids, default=None, metavar="IDS", help="taps without --backbone "
                   "(DFlash's convention)")
    p.set_defaults(draft_vocab=None)

    p = tsub.add_parser("mtp", help="train a multi-token-prediction head (DeepSeek-V3's MTP module over the target's "
                        "last hidden state, one module reused for every draft step; --drafter mtp:DIR)")
    _common(p)
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps, the module fed its own hidden "
                   "(default 3)")
    p.add_argument("--decay", type=float, default=0.6, help="loss weight of unrolled step k is decay**k (default 0.6, "
                   "FastMTP's)")
    p.add_argument("--draft-vocab", type=int, default=None, help="train the loss over the target's lm_head rows of "
                   "the Vd most frequent labels only (a CPU saving; the head still reads out over the whole "
                   "vocabulary; default: all)")
    from . import dfly

    p = tsub.add_parser("dfly", help="train DFly's per-layer feature mix and predecessor correction on a frozen "
                        "DFlash head (--drafter dfly:HEAD; docs/methods.md#angelspec--dfly-and-mtp)")
    dfly.add_arguments(p)
    p.set_defaults(run=dfly.run)
    from . import dartree, lilicorr

    p = tsub.add_parser("dartree", help="train DARTree's correction head on a frozen DFlash head "
                        "(--refiner dartree; docs/block-drafters.md)")
    dartree.add_arguments(p)
    p.set_defaults(run=dartree.run)
    p = tsub.add_parser("lilicorr", help="fit LiLiCorr's pairwise correlator on the target's regenerated text "
                        "(--refiner lilicorr; docs/block-drafters.md)")
    lilicorr.add_arguments(p)
    p.set_defaults(run=lilicorr.run)
    from . import xpress

    p = tsub.add_parser("xpress", help="train xPress's causal refiner head on a frozen DFlash head "
                        "(--refiner xpress[:P]; docs/methods.md#xpress)")
    xpress.add_arguments(p)
    p.set_defaults(run=xpress.run)
    from . import matryoshka

    p = tsub.add_parser("matryoshka", help="train a Matryoshka suite of nested models from scratch on code "
                        "(--drafter matryoshka[:K]; docs/methods.md#matryoshka), or with --independent its baselines")
    matryoshka.add_arguments(p)
    p.set_defaults(run=matryoshka.run)


def run_dspark(args) -> int:
    """`outrider train dspark`: the one loop (train/loop.py) with DSpark's options."""
    from .loop import TrainOptions, train

    keys = ("target", "data", "out", "steps", "tokens", "seq_len", "batch_size", "lr", "warmup_steps", "clip",
            "draft_vocab", "vocab_tokens", "seed", "resume", "regenerate", "max_response_tokens", "checkpoint_every",
            "threads", "device", "target_dtype", "precision", "snapshot_every", "regenerate_batch", "time_budget",
            "length_group", "code_roots", "responses", "regenerate_only", "layers", "block_size", "anchors", "gamma",
            "mask_token", "target_layers", "markov", "markov_rank", "backbone", "backbone_mode")
    train(TrainOptions(**{k: getattr(args, k) for k in keys}, head="dspark", progress=not args.no_progress,
                       command=["outrider"] + sys.argv[1:]))
    return 0

def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _common(p) -> None:
    """The arguments every head's training shares."""
    p.add_argument("--target", required=True, help="catalog name or model folder of the target")
    p.add_argument("--data", required=True,
                   help=f"comma-separated sources: {', '.join(SOURCES)} (humaneval is the bench workload: "
                        "contaminated for it)")
    p.add_argument("--code-root", action="append", default=None, metavar="DIR", dest="code_roots",
                   help="a folder of .py files the code sources read instead of this Python's standard library "
                        "(repeatable: your own project, installed packages)")
    p.add_argument("--out", required=True, help="output folder (new or empty; or the run to --resume)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1000 unless --tokens)")
    p.add_argument("--tokens", type=int, default=None, help="stop after this many training tokens instead")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="train for about this many seconds instead: the step count is planned from the speed "
                        "of the first steps (loading and --regenerate not counted); train_info.json records "
                        "the --steps that reproduce the run")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per global batch (default 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default 5%% of the steps)")
    p.add_argument("--clip", type=float, default=0.5, help="gradient-norm clip (default 0.5)")
    p.add_argument("--vocab-tokens", type=int, default=2_000_000,
                   help="training labels counted to choose the draft vocabulary (default 2,000,000)")
    p.add_argument("--length-group", type=int, default=8, metavar="G",
                   help="sort G batches' examples by length together so each batch pads less (1: stream order; "
                        "default 8)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order (default 0)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--regenerate", action="store_true",
                   help="the target writes the responses of chat/prompt items itself (greedy)")
    p.add_argument("--responses", default=None, metavar="FILE",
                   help="with --regenerate: responses this target already wrote (another run's OUT/regenerated.jsonl); "
                        "only the items it lacks are generated")
    p.add_argument("--regenerate-only", action="store_true",
                   help="with --regenerate: write OUT/regenerated.jsonl and stop (no head); a later run takes it as "
                        "--responses, so its --time-budget counts training alone")
    p.add_argument("--max-response-tokens", type=int, default=256, help="per regenerated response (default 256)")
    p.add_argument("--regenerate-batch", type=int, default=None,
                   help="prompts the target answers together (default 16 on a CPU, 512 on a GPU)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N or mps")
    p.add_argument("--target-dtype", default="float32",
                   help="float32 or bfloat16: the frozen target's weights (bfloat16: about 2x faster on CPUs with AMX; default float32)")
    p.add_argument("--precision", default="fp32",
                   help="fp32 or bf16: the head's arithmetic: fp32, or bf16 autocast with fp32 weights (default fp32)")
    p.add_argument("--snapshot-every", type=int, default=None,
                   help="also write the head to OUT/snapshots/step-N every N steps (tau against training tokens)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args) -> int:
    from .loop import TrainOptions, train

    keys = ("target", "data", "out", "steps", "tokens", "seq_len", "batch_size", "lr", "warmup_steps", "clip",
            "draft_vocab", "vocab_tokens", "seed", "resume", "regenerate",
            "max_response_tokens", "checkpoint_every", "threads", "device", "target_dtype", "precision",
            "snapshot_every", "regenerate_batch", "time_budget", "length_group", "code_roots", "responses",
            "regenerate_only")
    own = {"eagle3": ("ttt_steps", "decay", "init_from"), "mtp": ("ttt_steps", "decay"),
           "dflash": ("layers", "block_size", "anchors", "gamma", "mask_token", "target_layers", "objective",
                      "init_from")}[args.train_command]
    options = TrainOptions(**{k: getattr(args, k) for k in keys + own}, head=args.train_command,
                           progress=not args.no_progress, command=["outrider"] + sys.argv[1:])
    train(options)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a torchrun process whose run is written and whose group is destroyed: the interpreter's
        # teardown could still abort in gloo's threads ("terminate called without an active
        # exception", 1 run in 6 on 2 loaded cores: a failed exit for a finished run), so leave
        # without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
