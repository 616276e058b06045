"""``from_pretrained``: a transformers model whose routed experts are never loaded.

The moestream session over the checkpoint is opened first: it identifies every shard once
(device, inode, size, times), reads the headers and ``config.json`` once and checks them
against each other. Everything else comes from that one opening, never from a second read
by path: the model's config from the session's parsed ``config.json`` (``ModelInfo.config``,
given to transformers in a private directory with ``trust_remote_code=False``: no code of
the checkpoint runs, no prompt is shown), and every tensor except the routed experts through
``read_tensor``, from the shards as identified, their identity checked before and after each
read. A shard renamed over, replaced or written after the session opened it stops the load
(``ModelChangedError``): the model never computes with one file's dense weights and
another's experts.

The model is built as transformers builds it, on the meta device (shapes, no storage),
with ``experts_implementation="moestream"``. The dense tensors are renamed as transformers'
own loading renames them, moved to the device and assigned; non-persistent buffers (rotary
frequencies) are made by the model's own ``_init_weights``, as ``from_pretrained`` does;
tied weights are tied. The experts' ``gate_up_proj`` / ``down_proj`` stay meta parameters:
no byte of them is read, allocated or copied here; the session serves them when the model
runs.

Everything is checked before the model is handed out, and whatever was opened is closed on
a failure: a config that disagrees with the checkpoint's experts (layers, count, shapes),
experts in a type torch does not compute, a tensor the model needs and the checkpoint lacks,
a model type whose experts do not go through transformers' registry. Each is one line, a
``MoestreamError``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch  # type: ignore[import-not-found, unused-ignore]
import transformers  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.pipeline.foundation.errors import ExpertLayoutError, ModelFileError, UsageError
from moestream.transformers._arguments import (
    build_with,
    device_of,
    dtype_of,
    first_line,
    loading_words,
    not_a_dtype,
    wanted_dtype,
)
from moestream.transformers._budget import budget_for, warn_if_clamped
from moestream.transformers._dense import load_dense, load_gguf_dense, tensor_reader
from moestream.transformers._experts import (
    COMPUTES,
    IMPLEMENTATION,
    Compute,
    ExpertStream,
    follow_decode_switch,
    register,
    uncompiled,
)
from moestream.transformers._files import CONFIG, GENERATION_FILES, snapshot
from moestream.transformers._gate import is_available
from moestream.transformers._gguf import GgufSource, gguf_model, is_gguf
from moestream.transformers._gguf_experts import GgufExperts, gguf_experts
from moestream.transformers._hub import local_checkpoint
from moestream.transformers._layout import TORCH_DTYPES, first_projection
from moestream.transformers._model import serve
from moestream.transformers._mtp import mtp_layers
from moestream.transformers._prefetch import check_prefetch, next_routers
from moestream.transformers._quantized import LayerScales, load_scales
from moestream.transformers._scale_budget import budget_less_scales
from moestream.transformers._swap import swap_experts

__all__ = ["from_pretrained"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def from_pretrained(path: str | os.PathLike[str], *, budget: str | moestream.Budget | None = None,
                    mode: str = "auto", device: str | Any | None = None, dtype: Any = None,
                    compute: Compute = "grouped", policy: str = "lru", verify: bool = True,
                    log: str | os.PathLike[str] | None = None,
                    tuning: moestream.Tuning | None = None, progress: bool | None = None,
                    prefetch: str = "none", in_place: bool = False, **words: Any) -> Any:
    """Load a transformers MoE causal LM whose routed experts moestream serves.

    Args:
        path: a checkpoint directory (``config.json`` and safetensors shards), one
            ``.safetensors`` file with the ``config.json`` beside it, a GGUF file (or
            ``gguf_file=`` in a directory), or a hub id in the local hub cache.
        budget: the device cache for the routed experts: ``64`` or ``"64"`` (experts),
            ``"3GiB"`` (a size takes its unit), or a ``Budget``; None holds every expert.
            The least is the model's top-k experts for each layer in flight (2 by default):
            a smaller budget is refused naming that number.
        mode: moestream's I/O mode, ``auto``, ``direct`` or ``resident``.
        device: where the model computes: ``"cpu"`` (moestream's host backend) or
            ``"cuda"``/``"cuda:N"`` (CuPy); None: the first GPU if torch sees one.
        dtype: the model's dtype (default the checkpoint's); experts in others cast per use.
        compute: ``"grouped"`` (transformers' ``grouped_mm`` arithmetic, the default) or
            ``"eager"`` (logits ``torch.equal`` to ``experts_implementation="eager"``).
        policy, verify, log, tuning: as ``moestream.open``.
        prefetch: ``"none"`` or ``"predict"`` (prefetch the next MoE layer's router's guess).
        in_place: a GPU's full cache: read the experts it lacks in place (TRANSFORMERS.md).
        progress: a progress bar while the dense weights load (default: stderr is a terminal).
        **words: transformers' loading words where they mean something here (``torch_dtype``,
            ``attn_implementation``, ``device_map`` of one device, ``max_memory``: the
            budget is what it leaves once the dense weights are counted, ``revision``,
            ``cache_dir``, ``local_files_only``, ``low_cpu_mem_usage``, ``gguf_file``,
            ``trust_remote_code=False``); others refused in one line (docs/TRANSFORMERS.md).

    Returns:
        The model, in eval mode, on ``device``; ``model.moestream`` its ``ExpertStream``
        (``.session``, ``.close()``, ``.last_generate``); a forward is a moestream token.
        Close it (``with``; collected unclosed it warns, closes); no save_pretrained.

    Raises:
        UsageError: torch or transformers missing, a bad or unknown argument, a
            transformers word moestream replaces (above), a budget below the model's
            least (named), ``budget`` and ``max_memory`` both given.
        ModelFileError: the checkpoint cannot be used (its subclasses name why); nothing
            stays open or loaded.
    """
    is_available(raise_error=True)
    said = loading_words(words, device, dtype)
    given, root = _checkpoint(local_checkpoint(path, said.revision, said.cache_dir), compute,
                              said.gguf_file, prefetch, in_place)
    torch_device, wanted = device_of(said.device), wanted_dtype(said.dtype)
    budget = budget_for(given, budget, said.max_memory, torch_device, wanted, tuning)
    budget = budget_less_scales(given, budget, tuning, said.max_memory)
    session = _open(given, torch_device, budget=budget, mode=mode, policy=policy,
                    verify=verify, log=log, tuning=tuning)
    try:
        warn_if_clamped(session, budget)
        return _served(session, root, torch_device, wanted, said.attention, compute, progress,
                       prefetch, in_place)
    except BaseException:
        session.close()
        raise


def _checkpoint(path: str | os.PathLike[str], compute: Compute,
                gguf_file: str | None = None, prefetch: str = "none",
                in_place: object = False) -> tuple[Path, Path]:
    """The checkpoint as given and its directory, once ``compute``, ``prefetch`` and
    ``in_place`` are checked and the experts implementation registered: a directory, one
    .safetensors file with the config.json beside it, or a GGUF file (``gguf_file`` in the
    directory given)."""
    if compute not in COMPUTES:
        raise UsageError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    check_prefetch(prefetch)
    if not isinstance(in_place, bool):
        raise UsageError(f"in_place must be True or False, got {in_place!r}")
    register()
    given = Path(path) if gguf_file is None else Path(path) / gguf_file
    if is_gguf(given):  # its metadata is its config, its tokenizer too
        return given, given.parent
    root = given.parent if given.is_file() else given
    if not (root / CONFIG).is_file():
        raise ModelFileError(root, "not a checkpoint directory (no config.json)")
    return given, root


def _open(given: Path, device: Any, **session_words: Any) -> moestream.SyncSession:
    """The session over the checkpoint's experts, on the backend of the torch ``device``."""
    backend = "cupy" if device.type == "cuda" else "host"
    devices = [device.index or 0] if backend == "cupy" else None
    return moestream.open_sync(given, backend=backend, devices=devices, **session_words)


