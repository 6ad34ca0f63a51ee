"""The report of `outrider bench`: report.md, report.html and PNG plots, from results.json alone.

The content is built once, as a list of blocks, and rendered twice, so the two files say the same
thing: report.md (beside its PNGs) and report.html, one self-contained file (plots embedded as
base64 data URIs, inline CSS, no external resource) that reads offline. All text taken from the
results is escaped for the format it lands in.

    write_report(results, out_dir) -> {"md": report.md, "html": report.html,
                                       "speedup": speedup.png, "tau": ..., "acceptance": ...,
                                       "histogram": ...}

With several models the plots are per model, keyed and named `<plot>-<model>`.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from . import plots
from .round_cost import round_cost_table
from .table import (MISSING, audit_mark, audit_verdict, fmt, fmt_tau, find_run, first_difference, methods, model_names,
                    number, speedup, summary_grid, summary_of, tau, workload_names)

HOW_TO_READ = [
    "Every figure comes from one process on one machine: the methods ran back to back on the same "
    "prompts, so compare the ratios (speed-ups); absolute tokens/s depend on the machine and its load.",
    "x AR: the method's tokens/s over our autoregressive baseline's on the same workload; x HF: over "
    "transformers' generate. Above 1.00x is faster. decode: x AR with every prompt's prefill left out "
    "(what speculation changes; every method pays the same prefill); prefill: its mean seconds a prompt.",
    "tau: mean tokens committed per round, bonus token included (as vLLM and SGLang report it); "
    "autoregressive decoding has tau = 1. Peers report none.",
    "Acceptance at draft position d: of the rounds that drafted a token at depth d, the share that "
    "accepted it. Accepted-length histogram: rounds that accepted exactly a drafts.",
    "lossless: every greedy output equals autoregressive token for token. MISMATCH@n: one of our "
    "methods differed, first at output token n (a bug). differs@n: a peer differed (its numerics "
    "are not ours; peers are not audited). lossy: a verifier lossy by name (e.g. verify-skip-lossy), its "
    "output allowed to differ; differs@n says where, and it is not counted against the audit.",
    "A run that samples (temperature > 0): acc is accepted draft depths over drafted ones; the last column "
    "is the distributional audit's verdict (see its section): pass / FAIL with the Bonferroni-adjusted p-value; "
    "lossy: a lossy verifier, expected to fail; the baseline is the audit's reference.",
    '"-": the figure does not apply or was not measured.',
]


class Loud(str):
    """Text to render so that nobody misses it (a lossless failure)."""


def _loud_if_bad(cell: str) -> str:
    return Loud(cell) if "MISMATCH" in cell or cell == "FAILED" or cell.startswith("FAIL p=") else cell


# -- content ---------------------------------------------------------------------------------------

def build_blocks(results: dict, plot_files: dict[str, Path]) -> list[tuple]:
    """The report as blocks: ("h", level, text), ("p", text), ("list", [text]), ("alarm", text),
    ("table", header, rows), ("code", text), ("img", path, alt)."""
    preset = results.get("preset") or "custom"
    sessions = results.get("sessions") or 1
    resumed = (f" Resumed: it ran in {sessions} sessions (processes); each prompt's methods still ran "
               "back to back in one." if sessions > 1 else "")
    b: list[tuple] = [("h", 1, "outrider bench"),
                      ("p", f"outrider {results.get('outrider_version', '?')}, {preset} run, "
                            f"created {results.get('created', '?')}.{resumed}")]
    audit = results.get("audit") or {}
    bad = audit.get("mismatches") or []
    if audit.get("kind") == "distributional" and audit.get("ok") is False:
        b.append(("alarm", "NOT LOSSLESS: " + audit_verdict(results)))
    elif audit.get("ok") is False or bad:
        b.append(("alarm", f"NOT LOSSLESS: {len(bad)} output(s) of our methods differ from autoregressive "
                           f"(see the lossless audit below). This is a bug in a method."))
    b += [("h", 2, "How to read this"), ("list", HOW_TO_READ)]
    b += _setup(results)
    multi = len(model_names(results)) > 1
    for model in model_names(results):
        b += _model_section(results, model, plot_files, multi)
    b += _audit(results)
    return b


def _setup(results: dict) -> list[tuple]:
    b: list[tuple] = [("h", 2, "Setup")]
    facts = [[k, _text(v)] for k, v in (results.get("machine") or {}).items()]
    facts += [[k, _text(v)] for k, v in (results.get("versions") or {}).items()]
    runtime = results.get("runtime") or {}
    if runtime:
        cpu = runtime.get("cpu") or {}
        facts.append(["cpu", _text(f"{cpu.get('model') or cpu.get('machine')}: {' '.join(cpu.get('isa') or []) or '-'}")])
        changed = {k: v for k, v in (runtime.get("config") or {}).items() if k not in ("cache_dir",)}
        facts.append(["config", _text(", ".join(f"{k}={v}" for k, v in changed.items()))])
        facts.append(["kernels", _text(", ".join(runtime.get("kernels") or []) or "torch")])
        if runtime.get("native"):
            facts.append(["native library", _text(runtime["native"])])
    b.append(("table", ["machine and versions", ""], facts))
    models = results.get("models") or {}
    if models:
        b += [("h", 3, "Models"),
              ("table", ["model", "params", "dtype", "sha256", "of", "path"],
               [[name, _params(m.get("params")),
                 _text(m.get("dtype")) + (f", K/V {m['kv_dtype']}" if m.get("kv_dtype") not in (None, "float32") else ""),
                 _text(m.get("sha256")),
                 _text(m.get("sha256_of")), _text(m.get("path"))] for name, m in models.items()])]
    loads = results.get("workloads") or []
    if loads:
        b += [("h", 3, "Workloads"),
              ("table", ["workload", "prompts", "max new tokens", "chat", "source", "description"],
               [[_text(w.get(k)) for k in ("name", "prompts", "max_new_tokens", "chat", "source", "description")]
                for w in loads])]
    skipped = results.get("skipped") or []
    if skipped:
        b += [("h", 3, "Skipped or failed peers"),
              ("list", [f"{'FAILED: ' if s.get('failed') else 'skipped: '}{s.get('method')} on {s.get('model')}: "
                        f"{s.get('reason')}" for s in skipped])]
    notes = results.get("peer_notes") or []
    if notes:
        b += [("h", 3, "Peer settings"),
              ("list", [f"{n.get('method')} on {n.get('model')}: {n.get('note')}" for n in notes])]
    b += [("h", 3, "Configuration"),
          ("code", json.dumps(results.get("config") or {}, indent=2, default=str, ensure_ascii=False))]
    return b


def _model_section(results: dict, model: str, plot_files: dict[str, Path], multi: bool) -> list[tuple]:
    def img(name: str, alt: str) -> list[tuple]:
        path = plot_files.get(_plot_key(name, model, multi))
        return [("img", path, alt)] if path else []

    loads, per, rows = summary_grid(results, model, vs_transformers=True)
    header = ["method", "kind"] + [f"{w} {col}" for w in loads for col in per] + ["lossless"]
    b: list[tuple] = [("h", 2, f"Results: {model}"),
                      ("table", header, [r[:-1] + [_loud_if_bad(r[-1])] for r in rows])]
    b += img("speedup", f"speed-up over autoregressive by method and workload, {model}")
    b += img("tau", f"tau by method and workload, {model}")
    b.append(("h", 3, "Acceptance by draft position"))
    for w in loads:
        b += _acceptance_table(results, model, w)
        b += round_cost_table(results, model, w)
    b += img("acceptance", f"acceptance by draft position, {model}")
    b += img("histogram", f"accepted-length histogram, {model}")
    return b


def _acceptance_table(results: dict, model: str, workload: str) -> list[tuple]:
    runs = [(m, find_run(results, model, workload, m.name)) for m in methods(results, model)]
    runs = [(m, r) for m, r in runs if summary_of(r).get("acceptance_by_position")]
    if not runs:
        return [("p", f"{workload}: no method drafted.")]
    depth = max(len(summary_of(r)["acceptance_by_position"]) for _, r in runs)
    header = ["method", "tau"] + [str(d) for d in range(1, depth + 1)] + ["draft %", "verify %", "other %"]
    rows = []
    for m, r in runs:
        acc = summary_of(r)["acceptance_by_position"]
        rows.append([m.label, fmt_tau(tau(r))] + [fmt(acc[d] if d < len(acc) else None, "{:.2f}")
                                                  for d in range(depth)] + _time_split(summary_of(r)))
    return [("p", f"{workload}: acceptance at each draft position, and where the time went."),
            ("table", header, rows)]


def _time_split(s: dict) -> list[str]:
    seconds, draft, verify = number(s.get("seconds")), number(s.get("draft_s")), number(s.get("verify_s"))
    if not seconds or draft is None or verify is None:
        return [MISSING] * 3
    other = number(s.get("other_s"))
    other = max(seconds - draft - verify, 0.0) if other is None else other
    return [fmt(100 * x / seconds, "{:.0f}") for x in (draft, verify, other)]


def _distributional(results: dict) -> list[tuple]:
    """A bench that samples: each method's audit (bench/audit.py) per model."""
    audit = results.get("audit") or {}
    b: list[tuple] = [("h", 2, "Distributional audit"), ("p", audit_verdict(results)),
                      ("p", "Per method: its tokens at each of the first output positions against our autoregressive "
                            "sampling's on the same prompt (other seeds), a two-sample chi-square test a position, "
                            "the smallest p-value times the number of tests (Bonferroni) against alpha. drafted / "
                            "accepted: how much speculation the audit's samples exercised. Peers: not audited.")]
    for model, m in (audit.get("models") or {}).items():
        prompts = ", ".join(f"{a['workload']} {a['prompt']} (last {a['context_tokens']} tokens, {a['samples']} samples "
                            f"x {a['positions']} positions)" for a in m.get("prompts", []))
        b.append(("p", f"{model}: {prompts or 'nothing audited'}"))
        b.append(("table", ["method", "verdict", "adjusted p", "tests", "worst position", "drafted", "accepted"],
                  [[name, _loud_if_bad(audit_mark(results, model, name, "ours")), fmt(e.get("adjusted_p"), "{:.3g}"),
                    _text(e.get("tests")), _text((e.get("worst") or {}).get("position")), _text(e.get("drafted")),
                    _text(e.get("accepted"))] for name, e in m.get("methods", {}).items()]))
    return b


