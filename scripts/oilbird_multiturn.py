"""Write a multi-turn, agent-like tool-call workload (jsonl) from BFCL prompts: calls that repeat with new values.

Each prompt is one BFCL v4 simple_python entry whose required parameters are all scalars (integer,
number, string, boolean). The conversation has the toolcall workload's system message (the
function's JSON schema and the one-JSON-call instruction, bench/workloads.py), then TURNS earlier
turns, each a user request naming new values for the required parameters and the assistant's call
with exactly those values, then the entry's own BFCL question as the last user turn. So the
answer repeats the earlier calls' shape with values the pool has never seen: fresh numbers,
fresh ids. Values are derived from sha256 of the entry id and the turn (the same file on every
machine).

    .venv/bin/python scripts/oilbird_multiturn.py OUT.jsonl [--prompts 8] [--turns 3]
    outrider bench --methods METHODS.toml --workload jsonl:OUT.jsonl ...

Used for Oilbird's measurement (docs/methods.md#oilbird).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from outrider.bench import datasets
from outrider.bench.workloads import data_file, seeded_order, toolcall_messages

SCALARS = ("integer", "number", "float", "string", "boolean")
WORDS = ("Springfield", "Oslo", "Nairobi", "Lima", "Kyoto", "Tartu", "Quito", "Perth", "Bergen", "Leeds")


def draw(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def value(name: str, schema: dict, key: str):
    """A fresh value of the parameter's type."""
    n = draw(key)
    if schema.get("enum"):
        return schema["enum"][n % len(schema["enum"])]
    kind = schema.get("type")
    if kind == "integer":
        return 2 + n % 997
    if kind in ("number", "float"):
        return round(1 + (n % 99991) / 100, 2)
    if kind == "boolean":
        return bool(n % 2)
    if "id" in name.lower() or "code" in name.lower():
        return f"{n % 16**8:08x}"
    return f"{WORDS[n % len(WORDS)]} {n % 89 + 10}"


def usable(entry: dict) -> bool:
    (function,) = entry["function"] if len(entry["function"]) == 1 else (None,)
    if function is None:
        return False
    properties = function["parameters"].get("properties", {})
    required = function["parameters"].get("required", [])
    return bool(required) and all(properties.get(p, {}).get("type") in SCALARS for p in required)


def conversation(entry: dict, turns: int) -> list[dict]:
    function = entry["function"][0]
    properties = function["parameters"]["properties"]
    system, *question = toolcall_messages(entry)
    messages = [system]
    for turn in range(turns):
        arguments = {p: value(p, properties[p], f"{entry['id']}:{turn}:{p}") for p in function["parameters"]["required"]}
        ask = ", ".join(f"{p} = {json.dumps(v)}" for p, v in arguments.items())
        messages.append({"role": "user", "content": f"Call {function['name']} with {ask}."})
        messages.append({"role": "assistant", "content": json.dumps({"name": function["name"], "arguments": arguments})})
    return messages + question


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path, _ = data_file("bfcl_simple_python", None)
    rows = [e for e in datasets.bfcl("bfcl_simple_python", path) if usable(e)]
    ordered = seeded_order([_Id(e) for e in rows], args.seed)[: args.prompts]
    with args.out.open("w", encoding="utf-8") as f:
        for item in ordered:
            entry = item.entry
            f.write(json.dumps({"id": f"multiturn-{entry['id']}", "messages": conversation(entry, args.turns)},
                               ensure_ascii=False) + "\n")
    print(f"wrote {len(ordered)} prompts to {args.out}", file=sys.stderr)
    return 0


class _Id:
    def __init__(self, entry: dict):
        self.entry, self.id = entry, entry["id"]


if __name__ == "__main__":
    sys.exit(main())
