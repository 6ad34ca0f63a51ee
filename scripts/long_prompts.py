"""A jsonl workload of long prompts from the running Python's standard library (no download): each
a module cut to `--tokens` tokens of the model's tokenizer, then a request to summarize it. For
decoding at long contexts (the K/V cache's cost: docs/benchmarks/2026-12-01-amd-epyc-zen5-avx512.md,
Against llama.cpp, "Long prompts, and the float16 K/V cache").

    .venv/bin/python scripts/long_prompts.py --out /tmp/long.jsonl            # 3 modules, 1,800 tokens
    .venv/bin/python scripts/long_prompts.py --out /tmp/long8k.jsonl --modules argparse.py --tokens 7900
    .venv/bin/outrider bench --preset llamacpp --dtype q4-i8 --kv-dtype float16 --workload jsonl:/tmp/long.jsonl
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

MODULES = ("textwrap.py", "fnmatch.py", "shlex.py")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer counts the tokens")
    ap.add_argument("--tokens", type=int, default=1800, help="at most this many tokens of each module")
    ap.add_argument("--modules", default=",".join(MODULES), help="standard-library files, comma-separated "
                    "(argparse.py holds ~25k SmolLM2 tokens: an 8k prompt)")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from outrider.catalog.resolve import resolve_model

    tok = Tokenizer.from_file(str(resolve_model(args.model) / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for name in args.modules.split(","):
        ids = tok.encode((stdlib / name).read_text()).ids[: args.tokens]
        content = (f"Here is a Python module:\n\n```python\n{tok.decode(ids)}\n```\n\n"
                   "Write a short summary of what it does, then list its public functions.")
        lines.append(json.dumps({"id": name, "messages": [{"role": "user", "content": content}]}))
        print(f"{name}: {len(ids)} tokens")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
