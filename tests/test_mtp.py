"""The MTP head kind (heads/mtp/, drafters/mtp.py) on a tiny random target: the fast forward equals
the slow reference (prompt rows, then draft rows fed their own hidden through the chain mask); the
trainable's unrolled steps compute what the runtime head computes; greedy speculation equals plain
decoding for a chain and a tree, with drafts accepted; check-head passes the folder and fails a
corrupted copy; the vllm export carries the target's embedding and lm_head; gguf is refused."""

import json

import pytest
import torch
from enumerate_law import one_thread
from safetensors.torch import load_file, save_file
from tiny import make_tiny

from outrider.engine.generate import generate_ids
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError
from outrider.heads.checks import Check
from outrider.heads.mtp.check import check_mtp
from outrider.heads.mtp.export import export_mtp
from outrider.heads.mtp.format import load_mtp
from outrider.heads.mtp.reference import reference_rows
from outrider.heads.mtp.trainable import MtpTrainable
from outrider.heads.staging import staged_head
from outrider.models.batch import causal_batch, pack
from outrider.sampling import SamplingParams
from outrider.weights.loader import load_decoder

PROMPTS = [[3, 4, 5, 3, 4, 5, 3], [6, 7, 3, 6, 7, 3, 6], [5], [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def write_head(folder, target, seed=0, scale=3.0):
    """A random MTP head for `target` (MtpTrainable's init with the matrices scaled up, so its
    drafts are not all one token), written in the shipped layout."""
    model = MtpTrainable.for_target(target, seed=seed)
    with torch.no_grad():
        for name in ("eh_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            getattr(model, name).mul_(scale * 10)
    with staged_head(folder, model.export_config(), model.state_tensors()):
        pass
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    folder = make_tiny("llama", root / "t", vocab=8, layers=4)
    target = load_decoder(folder, "cpu")
    return folder, target, write_head(root / "head", target)


def test_fast_forward_equals_the_reference(setup):
    folder, target, head_dir = setup
    head = load_mtp(head_dir, target)
    tokens = torch.tensor([1, 5, 3, 6, 2, 7, 4])
    cache = target.new_cache(1, 16)
    hidden = target.forward(causal_batch([tokens], hidden_layers=(4,), scratch_row=cache.scratch_row), cache).hidden[4][0]
    n = len(tokens) - 1
    own = head.new_cache(1, 16)
    batch = pack([0], [0], [tokens[1:]], scratch_row=own.scratch_row)
    logits, outs = head.forward(batch, own, hidden[:n].unsqueeze(0))  # rows 0..n-1
    # two draft rows chained off the last committed row, fed their parent's output hidden
    step1, h1 = head.forward(pack([0], [n - 1], [torch.tensor([3])], [torch.tensor([-1, 0])],
                                  scratch_row=own.scratch_row, first_nodes=[1]), own, outs[:, -1:])
    step2, _ = head.forward(pack([0], [n - 1], [torch.tensor([4])], [torch.tensor([-1, 0, 1])],
                                 scratch_row=own.scratch_row, first_nodes=[2]), own, h1)
    want, _ = reference_rows(head, [hidden[p] for p in range(n)] + [None, None], tokens[1:].tolist() + [3, 4])
    got = torch.cat((logits[0], step1[0], step2[0])).double()
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_the_trainable_computes_what_the_head_computes(setup):
    folder, target, head_dir = setup
    head = load_mtp(head_dir, target)
    model = MtpTrainable.for_target(target, seed=1)
    model.load_state_tensors(load_file(str(head_dir / "model.safetensors")))
    tokens = torch.tensor([[1, 5, 3, 6, 2, 7, 4, 3]])
    cache = target.new_cache(1, 16)
    hidden = target.forward(causal_batch([tokens[0]], hidden_layers=(4,), scratch_row=cache.scratch_row),
                            cache).hidden[4]  # [1, T, H]
    with torch.no_grad():
        steps = model.unroll(hidden.unsqueeze(2), tokens, 2)  # per step [1, T, V]
    T = tokens.shape[1]
    want, _ = reference_rows(head, [hidden[0, p] for p in range(T - 1)], tokens[0, 1:].tolist())
    assert torch.allclose(steps[0][0, : T - 1].double(), want, atol=1e-4)
    # step 1 of row 2: the row's draft fed token x_4 and step 0's output hidden of row 2
    rows, _ = reference_rows(head, [hidden[0, p] for p in range(3)] + [None], tokens[0, 1:4].tolist() + [int(tokens[0, 4])])
    assert torch.allclose(steps[1][0, 2].double(), rows[3], atol=1e-4)


@pytest.mark.parametrize("tree", ["chain", "static:2,2,1"])
def test_greedy_speculation_equals_plain_and_drafts_are_accepted(setup, tree):
    folder, target, head_dir = setup
    spec = Speculator.build(SpecOptions(f"mtp:{head_dir}", tree, "fixed:3"), target, folder)
    assert spec.hidden_layers == (4,)  # the last layer's output
    fast = generate_ids(target, [Request(list(p), 16, SamplingParams()) for p in PROMPTS], set(), speculation=spec)
    plain = generate_ids(target, [Request(list(p), 16, SamplingParams()) for p in PROMPTS], set())
    assert [f.token_ids for f in fast] == [f.token_ids for f in plain]
    assert sum(f.round_stats.committed for f in fast) > sum(f.round_stats.rounds for f in fast)


def test_check_head_passes_the_head_and_fails_a_corrupted_copy(setup, tmp_path):
    folder, target, head_dir = setup
    checks = check_mtp(head_dir, folder, golden=False)
    assert all(c.status != "FAIL" for c in checks), [c.line() for c in checks]
    assert [c.name for c in checks][:5] == ["layout", "weights file", "config fields", "target", "tensors"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((head_dir / "config.json").read_text())
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors.pop("model.layers.4.hnorm.weight")
    save_file(tensors, str(bad / "model.safetensors"))
    failed = {c.name for c in check_mtp(bad, folder, golden=False) if c.status == "FAIL"}
    assert failed == {"tensors"}
    raw = json.loads((head_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    assert "target" in {c.name for c in check_mtp(bad, folder, golden=False) if c.status == "FAIL"}
    assert isinstance(checks[0], Check)


def test_exports(setup, tmp_path):
    folder, target, head_dir = setup
    with pytest.raises(ConfigError, match="llama graph has none"):
        export_mtp(head_dir, tmp_path / "g", "gguf", folder, golden=False)
    out = export_mtp(head_dir, tmp_path / "v", "vllm", folder, golden=False)
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["model.layers.4.shared_head.head.weight"], target.lm_head)
    assert torch.equal(tensors["model.layers.4.embed_tokens.weight"], target.embed)
    a, b = load_mtp(out, target), load_mtp(head_dir, target)  # the same drafts with its own copies
    assert torch.equal(a.w.lm_head, b.w.lm_head) and a.w.lm_head is not b.w.lm_head


def test_the_shipped_head_is_small_with_its_recipe_and_conforms(smollm2_path):
    from outrider.heads.catalog import drafters_for, resolve_head

    head = resolve_head("smollm2-135m-instruct", "mtp")
    assert "mtp:smollm2-135m-instruct" in drafters_for("smollm2-135m-instruct")
    assert all(p.stat().st_size <= 25 * 1024 * 1024 for p in head.iterdir())
    info = json.loads((head / "train_info.json").read_text())
    assert info["seed"] == 0 and info["tokens"] > 0 and "reproduce" in info
    checks = check_mtp(head, smollm2_path, golden=False)
    assert all(c.status != "FAIL" for c in checks), [c.line() for c in checks]
