"""The expert ids of a log's tokens, held as one ``(tokens, layers, width)`` int32 array.

The what-if simulator replays every token's expert ids; what that array may take follows the
log's size, never a value in it: a token listing more experts in a layer than the model has
keeps its numbers but not its lists, and a log whose few wide lists would pad every token
past 64 bytes a byte of log is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.pipeline.foundation.errors import TraceError

__all__ = ["FITS", "MAX_LAYER_EXPERTS", "MAX_MOE_LAYERS", "RAGGED", "TOO_WIDE", "ExpertBuffer"]

_INT32_MAX = 2**31 - 1

MAX_LAYER_EXPERTS = 4096
"""The most expert ids one layer's list may hold: the model's expert count when the header
gives one (at most this), else this (the largest models route among a few hundred). A token
listing more in a layer has its lists left out, counted as a problem: one line cannot widen
every token's row of the what-if array."""

MAX_MOE_LAYERS = 4096
"""The most MoE layers a header may list (models have tens): a row of the expert array per
token is ``layers x width x 4`` bytes, whatever the token's line holds."""

_BLOCK_BYTES = 16 << 20  # one block of expert ids, at most (a block has at least one row)
_HELD_FLOOR_BYTES = 256 << 20  # the expert ids kept for a replay, at most, or ...
_HELD_PER_LOG_BYTE = 64  # ... this many bytes a byte of log, when that is more

FITS, RAGGED, TOO_WIDE = 0, 1, 2  # what ``ExpertBuffer.append`` made of a token


