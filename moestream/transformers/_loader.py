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

import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

import structlog
import torch  # type: ignore[import-not-found, unused-ignore]
import transformers  # type: ignore[import-not-found, unused-ignore]

import moestream
from moestream.pipeline.foundation.errors import (
    ExpertLayoutError,
    ModelFileError,
    UsageError,
    UsageTypeError,
)
from moestream.transformers._experts import (
    COMPUTES,
    IMPLEMENTATION,
    TORCH_DTYPES,
    Compute,
    ExpertStream,
    first_projection,
    register,
)
from moestream.transformers._files import CONFIG, GENERATION_FILES, snapshot
from moestream.transformers._gate import is_available
from moestream.transformers._quantized import DenseScales, load_scales

__all__ = ["from_pretrained"]

_log = structlog.get_logger("moestream.transformers")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FILE_DTYPES: dict[str, Any] = {
    name: getattr(torch, attr) for name, attr in (
        ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"),
        ("U16", "uint16"), ("I32", "int32"), ("U32", "uint32"), ("I64", "int64"),
        ("U64", "uint64"), ("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32"),
        ("F64", "float64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"))
    if hasattr(torch, attr)
}
"""safetensors' type names, as torch loads them (as safetensors' own torch loader maps
them)."""


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    budget: str | moestream.Budget | None = None,
    mode: str = "auto",
    device: str | Any | None = None,
    dtype: Any = None,
    compute: Compute = "grouped",
    policy: str = "lru",
    verify: bool = True,
    log: str | os.PathLike[str] | None = None,
    tuning: moestream.Tuning | None = None,
    progress: bool | None = None,
    **words: Any,
) -> Any:
    """Load a transformers MoE causal LM whose routed experts moestream serves.

    Args:
        path: a checkpoint directory (``config.json`` and safetensors shards), or one
            ``.safetensors`` file with the ``config.json`` beside it.
        budget: the device cache for the routed experts: ``"64"`` (experts), ``"3GiB"``,
            or a ``Budget``; None holds every expert.
        mode: moestream's I/O mode, ``auto``, ``direct`` or ``resident``.
        device: where the model computes: ``"cpu"`` (moestream's host backend) or
            ``"cuda"``/``"cuda:N"`` (CuPy); None: the first GPU if torch sees one.
        dtype: the model's dtype (default: the checkpoint's, as transformers' "auto").
            Experts stored in another dtype are cast per use.
        compute: ``"grouped"`` (transformers' ``grouped_mm`` arithmetic, the default) or
            ``"eager"`` (logits ``torch.equal`` to ``experts_implementation="eager"``).
        policy, verify, log, tuning: as ``moestream.open``.
        progress: a progress bar while the dense weights load (default: stderr is a
            terminal).
        **words: transformers' own loading words, where they mean something here:
            ``torch_dtype`` (``dtype``'s old name, taken without a warning);
            ``attn_implementation`` (set on the model's config before it is built, as
            transformers does: ``"eager"``, ``"sdpa"``, an installed ``flash_attention_N``
            or ``flex_attention``); ``device_map`` naming one device (``"cuda:0"``, a
            ``torch.device``, an index, ``{"": device}``, or ``"auto"``: ``device``'s
            default), as ``device``; ``low_cpu_mem_usage`` (nothing beyond the dense
            weights is ever loaded: a no-op); ``trust_remote_code=False``. Refused, each in
            one line naming what to use instead: a ``device_map`` that splits the model
            (the dense weights go to one device, the experts stream under ``budget``),
            ``max_memory`` (``budget`` bounds the experts' device memory), ``revision`` (a
            local path only), ``trust_remote_code=True`` (no checkpoint code ever runs);
            any other word, naming the arguments this function takes.

    Returns:
        The model, in eval mode, on ``device``; ``model.moestream`` is its
        ``ExpertStream`` (``.session``, ``.close()``). Each forward is one moestream token
        (``end_token`` at its end). Close it when done: ``model.moestream.close()``.

    Raises:
        UsageError: torch or transformers missing, a bad or unknown argument, a
            transformers word moestream replaces (above), a budget below what one
            layer's experts need.
        ModelFileError: the checkpoint cannot be used (its subclasses name why); nothing
            stays open or loaded.
    """
    is_available(raise_error=True)
    device, dtype, attention = _loading_words(words, device, dtype)
    if compute not in COMPUTES:
        raise UsageError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    register()
    given = Path(path)
    if given.suffix == ".gguf":
        raise ModelFileError(given, "moestream.transformers reads safetensors checkpoints "
                             "(a directory with config.json); GGUF is not supported yet")
    # a checkpoint directory, or one .safetensors file with the config.json beside it
    root = given.parent if given.is_file() else given
    if not given.exists():
        raise ModelFileError(given, "no such checkpoint directory or file (a local path: a "
                             "hub id is not downloaded, fetch it first, e.g. with "
                             "huggingface_hub.snapshot_download)")
    if not (root / CONFIG).is_file():
        raise ModelFileError(root, "not a checkpoint directory (no config.json)")
    torch_device = _device(device)
    wanted = _dtype(dtype)
    if wanted is None and dtype not in (None, "auto"):
        raise UsageError(f"dtype {_no_dtype(dtype)}")
    backend = "cupy" if torch_device.type == "cuda" else "host"
    devices = [torch_device.index or 0] if backend == "cupy" else None
    session = moestream.open_sync(given, budget=budget, mode=mode, policy=policy,  # type: ignore[arg-type]
                                  verify=verify, backend=backend, devices=devices, log=log,
                                  tuning=tuning)
    try:
        if not session.model.config:
            raise ModelFileError(root, "has no config.json: moestream.transformers builds the "
                                 "model from it")
        for key in ("dtype", "torch_dtype"):  # transformers fails on others with a traceback
            stored = session.model.config.get(key)
            if stored not in (None, "auto") and _dtype(stored) is None:
                raise ModelFileError(root / CONFIG, f"its {key} {_no_dtype(stored)}")
        with snapshot(root, GENERATION_FILES, session.model.config) as files:
            config = _config(root, files)
            if attention is not None:  # as transformers' _from_config applies it
                config._attn_implementation = attention
            model = _build_with(attention, lambda: _meta_model(root, files, config, wanted))
        experts = _experts_modules(root, model, config)
        group = _check_experts(session, experts)
        _load_dense(model, session, torch_device, progress)
        read = _reader(session)
        scales = load_scales(session, sorted(experts), torch_device, read)
        stream = ExpertStream(session, torch_device, compute=compute, group_experts=group,
                              scales=scales)
        for layer, module in experts.items():
            module.moestream_stream = stream
            module.moestream_layer = layer
        model.moestream = stream
        model.register_forward_pre_hook(_begin_hook(stream))
        model.register_forward_hook(_end_hook(stream))
        model.eval()
    except BaseException:
        session.close()
        raise
    return model


