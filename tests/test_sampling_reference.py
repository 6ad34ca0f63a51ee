"""`warp_probs` against an independent reference: transformers' logits processors.

The reference applies TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper in the order
transformers' `generate` does (temperature, top-k, top-p) and takes the softmax of what is left.

The two top-p rules are the same rule written from opposite ends. Ours sorts descending and keeps a
token when the mass strictly before it is < top_p; transformers sorts ascending and removes a
token when the cumulative mass from the bottom up to it is <= 1 - top_p. The mass from the bottom
up to a token is 1 - (mass before it), so in exact arithmetic both keep a token iff mass before
it < top_p. They differ only through rounding, and only when top_p equals the mass of the top m
tokens to within a few ulps: there each implementation keeps m or m + 1 tokens, not always the
same one (measured on 4000 such ties per dtype: ours keeps m in 79% (float32) and 86% (float64)
of them, transformers in 54%). Which one a float lands on is rounding, not a rule: no test on
random logits can tell `before >= top_p` from `before > top_p`.
`test_top_p_boundary_differs_only_by_rounding` pins this down; with random logits and ordinary
top_p values the supports agree exactly.
"""

import itertools

import pytest
import torch

transformers_lp = pytest.importorskip("transformers.generation.logits_process")

from outrider.sampling import MIN_TEMPERATURE, SamplingParams, warp_probs  # noqa: E402

TEMPERATURES = (MIN_TEMPERATURE, 0.3, 1.0, 1.7)
TOP_P = (1.0, 0.95, 0.7, 0.3, 1e-3)
VOCABS = (2, 3, 10, 97, 400, 1000)
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Thousands of tiny ops: one thread, or a loaded machine spends its time handing them out."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference(logits: torch.Tensor, t: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers in generate's order, then softmax. logits: [rows, vocab] -> [rows, vocab]."""
    scores = transformers_lp.TemperatureLogitsWarper(float(t))(None, logits)
    if top_k:
        scores = transformers_lp.TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = transformers_lp.TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def random_logits(seed: int, vocab: int, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """[rows', vocab] logits, each row of its own spread, keeping only rows without exact ties
    (with ties the two top-p rules may keep different tokens of equal probability)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=g, dtype=torch.float64) * 8 + 0.05  # [rows, 1]
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)  # [rows, vocab]
    no_ties = torch.tensor([row.unique().numel() == vocab for row in logits])
    assert no_ties.sum() > rows // 2
    return logits[no_ties]


def top_ks(vocab: int) -> list[int]:
    return sorted({0, 1, 5, vocab - 1, vocab + 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab", VOCABS)
def test_warp_equals_transformers_on_random_logits(vocab, dtype):
    logits = random_logits(vocab, vocab, dtype, rows=min(128, 40_000 // vocab))  # [rows, vocab]
    for t, top_k, top_p in itertools.product(TEMPERATURES, top_ks(vocab), TOP_P):
        ours = warp_probs(logits, SamplingParams(t, top_k, top_p))
        ref = reference(logits, t, top_k, top_p).to(ours.dtype)
        where = f"vocab {vocab}, t {t}, top_k {top_k}, top_p {top_p}"
        assert ours.dtype == dtype
        differ = ((ours > 0) != (ref > 0)).any(-1)  # [rows]
        assert not differ.any(), f"different tokens kept: {where}, rows {differ.nonzero().flatten().tolist()}"
        assert torch.allclose(ours, ref, rtol=0, atol=TOLERANCE[dtype]), where


def test_warp_equals_transformers_on_leading_dimensions():
    """logits [2, 3, vocab]: every row warped on its own, as transformers does on [6, vocab]."""
    logits = torch.randn(2, 3, 97, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for t, top_k, top_p in ((0.8, 10, 0.9), (1.3, 0, 0.5), (0.5, 3, 1.0)):
        ours = warp_probs(logits, SamplingParams(t, top_k, top_p))  # [2, 3, 97]
        ref = reference(logits.reshape(6, 97), t, top_k, top_p).reshape(2, 3, 97)
        assert torch.allclose(ours, ref, rtol=0, atol=1e-12)


def kept(probs: torch.Tensor) -> int:
    return int((probs > 0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_p_boundary_differs_only_by_rounding(dtype):
    """top_p set to the (rounded) mass of the top m tokens: exactly at the boundary both keep m or
    m + 1 tokens, each by its own rounding; a relative nudge of 1e-4 (far above rounding, far below
    the gap to the next token) either way makes them agree on m or m + 1."""
    nudge = 1e-4
    for seed in range(300):
        g = torch.Generator().manual_seed(1000 + seed)
        vocab = int(torch.randint(3, 60, (), generator=g))
        logits = (torch.randn(1, vocab, generator=g, dtype=torch.float64) * 2).to(dtype)  # [1, vocab]
        sorted_p = torch.softmax(logits, -1)[0].sort(descending=True).values
        m = int(torch.randint(1, vocab - 1, (), generator=g))
        mass = float(sorted_p[:m].sum())
        if float(sorted_p[m]) < 10 * nudge or float(sorted_p[m - 1]) < 10 * nudge:
            continue  # a nudge could cross a neighbouring token

        def both(top_p: float) -> tuple[int, int]:  # tokens kept: (ours, transformers')
            return kept(warp_probs(logits, SamplingParams(1.0, 0, top_p))), kept(reference(logits, 1.0, 0, top_p))

        assert set(both(mass)) <= {m, m + 1}, (seed, m, both(mass))
        assert both(mass * (1 - nudge)) == (m, m), seed
        assert both(min(1.0, mass * (1 + nudge))) == (m + 1, m + 1), seed


def test_greedy_is_the_argmax():
    """Temperature 0 is greedy: transformers has no warper for it, it takes the argmax."""
    logits = torch.randn(5, 33, generator=torch.Generator().manual_seed(3))
    probs = warp_probs(logits, SamplingParams(0.0, 4, 0.5))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(5))
    assert int((probs > 0).sum()) == 5
