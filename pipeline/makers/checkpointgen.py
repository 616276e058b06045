"""Hugging Face checkpoints shaped like the presets (``tools.make_model --format safetensors``).

Why: the second model source (``pipeline.foundation.safetensors_table``) must be tested and
benchmarked on checkpoints with the real on-disk layout (``config.json``, safetensors
shards, ``model.safetensors.index.json``) at every preset's shape, plain or quantized as
the big MoE checkpoints ship (FP8 blocks, gpt-oss's MXFP4, DeepSeek-V4's FP4), without
downloading weights. What each layout holds is ``pipeline.makers.checkpointlayouts``; how a
tensor's deterministic bytes are made, ``moestream.pipeline.makers.checkpointtensors``.

Shards are written through ``safetensors.serialize_file`` one at a time (a shard's tensors
are the only ones in memory, made by a thread pool: numpy releases the GIL; a weight and its
scales always share a shard), into a temporary directory beside the target that is renamed
over it once every file is written and synced.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import structlog
from safetensors import SafetensorError, TensorSpec, serialize_file
from tqdm import tqdm

from moestream.pipeline.foundation.errors import OutputError, UsageError
from moestream.pipeline.foundation.inputs import file_kind
from moestream.pipeline.foundation.outputs import check_output_dir, fsync_path
from moestream.pipeline.makers.checkpointlayouts import QUANTS, Layout, Quant, layout
from moestream.pipeline.makers.checkpointtensors import Unit, to_bf16
from moestream.pipeline.makers.modelspec import ModelSpec

__all__ = ["DTYPES", "INDEX_NAME", "QUANTS", "CheckpointOptions", "CheckpointWritten",
           "checkpoint_config", "plan_shards", "shard_names", "to_bf16", "write_checkpoint"]

log = structlog.get_logger(__name__)

Dtype = Literal["bf16", "f16", "f32"]
DTYPES: dict[str, tuple[str, str, int]] = {
    "bf16": ("BF16", "bfloat16", 2),
    "f16": ("F16", "float16", 2),
    "f32": ("F32", "float32", 4),
}
"""``--dtype`` -> (safetensors header dtype, ``TensorSpec`` dtype, bytes per element)."""

INDEX_NAME = "model.safetensors.index.json"
_KEEP = frozenset({"config.json", INDEX_NAME, "generation_config.json"})


@dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """How a spec is laid out as a checkpoint.

    Attributes:
        dtype: the plain tensors' dtype (``bf16``, ``f16`` or ``f32``); quantized tensors
            quantize values rounded to it.
        fused_experts: one ``gate_up_proj`` and one ``down_proj`` tensor per layer instead
            of three tensors per expert (plain only; ``mxfp4`` experts are always fused).
        shard_bytes: the largest shard's tensor data; a tensor (with its scales) larger
            than this gets a shard of its own.
        quant: ``fp8`` (Qwen3-MoE, FP8 blocks), ``mxfp4`` (gpt-oss) or ``fp4``
            (DeepSeek-V4); None for plain.
        block: an ``fp8`` scale block, rows x columns.
    """

    dtype: Dtype = "bf16"
    fused_experts: bool = False
    shard_bytes: int = 2 << 30
    quant: Quant | None = None
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")
        if self.shard_bytes < 1:
            raise UsageError(f"shard size must be at least 1 byte, got {self.shard_bytes}")
        if self.quant is not None and self.quant not in QUANTS:
            raise UsageError(f"unknown quantization {self.quant!r} (choose from "
                             f"{', '.join(QUANTS)})")
        if self.fused_experts and self.quant in ("fp8", "fp4"):
            raise UsageError(f"--fused-experts: {self.quant} checkpoints ship one tensor per "
                             "expert matrix (each with its own scales)")
        if len(self.block) != 2 or min(self.block) < 1:
            raise UsageError(f"a scale block is two sizes >= 1, got {self.block}")
        if self.block != (128, 128) and self.quant != "fp8":
            raise UsageError("--block is for --quant fp8")


@dataclass(frozen=True, slots=True)
class CheckpointWritten:
    """What ``write_checkpoint`` wrote: the directory, its shard files and data bytes."""


    path: Path
    shards: tuple[str, ...]
    tensor_bytes: int
    seconds: float
    expert_bytes: int
    """One routed expert's bytes as stored (weights and their scales)."""


