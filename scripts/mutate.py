"""Mutation testing of the exactness core (`make mutate`), with mutmut, bounded in time.

    python scripts/mutate.py                      # every group, 20 minutes each at most
    python scripts/mutate.py stopping verifiers   # some groups
    python scripts/mutate.py --minutes 5 --show   # shorter; print each survivor's diff

Each group mutates a few modules and runs only the fast tests that exercise them (mutmut runs,
for each mutant, the tests that cover the mutated function, each in a forked process). A group
runs in its own folder under build/mutate/<group>/ (a copy of outrider/ and tests/ with a
pyproject.toml naming that group's modules and tests), so groups do not share mutmut's state.
The summary (killed, survived, timed out, score per module, and every survivor's diff) goes to
build/mutate/summary.json and is printed; docs/mutation.md records the last full run and why
each surviving mutant cannot change behaviour.

Why mutmut (not cosmic-ray): it forks the test process per mutant after importing torch once and
runs only the tests that cover the mutated function, so a mutant costs a fraction of a second
instead of an interpreter start, and it needs no session database or worker setup.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "mutate"


def stop_in_round(kinds=("eos", "length", "stop string", "context"), places=("first", "middle", "last draft", "bonus"),
                  shapes=("chain", "static:2,2,1,1", "dynamic"), samplings=("greedy", "seeded")) -> list[str]:
    """Cases of test_stop_in_round.py's main test (4 x 4 x 3 x 2 = 96 of them, ~0.2 s each): a
    group that needs only some of them runs those."""
    return [f"test_stop_in_round.py::test_stop_inside_a_round_equals_plain_decoding[{k}-{p}-{s}-{m}]"
            for k in kinds for p in places for s in shapes for m in samplings]


STOP_IN_ROUND_OTHERS = ["test_stop_in_round.py::test_streamed_text_and_stop_through_llm_generate",
                        "test_stop_in_round.py::test_eos_at_the_length_limit_is_eos",
                        "test_stop_in_round.py::test_ignore_eos_runs_on_through_a_round",
                        "test_stop_in_round.py::test_without_a_tokenizer_there_is_no_text"]

# group -> (modules to mutate, the tests that exercise them); fast tests only (no packaged model).
# A mutant that survives runs every selected test that calls the mutated function, so the slow
# and redundant ones are left out: each group must finish within 20 minutes on 2 busy cores.
GROUPS = {
    "verifiers": (["spec/verify_greedy.py", "spec/verify_chain.py", "spec/verify_tree.py", "spec/verify_multidraft.py",
                   "spec/verifiers.py"],
                  ["test_verify_greedy.py", "test_verify_chain.py", "test_verify_tree.py", "test_verify_multidraft.py",
                   "test_verify_registry.py", "test_verify_chisquare.py", "test_verify_random.py",
                   "test_verify_real_rows.py", "test_spec_sampling_exact.py"]),
    "stopping": (["engine/stopping.py"], ["test_stop_in_round.py", "test_stop_at_start.py",
                                          "test_processing.py::test_stop_token_ids_end_the_output_kept"]),
    "random": (["spec/random.py"], ["test_verify_random.py", "test_verify_chisquare.py", "test_seed_reproducible.py",
                                   "test_spec_sampling_exact.py"]),
    "tree": (["spec/tree.py"], ["test_tree.py", "test_verify_tree.py", "test_verify_greedy.py",
                               "test_verify_multidraft.py", "test_runtime_tree_cache.py",
                               "test_spec_limits.py::test_tree_problem_names_each_defect",
                               *stop_in_round(kinds=("eos",), places=("middle",))]),
    "round": (["engine/round.py", "engine/verify.py", "engine/commit.py", "models/kv_cache.py"],
              ["test_round.py", "test_runtime_tree_cache.py", "test_serve_kv_views.py",
               "test_spec_greedy_equal.py::test_early_exit", "test_spec_greedy_equal.py::test_self_draft_accepts_everything",
               "test_spec_greedy_equal.py::test_early_exit_over_the_target_cache[static:2,2,1]",
               "test_spec_greedy_equal.py::test_independent_draft_model",
               "test_spec_greedy_equal.py::test_controllers_keep_output", "test_serve_engine.py",
               "test_processing.py::test_logprobs_are_the_targets_and_equal_under_speculation",
               "test_processing.py::test_logprobs_match_a_plain_forward",
               "test_processing.py::test_seeded_sampling_with_processing_is_the_plain_sample",
               "test_seed_reproducible.py::test_sampled_chain_repeats_itself_whatever_the_batch",
               "test_eagle3_spec.py::test_the_drafter_gets_the_targets_hidden_states", "test_engine_faults.py",
               *stop_in_round(places=("middle",), shapes=("static:2,2,1,1",)), "test_stop_at_start.py"]),
    "text": (["engine/text_stream.py"], ["test_text.py", *stop_in_round(kinds=("stop string",), shapes=("chain",)),
                                        "test_stop_in_round.py::test_streamed_text_and_stop_through_llm_generate",
                                        "test_stop_at_start.py"]),
    "loop": (["engine/loop.py", "engine/drafting.py", "engine/constrain.py"], ["test_loop.py", "test_grammar_tiny.py", "test_serve_engine.py", "test_engine_faults.py",
                                  "test_processing.py::test_logprobs_match_a_plain_forward",
                                  "test_processing.py::test_prompt_logprobs_and_a_shared_prefill",
                                  "test_processing.py::test_token_ids_outside_the_vocabulary_are_refused",
                                  "test_eagle3_spec.py::test_the_drafter_gets_the_targets_hidden_states",
                                  "test_eagle3_spec.py::"
                                  "test_a_shared_prompt_is_prefilled_again_for_a_drafter_that_reads_hidden_states",
                                  *stop_in_round(places=("middle",), shapes=("dynamic",)),
                                  *STOP_IN_ROUND_OTHERS, "test_stop_at_start.py"]),
    # the mixture-of-experts MLP and its reading (Qwen3-Next's; issue 41 builds on it), against its family's tests
    "moe": (["models/moe_layer.py", "models/moe_config.py", "weights/mlp_load.py"], ["test_qwen3_next.py"]),
    # latent attention (issue 40): its forms, its cache, its sizes and its reading, against transformers' MLA families
    "mla": (["models/latent_layer.py", "models/latent_cache.py", "models/mla_config.py", "weights/latent_load.py"],
            ["test_mla.py", "test_mla_convert.py"]),
}

STATUS = re.compile(r"^\s*(outrider\.\S+): (\S.*)$")


def pyproject(modules: list[str], tests: list[str]) -> str:
    quoted = lambda items: ", ".join(f'"{x}"' for x in items)  # noqa: E731
    base = (ROOT / "pyproject.toml").read_text().split("[tool.mutmut]")[0]
    return base + f"""[tool.mutmut]