def _served(session: moestream.SyncSession, root: Path, device: Any, dtype: Any,
            attention: str | None, compute: Compute, progress: bool | None,
            prefetch: str = "none", in_place: bool = False) -> Any:
    """The model over ``session``: built on the meta device, its dense weights loaded, its
    experts served by an ``ExpertStream`` that runs a token each forward (the caller closes
    the session on a failure)."""
    gguf = None
    if is_gguf(session.model.path):
        model, config, gguf = _gguf_built(session, root, dtype, attention)
    else:
        model, config = _built(session, root, dtype, attention)
    swap_experts(model)  # experts outside transformers' registry (Llama 4, JetMoE)
    experts = _experts_modules(root, model, config)
    group = _check_experts(session, experts)
    scales = _weights(model, session, device, progress, sorted(experts), gguf)
    routers = next_routers(model, experts) if prefetch == "predict" else None
    experts_stream = ExpertStream(session, device, compute=compute, group_experts=group,
                                  scales=scales, next_routers=routers, in_place=in_place)
    for layer, module in experts.items():
        module.moestream_stream = experts_stream
        module.moestream_layer = layer
    model.moestream = experts_stream
    model.register_forward_pre_hook(_begin_hook(experts_stream))
    model.register_forward_hook(_end_hook(experts_stream))
    follow_decode_switch(model, experts_stream)
    model.eval()
    return serve(model)


