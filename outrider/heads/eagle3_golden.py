"""Golden tau: the acceptance a head gets here on a fixed prompt set, recorded at export and re-measured.

`outrider export` measures the exported folder itself with our own speculative generation
(`LLM(target, drafter="eagle3:DIR")`: greedy, a chain of `depth` drafts per round, one torch
thread so the float arithmetic does not depend on how many cores were free) and writes
`outrider_golden.json` beside the weights; `outrider check-head` measures again and compares.

    {"format": 2, "target": {"name": ..., "path": ..., "architectures": [...]},
     "settings": {"temperature": 0.0, "tree": "chain", "depth": 4, "max_new_tokens": 32,
                  "chat": true, "device": "cpu", "dtype": "float32", "threads": 1, "linear": "linear"},
     "prompts": [...], "prompt_ids": [[...], ...],
     "results": [{"rounds": 9, "committed": 32, "output_ids": [...]}, ...],
     "rounds": 45, "committed": 160, "tau": 3.56,
     "measured_on": {"machine": "x86_64", "cpu": "...", "torch": "2.13.0", "device": "cpu"},
     "tolerance": {...}, "computes": {...}}                      # format 2: heads/golden_compute.py

tau is committed tokens per round over all prompts, bonus included (engine/stats.py). Comparison: on
the same machine (same `measured_on`) with the same settings the rounds and committed tokens
of every prompt must be equal; elsewhere the arithmetic may round differently and flip a near
tie, so tau may move: it must stay within 5% (float32) or 10% (bf16, fp16) of the golden.

Since issue 43 (format 2) the record also holds what the head computes (`"computes"`,
heads/golden_compute.py): along each prompt's text (prompt + the target's own greedy output, the
`output_ids` above, as the chain is lossless) at every generated position p (the anchors), the
chain of `depth` slots a draft there takes, fed the text's tokens instead of the head's drafts:
slot 1 is the head's row over the target's feature of position p-2 and token x_{p-1}, predicting
x_p; slot k predicts x_{p+k-1}, fed x_{p+k-2} and slot k-1's output hidden (`chain_logits`).
Those inputs depend on the prompts and the target only, so a changed weight shows as changed
argmaxes or logits even where tau does not move. The file is written one top-level field a line
(`write_golden`).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import overriding
from .golden_compute import measured_part, recorded, top_of

GOLDEN = "outrider_golden.json"
PROMPTS = (
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "import json\n\ndef load_config(path):",
    "Explain what a hash map is in two sentences.",
)
TOLERANCE = {"float32": 0.05, "other": 0.10}  # relative, between machines
TOLERANCE_NOTE = ("exact on the same machine, device and dtype; elsewhere within 5% of the golden tau for "
                  "float32, 10% for bfloat16/float16")


@dataclass(frozen=True)
class GoldenSettings:
    depth: int = 4  # drafts per round (the chain's length): the speculators export's speculative_tokens
    max_new_tokens: int = 32
    device: str = "cpu"
    dtype: str = "float32"  # the target's (the head runs in it)
    chat: bool | None = None  # None: the chat template when the tokenizer has one


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")  # pick the CPU kernels


def machine(device: str) -> dict:
    """What the float arithmetic depends on: the CPU (model and the vector units that choose
    torch's kernels) or GPU, torch, the device."""
    cpu, flags = platform.processor(), []
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
        present = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
        flags = [f for f in ISA_FLAGS if f in present]
    except OSError:
        pass
    out = {"machine": platform.machine(), "cpu": cpu, "cpu_flags": flags, "torch": torch.__version__,
           "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def measure(head_dir: str | Path, target: str | Path, settings: GoldenSettings = GoldenSettings(),
            prompts=PROMPTS) -> dict:
    """Greedy speculative generation of each prompt (one at a time) with the head in `head_dir`
    drafting for `target`; the record's measured part (see the module docstring)."""
    from ..llm import LLM
    from .eagle3_format import load_eagle3

    threads = torch.get_num_threads()
    # The CPU's matrix-product path is otherwise chosen by timing (kernels/cpu_linear.py), which a
    # busy machine can tip between near-equal paths: pin plain F.linear so the golden's arithmetic
    # (and the exact same-machine comparison) never depends on load.
    with overriding(linear="linear", threads=1):
        try:
            llm = LLM(str(target), drafter=f"eagle3:{head_dir}", tree="chain",
                      controller=f"fixed:{settings.depth}", device=settings.device, dtype=settings.dtype)
            chat = settings.chat if settings.chat is not None else bool(getattr(llm.tokenizer, "chat_template", None))
            head = load_eagle3(head_dir, llm.target)
            results, prompt_ids, anchors, tops = [], [], [], []
            for prompt in prompts:
                ids = llm.encode(prompt, chat)
                prompt_ids.append(ids)
                out = llm.generate(prompt, settings.max_new_tokens, chat=chat)
                results.append({"rounds": out.stats["rounds"], "committed": out.stats["committed"],
                                "output_ids": list(out.token_ids)})
                text = ids + list(out.token_ids)
                rows = list(range(max(len(ids) - 2, 0), len(text) - settings.depth))  # each chain's last committed row
                anchors.append([r + 2 for r in rows])  # the position slot 1 predicts
                tops.append(top_of(chain_logits(head, llm.target, text, rows, settings.depth)))
        finally:
            torch.set_num_threads(threads)
    rounds, committed = sum(r["rounds"] for r in results), sum(r["committed"] for r in results)
    resolved = {"temperature": 0.0, "tree": "chain", **asdict(settings), "chat": chat, "threads": 1, "linear": "linear"}
    return {"settings": resolved, "prompts": list(prompts), "prompt_ids": prompt_ids, "results": results,
            "rounds": rounds, "committed": committed, "tau": committed / max(rounds, 1),
            "measured_on": machine(settings.device),
            "computes": measured_part("eagle3 chains fed the text at every generated position, slots 1..depth",
                                      settings.depth, anchors, tops)}


@torch.inference_mode()
def chain_logits(head, target, text: list[int], rows: list[int], depth: int) -> torch.Tensor:
    """Logits [len(rows), depth, V] over the target vocabulary of the head's chain after each
    committed row r in `rows` (r + depth < len(text)), fed the text's tokens: slot 1 is row r
    ((feature r, token x_{r+1}) predicting x_{r+2}), slot k the node at position r + k - 1
    (token x_{r+k}, input slot k-1's output hidden) as drafters/eagle3.py's chain feeds it."""
    from ..models.batch import causal_batch, pack

    n = len(text)
    out = torch.zeros(len(rows), depth, head.config.vocab_size)
    if not rows:
        return out
    tokens = torch.tensor(text, device=target.device)
    taps = head.config.taps(target.config.num_layers)
    cache = target.new_cache(1, n)
    hidden = target.forward(causal_batch([tokens], hidden_layers=tuple(sorted(set(taps))),
                                         scratch_row=cache.scratch_row, device=target.device), cache).hidden
    features = torch.stack([hidden[t][0] for t in taps], dim=1)[: n - 1]  # [n-1, 3, Ht]
    own = head.new_cache(1, n + depth)
    batch = pack([0], [0], [tokens[1:]], scratch_row=own.scratch_row, device=head.device)
    logits, outs = head.forward(batch, own, head.fuse(features).unsqueeze(0))  # [1, n-1, Vd], [1, n-1, H]
    for i in reversed(range(len(rows))):  # last first: a chain overwrites only rows past its own r
        r = rows[i]
        step, h = logits[0, r], outs[0, r]
        out[i, 0] = head.target_logits(step).cpu()
        for k in range(2, depth + 1):
            d = k - 1  # the node's index in the chain (node 0: row r)
            feed = pack([0], [r], [tokens[r + k: r + k + 1]], [torch.arange(-1, d)], scratch_row=own.scratch_row,
                        device=head.device, first_nodes=[d])
            step, h = head.forward(feed, own, h.view(1, 1, -1))
            step, h = step[0, 0], h[0, 0]
            out[i, d] = head.target_logits(step).cpu()
    return out


def record(measured: dict, target_name: str, target_path: Path, architectures: list[str]) -> dict:
    computes = recorded(measured["computes"], measured["settings"]["dtype"])
    rest = {k: v for k, v in measured.items() if k != "computes"}
    return {"format": 2, "target": {"name": target_name, "path": str(target_path), "architectures": architectures},
            **rest, "tolerance": {**TOLERANCE, "note": TOLERANCE_NOTE}, "computes": computes}


def write_golden(folder: Path, golden: dict) -> None:
    """One top-level field a line; "computes" one field a line and one prompt's list a line."""
    def field(key, value, indent=" "):
        if key == "computes":
            inner = ",\n".join(field(k, v, "  ") for k, v in value.items())
            return f'{indent}"computes": {{\n{inner}\n{indent}}}'
        if key in ("argmax", "logits", "anchors", "prompt_ids"):
            rows = ",\n".join(indent + "  " + json.dumps(row) for row in value)
            return f"{indent}{json.dumps(key)}: [\n{rows}\n{indent}]"
        return f"{indent}{json.dumps(key)}: {json.dumps(value)}"

    body = ",\n".join(field(k, v) for k, v in golden.items())
    (Path(folder) / GOLDEN).write_text("{\n" + body + "\n}\n")


def read_golden(folder: Path) -> dict | None:
    """The folder's golden record, None when it has none; ValueError when it is unreadable."""
    path = Path(folder) / GOLDEN
    if not path.is_file():
        return None
    golden = json.loads(path.read_text())
    for key in ("settings", "prompts", "prompt_ids", "results", "tau", "measured_on", "target"):
        if key not in golden:
            raise ValueError(f"{GOLDEN} lacks '{key}'")
    return golden


def settings_of(golden: dict, device: str | None = None) -> GoldenSettings:
    """The settings to re-measure with: the golden's, on `device` if given (else the golden's
    device when present here, else the CPU)."""
    s = golden["settings"]
    if device is None:
        device = s["device"] if not s["device"].startswith("cuda") or torch.cuda.is_available() else "cpu"
    return GoldenSettings(depth=int(s["depth"]), max_new_tokens=int(s["max_new_tokens"]), device=device,
                          dtype=str(s["dtype"]), chat=bool(s["chat"]))


def compare(golden: dict, measured: dict) -> tuple[bool, str]:
    """(ok, one line): is the re-measured tau the golden one (exact here, within tolerance elsewhere)?"""
    name = golden["target"].get("name")
    if measured["prompt_ids"] != golden["prompt_ids"]:
        return False, (f"the target encodes the golden prompts differently from the one the head was exported "
                       f"with ({name}); pass that target as --target")
    tau, gold = measured["tau"], golden["tau"]
    same = measured["measured_on"] == golden["measured_on"] and measured["settings"] == golden["settings"]
    if same:
        counts = lambda rs: [(r["rounds"], r["committed"]) for r in rs]  # noqa: E731
        if counts(measured["results"]) == counts(golden["results"]):
            return True, f"tau {tau:.3f} == golden {gold:.3f} (exact: same machine, device, dtype)"
        return False, (f"tau {tau:.3f} != golden {gold:.3f} on the same machine, device and dtype: the head or "
                       f"the target changed since export; check --target (exported for {name}) or re-export")
    limit = TOLERANCE["float32"] if golden["settings"]["dtype"] == "float32" else TOLERANCE["other"]
    off = abs(tau - gold) / max(gold, 1e-9)
    where = "another machine or device" if measured["measured_on"] != golden["measured_on"] else "other settings"
    if off <= limit:
        return True, f"tau {tau:.3f} vs golden {gold:.3f} ({where}: {off:.1%} <= {limit:.0%})"
    return False, (f"tau {tau:.3f} vs golden {gold:.3f} differs by {off:.1%} ({where}, allowed {limit:.0%}): the head "
                   f"drafts worse here; check --target (exported for {name}) and the head's weights, or re-export")
