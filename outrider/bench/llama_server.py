"""llama.cpp's `llama-server` as a bench peer: its binary in a subprocess, spoken to over HTTP.

    llama-server                     its plain decoding
    llama-server:TYPE                its speculative decoding, `--spec-type TYPE` (SPEC_TYPES)
    llama-server:draft-simple:N      the same with `--spec-draft-n-max N` (its default drafts 3)
    llama-server:draft-eagle3[:N]    its learned drafters, with our head exported as GGUF: the
    llama-server:draft-dflash[:N]    method's `head` (a shipped head's name or a head folder),
    llama-server:draft-dspark[:N]    written by heads/gguf_export.py as `outrider export KIND HEAD
                                     --format gguf` does, into a folder the peer deletes when closed

draft-simple drafts with a draft model: the method's `assistant` (its packaged GGUF, `-md`). The
learned types draft with the exported head (`-md`, and the bench's threads as `-td`, `-tbd`); with
:N they draft a fixed chain of N, as ours under `fixed:N` (`--spec-draft-n-max N --spec-draft-n-min
0 --spec-draft-p-min 0`, as scripts/llamacpp_head_check.py runs them), without it its defaults.
The server runs on the model's original GGUF (catalog models keep one), with the bench's threads
(`-t`, `-tb`, and the draft's `-td`, `-tbd`), one slot, no web UI. Each prompt is one POST
/completion with the bench's prompt token ids, n_predict = the prompt's budget, temperature 0,
cache_prompt false and return_tokens true; it stops at the model's end-of-generation tokens as
ours do. In a bench that samples (bench/sampling.py) it samples too: the bench's temperature and
top-p in our order (`samplers` ["temperature", "top_p"]: no top-k, min-p or penalties, which its
defaults would add), seeded with the prompt's timed seed (modulo 2**31, its seed field's range);
its own random numbers, so its text is not ours, and it is not audited. The row's seconds are
the request's wall time (prefill included, as every row's); its own `timings` (prompt_ms,
predicted_per_token_ms, draft_n, draft_n_accepted) go in the stats.

The binary: $OUTRIDER_LLAMA_SERVER, else `llama-server` on PATH, else the one
scripts/build_llama_server.sh built into the cache (cache_dir()/llama-server/*/build/bin/).

Weight repacking: llama.cpp built with its defaults segfaulted in its first completion on an
Intel Xeon with AMX (its repacked / AMX weight buffers; issue 45). So the server is started with
its defaults and given one short warm-up completion; if it dies (loading or in that completion)
it is started again with `--no-repack`, and the peer's note says so and why. A server that dies
with both, or later in the run, is a failed row with its reason (run.py); the bench goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import ConfigError
from .peer_process import PeerFailed, PeerUnavailable
from .runner import PromptRun

PEER = "llama-server"
SPEC_TYPES = ("draft-simple", "ngram-mod", "ngram-cache", "ngram-simple", "ngram-map-k", "ngram-map-k4v",
              "draft-eagle3", "draft-dflash", "draft-dspark")
NEEDS_DRAFT = {"draft-simple"}  # a draft model: the method's assistant
HEAD_KINDS = {"draft-eagle3": "eagle3", "draft-dflash": "dflash", "draft-dspark": "dspark"}  # our head kind each loads
LOAD_TIMEOUT_S = 600.0  # to load the model(s) and answer /health
RUN_TIMEOUT_S = 1800.0  # one prompt's completion
CONTEXT = 8192  # -c: the longest prompt plus its budget
WARMUP_IDS = list(range(100, 132))  # any 32 ids every vocabulary has


def is_kind(peer: str) -> bool:
    return peer == PEER or peer.startswith(PEER + ":")


def parse_kind(peer: str) -> tuple[str | None, int | None]:
    """(spec type or None, draft n-max or None) of a peer kind; a ConfigError names what is wrong."""
    parts = peer.split(":")
    if parts[0] != PEER or len(parts) > 3:
        raise ConfigError(f"'{peer}' is not a llama-server peer; write llama-server[:TYPE[:N]]")
    if len(parts) == 1:
        return None, None
    kind = parts[1]
    if kind not in SPEC_TYPES:
        raise ConfigError(f"llama-server spec type '{kind}' is not one the bench runs; known: {', '.join(SPEC_TYPES)}")
    if len(parts) == 2:
        return kind, None
    if kind not in NEEDS_DRAFT and kind not in HEAD_KINDS:
        raise ConfigError(f"'{peer}': a draft length (:N) applies to draft-simple and the learned draft-* types only")
    if not parts[2].isdigit() or int(parts[2]) < 1:
        raise ConfigError(f"'{peer}': the draft length must be a positive integer, got '{parts[2]}'")
    return kind, int(parts[2])


def find_binary() -> Path:
    """The llama-server to run (module docstring), or PeerUnavailable saying how to get one."""
    given = os.environ.get("OUTRIDER_LLAMA_SERVER")
    if given:
        if not os.access(given, os.X_OK):
            raise PeerUnavailable(f"OUTRIDER_LLAMA_SERVER={given} is not an executable file")
        return Path(given)
    on_path = shutil.which(PEER)
    if on_path:
        return Path(on_path)
    from ..config import cache_dir

    built = sorted(Path(cache_dir()).glob("llama-server/*/build/bin/llama-server"))
    if built:
        return built[-1]
    raise PeerUnavailable("no llama-server binary: build one with scripts/build_llama_server.sh "
                          "(or set OUTRIDER_LLAMA_SERVER)")


def server_args(binary: Path, gguf: Path, kind: str, threads: int, port: int, draft_gguf: Path | None,
                repack: bool, slots: int = 1, context: int = CONTEXT) -> list[str]:
    """The command line that starts the server for a peer kind: `slots` requests decoded at once
    (-np; the bench's one, a load test's clients), `context` rows of K/V in all (-c)."""
    spec, n_max = parse_kind(kind)
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-c", str(context), "-np", str(slots), "--no-webui"]
    if spec:
        args += ["--spec-type", spec]
    if spec in NEEDS_DRAFT or spec in HEAD_KINDS:
        args += ["-md", str(draft_gguf), "-td", str(threads), "-tbd", str(threads)]
    if n_max:
        args += ["--spec-draft-n-max", str(n_max)]
    if n_max and spec in HEAD_KINDS:  # a fixed chain of n_max, as ours under fixed:N
        args += ["--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    if not repack:
        args.append("--no-repack")
    return args


class LlamaServerPeer:
    """One llama-server process for one peer kind; run() and close() as a bench peer's."""

    def __init__(self, binary: Path, gguf: Path, kind: str, threads: int, draft_gguf: Path | None = None,
                 slots: int = 1, context: int = CONTEXT, sampling: tuple[float, float] | None = None,
                 head_folder: tempfile.TemporaryDirectory | None = None):
        self.binary, self.gguf, self.kind, self.threads, self.draft_gguf = binary, gguf, kind, threads, draft_gguf
        self.sampling = sampling  # (temperature, top_p) to sample with; None: greedy
        self.slots, self.context = slots, context  # -np and -c (a load test serves many clients: serve_peer.py)
        self.proc: subprocess.Popen | None = None
        self.head_folder = head_folder  # where draft_gguf was exported to: deleted when closed
        self._log = tempfile.NamedTemporaryFile(prefix="outrider-llama-server-", suffix=".log", delete=False)
        try:
            self._start(repack=True)
            self.repack, why = True, None
        except PeerFailed as first:
            try:
                self._start(repack=False)
            except PeerFailed:  # a second failure is the peer's: a failed row
                self.close()
                raise
            self.repack, why = False, str(first)
        flags = " ".join(self.args[7:])  # after the binary, -m GGUF, --host and --port
        self.note = f"llama-server {flags}" + (
            "" if self.repack else f" (with its defaults, weight repacking on, it failed: {why})")

    def _start(self, repack: bool) -> None:
        self._stop()
        self.port = free_port()
        self.args = server_args(self.binary, self.gguf, self.kind, self.threads, self.port, self.draft_gguf, repack,
                                self.slots, self.context)
        self._log.seek(0)
        self._log.truncate()
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()
        self.run(WARMUP_IDS, 4)  # a first completion: where repacked buffers crashed (issue 45)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerFailed(f"failed to load: {self._ending()}")
            try:
                with _LOCAL.open(self._url("/health"), timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self._kill()
        raise PeerFailed(f"failed to load: no /health in {LOAD_TIMEOUT_S:.0f} s; stopped it")

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> PromptRun:
        """One completion; seed: the prompt's seed when sampling (module docstring)."""
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        if self.sampling is not None:
            body.update(sampling_fields(*self.sampling, seed or 0))
        request = urllib.request.Request(self._url("/completion"), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with _LOCAL.open(request, timeout=RUN_TIMEOUT_S) as answer:
                reply = json.loads(answer.read())
        except urllib.error.HTTPError as err:
            raise PeerFailed(f"answered HTTP {err.code}: {_one_line(err.read().decode(errors='replace'))}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            try:
                self.proc.wait(5)  # a server that crashed closed the connection: let it finish dying
            except subprocess.TimeoutExpired:
                raise PeerFailed(f"no answer: {_one_line(str(err))}") from None
            raise PeerFailed(self._ending()) from None
        seconds = time.perf_counter() - start
        return PromptRun([int(t) for t in reply.get("tokens", [])], seconds, completion_stats(reply, seconds))

    def close(self) -> None:
        """Stops the server and deletes the exported head's folder, if any."""
        self._stop()
        if self.head_folder is not None:
            self.head_folder.cleanup()
            self.head_folder = None

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self._kill()
        self.proc = None

    def __del__(self):
        try:
            self.close()
            os.unlink(self._log.name)
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT, the server's root (its OpenAI-style API is under /v1)."""
        return self._url("")

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def _ending(self) -> str:
        """How the server ended (or that it hangs: then it is stopped), with its last log line."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self._kill()
            return "no answer; stopped it"
        if code < 0:
            try:
                how = f"crashed: its process was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"crashed: its process was killed by signal {-code}"
        else:
            how = f"its process exited with status {code}"
        last = self._last_log_line()
        return f"{how} ({last})" if last else how

    def _last_log_line(self) -> str:
        self._log.flush()
        lines = [ln.strip() for ln in Path(self._log.name).read_text(errors="replace").splitlines() if ln.strip()]
        return _one_line(lines[-1])[:200] if lines else ""


def sampling_fields(temperature: float, top_p: float, seed: int) -> dict:
    """A /completion body's sampling fields: our law (temperature, then top-p), seeded."""
    return {"temperature": float(temperature), "top_p": float(top_p), "samplers": ["temperature", "top_p"],
            "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": int(seed) % 2**31}


def completion_stats(reply: dict, seconds: float) -> dict:
    """A /completion reply's figures, in the bench's words (prefill_s: its own prompt time)."""
    timings = reply.get("timings") or {}
    tokens = len(reply.get("tokens", []))
    stats = {"new_tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
             "prefill_s": float(timings.get("prompt_ms", 0.0)) / 1000.0,
             "server_s": (float(timings.get("prompt_ms", 0.0)) + float(timings.get("predicted_ms", 0.0))) / 1000.0,
             "prompt_per_token_ms": timings.get("prompt_per_token_ms"),
             "predicted_per_token_ms": timings.get("predicted_per_token_ms"),
             "stop_type": reply.get("stop_type")}
    if "draft_n" in timings:
        stats["draft_n"] = timings["draft_n"]
        stats["draft_n_accepted"] = timings.get("draft_n_accepted", 0)
    return stats


# to 127.0.0.1 directly, whatever http_proxy says
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_llama_server(kind: str, model_path: Path, assistant_path: Path | None, threads: int,
                      sampling: tuple[float, float] | None = None, head: str | None = None) -> LlamaServerPeer:
    """The peer for a model folder (its original.gguf); PeerUnavailable where it cannot run.
    sampling: (temperature, top_p) in a bench that samples; None: greedy. head: the learned
    draft-* types' head (a shipped head's name or a folder), exported here as GGUF."""
    spec, _ = parse_kind(kind)
    binary = find_binary()
    gguf = Path(model_path) / "original.gguf"
    if not gguf.exists():
        raise PeerUnavailable(f"no original GGUF at {gguf} (only catalog models keep one)")
    draft, folder = None, None
    if spec in NEEDS_DRAFT:
        draft = Path(assistant_path or "") / "original.gguf"
        if assistant_path is None or not draft.exists():
            raise PeerUnavailable(f"{spec} needs the assistant's original GGUF; none at {draft}")
    if spec in HEAD_KINDS:
        if not head:
            raise ConfigError(f"{kind} needs head = \"NAME\" (a shipped {HEAD_KINDS[spec]} head or a head folder)")
        folder = tempfile.TemporaryDirectory(prefix="outrider-llama-server-head-")
        try:
            draft = export_head(HEAD_KINDS[spec], head, Path(model_path), Path(folder.name))
        except Exception:
            folder.cleanup()
            raise
    return LlamaServerPeer(binary, gguf, kind, threads, draft, sampling=sampling, head_folder=folder)


def export_head(kind: str, head: str, model_path: Path, folder: Path) -> Path:
    """The `kind` head `head` written as llama.cpp's draft GGUF into `folder`, made for the target
    in `model_path` (its original.gguf's tokenizer goes in); PeerUnavailable for a kind this
    installation does not have (DSpark before its package lands) or cannot write as GGUF."""
    from ..heads.catalog import resolve_head
    from ..heads.gguf_export import export_gguf
    from ..heads.kinds import KINDS

    if kind not in KINDS or KINDS[kind].gguf is None:
        raise PeerUnavailable(f"no {kind} head kind with a GGUF export in this installation")
    try:
        source = resolve_head(head, kind)
    except ConfigError as why:  # e.g. no shipped head of that name yet: a skipped row that says so
        raise PeerUnavailable(str(why)) from None
    return export_gguf(kind, source, folder / f"{kind}.gguf", model_path, target_gguf=model_path / "original.gguf")


def _one_line(text: str) -> str:
    return " ".join(text.split())