def _weights(model: Any, session: moestream.SyncSession, device: Any, progress: bool | None,
             layers: list[int], gguf: GgufSource | None) -> dict[int, LayerScales | GgufExperts]:
    """Load the dense weights; the dequantization of each quantized layer's experts."""
    if gguf is not None:
        load_gguf_dense(model, session, device, progress, gguf)
        return dict(gguf_experts(session, layers, in_dtype=gguf.header is not None))
    load_dense(model, session, device, progress)
    return dict(load_scales(session, layers, device, tensor_reader(session)))


def _gguf_built(session: moestream.SyncSession, root: Path, dtype: Any,
                attention: str | None) -> tuple[Any, Any, GgufSource]:
    """As :func:`_built`, for a GGUF file: the config from its metadata by transformers."""
    def build(files: Path, config: Any) -> Any:
        if attention is not None:  # as transformers' _from_config applies it
            config._attn_implementation = attention
        return build_with(attention, lambda: _meta_model(root, files, config, dtype))

    return gguf_model(session, build)


def _built(session: moestream.SyncSession, root: Path, dtype: Any,
           attention: str | None) -> tuple[Any, Any]:
    """The model on the meta device and its config, from the session's ``config.json``."""
    if not session.model.config:
        raise ModelFileError(root, "has no config.json: moestream.transformers builds the "
                             "model from it")
    for key in ("dtype", "torch_dtype"):  # transformers fails on others with a traceback
        stored = session.model.config.get(key)
        if stored not in (None, "auto") and dtype_of(stored) is None:
            raise ModelFileError(root / CONFIG, f"its {key} {not_a_dtype(stored)}")
    with snapshot(root, GENERATION_FILES, session.model.config) as files:
        config = _config(root, files)
        if attention is not None:  # as transformers' _from_config applies it
            config._attn_implementation = attention
        model = build_with(attention, lambda: _meta_model(root, files, config, dtype))
    return model, config


def _begin_hook(experts_stream: ExpertStream) -> Any:
    """The forward pre-hook that starts moestream's token (never traced by
    ``torch.compile``: ``uncompiled``)."""
    @uncompiled
    def begin(module: Any, args: Any) -> None:  # None: the forward's inputs stay as they are
        experts_stream.begin_step()

    return begin


def _end_hook(experts_stream: ExpertStream) -> Any:
    """The forward hook that ends moestream's token (never traced, as the pre-hook)."""
    @uncompiled
    def end(module: Any, args: Any, output: Any) -> None:  # None: the output stays
        experts_stream.end_step()

    return end


def _config(root: Path, files: Path) -> Any:
    """The model's config from the session's ``config.json`` (in ``files``), by
    transformers' own classes and never by code of the checkpoint."""
    try:
        return transformers.AutoConfig.from_pretrained(files, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelFileError(root / CONFIG, first_line(exc)) from exc


def _causal_lm(config: Any, **kwargs: Any) -> Any:
    """The model, as ``AutoModelForCausalLM.from_config`` builds it, or by the checkpoint's
    own causal-LM class (``config.architectures``) where the auto mapping lacks the model
    type (Mistral-4's ``Mistral4ForCausalLM``)."""
    auto = transformers.AutoModelForCausalLM
    if type(config) not in auto._model_mapping:
        for name in getattr(config, "architectures", None) or []:
            cls = getattr(transformers, str(name), None)
            if str(name).endswith("ForCausalLM") and cls is not None:
                return cls._from_config(config, **kwargs)
    return auto.from_config(config, **kwargs)  # its own error names what it lacks


def _meta_model(root: Path, files: Path, config: Any, dtype: Any) -> Any:
    """The model's modules with meta tensors (no storage), experts through the registry."""
    if dtype is None:
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = dtype_of(stored) or torch.float32  # checked in config.json already
    try:
        with torch.device("meta"):
            model = _causal_lm(config, dtype=dtype, experts_implementation=IMPLEMENTATION)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(root, f"model type {config.model_type!r} cannot be served by "
                             f"moestream: {first_line(exc)}") from exc
    _keep_in_float32(model, dtype)
    if (files / "generation_config.json").is_file():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(files)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(root / "generation_config.json", first_line(exc)) from exc
    return model


def _keep_in_float32(model: Any, dtype: Any) -> None:
    """The tensors transformers' ``from_pretrained`` keeps in float32 whatever the dtype:
    its load's dtype plan (a model class's ``_keep_in_fp32_modules_strict`` at bf16 or fp16,
    ``_keep_in_fp32_modules`` at fp16), which ``from_config`` does not apply. The dense
    tensors are cast to the meta model's dtypes, so the plan is applied to it here, by
    transformers' own ``_get_dtype_plan`` where the installed version has one. (5.17's
    DeepSeek-V4 makes its hyper-connections and sinks in the default dtype and relies on
    the plan: without it they were bf16 and its tokens left the reference's.)"""
    own = getattr(model, "_get_dtype_plan", None)
    if own is not None:
        names = list(own(dtype))
    else:
        strict = dtype in (torch.float16, torch.bfloat16)
        names = [*(getattr(model, "_keep_in_fp32_modules_strict", None) or [] if strict else []),
                 *(getattr(model, "_keep_in_fp32_modules", None) or []
                   if dtype == torch.float16 else [])]
    if not names:
        return
    kept = re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in names))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not (kept.search(name) and tensor.is_floating_point()
                and tensor.dtype != torch.float32):
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(tensor.to(torch.float32),
                                                          requires_grad=tensor.requires_grad)
        else:
            module._buffers[leaf] = tensor.to(torch.float32)