def _audit(results: dict) -> list[tuple]:
    audit = results.get("audit") or {}
    bad = audit.get("mismatches") or []
    if audit.get("kind") == "distributional":
        return _distributional(results)
    b: list[tuple] = [("h", 2, "Lossless audit")]
    if audit.get("ok") is False or bad:
        b.append(("alarm", f"FAILED: {len(bad)} output(s) of our methods differ from autoregressive."))
        labels = {(r["model"], r["method"]): r.get("label") or r["method"] for r in results.get("runs", [])}
        b.append(("table", ["model", "workload", "method", "prompt", "first differing output token"],
                  [[_text(m.get("model")), _text(m.get("workload")),
                    _text(labels.get((m.get("model"), m.get("method")), m.get("method"))),
                    _text(m.get("prompt")), Loud(f"MISMATCH@{m.get('first_difference')}")] for m in bad]))
    elif audit.get("ok") is True:
        b.append(("p", "ok: every greedy output of our methods equals autoregressive, token for token."))
    else:
        b.append(("p", "No audit in these results."))
    peers = [(r, first_difference(results, r)) for r in results.get("runs", []) if r.get("kind") == "peer"]
    peers = [(r, d) for r, d in peers if d is not None]
    if peers:
        b.append(("p", "Peers that differed from our autoregressive output (not audited: other numerics):"))
        b.append(("list", [f"{r.get('label') or r['method']} on {r['model']} / {r['workload']}: "
                           f"first at output token {d}" for r, d in peers]))
    return b


