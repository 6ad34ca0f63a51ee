"""The gated delta rule's forms against its per-token recurrence (models/gated_delta.py): TreeWY's
one triangular solve gives every node of a tree the output of the sequential recurrence along its
own branch, its stash rebuilds any node's state, rows held by an earlier call compose with new
ones, and the chunked prefill equals the token-by-token one (float64 throughout: 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from outrider.models.gated_delta import Stash, chunked, fold, recurrent_reference, snapshot_tree, tree_step

HV, DK, DV = 3, 8, 6
PARENTS = [-1, 0, 0, 1, 1, 2, 3, -1, 7, 5]  # ../shared/checks/tree_wy_check.py's tree


def inputs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HV, DK, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(n, HV, DK, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(n, HV, DV, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, HV, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(n, HV, generator=gen, dtype=torch.float64) * 0.8 + 0.1
    return q, k, v, g, beta


def path(node: int, parents=PARENTS) -> list[int]:
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out[::-1]


def ancestors(parents=PARENTS) -> torch.Tensor:
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in path(i, parents)[:-1]:
            out[i, j] = True
    return out


@pytest.fixture
def state():
    return torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def test_every_node_gets_its_branchs_sequential_output(state):
    q, k, v, g, beta = inputs(len(PARENTS))
    o, _ = tree_step(q, k, v, g, beta, state, ancestors())
    for node in range(len(PARENTS)):
        p = path(node)
        want, _ = recurrent_reference(q[p], k[p], v[p], g[p], beta[p], state)
        assert (o[node] - want[-1]).abs().max() < 1e-12, node


def test_the_stash_rebuilds_any_nodes_state_as_the_snapshots_hold_it(state):
    q, k, v, g, beta = inputs(len(PARENTS))
    o, stash = tree_step(q, k, v, g, beta, state, ancestors())
    o_snap, states = snapshot_tree(q, k, v, g, beta, state, PARENTS)
    assert (o - o_snap).abs().max() < 1e-12
    for node in range(len(PARENTS)):
        p = path(node)
        rebuilt = fold(state, Stash(stash.k[p], stash.u[p], stash.gamma[p]))
        assert (rebuilt - states[node]).abs().max() < 1e-12, node


@pytest.mark.parametrize("split", [1, 4, 7])
def test_rows_held_by_an_earlier_call_compose_with_new_ones(state, split):
    """A draft model's steps, or a tree written over several forwards: nodes split..N see the
    first split nodes only through their stash."""
    q, k, v, g, beta = inputs(len(PARENTS), seed=3)
    anc = ancestors()
    whole, _ = tree_step(q, k, v, g, beta, state, anc)
    first, held = tree_step(q[:split], k[:split], v[:split], g[:split], beta[:split], state, anc[:split, :split])
    rest, _ = tree_step(q[split:], k[split:], v[split:], g[split:], beta[split:], state, anc[split:, split:],
                        held, anc[split:, :split])
    assert (torch.cat([first, rest]) - whole).abs().max() < 1e-12


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_a_chunked_prefill_is_the_recurrence(state, chunk):
    q, k, v, g, beta = inputs(37, seed=5)
    want_o, want_s = recurrent_reference(q, k, v, g, beta, state)
    o, s = chunked(q, k, v, g, beta, state, chunk=chunk)
    assert (o - want_o).abs().max() < 1e-12 and (s - want_s).abs().max() < 1e-12


def test_a_wrong_ancestry_is_caught(state):
    """Negative control: a sibling taken for an ancestor changes the node's output."""
    q, k, v, g, beta = inputs(len(PARENTS))
    wrong = ancestors()
    wrong[2, 1] = True  # nodes 1 and 2 are siblings
    good, _ = tree_step(q, k, v, g, beta, state, ancestors())
    bad, _ = tree_step(q, k, v, g, beta, state, wrong)
    assert (good[2] - bad[2]).abs().max() > 1e-3
