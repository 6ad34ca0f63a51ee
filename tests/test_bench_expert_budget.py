"""`outrider bench --expert-budget FRACTION[,store=mmap|direct]` (bench/expert_budget.py): the
option's text, its way from the command line and a methods file into the run, and a tiny
Qwen3-MoE bench under a quarter of its experts: every method's output equal to AR's, the bytes
moved a token beside the ratios, counted as the store reads them."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from outrider.bench.expert_budget import BudgetTier, ExpertBudget
from outrider.bench.methods import parse_config
from outrider.bench.run import plan, run_bench
from outrider.bench.runner import run_ours
from outrider.bench.settings import flag_overrides
from outrider.errors import ConfigError
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3-MoE (3 layers of 8 experts, top 2) saved by transformers, and one prompt."""
    import transformers as tf

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("budget")
    torch.manual_seed(4)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.normal_(1.0, 0.3)
    model.save_pretrained(root / "moe")
    add_tokenizer(root / "moe")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "w3 w4 w5 w6 w3 w4 w5 w6 w3 w4 w5"}) + "\n")
    return {"moe": root / "moe", "prompts": prompts}


def config(world, **extra):
    raw = {"models": [str(world["moe"])], "workloads": [f"jsonl:{world['prompts']}"], "prompts": 1,
           "max_new_tokens": 12, "method": [{"name": "suffix", "drafter": "suffix", "controller": "fixed:3"}], **extra}
    return parse_config(raw, "budget.toml")


@pytest.mark.parametrize("text, share, store", [("0.25", 0.25, "mmap"), ("0.5,store=direct", 0.5, "direct"),
                                                 (" 1 ", 1.0, "mmap"), ("1e-1,store=mmap", 0.1, "mmap")])
def test_the_option_reads(text, share, store):
    assert ExpertBudget.parse(text) == ExpertBudget(share, store)
    assert ExpertBudget.parse(str(ExpertBudget.parse(text))) == ExpertBudget(share, store)  # as a run saves it


@pytest.mark.parametrize("text", ["0", "1.5", "quarter", "0.25,store=disk", "0.25,direct", "-0.1", ""])
def test_bad_text_is_one_line(text):
    with pytest.raises(ConfigError, match="FRACTION") as err:
        ExpertBudget.parse(text)
    assert "\n" not in str(err.value)


def test_the_flag_and_the_file_reach_the_config(world):
    args = Namespace(model=None, workload=None, prompts=None, max_new_tokens=None, threads=None, dtype=None,
                     kv_dtype=None, expert_budget="0.5,store=direct")
    assert flag_overrides(args) == {"expert_budget": "0.5,store=direct"}
    assert config(world).expert_budget is None
    assert config(world, expert_budget="0.25").expert_budget == "0.25,store=mmap"
    with pytest.raises(ConfigError, match="budget.toml: expert_budget"):
        config(world, expert_budget="2")
    from outrider.cli import _parser  # the CLI's own parser: the flag exists under bench

    parsed = _parser().parse_args(["bench", "--expert-budget", "0.25"])
    assert parsed.expert_budget == "0.25"


def test_peers_and_what_the_store_cannot_hold_are_refused(world):
    peer = {"name": "hf", "peer": "transformers"}
    with pytest.raises(ConfigError, match="peer\\(s\\) hf run their own models"):
        plan(config(world, expert_budget="0.25", method=[peer]), log=lambda _: None)
    budget = ExpertBudget(0.25)
    with pytest.raises(ConfigError, match="quantized"):
        BudgetTier(budget, load_decoder(world["moe"], "cpu", "q8_0"), world["moe"])


def test_a_run_under_the_budget_is_the_same_model_and_counts_what_it_reads(world):
    target = load_decoder(world["moe"], "cpu", torch.float32)
    experts = list(target.layers[1].moe.gate_up)
    prompt = [5, 9, 3, 5, 9, 4, 5, 9, 3, 7, 8]
    plain = run_ours(target, None, prompt, 10)
    tier = BudgetTier(ExpertBudget(0.25), target, world["moe"])
    assert tier.slots == 6  # a quarter of 3 layers x 8 experts
    r = tier.run(lambda: run_ours(target, None, prompt, 10))
    assert r.output_ids == plain.output_ids
    per_expert = 3 * 32 * 64 * 4  # gate, up, down: 32 x 64 float32 each
    assert r.stats["expert_bytes"] == r.stats["expert_misses"] * per_expert > 0
    assert target.layers[1].moe.gate_up == experts  # the model's own experts back
    prefill = tier.prefill("a", lambda: run_ours(target, None, prompt, 1))
    assert 0 < prefill < r.stats["expert_bytes"]
    whole = BudgetTier(ExpertBudget(1.0), target, world["moe"]).run(lambda: run_ours(target, None, prompt, 10))
    assert whole.stats["expert_misses"] <= 24 and whole.stats["expert_bytes"] <= r.stats["expert_bytes"]


def test_the_bench_reports_bytes_a_token_beside_the_ratios(world):
    from outrider.bench.table import summary_table

    results = run_bench(plan(config(world, expert_budget="0.25")), threads=1, progress=False, log=lambda _: None)
    assert results["audit"]["ok"] is True and results["config"]["expert_budget"] == "0.25"
    runs = {r["method"]: r["summary"] for r in results["runs"]}
    assert set(runs) == {"autoregressive", "suffix"}
    for s in runs.values():
        assert s["expert_mb_per_token"] > 0 and s["expert_misses"] > 0
    table = summary_table(results)
    assert "MB/tok" in table and "--expert-budget 0.25,store=mmap" in table
    plain = run_bench(plan(config(world)), threads=1, progress=False, log=lambda _: None)
    assert "MB/tok" not in summary_table(plain)
    assert all("expert_mb_per_token" not in r["summary"] for r in plain["runs"])


def test_bytes_a_token_are_the_decodes():
    from outrider.bench.expert_budget import mb_per_token
    from outrider.bench.runner import PromptRun

    mib = 2**20
    runs = [PromptRun([1, 2, 3], 1.0, {"expert_bytes": 5 * mib, "expert_prefill_bytes": 2 * mib}),
            PromptRun([4], 1.0, {"expert_bytes": 3 * mib, "expert_prefill_bytes": 2 * mib})]
    assert mb_per_token(runs) == pytest.approx((3 + 1) / 4)
    assert mb_per_token(runs[:1] + [PromptRun([4], 1.0, {})]) is None  # a run not budgeted: no figure