def _experts_modules(root: Path, model: Any, config: Any) -> dict[int, Any]:
    """The model's routed-experts modules by layer index: those transformers calls through
    its experts registry, in the layout this integration computes."""
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "has_gate")
                and isinstance(first_projection(module), torch.nn.Parameter)
                and isinstance(getattr(module, "down_proj", None), torch.nn.Parameter)):
            continue
        layer = _LAYER.search(name)
        if layer is None:
            continue
        # biases, a transposed gate_up and its interleaving (the module's own _apply_gate),
        # no gate (an activation alone) are computed as transformers computes them; a norm
        # after the experts is not
        if getattr(module, "has_post_expert_norm", False):
            raise ModelFileError(root, f"model type {config.model_type!r}: experts with a norm "
                                 "after them (has_post_expert_norm) are not served by "
                                 "moestream")
        found[int(layer.group(1))] = module
    if not found:
        raise ModelFileError(root, f"model type {config.model_type!r} has no routed experts "
                             "behind transformers' experts registry (docs/TRANSFORMERS.md "
                             "lists the supported ones)")
    return found


def _check_experts(session: moestream.SyncSession, experts: dict[int, Any]) -> int:
    """Check the checkpoint's experts against the model; returns how many experts one fetch
    may pin (what the budget holds beside another layer in flight)."""
    info = session.model
    path = info.path
    # a checkpoint's multi-token-prediction layers are not the model's (transformers
    # ignores their weights too): their experts are never fetched
    ours = sorted(experts)
    theirs = sorted(set(info.moe_layers) - mtp_layers(info.config, info.moe_layers))
    if ours != theirs:
        raise ExpertLayoutError(path, f"the config has routed experts in layers {ours}, "
                                f"the checkpoint in layers {theirs}")
    for layer, module in experts.items():
        got = info.layers[layer]
        transposed = bool(getattr(module, "is_transposed", False))
        gated = bool(module.has_gate)
        if (transposed, gated) != (got.transposed, got.gated):
            raise ExpertLayoutError(path, f"layer {layer}: the model keeps its experts "
                                    f"{'transposed' if transposed else 'as [E, F, D]'} and "
                                    f"{'with' if gated else 'without'} a gate, the "
                                    "checkpoint's experts are laid out otherwise")
        _, rows, cols = first_projection(module).shape  # the model's own, whatever its names
        hidden, ffn = (rows, cols) if transposed else (cols, rows)
        ffn //= 2 if gated else 1
        for what, want, have in (("experts", module.num_experts, got.n_experts),
                                 ("hidden size", hidden, got.hidden),
                                 ("expert FFN size", ffn, got.ffn)):
            if want != have:
                raise ExpertLayoutError(path, f"layer {layer}: the config says {what} "
                                        f"{want}, the checkpoint's experts have {have}")
        for matrix_type in (got.gate_up_type, got.down_type):
            if (matrix_type.name not in TORCH_DTYPES and got.quant is None
                    and not is_gguf(info.path)):  # GGUF types: gguf_experts checks them
                raise ModelFileError(path, f"layer {layer}: experts in {matrix_type.name}; "
                                     f"torch computes {', '.join(TORCH_DTYPES)} experts")
    budget = session.counters().budget_bytes
    largest = max(info.layers[layer].expert_bytes for layer in experts)
    return max(1, budget // largest // 2)