_ARGUMENTS = ("path", "budget", "mode", "device", "dtype", "compute", "policy", "verify", "log",
              "tuning", "progress", "torch_dtype", "attn_implementation", "device_map",
              "low_cpu_mem_usage", "trust_remote_code")
"""What ``from_pretrained`` takes, as an unknown keyword's refusal lists it."""


def _loading_words(words: dict[str, Any], device: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """``device``, ``dtype`` and the attention implementation, after transformers' loading
    words in ``words`` (see ``from_pretrained``); the rest refused in one line each."""
    words = dict(words)
    torch_dtype = words.pop("torch_dtype", None)
    if torch_dtype is not None:
        if dtype is not None and dtype != torch_dtype and (
                _dtype(dtype) is None or _dtype(dtype) != _dtype(torch_dtype)):
            raise UsageError(f"dtype {str(dtype)[:40]!r} and torch_dtype "
                             f"{str(torch_dtype)[:40]!r}: give dtype alone (torch_dtype is "
                             "its old name)")
        dtype = torch_dtype
    if "device_map" in words:
        device = _device_map(words.pop("device_map"), device)
    if words.pop("max_memory", None) is not None:
        raise UsageError("max_memory: moestream keeps the dense weights on one device and "
                         "bounds the routed experts' device memory by budget= (e.g. "
                         "budget=\"20GiB\")")
    if words.pop("revision", None) is not None:
        raise UsageError("revision: moestream reads a local checkpoint directory only; fetch "
                         "the revision first (huggingface_hub.snapshot_download(repo, "
                         "revision=...)) and pass its path")
    trust = words.pop("trust_remote_code", None)
    if trust not in (None, False):
        raise UsageError("trust_remote_code: moestream never runs a checkpoint's code; it "
                         "serves the model types transformers itself ships")
    if words.pop("low_cpu_mem_usage", None) not in (None, True, False):
        raise UsageTypeError("low_cpu_mem_usage must be True or False")
    attention = words.pop("attn_implementation", None)
    if attention is not None:
        _check_attention(attention)
    if words:
        names = ", ".join(sorted(words))
        raise UsageTypeError(f"from_pretrained got an unexpected argument"
                             f"{'s' if len(words) > 1 else ''} {names}; it takes "
                             f"{', '.join(_ARGUMENTS)} (max_memory and revision are refused "
                             "with what replaces them)")
    return device, dtype, attention


def _device_map(device_map: Any, device: Any) -> Any:
    """The one device ``device_map`` names (``"auto"``: ``device``'s default); a map that
    splits the model is refused."""
    chosen = device_map
    if isinstance(device_map, dict) and set(device_map) == {""}:
        chosen = device_map[""]
    elif isinstance(device_map, dict) or device_map in ("balanced", "balanced_low_0",
                                                        "sequential"):
        raise UsageError(f"device_map {str(device_map)[:60]}: moestream does not split the "
                         "model over devices; the dense weights go to one device (device= or "
                         "device_map=\"cuda:0\") and the routed experts stream under budget=")
    elif device_map == "auto" or device_map is None:
        chosen = None
    if device is not None and chosen is not None and str(device) != str(chosen):
        raise UsageError(f"device {str(device)!r} and device_map {str(device_map)[:60]}: give "
                         "one of them")
    return device if chosen is None else chosen


def _check_attention(attention: Any) -> None:
    """Refuse an attention implementation transformers does not know, or a hub kernel
    (moestream downloads nothing)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if not isinstance(attention, str):
        raise UsageTypeError(f"attn_implementation must be a name ({', '.join(known)}), not "
                             f"{type(attention).__name__}")
    if attention not in known:
        raise UsageError(f"attn_implementation {attention[:60]!r}: one of {', '.join(known)} "
                         "(a hub kernel is not downloaded)")


def _build_with(attention: str | None, build: Any) -> Any:
    """``build()``; a failure the attention implementation causes (its package missing,
    the model lacking it) is the caller's, a ``UsageError`` naming it."""
    try:
        return build()
    except (ImportError, ModelFileError) as exc:
        cause = exc if isinstance(exc, ImportError) else exc.__cause__
        if (attention is None or not isinstance(cause, (ImportError, ValueError))
                or not re.search("attn|attention", str(cause), re.IGNORECASE)):
            raise
        raise UsageError(f"attn_implementation {attention!r}: {_first_line(cause)}") from exc


def _begin_hook(stream: ExpertStream) -> Any:
    def begin(module: Any, args: Any) -> None:  # None: the forward's inputs stay as they are
        stream.begin_step()

    return begin


def _end_hook(stream: ExpertStream) -> Any:
    def end(module: Any, args: Any, output: Any) -> None:  # None: the output stays
        stream.end_step()

    return end


def _device(device: Any) -> Any:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device {device!r}: {exc}") from exc
    if chosen.type not in ("cpu", "cuda"):
        raise UsageError(f"device {device!r}: moestream computes on cpu or cuda")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r}: torch sees no CUDA device")
    return chosen


