"""`outrider bench`: the methods file, metric arithmetic, a whole run on a tiny model with its
report, and the lossless audit catching a method that perturbs a token."""

import json
from pathlib import Path

import pytest

from outrider.bench.methods import load_config, parse_config, preset_names, preset_path
from outrider.bench.run import plan, run_bench, write_results
from outrider.bench.runner import PromptRun, aggregate, first_difference
from outrider.cli import main
from outrider.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "methods.toml"
    path.write_text(text)
    return path


def test_presets_parse():
    shipped = {"quick", "full", "eagle3", "dflash", "llamacpp", "qwen-pair", "qwen-pair-i8", "seeds"}
    assert shipped <= set(preset_names())
    for name in preset_names():
        config = load_config(preset_path(name))
        assert config.methods and config.models and config.workloads
    with pytest.raises(ConfigError, match="unknown preset 'fast'"):
        preset_path("fast")


def test_bench_help_lists_every_preset_in_the_folder():
    from outrider.cli import _parser

    bench = _parser()._subparsers._group_actions[0].choices["bench"]
    text = next(a for a in bench._actions if a.dest == "preset").help
    for name in preset_names():
        assert f"{name} (" in text, name  # each with its `# summary:` line


def test_usage_md_says_what_the_quick_preset_runs():
    """docs/usage.md's bench section gives the quick preset's prompts a workload as its file does."""
    import re

    config = load_config(preset_path("quick"))
    usage = (Path(__file__).parents[1] / "docs" / "usage.md").read_text()
    line = next(x for x in usage.splitlines() if "bench --preset quick " in x and "#" in x)
    assert re.search(r"(\d+) prompts a workload", line).group(1) == str(config.prompts), line


