"""``python -m pipeline.run --engine transformers``: generate with a real model through moestream.

The model is loaded by :func:`moestream.transformers.from_pretrained` (a checkpoint
directory or a GGUF file; routed experts streamed under ``--cache-budget``), the prompt is
the checkpoint tokenizer's (a GGUF file's: transformers' from the metadata the session
read, after the load) encoding of
``--prompt`` or the ids of ``--prompt-ids``, and ``--tokens`` tokens are generated greedily
with transformers' own ``generate`` (``--chat``: the prompt as one user message of the
tokenizer's chat template, the reply's tokens up to the model's end of turn, at most
``--tokens``: an instruct model's answer). Prints the tokens (and the text, with a tokenizer),
then the run's summary in ``moestream.pipeline.cli.run``'s format (``--json``: one JSON
object, the summary's fields with ``prompt_ids``, ``token_ids`` and ``text``); ``--log``
writes the same run log (one ``token`` line per generated token), which ``tools.analyze``
reads. Errors are one line and exit 2 for bad input, as ``moestream.pipeline.cli.run``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from moestream import RunSummary
from moestream.pipeline.cli.common import closable_stdout, print_error
from moestream.pipeline.cli.progress import LiveLine
from moestream.pipeline.cli.run_arguments import refuse_for_transformers, streaming_options
from moestream.pipeline.cli.summary import print_summary
from moestream.pipeline.foundation.describe import describe_experts
from moestream.pipeline.foundation.errors import MoestreamError, UsageError
from moestream.pipeline.foundation.outputs import check_not_input, check_output
from moestream.pipeline.foundation.sizes import size_text

__all__ = ["main"]


def _tuning(args: argparse.Namespace) -> Any:
    """The command line's streaming options as the session's ``Tuning``, checked first in
    the command line's words (``--queue-depth``, not ``Tuning.queue_depth``), as the proxy
    engine's are."""
    from moestream import Tuning
    from moestream.pipeline.foundation.config import StreamConfig

    options = streaming_options(args)
    StreamConfig(**options)  # raises in the command line's words
    return Tuning(**options)


def _check_vocabulary(ids: list[int], model: Any) -> None:
    """Every prompt id names a row of the model's embeddings (an id past them, or a negative
    one, is one line, not torch's index error from inside the forward)."""
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is None:
        return  # an embedding of another kind: its own errors stand
    bad = next((i for i in ids if not 0 <= i < rows), None)
    if bad is not None:
        raise UsageError(f"the prompt's token id {bad} is not one of this model's "
                         f"(0..{rows - 1})")


def _prompt_ids(args: argparse.Namespace, model_dir: Path) -> tuple[list[int] | None, Any]:
    """The prompt's ids, and the tokenizer (None without one). For a GGUF file's
    ``--prompt`` both are None here: its tokenizer is built after the load, from the header
    the session read (``_gguf_prompt``), never from a second open of the path."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise UsageError(f"--prompt-ids: not a comma-separated list of ids: "
                             f"{args.prompt_ids!r}") from exc
        if not ids:
            raise UsageError("--prompt-ids: no ids")
        return ids, None
    if args.prompt is None:
        raise UsageError("--engine transformers needs --prompt TEXT or --prompt-ids 1,2,3")
    from moestream import transformers as mt

    if mt.is_gguf(model_dir):
        return None, None
    tokenizer = mt.tokenizer(model_dir)
    return _encoded(tokenizer, args.prompt, args.chat), tokenizer


def _encoded(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """``prompt``'s ids; ``chat``: of the tokenizer's chat template around it as the one
    user message, with the assistant's turn opened (the template's own special tokens,
    none added twice)."""
    if not chat:
        encoded = tokenizer(prompt)
    elif not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat: the checkpoint's tokenizer has no chat template")
    else:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, return_dict=True)
    ids = [int(t) for t in encoded["input_ids"]]
    if not ids:
        raise UsageError("--prompt: the tokenizer made no tokens of it")
    return ids


def _gguf_prompt(model: Any, prompt: str, chat: bool, ids: list[int] | None,
                 tokenizer: Any) -> tuple[list[int], Any]:
    """The prompt's ids and tokenizer as ``_prompt_ids`` gave them; for a GGUF file's
    ``--prompt`` (``ids`` None), its ids by the tokenizer transformers builds from the
    header the session read (the file it identified, whatever the path names by now)."""
    from moestream import transformers as mt

    if ids is not None:
        return ids, tokenizer
    tokenizer = mt.tokenizer(model)
    return _encoded(tokenizer, prompt, chat), tokenizer


def main(args: argparse.Namespace) -> int:
    """Run ``pipeline.cli.run --engine transformers`` with its parsed arguments; returns the
    exit code."""
    try:
        return _generate(args)
    except MoestreamError as exc:
        if args.debug:
            raise
        print_error("moestream: error: ", exc)
        return exc.exit_code


def _check_args(args: argparse.Namespace) -> None:
    """The command line's own refusals, before anything is loaded."""
    if args.model is None:
        raise UsageError("--engine transformers needs -m CHECKPOINT_DIR or -m FILE.gguf")
    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    if args.chat and args.prompt is None:
        raise UsageError("--chat puts --prompt TEXT in the chat template: give --prompt")
    if args.prefetch == "oracle":
        raise UsageError("--prefetch oracle replays a trace's routing ahead, the proxy "
                         "engine's; --engine transformers takes none or predict")
    refuse_for_transformers(args)
    if args.log is not None:
        check_output(args.log, what="--log", in_place=True)
        check_not_input(args.log, {"--model": args.model}, what="--log")