def _config(root: Path, files: Path) -> Any:
    """The model's config from the session's ``config.json`` (in ``files``), by
    transformers' own classes and never by code of the checkpoint."""
    try:
        return transformers.AutoConfig.from_pretrained(files, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelFileError(root / CONFIG, _first_line(exc)) from exc


def _dtype(value: Any) -> Any:
    """A torch floating dtype from ``value`` (a torch dtype or its name), None for None or
    ``"auto"`` (the checkpoint's); None also for anything else, which the caller refuses."""
    chosen = getattr(torch, value, None) if isinstance(value, str) else value
    return chosen if isinstance(chosen, torch.dtype) and chosen.is_floating_point else None


def _no_dtype(value: Any) -> str:
    return (f"{str(value)[:40]!r} is not a torch floating-point dtype (bfloat16, float16, "
            "float32 or \"auto\")")


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
        dtype = _dtype(stored) or torch.float32  # checked in config.json already
    try:
        with torch.device("meta"):
            model = _causal_lm(config, dtype=dtype, experts_implementation=IMPLEMENTATION)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(root, f"model type {config.model_type!r} cannot be served by "
                             f"moestream: {_first_line(exc)}") from exc
    if (files / "generation_config.json").is_file():
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(files)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(root / "generation_config.json", _first_line(exc)) from exc
    return model


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
    ours, theirs = sorted(experts), sorted(info.moe_layers)
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
            if matrix_type.name not in TORCH_DTYPES and got.quant is None:
                raise ModelFileError(path, f"layer {layer}: experts in {matrix_type.name}; "
                                     f"torch computes {', '.join(TORCH_DTYPES)} experts")
    budget = session.counters().budget_bytes
    largest = max(info.layers[layer].expert_bytes for layer in experts)
    return max(1, budget // largest // 2)


def _renamer(model: Any) -> Any:
    """Checkpoint name -> (model name, the converter that builds it or None), by
    transformers' own renamings and converters for this model; the routed experts are never
    asked for (their converters stay unused)."""
    meta_state = model.state_dict()
    try:
        from transformers.conversion_mapping import (  # type: ignore[import-not-found, unused-ignore]
            get_model_conversion_mapping,
        )
        from transformers.core_model_loading import (  # type: ignore[import-not-found, unused-ignore]
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError as exc:  # an older 5.x: the names as they are
        _log.warning("transformers_renamings_unavailable", reason=str(exc),
                     fallback="checkpoint names used as they are")
        return lambda key: (key, None)
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)

    def rename(key: str) -> tuple[str, tuple[Any, str] | None]:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            # as transformers' loading: a renaming that should not have fired (DeepSeek-V4's
            # ``.norm.`` -> ``.kv_norm.`` on the final ``model.norm``); the prefix only
            return rename_source_key(key, [], [], prefix, meta_state)[0], None
        return renamed, (by_pattern[pattern], pattern) if pattern is not None else None

    return rename


def _load_dense(model: Any, session: moestream.SyncSession, device: Any,
                progress: bool | None) -> None:
    """Read every non-expert tensor through the session (the files it identified) onto
    ``device`` and assign it (those transformers builds from several, such as Kimi-Linear's
    stacked convolutions, by its own converter); make the buffers; tie."""
    params = dict(model.named_parameters())
    expected = set(model.state_dict())
    rename = _renamer(model)
    root = session.model.path
    dense = list(session.model.tensors.values())
    read = _reader(session)
    quantized = DenseScales(session, root)
    loaded: dict[str, Any] = {}
    merged: dict[str, Any] = {}  # model name -> its converter, collecting its sources
    unexpected: list[str] = []
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    def assign(name: str, target: str, tensor: Any) -> None:
        like = params.get(target)
        if like is None:
            like = model.get_buffer(target)
        if tuple(tensor.shape) != tuple(like.shape):
            raise ExpertLayoutError(root, f"{name} has shape {list(tensor.shape)[:8]}, the "
                                    f"config makes {target} {list(like.shape)}")
        loaded[target] = tensor.to(like.dtype)

    with tqdm(total=len(dense), unit="tensor", desc="loading dense weights",
              disable=not progress, leave=False, file=sys.stderr) as bar:
        for spec in dense:
            bar.update(1)
            if quantized.is_scale(spec.name):
                continue
            target, converter = rename(spec.name)
            if target not in expected:
                unexpected.append(spec.name)
                continue
            like = params.get(target)
            dtype = like.dtype if like is not None else model.dtype
            tensor = quantized.weight(spec, read(spec).to(device), dtype, read)
            if converter is not None:
                into = merged.setdefault(target, copy.deepcopy(converter[0]))
                into.add_tensor(target, spec.name, converter[1], tensor)
            else:
                assign(spec.name, target, tensor)
    for target, converter in merged.items():
        try:
            built = converter.convert(target, model=model, config=model.config)
        except Exception as exc:  # transformers' ops raise their own errors
            raise ModelFileError(root, f"{target}: transformers' converter failed: "
                                 f"{_first_line(exc)}") from exc
        for name, tensor in built.items():
            if name not in expected:
                unexpected.append(name)
                continue
            assign(target, name, tensor[0] if isinstance(tensor, list) else tensor)
    if unexpected:
        _log.warning("checkpoint_tensors_unused", count=len(unexpected),
                     first=unexpected[:4], path=str(root))
    model.load_state_dict(loaded, strict=False, assign=True)
    model.tie_weights()
    routed = {f"{name}.{p}" for name, m in model.named_modules()
              if getattr(m, "moestream_layer", None) is not None or hasattr(m, "has_gate")
              for p in ("gate_up_proj", "up_proj", "down_proj")}
    missing = [n for n, p in model.named_parameters()
               if p.is_meta and n not in routed]
    if missing:
        raise ModelFileError(root, f"the checkpoint lacks {len(missing)} tensors the model "
                             f"needs, first {missing[0]}")
    _make_buffers(root, model, device)


def _reader(session: moestream.SyncSession) -> Any:
    """A function reading a non-routed tensor through the session as a CPU tensor over its
    bytes (no copy), typed as the file declares it."""
    root = session.model.path

    def read(spec: moestream.TensorSpec) -> Any:
        dtype = _FILE_DTYPES.get(spec.dtype)
        if dtype is None:
            raise ModelFileError(root, f"{spec.name[:120]}: a {spec.dtype[:20]} tensor, a "
                                 "type torch does not load")
        data = session.read_tensor(spec.name)
        if not data:
            return torch.empty(spec.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(spec.shape)

    return read


def _make_buffers(root: Path, model: Any, device: Any) -> None:
    """Non-persistent buffers (rotary frequencies) as ``from_pretrained`` makes them: on
    the device, filled by the model's ``_init_weights``."""
    owners = {}
    for name, buffer in model.named_buffers():
        if not buffer.is_meta:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._buffers[leaf] = torch.empty_like(buffer, device=device)
        owners[owner_name] = owner
    with torch.no_grad():
        for owner in owners.values():
            model._init_weights(owner)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise ModelFileError(root, f"the model's buffer {left[0]} could not be made")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
