"""Measure a cost profile (costs.py) with the real engine on this machine.

    .venv/bin/outrider simulate --measure-profile profile.json --threads 1     # about a minute

Three measurements, one process, the model loaded once as `outrider serve` loads it:

1. a plain engine step (`EngineLoop.step`, scheduler and stopping rules included) with B
   sequences decoding, for each B of the grid: the median of `steps` timed steps after one
   untimed one;
2. the target's verify forward over B x W new tokens (control/batch_cost.measure_batch): a
   step W tokens wide costs the plain step plus fwd(B, W) - fwd(B, 1) (the drafter's own time
   is not in it: the suffix drafter's is a few percent, docs/benchmarks);
3. the first step of one request with a prompt of P tokens (its prefill and first round), less
   a plain one-sequence step: what prefilling P tokens adds.

The engine is built as `outrider serve --drafter suffix` builds its own (the suffix drafter and
`cost` controller, text streams decoded every step, 16 slots of 2048 rows), and the timed
requests carry `speculate=False`, as the load test's "off" requests do. Prompts are random token
ids (speed does not depend on which), `ignore_eos` keeps every sequence running.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

BATCHES = (1, 2, 4, 8, 16)
WIDTHS = (1, 2, 4, 6, 8)
PREFILL = (16, 64, 128, 256, 512)
SLOTS, MAX_LEN = 16, 2048  # the server's default --max-running and --max-model-len


def _engine(llm, max_running: int = SLOTS):
    """An engine built as `outrider serve` builds its own (server.py): drafter, text streams, slots."""
    from ...engine.loop import EngineLoop

    return EngineLoop(llm.target, llm.eos_ids, llm.speculator, decode=llm.decode, max_running=max_running,
                      max_len=MAX_LEN, chunk_size=512)


def _requests(n: int, prompt: int, new: int, vocab: int, seed: int):
    import torch

    from ...engine.request import Request

    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(10, vocab, (prompt,), generator=g).tolist(), new, ignore_eos=True,
                    speculate=False) for _ in range(n)]


def plain_step(llm, batch: int, steps: int = 8, prompt: int = 128) -> float:
    """Median seconds of one engine step with `batch` sequences decoding, nothing drafted."""
    engine = _engine(llm)
    for r in _requests(batch, prompt, steps + 4, llm.target.config.vocab_size, batch):
        engine.add(r)
    engine.step()  # admission, prefill and the first round: not a decode step's cost
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_step(llm, tokens: int, repeats: int = 3) -> float:
    """Median seconds of a one-request engine's first step: a `tokens`-token prefill and a round."""
    times = []
    for i in range(repeats):
        engine = _engine(llm)
        engine.add(_requests(1, tokens + 1, 2, llm.target.config.vocab_size, 100 + i)[0])
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_profile(model: str | None = None, threads: int | None = 1, log=print) -> dict:
    """A profile (costs.CostModel's JSON) measured now, with the machine and time it was measured on."""
    from ...control.batch_cost import measure_batch
    from ...llm import LLM

    llm = LLM(model, drafter="suffix", controller="cost", threads=threads)  # as `outrider serve --drafter suffix`
    log(f"measuring engine steps of {llm.name} at batches {list(BATCHES)}...")
    plain = [plain_step(llm, b) for b in BATCHES]
    log("measuring verify forwards at widths " + ", ".join(map(str, WIDTHS)) + "...")
    forward = measure_batch(llm.target, BATCHES, WIDTHS)
    seconds = [[p + forward.cost(b, w) - forward.cost(b, 1) for w in WIDTHS] for b, p in zip(BATCHES, plain)]
    log("measuring prefill...")
    one = plain[0]
    prefill = [max(0.0, prefill_step(llm, n) - one) for n in PREFILL]
    return {"batches": list(BATCHES), "widths": list(WIDTHS), "seconds": seconds,
            "prefill_tokens": list(PREFILL), "prefill_seconds": prefill,
            "model": llm.name, "threads": threads, "machine": _machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load_average": list(os.getloadavg())}


def _machine() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
