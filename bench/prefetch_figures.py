"""Figures of the prefetch benchmark, computed from its runs' JSON-lines logs.

Per run: accuracy, guesses loaded and wasted bytes of ``predict`` (``prefetch_figures``),
the guessed experts a run loaded, used and wasted (``guess_loads``), and how alike two runs
routed (``routing_agreement``); per mode, the speed-up of predict and oracle over none and
the share of the oracle's gain that predict reaches (``gain_figures``). Pure functions of
the logs' events and the runs' figures: ``bench.prefetch`` runs and prints them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "PREFETCHES",
    "device_expert_bytes",
    "gain_figures",
    "guess_loads",
    "prefetch_figures",
    "routing_agreement",
]

PREFETCHES = ("none", "predict", "oracle")
# A gain below this share of the baseline's tokens/s is noise: no share of it is reported.
_MIN_GAIN_SHARE = 0.01


def prefetch_figures(events: Sequence[dict[str, Any]],
                     exact_per_token: int = 0) -> dict[str, Any] | None:
    """Accuracy, guesses loaded and waste of ``predict`` over token events; None when none
    carry them.

    Args:
        events: token events.
        exact_per_token: guesses per token that are right by construction (the live
            router's hash-routed layers pick from the token id, as their guess does); with
            any, ``router_layer_accuracy`` is the accuracy of the others alone.
    """
    stats = [e["prefetch"] for e in events if "prefetch" in e]
    if not stats:
        return None
    predicted = sum(s["predicted"] for s in stats)
    correct = sum(s["correct"] for s in stats)
    wasted = sum(s["wasted_bytes"] for s in stats)
    out: dict[str, Any] = {
        "predicted": predicted,
        "correct": correct,
        "accuracy": round(correct / predicted, 4) if predicted else None,
        "wasted_bytes": wasted,
        "wasted_bytes_per_token": round(wasted / len(stats), 1),
    }
    if all("loaded" in s for s in stats):  # logs from before the field lack it
        out["loaded"] = sum(s["loaded"] for s in stats)
        out["loaded_per_token"] = round(out["loaded"] / len(stats), 2)
    if exact_per_token:
        exact = exact_per_token * len(stats)
        out["router_layer_accuracy"] = (round((correct - exact) / (predicted - exact), 4)
                                        if predicted > exact else None)
    return out


def guess_loads(events: Sequence[dict[str, Any]], summary: dict[str, Any],
                expert_bytes: int | None, *, counts_installs: bool) -> dict[str, Any]:
    """How many guessed experts a run loaded; a guess already in the cache loads nothing.

    Token events count them (``prefetch.loaded``); logs written before they did are read
    through the run's totals: with install checks on (and compute other than ``digest``,
    whose checks also count) every expert installed, a layer's miss or a guess, is checked
    once, so ``verified + mismatches - misses`` are the guesses loaded, bar the last layer's
    wrong guesses still loading when the run ended. That count is kept as a cross-check
    (``installs_beyond_misses``: 0 without prediction). Of the loaded guesses, wasted bytes
    over the expert's device bytes were never used.

    Args:
        events: every token event of the run (skipped tokens too).
        summary: the run's ``RunSummary.as_dict()``.
        expert_bytes: one expert's device bytes (None when layers differ).
        counts_installs: whether ``verified`` counts installs (see above).
    """
    stats = [e["prefetch"] for e in events if "prefetch" in e]
    wasted_bytes = sum(s["wasted_bytes"] for s in stats)
    wasted = wasted_bytes // expert_bytes if expert_bytes else None
    derived = (summary["verified"] + summary["mismatches"] - summary["misses"]
               if counts_installs else None)
    loaded: int | None
    if not stats:
        loaded, source = 0, "no prediction"
    elif all("loaded" in s for s in stats):
        loaded, source = sum(s["loaded"] for s in stats), "token events (prefetch.loaded)"
    elif derived is not None:
        loaded, source = max(0, derived), "run_end: verified + mismatches - misses"
    else:
        loaded, source = None, "not logged (no prefetch.loaded, and --no-verify)"
    return {
        "loaded": loaded,
        "used": None if loaded is None or wasted is None else max(0, loaded - wasted),
        "wasted": wasted,
        "loaded_per_token": (round(loaded / len(events), 2)
                             if loaded is not None and events else None),
        "source": source,
        "installs_beyond_misses": derived,
    }


def device_expert_bytes(log: Path) -> int | None:
    """One expert's device bytes from the run's header; None when layers differ."""
    with log.open() as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "run_start":
                sizes = set(event["model"]["expert_bytes"])
                return sizes.pop() if len(sizes) == 1 else None
    return None


def routing_agreement(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> float | None:
    """Share of (token, layer) choices two runs' token events agree on (as sets of experts);
    None when they share no token."""
    by_token = {e["token"]: e["experts"] for e in b}
    pairs = [(x, y) for e in a if e["token"] in by_token
             for x, y in zip(e["experts"], by_token[e["token"]], strict=True)]
    if not pairs:
        return None
    return round(sum(set(x) == set(y) for x, y in pairs) / len(pairs), 4)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def gain_figures(runs: dict[str, dict[str, Any]], suffix: str = "") -> dict[str, Any]:
    """Per mode, from runs named ``MODE_PREFETCH`` + ``suffix``: predict and oracle over none,
    and the share of the oracle's gain that predict reaches (None when the oracle gains
    nothing)."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs.values()):
        tps = {p: runs[f"{mode}_{p}{suffix}"]["tokens_per_s"] for p in PREFETCHES
               if f"{mode}_{p}{suffix}" in runs}
        fig: dict[str, Any] = {}
        none = tps.get("none", 0.0)
        if "predict" in tps:
            fig["predict_over_none"] = _ratio(tps["predict"], none)
        if "oracle" in tps:
            fig["oracle_over_none"] = _ratio(tps["oracle"], none)
        if {"none", "predict", "oracle"} <= tps.keys():
            gain = tps["oracle"] - none
            fig["share_of_oracle_gain"] = (
                round((tps["predict"] - none) / gain, 3)
                if none > 0 and gain > _MIN_GAIN_SHARE * none else None)
        predict = runs.get(f"{mode}_predict{suffix}", {})
        if {"none", "predict"} <= tps.keys():
            # misses the guesses turned into hits; ~0 when the guesses were already cached
            fig["predict_hit_rate_gain"] = round(predict["hit_rate"]
                                                 - runs[f"{mode}_none{suffix}"]["hit_rate"], 4)
        pf = predict.get("prefetch_stats")
        if pf is not None:
            fig["predict_accuracy"] = pf["accuracy"]
            if "router_layer_accuracy" in pf:
                fig["predict_router_layer_accuracy"] = pf["router_layer_accuracy"]
            fig["predict_wasted_bytes_per_token"] = pf["wasted_bytes_per_token"]
        if "routing_agreement_with_none" in predict:
            fig["routing_agreement_with_none"] = predict["routing_agreement_with_none"]
        if pf is not None and "loaded_per_token" in pf:
            fig["predict_guesses_loaded_per_token"] = pf["loaded_per_token"]
        out[mode] = fig
    return out
