"""Budgets and their messages without surprises: a bare number is experts, the minimum a
refusal names is the model's, a message says each thing once, sizes print in a unit that
reads."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

import moestream
from moestream._args import budget_of
from moestream.pipeline.cli.summary import print_summary
from moestream.pipeline.foundation.config import Budget, parse_budget
from moestream.pipeline.foundation.errors import UsageError
from moestream.pipeline.foundation.sizes import size_text
from moestream.pipeline.foundation.table import ExpertTable
from moestream.pipeline.run import main
from moestream.pipeline.streaming.summary import RunSummary

ROOT = Path(__file__).resolve().parent.parent


def _sync(model: Path, **kwargs: Any) -> moestream.SyncSession:
    return moestream.open_sync(model, mode="direct", backend="host", **kwargs)


def _least(table: ExpertTable, layers_in_flight: int = 2) -> int:
    return layers_in_flight * table.top_k


class TestBareNumbers:
    """A number without a unit is experts, whether or not it has a decimal point."""

    @pytest.mark.parametrize(("text", "experts"), [("4", 4), ("4.0", 4), ("12.000", 12),
                                                   (" 7.0 ", 7)])
    def test_whole_numbers_are_experts(self, text: str, experts: int) -> None:
        assert parse_budget(text) == Budget(experts=experts)
        assert budget_of(text) == Budget(experts=experts)

    @pytest.mark.parametrize("text", ["4.5", "0.5", "1.25"])
    def test_a_fraction_without_a_unit_is_refused(self, text: str) -> None:
        with pytest.raises(UsageError, match="a bare number is experts") as caught:
            parse_budget(text)
        assert "\n" not in str(caught.value) and "unit" in str(caught.value)

    @pytest.mark.parametrize(("text", "nbytes"), [("4.0B", 4), ("4096B", 4096),
                                                  ("0.5KiB", 512), ("1.5GiB", 3 << 29)])
    def test_bytes_take_a_unit(self, text: str, nbytes: int) -> None:
        assert parse_budget(text) == Budget(nbytes=nbytes)


class TestNothingToHold:
    """Zero or a negative budget, before the model is known: what a budget is, never
    "at least 1 expert"."""

    @pytest.mark.parametrize("budget", [0, -1, "0", "-1", "0.0", "0GiB",
                                        Budget(experts=0), Budget(nbytes=0)])
    def test_says_what_a_budget_is(self, budget: object) -> None:
        with pytest.raises(UsageError) as caught:
            budget_of(budget)
        text = str(caught.value)
        assert "a positive number of experts or a size with a unit" in text
        assert "at least 1 expert" not in text and "\n" not in text

    def test_the_cli_names_the_models_minimum(self, capsys: pytest.CaptureFixture[str],
                                              tiny_model: Path,
                                              tiny_table: ExpertTable) -> None:
        code = main(["-m", str(tiny_model), "-n", "1", "--backend", "host",
                     "--cache-budget", "0"])
        err = capsys.readouterr().err
        assert code == 2
        assert f"at least {_least(tiny_table, 1)} experts" in err  # the CLI pins one layer


class TestBelowTheMinimum:
    """The session's refusal names the model's minimum, says each figure once and counts
    in the right number."""

    def test_experts_given(self, tiny_model: Path, tiny_table: ExpertTable) -> None:
        with pytest.raises(UsageError) as caught:
            _sync(tiny_model, budget=1)
        text = str(caught.value)
        assert text.startswith("cache budget of 1 expert (")
        assert "1 experts" not in text
        assert text.endswith(f"at least {_least(tiny_table)} experts")

    def test_bytes_given_said_once(self, tiny_model: Path) -> None:
        with pytest.raises(UsageError) as caught:
            _sync(tiny_model, budget="4096B")
        text = str(caught.value)
        assert text.startswith("cache budget of 4096 bytes cannot hold")
        assert text.count("4096 bytes") == 1

    def test_one_layer_in_flight(self, tiny_model: Path, tiny_table: ExpertTable) -> None:
        with pytest.raises(UsageError) as caught:
            _sync(tiny_model, budget=1, tuning=moestream.Tuning(layers_in_flight=1))
        text = str(caught.value)
        assert "the one layer in flight" in text
        assert text.endswith(f"at least {_least(tiny_table, 1)} experts")

    def test_budget_counts(self) -> None:
        assert (str(Budget(experts=1)), str(Budget(experts=2))) == ("1 expert", "2 experts")
        assert (str(Budget(nbytes=1)), str(Budget(nbytes=8))) == ("1 byte", "8 bytes")


class TestSizesThatRead:
    """The run's summary prints sizes in the largest binary unit they reach."""

    @pytest.mark.parametrize(("nbytes", "text"), [
        (0, "0 B"), (1023, "1023 B"), (48128, "47.00 KiB"), (3 << 20, "3.00 MiB"),
        (3 << 29, "1.50 GiB"), (1000 << 20, "1,000.00 MiB"), (-(3 << 29), "-1.50 GiB"),
    ])
    def test_size_text(self, nbytes: int, text: str) -> None:
        assert size_text(nbytes) == text

    def test_small_model_summary(self, capsys: pytest.CaptureFixture[str]) -> None:
        summary = RunSummary()
        summary.budget_bytes, summary.peak_device_bytes = 48128, 24064
        summary.file_bytes = 5 << 20
        print_summary(summary, as_json=False)
        out = capsys.readouterr().out
        assert "0.00 GiB" not in out and "0.000 GiB" not in out
        assert "budget 47.00 KiB, peak 23.50 KiB" in out
        assert "5.00 MiB read from file" in out

    def test_json_keeps_bytes(self, capsys: pytest.CaptureFixture[str]) -> None:
        summary = RunSummary()
        summary.budget_bytes = 48128
        print_summary(summary, as_json=True)
        assert json.loads(capsys.readouterr().out)["budget_bytes"] == 48128


def _message_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of ``path`` that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


class TestMessagesNameTheThing:
    """No message points into a module's docstring, which a user never sees."""

    def test_no_message_says_module_docstring(self) -> None:
        found = [f"{path.relative_to(ROOT)}:{line}"
                 for package in ("moestream", "pipeline", "stages", "tools", "bench")
                 for path in sorted((ROOT / package).rglob("*.py"))
                 for line, text in _message_strings(path)
                 if re.search(r"module'?s? docstring", text)]
        assert found == []