def _generate(args: argparse.Namespace) -> int:
    _check_args(args)
    tuning = _tuning(args)
    from moestream.transformers import local_checkpoint

    checkpoint = local_checkpoint(args.model)  # a hub id: the hub cache's snapshot
    ids, tokenizer = _prompt_ids(args, checkpoint)
    from moestream.transformers import is_available

    is_available(raise_error=True)
    import torch  # type: ignore[import-not-found, unused-ignore]

    from moestream.transformers import from_pretrained, held_scale_bytes

    device = {"host": "cpu", "cupy": "cuda"}.get(args.backend)
    with warnings.catch_warnings():  # the console's budget_clamped event says it already
        warnings.filterwarnings("ignore", category=UserWarning, module=__name__)
        model = from_pretrained(checkpoint, budget=args.cache_budget, mode=args.mode,
                                device=device, compute=args.experts, policy=args.policy,
                                verify=not args.no_verify, log=args.log,
                                prefetch=args.prefetch, in_place=args.in_place,
                                tuning=tuning)
    stream = model.moestream
    summary = RunSummary(model=str(args.model), backend=stream.session.backend,
                         device=str(stream.device),
                         experts=describe_experts(stream.session.model.layers.values())
                         + _scales_text(held_scale_bytes(model)))
    live = LiveLine(args.tokens, enabled=not args.json and sys.stderr.isatty())
    stream.on_token = lambda s: live.update(s.hits, s.misses, s.time, s.mode)
    try:
        ids, tokenizer = _gguf_prompt(model, args.prompt, args.chat, ids, tokenizer)
        _check_vocabulary(ids, model)
        prompt = torch.tensor([ids], dtype=torch.long, device=stream.device)
        started = time.perf_counter()
        with torch.no_grad():
            # a benchmark's run generates --tokens exactly; a chat stops at the end of turn
            least = {} if args.chat else {"min_new_tokens": args.tokens}
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=args.tokens, do_sample=False, **least)
        summary.elapsed_s = time.perf_counter() - started
        summary.exit = "ok"
    finally:
        live.close()
        counters = stream.session.counters()
        stream.close()
    new = out[0, len(ids):].tolist()
    _fill(summary, counters, tokens=len(new), verify=not args.no_verify)
    text = (tokenizer.decode(new, skip_special_tokens=args.chat) if tokenizer is not None
            else None)
    with closable_stdout():
        if args.json:  # the summary's fields, and what was generated
            print(json.dumps({**summary.as_dict(), "prompt_ids": ids, "token_ids": new,
                              **({"text": text} if text is not None else {})}, indent=2))
        else:
            print(f"tokens     {','.join(str(t) for t in new)}")
            if text is not None:
                print(f"text       {text!r}")
            print_summary(summary, as_json=False)
    return 3 if counters.mismatches else 0


def _scales_text(held: int) -> str:
    """The summary's words for the quantized experts' scales on the device (empty when
    none are)."""
    return f"; their scales {size_text(held)} on the device, in the budget" if held else ""


def _fill(summary: RunSummary, counters: Any, *, tokens: int, verify: bool) -> None:
    """The summary's totals from the session's counters."""
    summary.tokens = tokens
    for name in ("hits", "misses", "evictions", "file_bytes", "cache_bytes", "storage_bytes",
                 "verified", "mismatches", "unverified", "peak_device_bytes", "mode",
                 "switches"):
        setattr(summary, name, getattr(counters, name))
    summary.budget_bytes = summary.final_budget_bytes = counters.budget_bytes
    summary.stall_ms = counters.stall_ms
    summary.digests = "on" if verify else "off"
