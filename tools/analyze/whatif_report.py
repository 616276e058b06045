"""The ``--what-if`` section of ``moestream-analyze``: replay a run, report it as text or JSON.

``run_what_if`` replays a run's expert accesses (``tools.analyze.whatif``) under the budgets asked
for (or a default ladder around the run's own) and every policy asked for; ``what_if_text`` and
``what_if_json`` render the result: hit rate per budget and policy, whether the replay at
the run's budget matched the log exactly, and the smallest budget reaching the target.
"""

from __future__ import annotations

from typing import Any

import structlog

from moestream.pipeline.runlog.records import RunLog
from moestream.tools.analyze.report_text import size_text, text_table
from moestream.tools.analyze.whatif import WhatIfReport, default_budgets, parse_budget, what_if
from moestream.tools.analyze.whatif_replay import AccessTrace

__all__ = ["run_what_if", "what_if_json", "what_if_text"]

_log = structlog.get_logger(__name__)


def run_what_if(run: RunLog, budgets: list[str] | None, target: float,
                policies: list[str], jobs: int | None) -> WhatIfReport:
    """Replay ``run`` under ``budgets`` (default: a ladder around the run's) and ``policies``.

    Args:
        run: the run whose accesses are replayed.
        budgets: budgets as given on the command line (sizes or expert counts), or None.
        target: the hit rate whose smallest budget is reported.
        policies: the policies to replay (names in ``tools.analyze.whatif_replay.POLICIES``).
        jobs: worker processes, or None for the default.
    """
    trace = AccessTrace.from_log(run)
    # the one part of the analysis that holds every token: say how much (--debug shows it)
    _log.info("what_if_holds", log=str(run.path), tokens=trace.tokens,
              expert_id_bytes=int(trace.experts.nbytes),
              bytes_per_token=int(trace.experts[0].nbytes) if trace.tokens else 0)
    header = run.header
    run_budget = header.budget_bytes if header else None
    if budgets:
        capacities = [parse_budget(b, trace.max_expert_bytes) for b in budgets]
    else:
        capacities = default_budgets(trace, run_budget)
    return what_if(trace, capacities, policies, target, run_budget,
                   header.policy if header else None, jobs)


def what_if_text(run: RunLog, report: WhatIfReport) -> str:
    """The what-if report as text: hit rate per budget and policy, exactness, target."""
    unit = report.expert_unit_bytes
    run_budget = run.header.budget_bytes if run.header else None
    lines = [f"what-if: {run.name} ({len(run.tokens):,} tokens; 1 expert = {size_text(unit)})\n"]
    rows = [["budget", "experts", *report.policies]]
    for budget in report.budgets:
        mark = " *" if budget == run_budget else ""
        rows.append([size_text(budget) + mark, f"{budget / unit:,.0f}",
                     *(f"{report.rate(p, budget):.4f}" for p in report.policies)])
    lines.append(text_table(rows))
    if run_budget in report.budgets:
        lines.append("  * the run's budget\n")
    exact = report.exact
    if exact is not None and report.logged_hits is not None:
        verdict = ("exact" if report.first_divergence is None
                   else f"DIVERGES from token {report.first_divergence}")
        lines.append(f"replay check: {exact.policy} at the run's budget: {exact.hits:,} hits,"
                     f" log {report.logged_hits:,}: {verdict}\n")
    for policy, best in report.smallest.items():
        if best is None:
            lines.append(f"{policy}: no budget tried reaches hit rate {report.target:g}\n")
        else:
            lines.append(f"{policy}: smallest budget reaching {report.target:g}:"
                         f" {size_text(best.capacity_bytes)} ({best.capacity_bytes / unit:,.0f}"
                         f" experts, hit rate {best.hit_rate:.4f})\n")
    return "".join(lines)


def what_if_json(report: WhatIfReport, run: RunLog) -> dict[str, Any]:
    """The what-if report as plain JSON."""
    exact = report.exact
    return {
        "log": run.name,
        "expert_unit_bytes": report.expert_unit_bytes,
        "results": [{"policy": r.policy, "budget_bytes": r.capacity_bytes,
                     "hit_rate": r.hit_rate, "hits": r.hits, "misses": r.misses,
                     "evictions": r.evictions} for r in report.results],
        "exact": None if exact is None else {
            "policy": exact.policy, "budget_bytes": exact.capacity_bytes,
            "replay_hits": exact.hits, "log_hits": report.logged_hits,
            "hit_rate": exact.hit_rate,
            "matches": report.logged_hits == exact.hits and report.first_divergence is None,
            "first_divergence": report.first_divergence},
        "target": report.target,
        "smallest": {p: None if r is None else {"budget_bytes": r.capacity_bytes,
                                                "hit_rate": r.hit_rate}
                     for p, r in report.smallest.items()},
    }
