"""EAGLE-3 export, import and conformance (issue 9, items 4 and 5) on a tiny target with a tiny head:
export -> import is bit-identical in both layouts (and through a loaded head); check-head passes a
good export, reproduces its golden tau exactly, and FAILs in one line with a non-zero exit on a
corrupted d2t, out-of-range layer ids, a missing tensor, a wrong hidden size and changed weights;
shipped heads resolve by name and show in `models list`; export refuses an existing --out."""

import json
import shutil

import pytest
import torch
from eagle3_tiny import write_eagle3
from enumerate_law import one_thread
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import add_tokenizer, make_tiny

from outrider.cli import main
from outrider.errors import ConfigError, ModelError
from outrider.heads import catalog
from outrider.heads.eagle3.check import check_head
from outrider.heads.eagle3.export import export_eagle3, from_head
from outrider.heads.eagle3.format import load_eagle3, read_config, read_tensors
from outrider.heads.golden import GOLDEN, GoldenSettings, compare
from outrider.heads.eagle3.speculators import schema_problems
from outrider.weights.loader import load_decoder
from outrider.engine.speculator import SpecOptions, Speculator

FAST = GoldenSettings(depth=3, max_new_tokens=12)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A vocab-8 target with a word tokenizer (so the head's drafts are sometimes right), a head
    with 6 draft tokens and SGLang-convention ids, and its export in both layouts."""
    root = tmp_path_factory.mktemp("e3export")
    target = add_tokenizer(make_tiny("llama", root / "t", vocab=8, layers=4), vocab=8)
    cfg = json.loads((target / "config.json").read_text())
    head = write_eagle3(root / "head", cfg, draft_vocab=6, layer_ids=[0, 1, 2], semantics="sglang", seed=4)
    eagle = export_eagle3(head, root / "eagle", "eagle", target, settings=FAST)
    spec = export_eagle3(head, root / "spec", "speculators", target, settings=FAST)
    return root, target, head, eagle, spec


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def header_names(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_round_trip_is_bit_identical_in_both_layouts(setup, tmp_path):
    root, target, head, eagle, spec = setup
    original = read_tensors(head)
    assert same_tensors(read_tensors(eagle), original) and same_tensors(read_tensors(spec), original)
    assert any(n.startswith("midlayer.") for n in header_names(eagle))
    assert any(n.startswith("layers.0.") for n in header_names(spec)) and not any(
        n.startswith("midlayer.") for n in header_names(spec))
    # speculators -> eagle gives back the eagle export byte for byte
    again = export_eagle3(spec, tmp_path / "again", "eagle", target, golden=False)
    assert (again / "model.safetensors").read_bytes() == (eagle / "model.safetensors").read_bytes()
    assert (again / "config.json").read_text() == (eagle / "config.json").read_text()
    # both load to the same runtime head, reading the same target layers
    decoder = load_decoder(target, "cpu")
    a, b, c = (load_eagle3(f, decoder) for f in (head, eagle, spec))
    for h in (b, c):
        assert h.config.taps(4) == a.config.taps(4) == (1, 2, 3)
        assert all(torch.equal(getattr(h.w, k), getattr(a.w, k)) for k in ("fc", "qkv", "gate_up", "draft_to_target"))


def test_configs_carry_what_each_engine_reads(setup):
    _, _, _, eagle, spec = setup
    e = json.loads((eagle / "config.json").read_text())
    assert e["architectures"] == ["LlamaForCausalLMEagle3"] and e["tie_word_embeddings"] is False
    assert e["draft_vocab_size"] == 6 and e["vocab_size"] == 8 and e["target_hidden_size"] == 64
    assert e["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # top level: vLLM, as-is
    assert e["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1
    s = json.loads((spec / "config.json").read_text())
    assert schema_problems(s) == []
    assert s["speculators_model_type"] == "eagle3" and s["architectures"] == ["Eagle3Speculator"]
    assert s["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and s["norm_before_residual"] is False
    assert s["transformer_layer_config"]["model_type"] == "llama"
    assert s["speculators_config"]["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert s["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(spec / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool


def test_dtype_export_and_a_loaded_head(setup, tmp_path):
    root, target, head, _, _ = setup
    bf16 = export_eagle3(head, tmp_path / "bf16", "speculators", target, dtype="bf16", golden=False)
    got, original = read_tensors(bf16), read_tensors(head)
    for name, t in original.items():
        want = t if name in ("d2t", "t2d") else t.to(torch.bfloat16)
        assert got[name].dtype == want.dtype and torch.equal(got[name], want)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    decoder = load_decoder(target, "cpu")
    loaded = export_eagle3(from_head(load_eagle3(head, decoder), decoder), tmp_path / "loaded", "eagle", target,
                           golden=False)
    assert same_tensors(read_tensors(loaded), original)


def lines_of(capsys, argv) -> tuple[int, dict]:
    status = main(argv)
    out = capsys.readouterr().out.splitlines()
    return status, {line.split()[0] + ("" if len(line.split()) < 2 else " " + line.split()[1]): line for line in out}


def test_check_head_passes_a_good_export_and_reproduces_its_golden_tau(setup, capsys):
    _, target, _, eagle, spec = setup
    for folder in (eagle, spec):
        checks = {c.name: c for c in check_head(folder, target)}
        assert all(c.status in ("ok", "skipped") for c in checks.values()), [c.line() for c in checks.values()]
        assert checks["golden tau"].status == "ok" and "exact" in checks["golden tau"].detail
        assert checks["speculators class"].status == "skipped"
    assert "speculators not installed" in {c.name: c for c in check_head(spec, target, golden=False)}[
        "speculators class"].detail
    golden = json.loads((eagle / GOLDEN).read_text())
    assert golden["settings"]["depth"] == 3 and golden["rounds"] > 0
    assert golden["committed"] > golden["rounds"]  # the head's drafts are accepted sometimes: tau > 1
    assert main(["check-head", str(eagle), "--target", str(target)]) == 0
    assert "conforms" in capsys.readouterr().out


def corrupt(src, dst, config_edit=None, tensor_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        raw = json.loads((dst / "config.json").read_text())
        config_edit(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensor_edit:
        tensors = load_file(str(dst / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def bump_d2t(t):
    t["d2t"][2] += 1


def far_layers(c):
    c["eagle_aux_hidden_state_layer_ids"], c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9], [0, 1, 8]


def wider_target(c):
    c["target_hidden_size"] = 128


def flip_lm_head(t):
    t["lm_head.weight"].neg_()  # a valid head that drafts other tokens


@pytest.mark.parametrize("check, config_edit, tensor_edit, expected", [
    ("vocab map", None, bump_d2t, "d2t maps draft id 2 to target id"),
    ("layer ids", far_layers, None, "hidden states [1, 2, 9] but the target has 4 layers"),
    ("tensors", None, lambda t: t.pop("midlayer.mlp.down_proj.weight"), "missing midlayer.mlp.down_proj.weight"),
    ("target", wider_target, None, "hidden states of size 128, this target's are 64"),
    ("golden tau", None, flip_lm_head, "on the same machine, device and dtype"),
])
def test_check_head_fails_in_one_line(setup, tmp_path, capsys, check, config_edit, tensor_edit, expected):
    _, target, _, eagle, _ = setup
    bad = corrupt(eagle, tmp_path / "bad", config_edit, tensor_edit)
    assert main(["check-head", str(bad), "--target", str(target)]) == 1
    out = capsys.readouterr().out.splitlines()
    failed = [line for line in out if line.startswith(check) and "FAIL: " in line]
    assert len(failed) == 1 and expected in failed[0], out
    assert "re-export" in failed[0] or "use a head" in failed[0] or "check --target" in failed[0]
    if check != "golden tau":
        assert any(line.startswith("golden tau") and "skipped" in line for line in out)


def test_speculators_import_refuses_what_the_runtime_cannot_run(setup, tmp_path):
    _, _, _, _, spec = setup
    for edit, expected in [
        (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type 'qwen3' is not supported"),
        (lambda c: c.update(norm_before_fc=True), "norm_before_fc is true"),
        (lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"), "speculative_tokens"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids="2,3"), "should be list[int]|None"),
    ]:
        bad = corrupt(spec, tmp_path / f"bad{len(list(tmp_path.iterdir()))}", edit)
        with pytest.raises(ModelError, match=expected.replace("[", r"\[").replace("|", r"\|")):
            read_config(bad)
    config = read_config(spec)  # the control
    assert (config.layer_ids, config.layer_convention) == ((1, 2, 3), "vllm")


def test_eagle_layout_with_disagreeing_id_lists_is_refused(setup, tmp_path):
    _, _, _, eagle, _ = setup
    bad = corrupt(eagle, tmp_path / "bad", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    with pytest.raises(ModelError, match="name different target layers"):
        read_config(bad)
    vllm_only = corrupt(eagle, tmp_path / "vllm", lambda c: c.pop("eagle_config"))  # a head made for vLLM alone
    assert read_config(vllm_only).taps(4) == read_config(eagle).taps(4) == (1, 2, 3)


def test_shipped_heads_resolve_by_name_and_show_in_models_list(setup, tmp_path, monkeypatch, capsys, runtime):
    _, target, head, eagle, _ = setup
    shipped = tmp_path / "shipped"
    shutil.copytree(eagle, shipped / "eagle3" / "tiny-target")
    (shipped / "eagle3" / "smollm2-135m-instruct").mkdir()
    (shipped / "eagle3" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    monkeypatch.setattr(catalog, "SHIPPED_DIR", shipped)
    assert catalog.resolve_head("tiny-target") == shipped / "eagle3" / "tiny-target"
    assert catalog.resolve_head(str(head)) == head  # a folder wins
    decoder = load_decoder(target, "cpu")
    spec = Speculator.build(SpecOptions("eagle3:tiny-target", "chain", "fixed:3"), decoder, target)
    assert spec.hidden_layers == (1, 2, 3)
    assert main(["check-head", "tiny-target", "--no-golden"]) == 0  # its target: the one recorded at export
    assert main(["export", "eagle3", "tiny-target", "--format", "speculators", "--out", str(tmp_path / "out"),
                 "--max-new-tokens", "4"]) == 0
    with pytest.raises(ConfigError) as err:
        SpecOptions("eagle3:no-such-head").check()
    assert "\n" not in str(err.value) and "or a shipped head: smollm2-135m-instruct, tiny-target" in str(err.value)
    runtime(cache_dir=str(tmp_path / "cache"))
    capsys.readouterr()
    assert main(["models", "list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "drafters" in rows[0]
    smol = next(r for r in rows if r.startswith("smollm2-135m-instruct"))
    assert smol.rstrip().endswith("eagle3:smollm2-135m-instruct")
    assert next(r for r in rows if r.startswith("qwen2.5-coder-0.5b")).rstrip().endswith("-")
    monkeypatch.setattr(catalog, "SHIPPED_DIR", tmp_path / "none")
    with pytest.raises(ConfigError, match="none in this installation"):
        catalog.resolve_head("tiny-target")


def test_export_cli_writes_and_refuses_an_existing_out(setup, tmp_path, capsys):
    _, target, head, _, _ = setup
    out = tmp_path / "cli"
    argv = ["export", "eagle3", str(head), "--format", "speculators", "--out", str(out), "--target", str(target),
            "--depth", "2", "--max-new-tokens", "8"]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", GOLDEN]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists and is not empty" in err
    assert main(["check-head", str(out)]) == 0  # the target recorded at export
    assert main(["export", "eagle3", str(head), "--format", "onnx", "--out", str(tmp_path / "x"),
                 "--target", str(target)]) == 2
    assert "use one of eagle, speculators" in capsys.readouterr().err


def test_golden_compare_rules(setup):
    """Exact on the same machine; across machines within 5% (float32) / 10% (bf16); another
    tokenizer's prompt ids refused."""
    golden = json.loads((setup[3] / GOLDEN).read_text())

    def measured(tau, **changes):
        m = {k: golden[k] for k in ("settings", "prompt_ids", "results", "measured_on")}
        return {**m, "tau": tau, **changes}

    elsewhere = {**golden["measured_on"], "cpu": "another CPU"}
    assert compare(golden, measured(golden["tau"]))[0]
    assert compare(golden, measured(golden["tau"] * 1.04, measured_on=elsewhere))[0]
    ok, message = compare(golden, measured(golden["tau"] * 1.07, measured_on=elsewhere))
    assert not ok and "allowed 5%" in message
    bf16 = {**golden, "settings": {**golden["settings"], "dtype": "bfloat16"}}
    assert compare(bf16, measured(golden["tau"] * 1.07, measured_on=elsewhere, settings=bf16["settings"]))[0]
    ok, message = compare(golden, measured(golden["tau"], prompt_ids=[[0]] * len(golden["prompt_ids"])))
    assert not ok and "encodes the golden prompts differently" in message


def test_export_takes_the_target_from_train_info(setup, tmp_path, capsys):
    """A head `outrider train eagle3` wrote records its --target in train_info.json: export needs no
    --target; a recorded target that does not resolve here is refused in one line."""
    _, target, head, _, _ = setup
    trained = tmp_path / "trained"
    shutil.copytree(head, trained)
    (trained / "train_info.json").write_text(json.dumps({"target": str(target), "steps": 1}))
    out = tmp_path / "out"
    assert main(["export", "eagle3", str(trained), "--format", "eagle", "--out", str(out), "--depth", "2",
                 "--max-new-tokens", "4"]) == 0
    assert f"for {target}" in capsys.readouterr().out
    assert json.loads((out / GOLDEN).read_text())["target"]["name"] == str(target)
    (trained / "train_info.json").write_text(json.dumps({"target": str(tmp_path / "gone")}))
    assert main(["export", "eagle3", str(trained), "--format", "eagle", "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train_info.json records the target" in err and "pass --target" in err, err


def test_check_head_says_a_truncated_weights_file_first(setup, tmp_path, capsys):
    _, target, _, eagle, _ = setup
    bad = corrupt(eagle, tmp_path / "cut")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 100])
    assert main(["check-head", str(bad), "--target", str(target)]) == 1
    out = capsys.readouterr().out.splitlines()
    failed = [line for line in out if "FAIL: " in line]
    assert failed and failed[0].startswith("weights file") and "truncated or corrupt" in failed[0], out
    assert len(failed) == 1, out  # nothing blamed on a tensor the cut file only seems to lack
    assert not any("lm_head" in line for line in out), out


def test_speculators_verifier_loads_offline_by_default(setup, tmp_path, monkeypatch):
    """The recorded verifier is the target's own folder, absolute (given relative here): it loads
    with no network, from anywhere; --verifier still sets it."""
    from transformers import AutoConfig

    root, target, head, _, _ = setup
    monkeypatch.chdir(target.parent)
    out = export_eagle3(head, tmp_path / "spec", "speculators", target.name, golden=False)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(target.resolve())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert AutoConfig.from_pretrained(verifier).model_type == "llama"
    given = export_eagle3(head, tmp_path / "spec2", "speculators", target, golden=False, verifier="org/model")
    assert json.loads((given / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == \
        "org/model"


def test_golden_chain_logits_are_the_reference_heads(setup):
    """The golden's EAGLE-3 slots (heads/eagle3/golden.py `chain_logits`: the chain at each
    committed row fed the text's tokens, through the cached fast path) are the slow float64
    reference's rows (heads/eagle3/reference.py) for the same features and tokens."""
    from outrider.heads.eagle3.golden import chain_logits
    from outrider.heads.eagle3.reference import reference_rows
    from outrider.models.batch import causal_batch

    _, target, head_dir, _, _ = setup
    decoder = load_decoder(target, "cpu")
    head = load_eagle3(head_dir, decoder)
    text, depth = [3, 4, 5, 3, 4, 5, 3, 6, 7, 1, 2, 5], 3
    rows = list(range(2, len(text) - depth))
    fast = chain_logits(head, decoder, text, rows, depth)  # [rows, depth, V]
    taps = head.config.taps(decoder.config.num_layers)
    cache = decoder.new_cache(1, len(text))
    hidden = decoder.forward(causal_batch([torch.tensor(text)], hidden_layers=tuple(sorted(set(taps))),
                                          scratch_row=cache.scratch_row), cache).hidden
    features = torch.stack([hidden[t][0] for t in taps], dim=1)  # [n, 3, Ht]
    for i, r in enumerate(rows):
        feeds = [features[p] for p in range(r + 1)] + [None] * (depth - 1)  # then the chain's own hidden
        slow, _ = reference_rows(head, feeds, text[1: r + depth + 1])  # [r + depth, V]
        torch.testing.assert_close(fast[i], slow[r:].float(), rtol=1e-4, atol=1e-4)
