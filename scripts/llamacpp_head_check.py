"""Run our learned heads, exported as GGUF, inside llama.cpp's llama-server, and set its acceptance beside ours.

    .venv/bin/python scripts/llamacpp_head_check.py [--kinds eagle3,dflash] [--max-new-tokens 64]
        [--prompts N] [--json out.json]

For each kind: the shipped SmolLM2 head is exported with heads/gguf_export.py (into a temporary
folder), llama-server (scripts/build_llama_server.sh's binary, or $OUTRIDER_LLAMA_SERVER) is started
on the target's original.gguf with `-md HEAD.gguf --spec-type draft-KIND --spec-draft-n-max D
--spec-draft-n-min 0 --spec-draft-p-min 0` (a fixed chain of D drafts, as ours: EAGLE-3 D = 4,
the golden's depth; DFlash D = block_size - 1), one slot, one thread; each golden prompt
(heads/eagle3/golden.py's PROMPTS under the chat template) goes as its token ids to /completion
(greedy, n_predict = --max-new-tokens). Ours: `LLM(target, drafter=KIND:NAME, tree=chain,
controller=fixed:D)` on the same ids, one thread, the target in dtype gguf-i8 (the GGUF's own
Q4_1/Q8_0 blocks with int8 activations, as llama.cpp's CPU kernels quantize them to Q8_1): its greedy
text then equals llama.cpp's token for token (with float activations, `--dtype gguf`, this 135M
model's greedy texts part from llama.cpp's within a few tokens on most prompts, so the two
acceptances would be measured on different texts). Printed per prompt and in total: whether the greedy texts
agree, drafted and accepted tokens (llama.cpp: its timings' draft_n / draft_n_accepted), the
acceptance rate and the mean accepted length per round (llama.cpp: its log's "mean len"), and two
standard errors of the difference of the two rates (binomial), the noise the comparison allows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = "smollm2-135m-instruct"
LOG_LINE = re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([0-9.]+)")


def export(kind: str, folder: Path, dtype: str | None = None) -> Path:
    from outrider.heads.catalog import resolve_head
    from outrider.heads.gguf_export import export_gguf

    return export_gguf(kind, resolve_head(TARGET, kind), folder / f"{kind}.gguf", TARGET, dtype=dtype)


def depth_of(kind: str) -> int:
    if kind == "eagle3":
        return 4
    from outrider.heads.catalog import resolve_head
    from outrider.heads.dflash.format import read_config

    return read_config(resolve_head(TARGET, "dflash")).block_size - 1


def run_llama(kind: str, draft: Path, prompts: list[list[int]], max_new: int, depth: int, log: Path) -> list[dict]:
    from outrider.bench.llama_server import _LOCAL, find_binary, free_port
    from outrider.catalog.resolve import resolve_model

    port = free_port()
    args = [str(find_binary()), "-m", str(resolve_model(TARGET) / "original.gguf"), "-md", str(draft),
            "--spec-type", f"draft-{kind}", "--spec-draft-n-max", str(depth), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0", "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1",
            "-td", "1", "-tbd", "1", "-c", "4096", "-np", "1", "--no-webui"]
    print("$ " + " ".join(args), file=sys.stderr)
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not start; its log: {log}")
            try:
                with _LOCAL.open(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        rows = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "cache_prompt": False,
                    "return_tokens": True, "stream": False}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with _LOCAL.open(request, timeout=1800) as answer:
                reply = json.loads(answer.read())
            timings = reply.get("timings") or {}
            rows.append({"tokens": reply.get("tokens", []), "drafted": timings.get("draft_n", 0),
                         "accepted": timings.get("draft_n_accepted", 0)})
    finally:
        proc.terminate()
        proc.wait(30)
    lines = LOG_LINE.findall(log.read_text(errors="replace"))
    for row, (accepted, drafted, mean_len) in zip(rows, lines[-len(rows):] if lines else []):
        row["mean_len"] = float(mean_len)
        assert int(accepted) == row["accepted"] and int(drafted) == row["drafted"], (row, accepted, drafted)
    return rows


def run_ours(kind: str, prompts_text: list[str], max_new: int, depth: int,
             dtype: str) -> tuple[list[list[int]], list[dict]]:
    import torch

    from outrider.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(TARGET, drafter=f"{kind}:{TARGET}", tree="chain", controller=f"fixed:{depth}", dtype=dtype)
    ids, rows = [], []
    for prompt in prompts_text:
        ids.append(llm.encode(prompt, True))
        out = llm.generate(prompt, max_new, chat=True)
        s = out.stats
        accepted = sum(s.get("accepted_by_position", []))
        rows.append({"tokens": list(out.token_ids), "drafted": s.get("drafted", 0), "accepted": accepted,
                     "mean_len": 1 + accepted / max(s.get("rounds", 1), 1)})
    return ids, rows


def rate(rows: list[dict]) -> tuple[int, int, float]:
    a, d = sum(r["accepted"] for r in rows), sum(r["drafted"] for r in rows)
    return a, d, a / max(d, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="eagle3,dflash")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=5, help="how many of the golden prompts (default all 5)")
    parser.add_argument("--dtype", default="gguf-i8", help="our target's dtype (default gguf-i8: module docstring)")
    parser.add_argument("--head-dtype", default=None, help="the GGUF head's matrices: bf16, fp16 or fp32 (default: "
                        "as shipped; ggml's BF16 matmul rounds activations to bf16, ours keeps them float32)")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from outrider.heads.golden import PROMPTS

    prompts = list(PROMPTS[: args.prompts])
    report = {"target": TARGET, "max_new_tokens": args.max_new_tokens, "prompts": prompts, "dtype": args.dtype,
              "head_dtype": args.head_dtype,
              "kinds": {}}
    with tempfile.TemporaryDirectory(prefix="outrider-gguf-heads-") as tmp:
        for kind in args.kinds.split(","):
            depth = depth_of(kind)
            draft = export(kind, Path(tmp), args.head_dtype)
            ids, ours = run_ours(kind, prompts, args.max_new_tokens, depth, args.dtype)
            theirs = run_llama(kind, draft, ids, args.max_new_tokens, depth, Path(tmp) / f"{kind}.log")
            print(f"\n{kind}: chain of {depth} drafts, {len(prompts)} prompts x {args.max_new_tokens} tokens")
            print(f"{'prompt':>6} {'same text':>9} {'llama.cpp acc/drafted':>22} {'mean len':>8} "
                  f"{'ours acc/drafted':>17} {'mean len':>8}")
            for i, (t, o) in enumerate(zip(theirs, ours)):
                same = t["tokens"] == o["tokens"]
                their_len = t.get("mean_len", float("nan"))
                print(f"{i:>6} {str(same):>9} {t['accepted']:>10}/{t['drafted']:<11} {their_len:>8.2f} "
                      f"{o['accepted']:>8}/{o['drafted']:<8} {o['mean_len']:>8.2f}")
            (ta, td, tr), (oa, od, orate) = rate(theirs), rate(ours)
            noise = 2 * math.sqrt(tr * (1 - tr) / max(td, 1) + orate * (1 - orate) / max(od, 1))
            print(f" total {sum(t['tokens'] == o['tokens'] for t, o in zip(theirs, ours))}/{len(ours)} same; "
                  f"llama.cpp {ta}/{td} = {tr:.3f}, ours {oa}/{od} = {orate:.3f}; difference {tr - orate:+.3f}, "
                  f"two standard errors {noise:.3f}: {'within' if abs(tr - orate) <= noise else 'OUTSIDE'} noise")
            report["kinds"][kind] = {"depth": depth, "prompt_ids": ids, "llama_cpp": theirs, "ours": ours,
                                     "llama_cpp_rate": tr, "ours_rate": orate, "two_se": noise}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
