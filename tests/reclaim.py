"""Whole-file residency checks on machines that page out cold page-cache pages by themselves.

The dev VM and CI run DAMON with a ``pageout`` scheme (``kdamond``: regions with no access
for a minute are paged out, 128 MiB a second at most). It judges regions of physical
memory, so a page a test has just read, and that nothing mapped since, can be paged out
between the read and the check: a forced warm-up once left 6 pages of ~11,000 out on CI,
and the warm-up command on the dev VM one page of 2.6 million (``tools.warmup`` itself
read every one). On such a machine "all resident" allows for that many; elsewhere it
means every page.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from moestream.pipeline.foundation.errors import ResidencyError
from moestream.stages.pagelock import lock_pages
from moestream.stages.residency import Residency

__all__ = ["RECLAIM_SLACK", "assert_all_resident", "assert_loaded", "assert_resident_pages",
           "assert_same_reading", "held_resident", "proactive_reclaim"]

_DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")


def proactive_reclaim() -> bool:
    """Whether a running kdamond pages memory out on its own."""
    try:
        for kdamond in _DAMON.glob("[0-9]*"):
            if (kdamond / "state").read_text().strip() != "on":
                continue
            for action in kdamond.glob("contexts/*/schemes/*/action"):
                if action.read_text().strip() == "pageout":
                    return True
    except OSError:
        return False
    return False


RECLAIM_SLACK = 0.01 if proactive_reclaim() else 0.0
"""The share of a file's pages a whole-file check lets the machine have paged out: 0.2%
held until a forced warm-up of a 25 MiB file on CI found 53 of its 6,478 pages (0.8%) out
right after it had read them all (its own report, printed at once: 99.2% resident)."""


def assert_all_resident(residency: Residency) -> None:
    """Every page resident, but for what this machine's own reclaim may have taken."""
    assert residency.fraction >= 1.0 - RECLAIM_SLACK, (
        f"{residency.n_pages - residency.resident_page_count} of {residency.n_pages} pages "
        f"not resident (this machine's reclaim may take {RECLAIM_SLACK:.1%})")


def assert_resident_pages(residency: Residency, expected: set[int]) -> None:
    """Exactly ``expected`` resident, but for what this machine's own reclaim may have taken.

    Reclaim only takes pages out, so a resident page outside ``expected`` is always wrong.
    """
    resident = {int(page) for page in np.flatnonzero(residency.pages)}
    extra = sorted(resident - expected)
    assert not extra, f"{len(extra)} pages resident that should not be, from {extra[:10]}"
    taken = len(expected - resident)
    assert taken <= RECLAIM_SLACK * residency.n_pages, (
        f"{taken} of {len(expected)} expected pages not resident "
        f"(this machine's reclaim may take {RECLAIM_SLACK:.1%} of {residency.n_pages})")


def assert_loaded(got: int, expected: int, file_bytes: int) -> None:
    """``got`` bytes resident of ``expected`` just loaded from a file of ``file_bytes``:
    every one, but for what this machine's own reclaim may have taken meanwhile."""
    assert got <= expected, f"{got} bytes resident, more than the {expected} loaded"
    assert got >= expected - RECLAIM_SLACK * file_bytes, (
        f"{got} of {expected} loaded bytes resident "
        f"(this machine's reclaim may take {RECLAIM_SLACK:.1%} of {file_bytes})")


def assert_same_reading(earlier: int, later: int, file_bytes: int) -> None:
    """Two readings of the same pages' resident bytes a moment apart (a report's, then the
    test's own mincore) with nothing read between: equal, but for what this machine's own
    reclaim took meanwhile (a file left idle is what it pages out first)."""
    assert later <= earlier, f"{later} bytes resident now, more than the {earlier} read before"
    assert earlier - later <= RECLAIM_SLACK * file_bytes, (
        f"{earlier} then {later} bytes resident "
        f"(this machine's reclaim may take {RECLAIM_SLACK:.1%} of {file_bytes})")


@contextmanager
def held_resident(path: Path) -> Iterator[None]:
    """The file's pages loaded and kept resident meanwhile: pinned (``mlock``), so that this
    machine's own reclaim cannot take one between the load and the caller's use of them (a
    resident-mode streamer registers only windows whose every page is resident, and a test
    of the registered path needs them all); only loaded where ``mlock`` is refused."""
    try:
        lock = lock_pages(path)
    except ResidencyError:
        with path.open("rb") as f:
            while f.read(8 << 20):
                pass
        yield
        return
    with lock:
        yield
