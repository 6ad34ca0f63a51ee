"""A peer in a child process of its own, so that a peer that crashes costs its row, not the run.

A peer is another engine's code (llama.cpp's native library, transformers); on some machines it
dies in native code (llama-cpp-python 0.3.36 segfaulted in its first completion on an Intel Xeon
with AMX: peers.py). In the bench's process that would end the whole run. Here the peer is built
and run in a child started with the `spawn` method (a fresh interpreter: no threads or locks of
ours carried over), and the bench talks to it over a pipe:

    peer = PeerProcess(open_peer, {"kind": ..., ...}, threads)   # PeerUnavailable / PeerFailed
    run = peer.run(prompt_ids, max_new_tokens)                    # a PromptRun, or PeerFailed
    peer.close()

PeerFailed says how the child ended: killed by a signal (SIGSEGV, SIGABRT), an exit status, an
exception's message, or no answer within LOAD_TIMEOUT_S / RUN_TIMEOUT_S (then it is killed).
The child ignores Ctrl-C: the bench handles it, then closes its peers.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback

import torch

from .runner import PromptRun

LOAD_TIMEOUT_S = 1800.0  # to build the peer (load its model)
RUN_TIMEOUT_S = 1800.0  # for one prompt's completion


class PeerUnavailable(Exception):
    """This peer cannot run on this machine or model; the message says why."""


class PeerFailed(Exception):
    """The peer's process crashed, exited, raised or stopped answering; the message says which."""


class PeerProcess:
    """`factory(**kwargs)` built and run in a child process; `factory` must be importable by name
    (a module-level function), as the spawned child imports it."""

    def __init__(self, factory, kwargs: dict, threads: int | None = None):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_serve, args=(child, factory, kwargs, threads), daemon=True,
                                     name=f"outrider-peer-{kwargs.get('kind', 'peer')}")
        self._proc.start()
        child.close()
        try:
            kind, value = self._answer(LOAD_TIMEOUT_S, "to load")
        except PeerFailed:
            self.close()
            raise
        if kind == "unavailable":
            self.close()
            raise PeerUnavailable(value)
        self.note: str | None = value  # what the peer says of its own settings (peers.LlamaCppPeer)

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None = None) -> PromptRun:
        """seed: a sampling peer's seed for this prompt (bench/sampling.py); None: not passed."""
        request = (list(prompt_ids), int(max_new_tokens)) + (() if seed is None else (int(seed),))
        try:
            self._conn.send(request)
        except (BrokenPipeError, OSError):
            raise PeerFailed(self._ending()) from None
        _, (output_ids, seconds, stats) = self._answer(RUN_TIMEOUT_S, "for a completion")
        return PromptRun(output_ids, seconds, stats)

    def close(self) -> None:
        """Ask the child to leave; kill it if it does not."""
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def _answer(self, timeout: float, doing: str):
        if not self._conn.poll(timeout):  # a closed pipe polls True, so this is silence
            self._proc.kill()
            self._proc.join()
            raise PeerFailed(f"no answer in {timeout:.0f} s {doing}; stopped it")
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise PeerFailed(self._ending()) from None
        if kind == "error":
            self.close()
            raise PeerFailed(value)
        return kind, value

    def _ending(self) -> str:
        """How the child ended, in words."""
        self._proc.join(10)
        code = self._proc.exitcode
        if code is None:
            return "its process stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"crashed: its process was killed by {name}"
        return f"its process exited with status {code}"


def _serve(conn, factory, kwargs: dict, threads: int | None) -> None:
    """The child: build the peer, say so, then answer (prompt ids, budget) until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle
    if threads:
        torch.set_num_threads(threads)
    try:
        peer = factory(**kwargs)
    except PeerUnavailable as why:
        conn.send(("unavailable", str(why)))
        return
    except Exception as err:  # noqa: BLE001 (any failure of the other engine is the row's reason)
        conn.send(("error", f"failed to load: {_one_line(err)}"))
        return
    conn.send(("ready", getattr(peer, "note", None)))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the bench is gone
            return
        if request is None:
            return
        try:
            run = peer.run(*request)
        except Exception as err:  # noqa: BLE001
            conn.send(("error", f"raised {_one_line(err)}"))
            return
        conn.send(("ok", (list(run.output_ids), float(run.seconds), dict(run.stats))))


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split()) or traceback.format_exception_only(type(err), err)[-1].strip()
    return f"{type(err).__name__}: {text}"
