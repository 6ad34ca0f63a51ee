"""The bench report from a synthetic results.json: every file written, plots are real PNGs, the html
is one self-contained file with escaped text, a lossless failure is said loudly everywhere."""

from __future__ import annotations

import re

import pytest

from outrider.bench.table import summary_table


def write_report(*args, **kwargs):
    """outrider.bench.report's, imported at the first call: it imports matplotlib (about 0.45 s of
    CPU in every pytest-xdist worker, each of which collects this file)."""
    from outrider.bench.report import write_report as write

    return write(*args, **kwargs)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EVIL = "suffix <b>&</b> \"tree\" | fixed:6"  # an ours method whose label needs escaping


def _run(workload: str, method: str, label: str, kind: str, tps: float, speedup: float | None,
         tau: float | None = None, acceptance=(), hist=(), first_difference=None, hf=None) -> dict:
    summary = {"new_tokens": 128, "seconds": 128 / tps, "tokens_per_s": tps,
               "speedup_vs_baseline": speedup, "speedup_vs_transformers": hf,
               "lossless": first_difference is None, "mismatches": int(first_difference is not None)}
    if tau is not None:
        summary.update({"mean_accepted_length": tau, "acceptance_by_position": list(acceptance),
                        "accepted_length_hist": list(hist), "draft_s": 0.4, "verify_s": 2.0, "other_s": 0.3})
    prompts = [{"id": f"{workload}/0", "new_tokens": 64, "seconds": 64 / tps, "tokens_per_s": tps,
                "first_difference": None, "stats": {}},
               {"id": f"{workload}/1", "new_tokens": 64, "seconds": 64 / tps, "tokens_per_s": tps,
                "first_difference": first_difference, "stats": {}}]
    return {"model": "smollm2-135m-instruct", "workload": workload, "method": method, "label": label,
            "kind": kind, "prompts": prompts, "summary": summary}


