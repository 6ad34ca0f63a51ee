"""Responses written by the target itself (`--regenerate`), so the head learns the target's own
distribution rather than someone else's answers (SpecForge and speculators regenerate the same way).

Greedy, `batch` prompts at a time (`--regenerate-batch`) through `greedy_batch`: a lean loop
for a static batch (every prompt prefilled in one forward, then one forward per token for all,
the next tokens and end-of-sequence flags kept on the device) that commits what
engine.generate.generate_ids commits (tested against it); the serving engine's scheduling, chunked
prefill and per-sequence bookkeeping cost too much per step for thousands of prompts on a GPU.
Each response is appended as token ids to a JSON-lines cache (OUT/regenerated.jsonl: {"id",
"ids"}) and read back on --resume, so a resumed run trains on exactly the responses the
interrupted one generated. `--responses FILE` (another run's regenerated.jsonl, by the same
target) supplies responses already written: they are copied into this run's cache, and only the
items FILE lacks are generated (a sweep regenerates once; a time budget then counts training alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.batch import ForwardBatch, pack
from .data import Encoder, Item


@torch.inference_mode()
def greedy_batch(target, prompts: list[list[int]], max_new: list[int], eos_ids: set[int]) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids), at most max_new[i] tokens each, ending with
    the first end-of-sequence token (kept, as generate_ids keeps it). One slot per prompt."""
    device = target.device
    B, steps = len(prompts), max(max_new)
    lens = [len(p) for p in prompts]
    cache = target.new_cache(B, max(lens) + steps)  # every slot runs all the steps
    first = target.forward(pack(list(range(B)), [0] * B, [torch.tensor(p) for p in prompts], logits="last",
                                scratch_row=cache.scratch_row, device=device), cache)
    token = first.logits[:, -1].argmax(-1)  # [B] the first new token of each prompt
    out = torch.empty(B, steps, dtype=torch.long, device=device)  # [B, steps]
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # [B] an end-of-sequence token is out
    length = torch.tensor(lens, device=device)  # [B] the cache row of the next token
    cols = torch.arange(max(lens) + steps, device=device)  # [L]
    slots = list(range(B))
    for step in range(steps):
        out[:, step] = token
        done |= torch.isin(token, eos)
        if step + 1 == steps or (step % 16 == 15 and bool(done.all())):
            break
        kv_len = max(lens) + step + 1
        batch = ForwardBatch(slot_ids=slots, tokens=token.view(B, 1), positions=length.view(B, 1),
                             rows=length.view(B, 1), attn_mask=(cols[:kv_len] <= length.view(B, 1)).view(B, 1, 1, kv_len),
                             kv_len=kv_len, logits_rows=None, span_size=B)
        token = target.forward(batch, cache).logits[:, -1].argmax(-1)
        length += 1
    rows = out[:, : step + 1].tolist()
    result = []
    for row, limit in zip(rows, max_new):
        row = row[:limit]
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        result.append(row if end is None else row[: end + 1])
    return result


def read_responses(path: Path) -> dict[str, list[int]]:
    """A regenerated.jsonl: {item id: response token ids}; a one-line error for a file that is not one."""
    known = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--responses {path}: cannot be read ({err})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item_id, ids = row["id"], row["ids"]
            if not isinstance(item_id, str) or not all(isinstance(t, int) for t in ids):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path}:{number}: not a response line {{\"id\": str, \"ids\": [int, ...]}}; give "
                              "a run's regenerated.jsonl") from None
        known[item_id] = ids
    return known


class Regenerator:
    def __init__(self, target, encoder: Encoder, eos_ids: set[int], max_tokens: int, cache: Path | None,
                 write: bool = True, log=None, batch: int = 16, responses: Path | None = None):
        self.target, self.encoder, self.eos_ids = target, encoder, eos_ids
        self.max_tokens, self.cache, self.write, self.log, self.batch = max_tokens, cache, write, log, batch
        self.known: dict[str, list[int]] = read_responses(cache) if cache is not None and cache.is_file() else {}
        if responses is not None:
            vocab = target.config.vocab_size
            given = {k: v for k, v in read_responses(responses).items() if k not in self.known}
            bad = next((k for k, v in given.items() if any(not 0 <= t < vocab for t in v)), None)
            if bad is not None:
                raise ConfigError(f"--responses {responses}: item {bad} holds token ids outside the target's "
                                  f"vocabulary ({vocab}); give a file this target wrote")
            self.known.update(given)
            if cache is not None and write and given:
                with open(cache, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps({"id": k, "ids": v}) + "\n" for k, v in given.items())
        self.generated = 0  # responses generated by this process (not read from the cache)
        self.too_long = 0  # prompts that leave no room for a response in seq_len

    def __call__(self, items: list[Item]) -> list[list[int]]:
        """Response token ids for each item (empty when its prompt leaves no room in seq_len)."""
        prompts: dict[str, tuple[list[int], int]] = {}
        for item in items:
            if item.id in self.known:
                continue
            prompt = self.encoder.prompt_ids(item)
            room = min(self.max_tokens, self.encoder.seq_len - len(prompt))
            if room < 1 or len(prompt) + room > self.target.config.max_position_embeddings:
                self.known[item.id] = []
                self.too_long += 1
                continue
            prompts[item.id] = (prompt, room)
        ids = sorted(prompts, key=lambda i: len(prompts[i][0]))  # similar lengths batch together
        for start in range(0, len(ids), self.batch):
            part = ids[start:start + self.batch]
            outputs = greedy_batch(self.target, [prompts[i][0] for i in part], [prompts[i][1] for i in part],
                                   self.eos_ids)
            rows = [{"id": i, "ids": o} for i, o in zip(part, outputs)]
            for row in rows:
                self.known[row["id"]] = row["ids"]
            self.generated += len(rows)
            if self.cache is not None and self.write:
                with open(self.cache, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
            if self.log:
                self.log(f"regenerated {len(rows)} responses ({self.generated} so far, "
                         f"{sum(len(r['ids']) for r in rows)} tokens in this batch)")
        return [self.known[i.id] for i in items]