class ExpertBuffer:
    """The tokens' expert ids as ``(tokens, layers, width)`` int32, -1 padded, in blocks.

    Per token, 4 bytes per (layer, slot) while ``keep`` (the what-if replay needs every
    token's ids), else only the 4-byte count of ids used; the block being filled is reused.
    Ids at or above ``n_experts`` are counted block by block for the consistency check.

    Memory follows the log, not the values in it: a block holds at most ``_BLOCK_BYTES``; a
    list longer than the model's expert count (``MAX_LAYER_EXPERTS`` at most) is left out;
    and the ids kept for a replay may take ``_HELD_PER_LOG_BYTE`` bytes a byte of log read
    (``_HELD_FLOOR_BYTES`` at least), past which the log is refused (``TraceError``: a few
    wide lists among many narrow ones would pad every token to their width).
    """

    __slots__ = ("_block", "_block_rows", "_blocks", "_held", "_in_block", "_keep", "_layers",
                 "_limit", "_most_rows", "_n_experts", "_outside", "_path", "_used", "_width",
                 "log_bytes")

    def __init__(self, layers: int, width: int, *, keep: bool, n_experts: int | None,
                 path: Path) -> None:
        if layers > MAX_MOE_LAYERS:
            raise TraceError(f"{path}: run_start lists {layers} MoE layers, more than the "
                             f"{MAX_MOE_LAYERS} a log may have")
        # kept blocks are many: large ones; the one reused block small (it is fixed cost)
        self._most_rows = 4096 if keep else 256
        self._layers = max(layers, 0)
        self._limit = (n_experts if n_experts is not None and 0 < n_experts < MAX_LAYER_EXPERTS
                       else MAX_LAYER_EXPERTS)
        self._width = min(max(width, 1), self._limit)
        self._keep = keep
        self._n_experts = n_experts
        self._path = path
        self._blocks: list[npt.NDArray[np.int32]] = []
        self._used: list[npt.NDArray[np.int32]] = []
        self._outside = 0
        self._held = 0
        self.log_bytes = 0
        """Bytes of the log read so far (the reader sets it): what the kept ids may take."""
        self._block_rows = 1
        self._block = self._new_block()
        self._in_block = 0

    @property
    def limit(self) -> int:
        """The most ids a layer's list may hold."""
        return self._limit

    def _new_block(self) -> npt.NDArray[np.int32]:
        row_bytes = max(self._layers * self._width * 4, 1)
        self._block_rows = max(1, min(self._most_rows, _BLOCK_BYTES // row_bytes))
        return np.full((self._block_rows, self._layers, self._width), -1, np.int32)

    def _row(self, width: int) -> int:
        """The row the next token goes in, in a block at least ``width`` wide."""
        if width > self._width:
            self._flush()  # the rows so far keep their width (``result`` pads them)
            self._width = width
            self._block = self._new_block()
        elif self._in_block == self._block_rows:
            self._flush()
        row = self._in_block
        self._in_block += 1
        return row

    def append(self, experts: Any) -> int:
        """Store one token's lists: ``FITS``; ``RAGGED`` when they are not one list of
        expert ids per layer (stored padded); ``TOO_WIDE`` when a list holds more than
        ``limit`` ids (none stored). Lists of another length than top-k are well formed: a
        prefill token lists every expert its prompt routed to, and a layer fetched twice
        in a token lists each expert once.

        Raises:
            OverflowError: an id no int32 holds (never wrapped).
        """
        try:  # the common case: a rectangular matrix, one row of ids per layer
            ids = np.asarray(experts)
            rectangular = (ids.ndim == 2 and ids.shape[0] == self._layers
                           and ids.dtype.kind in "iu")
        except (ValueError, TypeError):
            rectangular = False
        if rectangular:
            if ids.shape[1] > self._limit:
                self._row(0)
                return TOO_WIDE
            if ids.size and not -_INT32_MAX - 1 <= int(ids.min()) <= int(ids.max()) <= _INT32_MAX:
                raise OverflowError("an expert id outside int32")
            row = self._row(ids.shape[1])
            self._block[row, :, : ids.shape[1]] = ids  # never broadcast a short list
            return FITS
        if not isinstance(experts, list):
            self._row(0)
            return RAGGED
        well_formed = len(experts) == self._layers
        lists: list[list[int]] = []
        for ids in experts[: self._layers]:
            if not isinstance(ids, list):
                well_formed = False
                lists.append([])
                continue
            clean = [e for e in ids if isinstance(e, int) and not isinstance(e, bool)]
            well_formed = well_formed and len(clean) == len(ids)
            lists.append(clean)
        width = max(map(len, lists), default=0)
        if width > self._limit:
            self._row(0)
            return TOO_WIDE
        row = self._row(width)
        for pos, clean in enumerate(lists):
            if clean:
                self._block[row, pos, : len(clean)] = clean  # OverflowError outside int32
        return FITS if well_formed else RAGGED

    def _allowed_bytes(self) -> int:
        return max(_HELD_FLOOR_BYTES, _HELD_PER_LOG_BYTE * self.log_bytes)

    def _refuse(self, nbytes: int) -> TraceError:
        return TraceError(
            f"{self._path}: its expert lists would take {nbytes} bytes to replay, more than "
            f"{self._allowed_bytes()} for a log of {self.log_bytes} bytes (a layer lists "
            f"{self._width} experts: every token is padded to the widest list)")

    def _flush(self) -> None:
        if not self._in_block:
            return
        block = self._block[: self._in_block]
        self._used.append((block >= 0).sum(axis=(1, 2), dtype=np.int32))
        if self._n_experts is not None:
            self._outside += int((block >= self._n_experts).sum())
        if self._keep:
            kept = block.copy() if self._in_block < self._block_rows else block
            self._held += kept.nbytes
            if self._held > self._allowed_bytes():
                raise self._refuse(self._held)
            self._blocks.append(kept)
            self._block = self._new_block()
        else:
            self._block.fill(-1)
        self._in_block = 0

    def take_used(self) -> npt.NDArray[np.int32]:
        """The ids used per token since the last call (the buffer forgets them)."""
        self._flush()
        used = np.concatenate(self._used) if self._used else np.zeros(0, np.int32)
        self._used = []
        return used

    def result(self) -> tuple[npt.NDArray[np.int32], int]:
        """The ids (no tokens unless ``keep``) and how many ids were at or above
        ``n_experts``.

        Raises:
            TraceError: padded to the widest list, the ids would take more than the log
                allows.
        """
        self._flush()
        rows = sum(b.shape[0] for b in self._blocks)
        padded = rows * self._layers * self._width * 4
        if padded > self._allowed_bytes():
            raise self._refuse(padded)
        blocks = [np.pad(b, ((0, 0), (0, 0), (0, self._width - b.shape[2])), constant_values=-1)
                  if b.shape[2] < self._width else b for b in self._blocks]
        experts = (np.concatenate(blocks) if blocks
                   else np.full((0, self._layers, self._width), -1, np.int32))
        self._blocks = []
        return experts, self._outside