def make_results() -> dict:
    runs = []
    for w, diff in (("humaneval", 17), ("toolcall", None)):
        runs += [
            _run(w, "autoregressive", "autoregressive (ours)", "baseline", 20.0, 1.0, tau=1.0, hist=[2560], hf=1.1),
            _run(w, "suffix", EVIL, "ours", 37.0, 1.85 if w == "humaneval" else 2.34, tau=2.71,
                 acceptance=[0.81, 0.62, 0.45, 0.30], hist=[40, 30, 20, 10, 5], first_difference=diff, hf=2.04),
            _run(w, "transformers", "transformers generate", "peer", 18.2, 0.91, hf=1.0),
        ]
    return {
        "outrider_version": "0.1.0", "created": "2026-11-29T09:00:00+00:00", "preset": "quick",
        "machine": {"processor": "x86_64", "cores": 2, "threads": 2, "device": "cpu", "platform": "Linux"},
        "versions": {"python": "3.12.3", "torch": "2.13.0+cpu", "transformers": "4.57.0"},
        "models": {"smollm2-135m-instruct": {"path": "/cache/smollm2", "sha256": "ab" * 32,
                                             "params": 134515008}},
        "config": {"workloads": ["humaneval", "toolcall"], "max_new_tokens": 64,
                   "method": [{"name": "suffix", "drafter": "suffix", "controller": "fixed:6"}]},
        "runs": runs,
        "audit": {"ok": False, "mismatches": [{"model": "smollm2-135m-instruct", "workload": "humaneval",
                                               "method": "suffix", "prompt": "humaneval/1",
                                               "first_difference": 17}]},
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """One report for the tests that only read it (drawing is the slow part)."""
    return write_report(make_results(), tmp_path_factory.mktemp("report"))


def test_report_files_and_plots(files):
    tmp_path = files["md"].parent
    assert {"md", "html", "speedup", "tau", "acceptance", "histogram"} <= set(files)
    for key, path in files.items():
        assert path.is_file() and path.parent == tmp_path, key
    for key in ("speedup", "tau", "acceptance", "histogram"):
        data = files[key].read_bytes()
        assert data.startswith(PNG_MAGIC), key
        assert len(data) > 5_000, key  # a real figure, not an empty canvas
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 400 and height >= 200, (key, width, height)


def test_html_is_self_contained_and_escaped(files):
    page = files["html"].read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') == 4
    assert not re.search(r"https?://", page)
    assert not re.search(r"<(link|script)\b", page, re.IGNORECASE)
    assert "<b>&</b>" not in page
    assert "suffix &lt;b&gt;&amp;&lt;/b&gt; &quot;tree&quot; | fixed:6" in page
    assert "MISMATCH@17" in page
    assert 'class="alarm"' in page and 'class="bad"' in page


def test_markdown_says_the_mismatch_and_links_plots(files):
    md = files["md"].read_text(encoding="utf-8")
    assert "**MISMATCH@17 humaneval**" in md
    assert "NOT LOSSLESS" in md and "FAILED" in md
    assert "humaneval/1" in md
    for name in ("speedup.png", "tau.png", "acceptance.png", "histogram.png"):
        assert f"]({name})" in md
    assert "ab" * 32 in md  # the model checksum
    assert "suffix \\<b\\>&\\</b\\> \"tree\" \\| fixed:6" in md  # a | would split the table row
    assert "| 0.81 | 0.62 | 0.45 | 0.30 |" in md  # acceptance by position
    assert "tokens committed per round, bonus token included" in md


def test_terminal_table():
    table = summary_table(make_results())
    lines = table.splitlines()
    assert "1.85x" in table and "2.34x" in table and "0.91x" in table
    assert "2.71" in table and "MISMATCH@17 humaneval" in table
    assert "LOSSLESS AUDIT FAILED" in table
    row = {name: next(line for line in lines if line.startswith(name))
           for name in ("autoregressive", "suffix", "transformers")}
    assert row["transformers"].split()[-1] == "ok"
    assert " - " in row["transformers"]  # a peer has no tau
    # the columns line up: a speed-up ends where its header does
    header = next(line for line in lines if line.startswith("method"))
    end = header.index("x AR") + len("x AR")
    assert row["suffix"][end - len("1.85x"):end] == "1.85x"
    assert row["transformers"][end - len("0.91x"):end] == "0.91x"


def test_missing_figures_render_as_dashes(tmp_path):
    results = make_results()
    for run in results["runs"]:
        run["summary"]["speedup_vs_baseline"] = None  # computed from tokens/s instead
    results["runs"] = [r for r in results["runs"] if r["method"] != "autoregressive"]
    results["audit"] = {"ok": True, "mismatches": []}
    files = write_report(results, tmp_path)
    assert "tau" in files and files["html"].is_file()
    assert "- " in summary_table(results)


def test_decode_only_speedup_and_prefill_columns():
    """decode = tokens over (seconds - prefill) against the baseline's same figure; prefill = the
    mean seconds a prompt; a peer without prefill timings shows "-" for both."""
    from outrider.bench.runner import PromptRun, aggregate

    def runs(seconds, prefill):
        return [PromptRun(output_ids=[1] * 10, seconds=s, stats={"prefill_s": p}) for s, p in zip(seconds, prefill)]

    base, spec = aggregate(runs([2.0, 3.0], [1.0, 1.5])), aggregate(runs([1.5, 2.0], [1.0, 1.5]))
    assert base["prefill_s"] == 2.5 and base["decode_tokens_per_s"] == 20 / 2.5
    assert spec["decode_tokens_per_s"] == 20 / 1.0
    assert "prefill_s" not in aggregate([PromptRun(output_ids=[1], seconds=1.0, stats={})])
    results = make_results()
    for run in results["runs"]:
        if run["kind"] != "peer":
            run["summary"].update(base if run["kind"] == "baseline" else spec)
            run["prompts"] = [{}, {}]
    table = summary_table(results)
    header = next(line for line in table.splitlines() if line.startswith("method"))
    row = {name: next(line for line in table.splitlines() if line.startswith(name))
           for name in ("autoregressive", "suffix", "transformers")}
    for name, decode, prefill in (("autoregressive", "1.00x", "1.25s"), ("suffix", "2.50x", "1.25s"),
                                  ("transformers", "-", "-")):
        end = header.index("decode") + len("decode")
        assert row[name][end - len(decode):end] == decode, name
        end = header.index("prefill") + len("prefill")
        assert row[name][end - len(prefill):end] == prefill, name
