"""A bench that samples (bench/sampling.py) and its distributional audit (bench/audit.py): the seed
derivation, the two-sample test's arithmetic and correction, a whole sampled run on a tiny model
with an 8-token vocabulary (every method audited, drafts exercised, the walk-verified method
committing the baseline's text), the audit failing a verifier that accepts every draft, and the
audit failing `resispec-lossy` (the lossy verifier) where the exact multi-draft verifier passes."""

import hashlib
import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import add_tokenizer, make_tiny

from outrider.bench.audit import END, compare, mark, two_sample_chi_square, verdict
from outrider.bench.methods import load_config, parse_config, preset_path
from outrider.bench.results import needs_exit_failure
from outrider.bench.run import plan, run_bench
from outrider.bench.sampling import BenchSampling, prompt_seed
from outrider.bench.table import summary_table
from outrider.errors import ConfigError
from outrider.sampling import SamplingParams

SAMPLES = 150  # a batch each: the reference's and each method's continuations


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Llama target and an independent one-layer draft model, 8-token vocabulary (the
    sharper law an audit can test with few samples), and one raw-text prompt."""
    root = tmp_path_factory.mktemp("bench8")
    target = add_tokenizer(make_tiny("llama", root / "target", vocab=8, seed=0), vocab=8)
    draft = add_tokenizer(make_tiny("llama", root / "draft", vocab=8, seed=3, layers=1), vocab=8)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "w3 w4 w5 w3 w4 w5 w3"}) + "\n")
    return {"target": target, "draft": draft, "prompts": prompts, "root": root}


@pytest.fixture(scope="module")
def confident_draft(world):
    """A one-layer draft whose output head is scaled by 3: its q is confident where the target's p
    is not (q's largest probability 0.71 against p's 0.31 after the prompt), the case where
    ResiSpec's reshaped residual commits the draft's tokens too often (by exact enumeration at
    the first position, 2 siblings: total variation 0.32 from p; the seed-3 draft above: 0.06)."""
    folder = add_tokenizer(make_tiny("llama", world["root"] / "confident", vocab=8, seed=5, layers=1), vocab=8)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def sampled_config(world, **extra):
    draft = f"draft-model:{world['draft']}"
    raw = {"models": [str(world["target"])], "workloads": [f"jsonl:{world['prompts']}"], "prompts": 1,
           "max_new_tokens": 4, "temperature": 1.0, "seed": 3, "audit_samples": SAMPLES, "audit_positions": 3,
           "audit_context": 0, "audit_batch": SAMPLES,
           "method": [{"name": "ngram", "drafter": "ngram"},
                      {"name": "chain", "drafter": draft, "controller": "fixed:2"},
                      {"name": "sampled-tree", "drafter": draft, "tree": "sampled:2,2", "controller": "fixed:2"}],
           **extra}
    return parse_config(raw, "sampled.toml")


# -- seeds and statistics -------------------------------------------------------------------------
def test_prompt_seed_is_the_documented_hash():
    digest = hashlib.sha256(b"7/timed/humaneval/HumanEval/0/0").digest()
    assert prompt_seed(7, "humaneval", "HumanEval/0") == int.from_bytes(digest[:8], "little") >> 1
    seeds = {prompt_seed(7, "humaneval", "HumanEval/0", s, r) for s in range(3) for r in ("timed", "audit:x")}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert prompt_seed(8, "humaneval", "HumanEval/0") != prompt_seed(7, "humaneval", "HumanEval/0")
    assert prompt_seed(7, "toolcall", "HumanEval/0") != prompt_seed(7, "humaneval", "HumanEval/0")
    # a jsonl workload by its file's name: the same samples wherever the file is
    assert prompt_seed(7, "jsonl:/a/p.jsonl", "x") == prompt_seed(7, "jsonl:/b/c/p.jsonl", "x") \
        == int.from_bytes(hashlib.sha256(b"7/timed/jsonl:p.jsonl/x/0").digest()[:8], "little") >> 1


def test_sampling_params_have_no_seed_of_their_own():
    """An unseeded request gets the verifier of most acceptance (rejection sampling), not the walk."""
    params = BenchSampling(0.7, 0.9, 5).params()
    assert params == SamplingParams(temperature=0.7, top_p=0.9) and params.seed is None
    assert BenchSampling().greedy and BenchSampling(0.0, 0.5).params().top_p == 1.0


def test_two_sample_chi_square_by_hand():
    stat, dof, p = two_sample_chi_square(Counter({0: 50, 1: 50}), Counter({0: 80, 1: 20}))
    # pooled 130 / 70, expected 65 / 35 in each sample of 100
    assert dof == 1 and stat == pytest.approx(2 * (15**2 / 65 + 15**2 / 35))
    assert p == pytest.approx(8.69e-6, rel=0.01)
    assert two_sample_chi_square(Counter({4: 30, 5: 70}), Counter({4: 30, 5: 70}))[2] == pytest.approx(1.0)
    assert two_sample_chi_square(Counter({4: 100}), Counter({4: 100})) == (0.0, 0, 1.0)  # nothing to test
    # tokens expected fewer than 5 times in a sample are pooled: five rare ones make one bin ...
    stat, dof, _ = two_sample_chi_square(Counter({0: 45, 1: 45, 2: 3, 3: 3, 5: 4}),
                                         Counter({0: 46, 1: 44, 6: 4, 7: 6}))
    assert dof == 2 and stat == pytest.approx(2 * (0.5**2 / 45.5 + 0.5**2 / 44.5))  # the rare bin: 10 and 10
    # ... which joins the smallest bin when it is itself expected fewer than 5 times
    stat, dof, _ = two_sample_chi_square(Counter({0: 47, 1: 50, 2: 1, 3: 1, 5: 1}),
                                         Counter({0: 50, 1: 47, 6: 1, 7: 2}))
    assert dof == 1


def test_compare_reads_positions_and_end():
    ref = [(1, 2, END)] * 60 + [(1, 3, 4)] * 40
    same = [(1, 3, 4)] * 40 + [(1, 2, END)] * 60
    other = [(1, 2, END)] * 95 + [(1, 3, 4)] * 5
    assert compare(ref, same, 3) == pytest.approx([1.0, 1.0, 1.0])
    p = compare(ref, other, 3)
    assert p[0] == 1.0 and p[1] < 1e-6 and p[2] < 1e-6


def test_verdict_is_bonferroni_at_alpha():
    assert verdict([0.5, 0.0002, 0.9])["adjusted_p"] == pytest.approx(0.0006)
    assert verdict([0.5, 0.0002, 0.9])["passed"] is False
    assert verdict([0.5, 0.0004, 0.9])["passed"] is True  # 0.0012 >= 0.001
    assert verdict([0.2, 0.3])["adjusted_p"] == pytest.approx(0.4) and verdict([0.9, 0.8])["adjusted_p"] == 1.0
    assert mark({"passed": False, "adjusted_p": 2e-7, "lossy": True}) == "lossy: FAIL p=2e-07"
    assert mark(None) == "not audited"


def test_a_lossy_method_is_shown_not_counted():
    from outrider.bench.audit import summarize

    audits = [{"workload": "w", "positions": 2, "methods": {
        "exact": {"p_values": [0.3, 0.6], "accepted": 5, "drafted": 9},
        "lossy": {"p_values": [1e-6, 0.5], "accepted": 7, "drafted": 9}}}]
    out = summarize(audits, {"lossy"})
    assert out["ok"] and out["methods"]["lossy"]["passed"] is False and out["methods"]["lossy"]["lossy"]
    assert out["methods"]["lossy"]["worst"] == {"workload": "w", "position": 1}
    assert not summarize(audits, set())["ok"]


# -- whole runs -----------------------------------------------------------------------------------
def test_a_sampled_run_audits_every_method(world):
    results = run_bench(plan(sampled_config(world)), threads=1, progress=False, log=lambda _: None)
    audit = results["audit"]
    assert audit["kind"] == "distributional" and audit["ok"] and not needs_exit_failure(results)
    methods = audit["models"][str(world["target"])]["methods"]
    for name in ("ngram", "chain", "sampled-tree"):
        entry = methods[name]
        assert entry["passed"] and not entry["lossy"] and entry["tests"] == 3
        least = 1 if name == "ngram" else SAMPLES // 2  # ngram drafts only where the text repeats itself
        assert entry["accepted"] >= least, f"{name}: the audit barely exercised its drafts"
    runs = {r["method"]: r for r in results["runs"]}
    # the same request seed for every method of a prompt: the walk (ngram) commits the baseline's text
    assert runs["ngram"]["prompts"][0]["output_ids"] == runs["autoregressive"]["prompts"][0]["output_ids"]
    assert runs["chain"]["summary"]["acceptance_rate"] > 0 and runs["chain"]["summary"]["lossless"] is None
    table = summary_table(results)
    assert "audit" in table and "pass p=" in table and "distributional audit: ok" in table
    assert results["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 3}


def test_the_audit_fails_a_verifier_that_accepts_every_draft(world, monkeypatch):
    """Negative control: the chain's drafts all accepted (no min(1, p/q) test: positions 1 and 2
    follow q's law). The seeds are fixed, so the verdict is deterministic; with the 150 samples of
    the passing run above it was not yet seen (adjusted p 0.002), with 400 it is."""
    from outrider.engine import speculator
    from outrider.spec.types import VerifyResult

    real = speculator.Speculator.verifier_for

    def biased(self, params, seeded=False):
        verify = real(self, params, seeded)
        if self.tree_kind != "chain" or self.options.kind != "draft-model":
            return verify

        def accept_all(tree, logits, p, rng):
            k = tree.size - 1
            bonus = rng.categorical(torch.softmax(logits[k].double() / p.temperature, -1), offset=k)
            return VerifyResult(list(range(1, k + 1)), tree.tokens[1:].tolist() + [bonus])
        return accept_all

    monkeypatch.setattr(speculator.Speculator, "verifier_for", biased)
    config = sampled_config(world)
    samples = 400
    config = parse_config({**config.raw, "method": config.raw["method"][1:2], "audit_samples": samples,
                           "audit_batch": samples}, "sampled.toml")  # the chain alone
    results = run_bench(plan(config), threads=1, progress=False, log=lambda _: None)
    entry = results["audit"]["models"][str(world["target"])]["methods"]["chain"]
    assert entry["passed"] is False and entry["adjusted_p"] < 1e-5, json.dumps(results["audit"]["models"])
    assert needs_exit_failure(results) and "DISTRIBUTIONAL AUDIT FAILED: chain" in summary_table(results)


def test_the_audit_fails_resispec_lossy_and_passes_the_exact_multidraft(world, confident_draft):
    """The lossy verifier named in a [[method]] fails the audit (shown, not counted: the run does
    not fail), the exact `multidraft_without_replacement` on the same sampled trees of the same
    draft passes. 150 samples x 3 positions; seeds fixed, so the verdicts are deterministic
    (adjusted p 7e-07 against the exact verifier's 0.12 when written). The mutant, shaping 0
    (multi-draft rejection sampling) in place of ResiSpec's 0.5, passes the audit (0.52) and fails
    this test."""
    draft = f"draft-model:{confident_draft}"
    tree = {"drafter": draft, "tree": "sampled:2,2", "controller": "fixed:2"}
    config = sampled_config(world, method=[{"name": "multidraft", **tree},
                                           {"name": "resispec", **tree, "verifier": "resispec-lossy"}])
    results = run_bench(plan(config), threads=1, progress=False, log=lambda _: None)
    methods = results["audit"]["models"][str(world["target"])]["methods"]
    exact, lossy = methods["multidraft"], methods["resispec"]
    assert exact["passed"] and not exact["lossy"]
    assert lossy["lossy"] and lossy["passed"] is False and lossy["adjusted_p"] < 1e-4, json.dumps(methods)
    assert lossy["drafted"] >= SAMPLES and exact["drafted"] >= SAMPLES  # drafts exercised
    assert results["audit"]["ok"] and not needs_exit_failure(results)
    assert "lossy: FAIL p=" in summary_table(results)


# -- settings -------------------------------------------------------------------------------------
def test_the_quick_preset_samples_with_every_method():
    config = load_config(preset_path("quick"))
    params = BenchSampling(1.0).params()
    for m in config.methods:
        if m.spec:
            m.spec.check_sampling(params)
            assert m.spec.verifier_choice(params).ok
    for name in ("sampling", "sampling-0.7"):
        config = load_config(preset_path(name))
        trees = {m.spec.tree for m in config.methods if m.spec}
        assert config.temperature == {"sampling": 1.0, "sampling-0.7": 0.7}[name]
        assert any(t.startswith("sampled:") for t in trees)
        assert any(m.spec and m.spec.verifier == "resispec-lossy" for m in config.methods)


@pytest.mark.parametrize("extra,message", [
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"seed": -2}, "seed must be an integer >= 0"),
    ({"audit_samples": 0}, "audit_samples must be a positive integer"),
    ({"audit_workloads": ["toolcall"]}, "audit_workloads names 'toolcall'"),
])
def test_bad_sampling_settings_are_one_line(world, extra, message):
    with pytest.raises(ConfigError, match=message):
        sampled_config(world, **extra)


def test_a_sampled_tree_is_refused_when_greedy(world):
    config = sampled_config(world, temperature=0.0)
    with pytest.raises(ConfigError, match="method 'sampled-tree'.*needs temperature > 0"):
        plan(config)


def test_the_cli_takes_temperature_for_the_bench(world, tmp_path, capsys):
    from outrider.cli import main

    out = tmp_path / "out"
    methods = tmp_path / "m.toml"
    methods.write_text(f'models = ["{world["target"]}"]\nworkloads = ["jsonl:{world["prompts"]}"]\n'
                       f'[[method]]\nname = "ngram"\ndrafter = "ngram"\n')
    assert main(["bench", "--methods", str(methods), "--temperature", "0.8", "--top-p", "0.9", "--seed", "1",
                 "--audit-samples", "20", "--audit-positions", "2", "--audit-batch", "20", "--max-new-tokens", "4",
                 "--threads", "1", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["sampling"] == {"temperature": 0.8, "top_p": 0.9, "seed": 1}
    assert results["audit"]["models"][str(world["target"])]["prompts"][0]["samples"] == 20
    capsys.readouterr()
    assert main(["bench", "--methods", str(methods), "--top-p", "2", "--out", str(tmp_path / "o2")]) == 2
    assert "error: --top-p must be in (0, 1]" in capsys.readouterr().err  # named as the user wrote it