def test_results_record_the_flags_that_ran(tiny_folders, tmp_path, capsys):
    """--prompts and --max-new-tokens are what results.json's config and the report's
    Configuration block show, not the methods file's own numbers."""
    methods = write(tmp_path, f"""
models = ["{tiny_folders['llama']}"]
workloads = ["jsonl:{FIXTURES / 'prompts.jsonl'}"]
prompts = 3
max_new_tokens = 64

[[method]]
name = "ngram"
drafter = "ngram"
""")
    out = tmp_path / "out"
    assert main(["bench", "--methods", str(methods), "--prompts", "1", "--max-new-tokens", "4", "--threads", "1",
                 "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert (results["config"]["prompts"], results["config"]["max_new_tokens"], results["config"]["threads"]) == (1, 4, 1)
    assert [len(r["prompts"]) for r in results["runs"]] == [1, 1]
    assert all(len(p["output_ids"]) <= 4 for r in results["runs"] for p in r["prompts"])
    configuration = (out / "report.md").read_text().split("Configuration", 1)[1]
    assert '"prompts": 1' in configuration and '"max_new_tokens": 4' in configuration


@pytest.mark.parametrize("text,expect", [
    ("models = [\n[[method]]\n", "malformed TOML"),
    ('[[method]]\nname = "a"\ndrafter = "ngram"\nspeed = 3\n', "methods.toml:1: method 'a' has unknown key"),
    ('[[method]]\nname = "a"\ndrafter = "ngram"\n\n[[method]]\nname = "b"\ndrafter = "warp"\n',
     "methods.toml:5: method 'b': --drafter 'warp': unknown drafter"),
    ('[[method]]\nname = "a"\npeer = "vllm"\n', "unknown peer 'vllm'"),
    ('[[method]]\nname = "a"\ndrafter = "ngram"\n[[method]]\nname = "a"\ndrafter = "suffix"\n', "used twice"),
    ('[[method]]\nname = "a"\n', "needs a drafter"),
    ('prompts = 0\n', "prompts must be a positive integer"),
    ('colour = "red"\n', "unknown key(s) colour"),
    ("", "no [[method]] table; a methods file needs at least one, with a name and a drafter or a peer"),
    ('models = ["smollm2-135m-instruct"]\nprompts = 2\n', "no [[method]] table"),
])
def test_methods_file_errors_name_file_and_line(tmp_path, text, expect):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert expect in message and "methods.toml" in message and "\n" not in message


def test_bad_methods_file_is_one_line_on_the_cli(tmp_path, capsys):
    path = write(tmp_path, '[[method]]\nname = "a"\ndrafter = "ngram"\ntree = "static:2"\n')
    assert main(["bench", "--methods", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "methods.toml:1" in err[0] and "model drafters" in err[0]


def test_empty_methods_file_is_refused_on_the_cli(tmp_path, capsys, monkeypatch):
    import outrider.bench.run as bench_run

    monkeypatch.setattr(bench_run, "plan", lambda *a, **k: pytest.fail("planned a run of no method"))
    assert main(["bench", "--methods", str(write(tmp_path, "# nothing yet\n"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "needs at least one" in err[0]


def test_unknown_workload_is_refused_before_loading(tmp_path):
    config = parse_config({"workloads": ["gsm8k"], "models": ["/nonexistent"],
                           "method": [{"name": "ngram", "drafter": "ngram"}]}, "x.toml")
    with pytest.raises(ConfigError, match="unknown workload"):
        plan(config)


def test_aggregate_arithmetic():
    runs = [
        PromptRun([1, 2, 3, 4], 2.0, {"rounds": 2, "committed": 4, "accepted_by_position": [2, 0],
                                      "proposed_by_position": [2, 2], "accepted_length_hist": [0, 2],
                                      "acceptance_by_position": [1.0, 0.0], "draft_s": 0.1, "verify_s": 1.5}),
        PromptRun([5, 6], 2.0, {"rounds": 2, "committed": 2, "accepted_by_position": [0],
                                "proposed_by_position": [2], "accepted_length_hist": [2],
                                "acceptance_by_position": [0.0], "draft_s": 0.1, "verify_s": 1.0}),
    ]
    agg = aggregate(runs)
    assert agg["tokens_per_s"] == pytest.approx(6 / 4.0)
    assert agg["mean_accepted_length"] == pytest.approx(6 / 4)
    assert agg["acceptance_by_position"] == pytest.approx([2 / 4, 0 / 2])
    assert agg["accepted_length_hist"] == [2, 2]
    assert agg["draft_s"] == pytest.approx(0.2) and agg["verify_s"] == pytest.approx(2.5)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def tiny_config(folder: Path, extra: str = "", peer: bool = True) -> dict:
    """Two of our methods and, with `peer`, transformers as a peer (a spawned child process that
    imports torch and transformers: seconds, so only where a test is about peers)."""
    import tomllib

    text = f"""
models = ["{folder}"]
workloads = ["jsonl:{FIXTURES / 'prompts.jsonl'}"]
max_new_tokens = 8

[[method]]
name = "ngram"
drafter = "ngram"

[[method]]
name = "early-exit"
drafter = "early-exit:1"
tree = "static:2,1"
controller = "fixed:2"
"""
    if peer:
        text += """
[[method]]
name = "transformers"
peer = "transformers"
"""
    return tomllib.loads(text + extra)


def test_whole_run_on_a_tiny_model_writes_results_and_report(tiny_folders, tmp_path):
    from outrider.bench.report import write_report
    from outrider.bench.table import summary_table

    config = parse_config(tiny_config(tiny_folders["llama"]), "tiny.toml")
    results = run_bench(plan(config), threads=1, progress=False)
    assert results["audit"]["ok"]
    names = [r["method"] for r in results["runs"]]
    assert names == ["autoregressive", "ngram", "early-exit", "transformers"]
    base = results["runs"][0]
    assert base["summary"]["speedup_vs_baseline"] == pytest.approx(1.0)
    for run in results["runs"]:
        assert len(run["prompts"]) == 3
        assert run["summary"]["lossless"] is True
        if run["kind"] == "ours":
            assert run["summary"]["mean_accepted_length"] >= 1.0
            assert [p["output_ids"] for p in run["prompts"]] == [p["output_ids"] for p in base["prompts"]]
    runtime = results["runtime"]  # the config in force, the CPU's instruction sets, the kernels that ran
    assert runtime["config"]["linear"] in ("auto", "linear", "mm_t", "chunked", "packed")
    assert "isa" in runtime["cpu"] and runtime["torch_threads"] >= 1
    assert any(k.startswith("torch float") for k in runtime["kernels"])  # the tiny float32 model's products
    write_results(results, tmp_path)
    files = write_report(json.loads((tmp_path / "results.json").read_text()), tmp_path)
    assert files["html"].exists() and "data:image/png;base64," in files["html"].read_text()
    assert "kernels" in (tmp_path / "report.md").read_text()
    assert "lossless audit: ok" in summary_table(results)


def test_audit_catches_a_method_that_perturbs_a_token(tiny_folders, monkeypatch):
    from outrider.engine import speculator
    from outrider.spec.types import VerifyResult

    real = speculator.Speculator.verifier_for

    def perturbing(self, params):
        verify = real(self, params)
        if self.options.drafter != "ngram":
            return verify

        def broken(tree, logits, p, rng):
            result = verify(tree, logits, p, rng)
            return VerifyResult(result.accepted_nodes, result.tokens[:-1] + [(result.tokens[-1] + 1) % 96])
        return broken

    monkeypatch.setattr(speculator.Speculator, "verifier_for", perturbing)
    # no peer: the audit is of our methods only (results.assemble), so a peer's row is not in it
    config = parse_config(tiny_config(tiny_folders["llama"], peer=False), "tiny.toml")
    results = run_bench(plan(config), threads=1, progress=False)
    assert not results["audit"]["ok"]
    bad = {m["method"] for m in results["audit"]["mismatches"]}
    assert bad == {"ngram"}
    assert all(m["first_difference"] == 0 for m in results["audit"]["mismatches"])


def test_a_lossy_verifier_runs_in_a_greedy_bench_marked_lossy_and_not_counted(tiny_folders):
    """Issue 44: verifier skipping (`verify-skip-lossy:T,G`) runs in a greedy preset: its outputs may
    differ from autoregressive decoding, which its row says ("lossy: differs@n") without failing the
    audit; an exact method beside it is still held to every token."""
    from outrider.bench.results import needs_exit_failure
    from outrider.bench.table import row_mark, summary_table

    extra = """
[[method]]
name = "skip"
drafter = "early-exit:1"
controller = "fixed:4"
verifier = "verify-skip-lossy:0,1"
"""
    raw = tiny_config(tiny_folders["llama"], peer=False)
    import tomllib

    raw["method"] += tomllib.loads(extra)["method"]
    results = run_bench(plan(parse_config(raw, "tiny.toml")), threads=1, progress=False)
    skip = next(r for r in results["runs"] if r["method"] == "skip")
    assert skip["summary"]["lossy"] is True and skip["summary"]["lossless"] is False  # T = 0: drafts committed
    assert results["audit"]["ok"] and results["audit"]["mismatches"] == [] and not needs_exit_failure(results)
    assert row_mark(results, str(tiny_folders["llama"]), "skip", [skip["workload"]]).startswith("lossy: differs@")
    assert row_mark(results, str(tiny_folders["llama"]), "ngram", [skip["workload"]]) == "ok"
    assert "lossy methods are shown, not counted" in summary_table(results)


def test_a_float16_cache_runs_every_method_losslessly(tiny_folders, monkeypatch):
    """kv_dtype = "float16" reaches the target (its caches are float16), is named in the run's
    identity and facts, and every method still equals autoregressive decoding with it."""
    from outrider.bench import run as bench_run
    from outrider.models.decoder import Decoder

    made = []
    original = Decoder.new_cache
    monkeypatch.setattr(Decoder, "new_cache", lambda self, *a, **k: made.append(original(self, *a, **k)) or made[-1])
    import torch

    raw = tiny_config(tiny_folders["llama"], peer=False)  # the cache type is ours: a peer runs its own
    config = parse_config({**raw, "kv_dtype": "float16"}, "tiny.toml")
    assert config.kv_dtype == "float16"
    results = bench_run.run_bench(plan(config), threads=1, progress=False)
    assert results["audit"]["ok"]
    assert any(c.k[0].dtype == torch.float16 for c in made)
    assert all(facts["kv_dtype"] == "float16" for facts in results["models"].values())
    with pytest.raises(ConfigError, match="kv-dtype"):
        parse_config({**raw, "kv_dtype": "int4"}, "tiny.toml")