def plan_shards(sizes: Sequence[int], shard_bytes: int) -> list[range]:
    """Consecutive runs of tensors (by index) whose bytes stay within ``shard_bytes``; a
    tensor larger than that is a run of its own."""
    runs: list[range] = []
    start, held = 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and held + nbytes > shard_bytes:
            runs.append(range(start, i))
            start, held = i, 0
        held += nbytes
    if len(sizes) > start:
        runs.append(range(start, len(sizes)))
    return runs


def shard_names(count: int) -> list[str]:
    """The file names transformers gives ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def checkpoint_config(spec: ModelSpec, options: CheckpointOptions) -> dict[str, object]:
    """``config.json`` of the checkpoint of ``spec`` written with ``options``."""
    return _layout(spec, options).config


def _layout(spec: ModelSpec, options: CheckpointOptions) -> Layout:
    return layout(spec, DTYPES[options.dtype][1], fused=options.fused_experts,
                  quant=options.quant, block=options.block)


def _write_shard(units: Sequence[Unit], path: Path, metadata: dict[str, str],
                 pool: ThreadPoolExecutor, bar: tqdm[None]) -> None:
    """Make ``units``' tensors (only they are in memory) and write them as one shard."""
    outs = [out for unit in units for out in unit.outs]
    buffers = {out.name: np.empty(out.shape, dtype=out.storage) for out in outs}
    jobs = [job for unit in units for job in unit.jobs]
    for nbytes in pool.map(lambda job: job(buffers), jobs):
        bar.update(nbytes)
    specs = {out.name: TensorSpec(dtype=out.dtype, shape=list(out.shape),
                                  data_ptr=buffers[out.name].ctypes.data,
                                  data_len=buffers[out.name].nbytes) for out in outs}
    serialize_file(specs, path, metadata)  # reads the buffers, which live until it returns
    fsync_path(path)


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` would, for every thread)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _open_modes(made: Path) -> None:
    """The modes a directory and files made by hand would have (``mkdtemp`` and the
    serializer make them private)."""
    mask = _umask()
    for entry in made.iterdir():
        entry.chmod(0o666 & ~mask)
    made.chmod(0o777 & ~mask)


def _check_target(shown: Path, target: Path, replace: bool) -> bool:
    """Whether ``target`` exists; refused when it may not be replaced by a checkpoint."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise OutputError(shown, f"cannot write: {exc.strerror or exc}", what="OUT") from exc
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(shown, "is a symbolic link; name the checkpoint directory itself",
                          what="OUT")
    kind = None if stat.S_ISDIR(st.st_mode) else file_kind(st.st_mode)
    if kind is not None:
        raise OutputError(shown, f"cannot write: is {kind}; a checkpoint is a directory",
                          what="OUT")
    if not replace:
        raise UsageError(f"{shown} exists (use --force to replace it)")
    if stat.S_ISDIR(st.st_mode):
        # --force replaces a checkpoint, never a directory of other things (a home directory)
        for entry in os.scandir(target):
            if not entry.is_file(follow_symlinks=False) or not (
                    entry.name in _KEEP or entry.name.endswith(".safetensors")):
                raise OutputError(shown, f"cannot replace: it holds {entry.name!r}, which is "
                                  "not a checkpoint's file (config.json, *.safetensors, the "
                                  "index); remove it yourself", what="OUT")
    return True


def _swap_in(made: Path, target: Path, exists: bool) -> None:
    """Rename ``made`` to ``target``; an existing target is renamed aside first and removed
    once the new one is in place (a checkpoint is a directory: no rename replaces one)."""
    if not exists:
        os.rename(made, target)
        return
    aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
    os.rename(target, aside / "old")
    try:
        os.rename(made, target)
    except BaseException:
        os.rename(aside / "old", target)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)  # the replaced checkpoint


def write_checkpoint(spec: ModelSpec, path: Path, options: CheckpointOptions = CheckpointOptions(),
                     *, progress: bool = False, replace: bool = False) -> CheckpointWritten:
    """Write ``spec`` as a checkpoint directory at ``path``, atomically.

    Args:
        spec: the shape and seed (``moestream.pipeline.makers.modelspec.spec_for``).
        path: the directory to make; its parent must exist.
        options: dtype, expert layout, quantization, shard size.
        progress: a tqdm bar of bytes generated, on stderr.
        replace: replace an existing ``path`` (a checkpoint directory or a file); without
            it an existing ``path`` is refused.

    Raises:
        UsageError: ``path`` exists and ``replace`` is false; a shape the quantization
            cannot hold (MX scales need a hidden size and expert FFN divisible by 32).
        OutputError: ``path`` is a link, a special file or a directory of other things; its
            directory refuses new files; or a write failed (the message names the OS error).
    """
    plan = _layout(spec, options)
    shown = Path(path)
    parent = check_output_dir(Path(os.path.abspath(shown)).parent, what="OUT")
    target = parent / Path(os.path.abspath(shown)).name
    exists = _check_target(shown, target, replace)
    units = plan.units
    sizes = [unit.nbytes for unit in units]
    total = sum(sizes)
    runs = plan_shards(sizes, options.shard_bytes)
    names = shard_names(len(runs))
    metadata = {"format": "pt", "moestream.preset": spec.preset,
                "moestream.seed": str(spec.seed)}
    started = time.perf_counter()
    try:
        made = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.", suffix=".tmp"))
    except OSError as exc:
        raise OutputError(shown, f"cannot write: {exc.strerror or exc}", what="OUT") from exc
    try:
        _write_files(made, plan, runs, names, metadata, shown.name if progress else None)
        _open_modes(made)
        fsync_path(made)
        _swap_in(made, target, exists)
        fsync_path(parent)
    except (OSError, SafetensorError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OutputError(shown, f"cannot write: {reason}", what="OUT") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(made)
    seconds = time.perf_counter() - started
    log.info("make_model.checkpoint_written", path=str(target), preset=spec.preset,
             layers=spec.n_layers, experts=spec.n_experts, quant=options.quant,
             expert_bytes=plan.expert_bytes, shards=len(names), bytes=total,
             seconds=round(seconds, 3), mb_per_s=round(total / 1e6 / max(seconds, 1e-9), 1))
    return CheckpointWritten(target, tuple(names), total, seconds, plan.expert_bytes)


def _write_files(made: Path, plan: Layout, runs: Sequence[range], names: Sequence[str],
                 metadata: dict[str, str], progress: str | None) -> None:
    """``config.json``, the shards (``runs`` of ``plan.units``, named ``names``) and, when
    there are several, their index, each synced; ``progress``: the bar's label (None: no
    bar)."""
    units = plan.units
    config = json.dumps(plan.config, indent=2) + "\n"
    (made / "config.json").write_text(config, encoding="utf-8")
    fsync_path(made / "config.json")
    total = sum(unit.nbytes for unit in units)
    workers = min(8, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(workers, thread_name_prefix="make_checkpoint") as pool, \
            tqdm(total=total, unit="B", unit_scale=True, disable=progress is None,
                 desc=progress) as bar:
        for run, name in zip(runs, names, strict=True):
            _write_shard([units[i] for i in run], made / name, metadata, pool, bar)
    if len(runs) > 1:
        weight_map = {out.name: name for run, name in zip(runs, names, strict=True)
                      for i in run for out in units[i].outs}
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        (made / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        fsync_path(made / INDEX_NAME)