def _text(value) -> str:
    return MISSING if value is None or value == "" else str(value)


def _params(value) -> str:
    n = number(value)
    if n is None:
        return _text(value)
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:.0f}"


# -- plots -----------------------------------------------------------------------------------------

def _plot_key(name: str, model: str, multi: bool) -> str:
    return f"{name}-{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}" if multi else name


def draw_plots(results: dict, out_dir: Path) -> dict[str, Path]:
    """Every plot for every model, as {key: path}; a plot with nothing to draw is left out."""
    files: dict[str, Path] = {}
    models = model_names(results)
    for model in models:
        ms, loads = methods(results, model), workload_names(results, model)
        labels = [m.label for m in ms]

        def grid(get, ms=ms):
            return [[get(find_run(results, model, w, m.name)) for w in loads] for m in ms]

        key = lambda name: _plot_key(name, model, len(models) > 1)  # noqa: E731
        path = lambda name: out_dir / f"{key(name)}.png"  # noqa: E731
        with_tau = [i for i, row in enumerate(grid(tau)) if any(v is not None for v in row)]
        no_tau = len(ms) - len(with_tau)
        drawn = {
            "speedup": plots.bars_by_method(
                path("speedup"), f"Speed-up over our autoregressive baseline ({model})",
                "speed-up (tokens/s over autoregressive tokens/s, same run)",
                [m.label + (" (peer)" if m.kind == "peer" else "") for m in ms], loads,
                grid(lambda r: speedup(results, r)), reference=1.0, reference_label="autoregressive = 1.0",
                pattern="{:.2f}x"),
            "tau": plots.bars_by_method(
                path("tau"), f"tau: tokens committed per round, bonus included ({model})", "tau",
                [labels[i] for i in with_tau], loads, [grid(tau)[i] for i in with_tau], reference=1.0,
                reference_label="autoregressive = 1", note=f"{no_tau} method(s) without tau (peers) left out"
                if no_tau else ""),
            "acceptance": plots.acceptance_lines(
                path("acceptance"), labels, loads, grid(lambda r: summary_of(r).get("acceptance_by_position"))),
            "histogram": plots.length_histograms(
                path("histogram"), labels, loads,
                grid(lambda r: summary_of(r).get("accepted_length_hist")
                     if summary_of(r).get("acceptance_by_position") else None)),
        }
        files.update({key(name): p for name, p in drawn.items() if p is not None})
    return files


