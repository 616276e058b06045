"""The jobs of a digest manifest's computation: which experts go together, and one job done.

A job is a run of neighbouring experts of one layer, about ``job_bytes`` of them, so a
layer's gate tensor, say, is read in large pieces whatever the expert size; experts the
verifier waits for come first (``plan_jobs``). ``digest_job`` runs on a worker thread of
``moestream.stages.manifest_build.ManifestBuilder``: it reads a job's matrices that touch in
the file as one stretch, in ``piece_bytes`` reads into the thread's buffer, and feeds each
matrix's running digest (``pipeline.foundation.digest``) as the bytes arrive.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from moestream.gpu.cache.policy import ExpertKey
from moestream.pipeline.foundation.digest import RunningDigest
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.layout import aligned_cover, iter_chunks
from moestream.stages.reader import ModelReader

__all__ = ["Digests", "JobResult", "digest_job", "plan_jobs"]

Digests = tuple[int, int, int]
"""An expert's three matrix digests."""

JobResult = tuple[list[tuple[int, Digests]], int]
"""A job's (expert, digests) pairs and the bytes it read."""


@dataclass(frozen=True, slots=True)
class _Range:
    """One expert matrix in the file, and where its digest goes."""

    offset: int
    nbytes: int
    expert: int
    matrix: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _stretches(ranges: Iterable[_Range]) -> list[list[_Range]]:
    """Ranges sorted by offset, those that touch joined into stretches read as one."""
    out: list[list[_Range]] = []
    for r in sorted(ranges, key=lambda r: r.offset):
        if out and out[-1][-1].end == r.offset:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def plan_jobs(table: ExpertTable, missing: Iterable[ExpertKey], job_bytes: int,
              urgent: deque[ExpertKey],
              free: Callable[[ExpertKey], bool]) -> Iterator[tuple[int, list[int]]]:
    """(layer, experts) to digest: ``urgent`` experts first (popped as taken), then
    ``missing`` in file order; each time only experts ``free`` (neither known nor in
    flight), neighbours of a layer together."""
    per_job = {n: max(1, job_bytes // table.expert_bytes(n)) for n in table.moe_layers}
    todo = iter(missing)
    pending: ExpertKey | None = None  # read from todo, not yet in a job
    while True:
        source: deque[ExpertKey] | None = None
        key: ExpertKey | None = None
        while urgent and key is None:
            key = urgent.popleft()
            key = key if free(key) else None
        if key is not None:
            source = urgent
        while key is None:
            key, pending = (pending if pending is not None else next(todo, None)), None
            if key is None:
                return
            key = key if free(key) else None
        layer, job = key[0], [key[1]]
        while len(job) < per_job[layer]:
            if source is not None:  # waited for: neighbours also waited for
                nxt = source[0] if source else None
                if nxt != (layer, job[-1] + 1):
                    break
                source.popleft()
            else:
                nxt = next(todo, None)
                if nxt is None or nxt != (layer, job[-1] + 1):
                    pending = nxt  # starts the next job
                    break
            if not free(nxt):
                break
            job.append(nxt[1])
        yield layer, job


def digest_job(table: ExpertTable, reader: ModelReader, buf: npt.NDArray[np.uint8],
               piece_bytes: int, resumed: threading.Event, stop: threading.Event,
               layer: int, experts: Sequence[int], direct: bool) -> JobResult:
    """Read and digest ``experts`` of ``layer`` through ``buf``; their digests and bytes read.

    Between pieces it waits for ``resumed`` (paused: decode's reads go first) and gives up
    with no digests once ``stop`` is set.
    """
    ranges = [
        _Range(r.offset, r.nbytes, e, m)
        for e in experts
        for m, r in enumerate(table.slices((layer, e)).ranges)
    ]
    running = {(r.expert, r.matrix): RunningDigest() for r in ranges}
    read = 0
    for stretch in _stretches(ranges):
        start, length = aligned_cover(stretch[0].offset, stretch[-1].end - stretch[0].offset)
        first = 0  # the first range of the stretch not yet wholly fed
        for offset, n in iter_chunks(start, length, piece_bytes):
            resumed.wait()
            if stop.is_set():
                return [], read
            got = reader.read_into(buf[:n], offset, direct=direct)
            read += got
            end = offset + got
            while first < len(stretch) and stretch[first].end <= offset:
                first += 1
            for r in stretch[first:]:
                if r.offset >= end:
                    break
                lo, hi = max(r.offset, offset), min(r.end, end)
                running[r.expert, r.matrix].update(buf[lo - offset : hi - offset])
    out = [(e, (running[e, 0].value(), running[e, 1].value(), running[e, 2].value()))
           for e in experts]
    return out, read
