"""The native gated-delta step and fold (kernels/delta_native.py, csrc/gated_delta.c) against their
torch reference (models/gated_delta.py) on every kernel variant this machine runs: every node of
a tree with held rows within 1e-12, the fold in place, a node's bits independent of the nodes
beside it and of the thread count; and the choice between them fixed at a model state's making."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_variants import ALL, variant  # noqa: F401  (the fixture)
from outrider.kernels import delta_native
from outrider.models import gated_delta
from outrider.models.gated_delta import Stash

HV, DK, DV = 3, 8, 6
PARENTS = [-1, 0, 0, 1, 1, 2, 3, -1, 7, 5]  # as tests/test_gated_delta.py's


def inputs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HV, DK, generator=gen) * DK ** -0.5
    k = F.normalize(torch.randn(n, HV, DK, generator=gen), dim=-1)
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * 0.5
    beta = torch.rand(n, HV, generator=gen) * 0.8 + 0.1
    return q, k, v, g, beta


def ancestors(parents=PARENTS) -> torch.Tensor:
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p != -1:
            out[i, p] = True
            p = parents[p]
    return out


def state(seed: int = 9) -> torch.Tensor:
    return torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(a, b) -> bool:
    return (a - b).abs().max().item() < 1e-12


@pytest.mark.parametrize("variant", ALL, indirect=True)
@pytest.mark.parametrize("split", [0, 4, 7])
def test_every_node_and_its_stash_equal_the_reference(variant, split):
    """Nodes 0..split-1 written by a first call are held rows of the second (a draft model's steps,
    a tree over several forwards), as in the reference."""
    q, k, v, g, beta = inputs(len(PARENTS), seed=split)
    S, anc = state(), ancestors()
    held = held_anc = None
    if split:
        _, held = gated_delta.tree_step(q[:split], k[:split], v[:split], g[:split], beta[:split], S,
                                        anc[:split, :split])
        held_anc = anc[split:, :split]
    rest = slice(split, None)
    args = (q[rest], k[rest], v[rest], g[rest], beta[rest], S, anc[rest, rest], held, held_anc)
    want_o, want = gated_delta.tree_step(*args)
    o, got = delta_native.tree_step(*args)
    assert close(o, want_o) and close(got.u, want.u) and close(got.gamma, want.gamma)
    assert torch.equal(got.k, k[rest])


@pytest.mark.parametrize("variant", ALL, indirect=True)
def test_the_fold_in_place_is_the_references(variant):
    q, k, v, g, beta = inputs(len(PARENTS), seed=2)
    S = state()
    _, stash = gated_delta.tree_step(q, k, v, g, beta, S, ancestors())
    p = [0, 1, 3, 6]  # a root-to-leaf path
    path = Stash(stash.k[p].float(), stash.u[p], stash.gamma[p])
    got = S.clone()
    delta_native.fold_into(got, path)
    assert close(got, gated_delta.fold(S, path))
    untouched = S.clone()
    delta_native.fold_into(untouched, Stash(path.k[:0], path.u[:0], path.gamma[:0]))
    assert torch.equal(untouched, S)


def test_a_nodes_bits_do_not_depend_on_the_nodes_beside_it_or_the_threads():
    """The chain 0-1-3-6 alone, and inside the whole tree with 1 and 2 threads: the same bits."""
    q, k, v, g, beta = inputs(len(PARENTS), seed=4)
    S, anc = state(), ancestors()
    chain = [0, 1, 3, 6]
    alone, _ = delta_native.tree_step(q[chain], k[chain], v[chain], g[chain], beta[chain], S,
                                      anc[chain][:, chain])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            whole, _ = delta_native.tree_step(q, k, v, g, beta, S, anc)
            assert torch.equal(whole[chain], alone)
    finally:
        torch.set_num_threads(before)


def test_a_wrong_ancestry_changes_the_native_output():
    """Negative control: a sibling taken for an ancestor changes node 2's output."""
    q, k, v, g, beta = inputs(len(PARENTS))
    wrong = ancestors()
    wrong[2, 1] = True
    good, _ = delta_native.tree_step(q, k, v, g, beta, state(), ancestors())
    bad, _ = delta_native.tree_step(q, k, v, g, beta, state(), wrong)
    assert (good[2] - bad[2]).abs().max() > 1e-3


def test_the_choice_is_native_where_the_library_runs_and_torch_where_it_is_off():
    from outrider.config import overriding
    from outrider.kernels import native

    assert delta_native.DeltaOps.choose("cpu").name == ("native" if native.available() else "torch")
    with overriding(native=False):
        assert delta_native.DeltaOps.choose("cpu") is delta_native.TORCH
    assert delta_native.DeltaOps.choose("meta") is delta_native.TORCH


def test_a_hybrid_decodes_and_speculates_the_same_tokens_on_either(tmp_path, monkeypatch):
    """The tiny Qwen3.5 hybrid with the state arithmetic native and in torch: the same greedy tokens,
    plain and with a draft model's tree (held rows, folds, rows held across forwards)."""
    from outrider.engine.generate import generate_ids
    from outrider.engine.request import Request
    from outrider.engine.speculator import SpecOptions, Speculator
    from outrider.kernels import native
    from outrider.sampling import SamplingParams
    from outrider.weights.loader import load_decoder
    from tiny import add_tokenizer, make_tiny

    if not native.available():
        pytest.skip(f"no native library here: {native.reason()}")
    folder = make_tiny("qwen3_5", tmp_path / "qwen3_5", layers=4)
    add_tokenizer(folder)
    model = load_decoder(folder, "cpu", torch.float32)
    prompt = [5, 17, 33, 8, 5, 17, 33, 9, 40, 41]
    runs = {}
    for ops in (delta_native.NATIVE, delta_native.TORCH):
        monkeypatch.setattr(delta_native.DeltaOps, "choose", classmethod(lambda cls, device="cpu", ops=ops: ops))
        spec = Speculator.build(SpecOptions(f"draft-model:{folder}", "static:2,2", "fixed:3"), model, folder)
        runs[ops.name] = [generate_ids(model, [Request(prompt, 16, SamplingParams(0.0))], set(), speculation=s)[0]
                          .token_ids for s in (None, spec)]
    assert runs["native"][0] == runs["native"][1] == runs["torch"][0] == runs["torch"][1]
