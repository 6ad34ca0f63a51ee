"""Rows a head drafter has been handed but not yet written: the fused target features of committed
positions (eagle3.py, dflash.py), waiting for the next proposal.

A round that does not draft (the controller's depth 0) adds its accepted path's rows and writes
nothing, so rows can wait for a whole request. They are kept as the parts they came in and joined
once, when written: a round costs the rows it adds, not a copy of all that wait (a torch.cat per
round would copy the prompt's features every round).
"""

from __future__ import annotations

import torch


class PendingRows:
    def __init__(self, first: torch.Tensor):
        """first: [m, H] (m may be 0; its dtype, device and width are every later part's)."""
        self._empty = first[:0]
        self._parts = [first] if first.shape[0] else []
        self.rows = first.shape[0]

    def add(self, part: torch.Tensor) -> None:
        """part: [a, H], after the rows already waiting."""
        self._parts.append(part)
        self.rows += part.shape[0]

    def joined(self) -> torch.Tensor:
        """Every waiting row, in order: [rows, H] (they still wait, now as one part: clear() once
        they are written, so a write that fails loses none)."""
        if len(self._parts) > 1:
            self._parts = [torch.cat(self._parts)]
        return self._parts[0] if self._parts else self._empty

    def clear(self) -> None:
        self._parts, self.rows = [], 0
