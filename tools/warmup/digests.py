"""``moestream.tools.warmup MODEL --digests``: compute a model's digest manifest ahead of its runs.

A file that records no digests (every real GGUF) is verified against its digest manifest
(``pipeline.foundation.manifest``). A run computes the manifest in the background when it has none;
this computes it beforehand, at storage speed, so the first run verifies at no extra cost.
Experts are read with O_DIRECT (the page cache is left as it was) unless most of them are
already resident, then through the page cache (RAM speed).
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from moestream.pipeline.foundation.errors import ModelChangedError
from moestream.pipeline.foundation.manifest import load_manifest, manifest_path
from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.table import ExpertTable
from moestream.stages.manifest_build import BuildResult, ManifestBuilder
from moestream.stages.residency import Residency

__all__ = ["compute_digests"]


def _mostly_resident(table: ExpertTable) -> bool:
    """Whether at least half of the routed expert bytes are in the page cache now."""
    ranges = [r for s in table.iter_slices() for r in s.ranges]
    return Residency.of_files(table.files).resident_bytes(ranges) * 2 >= table.routed_bytes


def compute_digests(table: ExpertTable, threads: int | None, out: TextIO | None = None) -> int:
    """Compute and save ``table``'s digest manifest, with a progress bar; returns 0.

    What was digested before an interrupt is saved too (a later run or call resumes it).

    Raises:
        ReadError, ModelChangedError: a read failed, or the file changed while digested.
        OutputError: the cache directory cannot take the manifest.
    """
    from tqdm import tqdm  # imported here, as the warm-up's: start-up time counts

    out = out or sys.stdout
    if table.digests is not None:
        print(f"{table.path} records its digests in its metadata: no manifest needed",
              file=out)
        return 0
    path = manifest_path(table.path)
    manifest = load_manifest(table, path)
    if manifest.complete:
        print(f"digests: manifest {path} is up to date ({manifest.total} experts)", file=out)
        return 0
    direct = not _mostly_resident(table)
    total = sum(table.expert_bytes(n) for n, _ in manifest.missing())
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr,
               desc="digesting", dynamic_ncols=True, disable=None)

    def progress(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    async def build() -> BuildResult:
        async with ManifestBuilder(table, manifest, threads=threads, direct=direct) as builder:
            return await builder.build(progress=progress)

    try:
        result = asyncio.run(build())
    finally:
        bar.close()
        if manifest.dirty:  # complete, or what an interrupt or a failure left: kept
            changed = manifest.save_if_current(table, path)
            if changed:
                raise ModelChangedError(table.path, f"changed while digested "
                                                    f"({', '.join(changed)}); nothing saved")
    source = "O_DIRECT" if direct else "page cache"
    print(f"digests: {result.experts} experts, {size_text(result.bytes_read)} read in "
          f"{result.seconds:.2f} s ({result.gb_per_s:.2f} GB/s, {source}); manifest {path}",
          file=out)
    return 0