source_paths = ["outrider"]
only_mutate = [{quoted("outrider/" + m for m in modules)}]
pytest_add_cli_args_test_selection = [{quoted("tests/" + t for t in tests)}]
pytest_add_cli_args = ["-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
"""


def run_group(name: str, minutes: float, log) -> dict:
    modules, tests = GROUPS[name]
    work = OUT / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(ROOT / "outrider", work / "outrider", ignore=shutil.ignore_patterns("__pycache__", "shipped"))
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "pyproject.toml").write_text(pyproject(modules, tests))
    mutmut = Path(sys.executable).with_name("mutmut")
    start = time.monotonic()
    log(f"[{name}] mutating {', '.join(modules)} against {len(tests)} test files (at most {minutes:g} min)")
    env = dict(os.environ)
    env["OUTRIDER_TEST_TINY_CACHE"] = str(work / "tiny-models")  # tests/tiny.py: built once, not per mutant
    (work / "tiny-models").mkdir()
    try:
        subprocess.run([str(mutmut), "run", "--max-children", str(os.cpu_count() or 1)], cwd=work, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=minutes * 60)
        finished = True
    except subprocess.TimeoutExpired:
        finished = False
    results = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=work, env=env, capture_output=True,
                             text=True).stdout
    by_module: dict[str, dict[str, int]] = {}
    survivors = []
    for line in results.splitlines():
        m = STATUS.match(line)
        if not m:
            continue
        mutant, status = m.group(1), m.group(2).strip()
        module = mutant.rsplit(".x", 1)[0] if ".x" in mutant else mutant
        counts = by_module.setdefault(module, {})
        counts[status] = counts.get(status, 0) + 1
        if status == "survived":
            diff = subprocess.run([str(mutmut), "show", mutant], cwd=work, env=env, capture_output=True,
                                  text=True).stdout
            survivors.append({"mutant": mutant, "diff": [ln for ln in diff.splitlines()
                                                         if ln.startswith(("+ ", "- ", "+\t", "-\t"))]})
    for module, counts in by_module.items():
        killed, survived = counts.get("killed", 0), counts.get("survived", 0)
        counts["score"] = round(killed / max(killed + survived, 1), 3)
    return {"group": name, "modules": modules, "tests": tests, "finished": finished,
            "minutes": round((time.monotonic() - start) / 60, 1), "by_module": by_module, "survivors": survivors}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("groups", nargs="*", help=f"groups to run (default: all): {', '.join(GROUPS)}")
    parser.add_argument("--minutes", type=float, default=20.0, help="time bound per group (default 20)")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    args = parser.parse_args(argv)
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        print(f"error: unknown group(s) {', '.join(unknown)}: use {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    if shutil.which("mutmut", path=str(Path(sys.executable).parent)) is None:
        print("error: mutmut is not installed: pip install 'outrider[mutate]' (or `make mutate`)", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    summary = [run_group(g, args.minutes, log) for g in (args.groups or GROUPS)]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "summary.json"  # groups run earlier and not now are kept
    earlier = json.loads(path.read_text()) if path.is_file() else []
    ran = {g["group"] for g in summary}
    path.write_text(json.dumps([g for g in earlier if g["group"] not in ran] + summary, indent=2))
    for g in summary:
        bound = "" if g["finished"] else f" (stopped at the {args.minutes:g}-minute bound)"
        print(f"{g['group']}: {g['minutes']} min{bound}")
        for module, counts in g["by_module"].items():
            rest = {k: v for k, v in counts.items() if k not in ("killed", "survived", "score")}
            print(f"  {module}: killed {counts.get('killed', 0)}, survived {counts.get('survived', 0)}, "
                  f"score {counts['score']:.3f}" + (f", {rest}" if rest else ""))
        if args.show:
            for s in g["survivors"]:
                print(f"  survived {s['mutant']}:\n    " + "\n    ".join(s["diff"]))
    print(f"summary: {OUT / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