# -- rendering -------------------------------------------------------------------------------------

# Backslash-escape what Markdown would read as markup; "_" only at a word's edge (x86_64 stays).
_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def _md(text: str) -> str:
    escaped = _MD_SPECIAL.sub(r"\\\1", str(text).replace("\n", " "))
    return f"**{escaped}**" if isinstance(text, Loud) else escaped


def render_markdown(blocks: list[tuple], out_dir: Path) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append(f"{'#' * block[1]} {_md(block[2])}")
        elif kind == "p":
            out.append(_md(block[1]))
        elif kind == "alarm":
            out.append(f"> **{_md(block[1])}**")
        elif kind == "list":
            out.append("\n".join(f"- {_md(item)}" for item in block[1]))
        elif kind == "table":
            header, rows = block[1], block[2]
            lines = ["| " + " | ".join(_md(h) for h in header) + " |",
                     "|" + "|".join("---:" if _numeric_column(rows, i) else "---" for i in range(len(header))) + "|"]
            lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "code":
            fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", block[1])), default=0))
            out.append(f"{fence}json\n{block[1]}\n{fence}")
        elif kind == "img":
            out.append(f"![{_md(block[2])}]({block[1].relative_to(out_dir).as_posix()})")
    return "\n\n".join(out) + "\n"


_NUMERIC = re.compile(r"^(-|-?\d[\d.,]*(x|%|M|B)?)$")


def _numeric_column(rows: list[list[str]], i: int) -> bool:
    cells = [row[i] for row in rows if i < len(row)]
    return bool(cells) and all(_NUMERIC.match(c) for c in cells) and any(c != MISSING for c in cells)


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
       max-width: 1200px; margin: 2em auto; padding: 0 1em; line-height: 1.45; }
h1, h2, h3 { line-height: 1.2; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
.scroll { overflow-x: auto; margin: .8em 0; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f4f6; } tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.bad, .bad { color: #b00020; font-weight: 700; }
.alarm { border: 2px solid #b00020; background: #fdecee; color: #b00020; font-weight: 700;
         padding: .6em 1em; border-radius: 4px; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: 12px; }
figure { margin: 1.2em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; }
"""


def _cell_class(cell: str, numeric: bool) -> str:
    return ' class="bad"' if isinstance(cell, Loud) else ' class="num"' if numeric else ""


def render_html(blocks: list[tuple]) -> str:
    esc = html.escape
    title = next((b[2] for b in blocks if b[0] == "h"), "outrider bench")
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind == "h":
            out.append(f"<h{block[1]}>{esc(block[2])}</h{block[1]}>")
        elif kind == "p":
            out.append(f"<p>{esc(block[1])}</p>")
        elif kind == "alarm":
            out.append(f'<p class="alarm">{esc(block[1])}</p>')
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            header, rows = block[1], block[2]
            numeric = [_numeric_column(rows, i) for i in range(len(header))]
            cells = ["<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"]
            for row in rows:
                cells.append("<tr>" + "".join(
                    f"<td{_cell_class(c, numeric[i])}>{esc(c)}</td>"
                    for i, c in enumerate(row)) + "</tr>")
            out.append('<div class="scroll"><table>' + "".join(cells) + "</table></div>")
        elif kind == "code":
            out.append(f"<details><summary>configuration (JSON)</summary><pre>{esc(block[1])}</pre></details>")
        elif kind == "img":
            data = base64.b64encode(block[1].read_bytes()).decode("ascii")
            out.append(f'<figure><img src="data:image/png;base64,{data}" alt="{esc(block[2])}">'
                       f"<figcaption>{esc(block[2])}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(results: dict, out_dir: Path) -> dict[str, Path]:
    """Plots, report.md and report.html in `out_dir`; returns every file written, by key."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = draw_plots(results, out_dir)
    blocks = build_blocks(results, files)
    files["md"] = out_dir / "report.md"
    files["md"].write_text(render_markdown(blocks, out_dir), encoding="utf-8")
    files["html"] = out_dir / "report.html"
    files["html"].write_text(render_html(blocks), encoding="utf-8")
    return files
