"""Tests for foundation.trace: the routing-trace format, its validation and its fit checks."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.pipeline.foundation.errors import TraceError
from moestream.pipeline.foundation.trace import (
    TRACE_FORMAT,
    TRACE_VERSION,
    Trace,
    load_trace,
    save_trace,
)


def make_trace(
    tokens: int = 5, layers: int = 3, n_experts: int = 16, top_k: int = 4, seed: int = 0
) -> Trace:
    """A small valid trace: distinct random ids per row, Dirichlet weights."""
    rng = np.random.default_rng(seed)
    keys = rng.random((tokens, layers, n_experts))
    experts = np.argsort(keys, axis=2)[:, :, :top_k].astype(np.int32)
    weights = rng.random((tokens, layers, top_k), dtype=np.float32) + np.float32(0.01)
    weights /= weights.sum(axis=2, keepdims=True)
    return Trace(experts, weights, n_experts, "test")


def write_jsonl(path: Path, header: Any, rows: list[Any]) -> Path:
    lines = [json.dumps(header)] + [json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def good_header(layers: int = 2, n_experts: int = 8, top_k: int = 2) -> dict[str, Any]:
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "n_layers": layers,
        "n_experts": n_experts,
        "top_k": top_k,
        "preset": "hand",
    }


def good_row(token: int = 0) -> dict[str, Any]:
    return {"token": token, "experts": [[0, 1], [2, 3]], "weights": [[0.5, 0.5], [0.25, 0.75]]}


def assert_one_line_error(path: Path, match: str) -> None:
    with pytest.raises(TraceError, match=match) as info:
        load_trace(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message


class TestRoundTrip:
    """A saved trace loads back bit for bit, in either form, and the form is sniffed."""

    @pytest.mark.parametrize("name", ["t.npz", "t.jsonl", "t.bin"])
    def test_round_trip(self, tmp_path: Path, name: str) -> None:
        trace = make_trace(tokens=7, layers=3, n_experts=32, top_k=5)
        path = tmp_path / name
        save_trace(trace, path)
        loaded = load_trace(path)
        np.testing.assert_array_equal(loaded.experts, trace.experts)
        np.testing.assert_array_equal(loaded.weights, trace.weights)
        assert loaded.experts.dtype == np.int32 and loaded.weights.dtype == np.float32
        assert (loaded.n_experts, loaded.preset, loaded.source) == (32, "test", str(path))
        assert (loaded.n_tokens, loaded.n_layers, loaded.top_k) == (7, 3, 5)

    def test_jsonl_layout(self, tmp_path: Path) -> None:
        trace = make_trace(tokens=2, layers=2, n_experts=8, top_k=2)
        path = tmp_path / "t.jsonl"
        save_trace(trace, path)
        lines = path.read_text().splitlines()
        assert len(lines) == 3
        assert json.loads(lines[0]) == {
            "format": "moestream-trace",
            "version": 1,
            "n_layers": 2,
            "n_experts": 8,
            "top_k": 2,
            "preset": "test",
        }
        row = json.loads(lines[2])
        assert row["token"] == 1 and row["experts"] == trace.experts[1].tolist()

    def test_save_is_atomic_and_leaves_no_temporary(self, tmp_path: Path) -> None:
        save_trace(make_trace(), tmp_path / "t.npz")
        assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]

    @settings(max_examples=25, deadline=None)
    @given(
        tokens=st.integers(1, 6),
        layers=st.integers(1, 4),
        n_experts=st.integers(1, 40),
        data=st.data(),
    )
    def test_any_valid_trace_round_trips(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        tokens: int,
        layers: int,
        n_experts: int,
        data: st.DataObject,
    ) -> None:
        top_k = data.draw(st.integers(1, n_experts))
        seed = data.draw(st.integers(0, 2**32 - 1))
        trace = make_trace(tokens, layers, n_experts, top_k, seed)
        folder = tmp_path_factory.mktemp("rt")
        for name in ("t.npz", "t.jsonl"):
            save_trace(trace, folder / name)
            loaded = load_trace(folder / name)
            np.testing.assert_array_equal(loaded.experts, trace.experts)
            np.testing.assert_array_equal(loaded.weights, trace.weights)


class TestConstruction:
    """Building a Trace validates the arrays and names the first problem."""

    def test_properties(self) -> None:
        trace = make_trace(tokens=4, layers=2, n_experts=10, top_k=3)
        assert (trace.n_tokens, trace.n_layers, trace.top_k) == (4, 2, 3)

    @pytest.mark.parametrize(
        ("change", "match"),
        [
            (lambda e, w: (e.astype(np.int64), w), "int32"),
            (lambda e, w: (e, w.astype(np.float64)), "float32"),
            (lambda e, w: (e[0], w[0]), r"\[tokens, layers, top_k\]"),
            (lambda e, w: (e, w[:, :1]), "differs"),
            (lambda e, w: (e[:0], w[:0]), "empty"),
        ],
    )
    def test_bad_arrays(self, change: Any, match: str) -> None:
        good = make_trace()
        experts, weights = change(good.experts, good.weights)
        with pytest.raises(TraceError, match=match):
            Trace(experts, weights, good.n_experts, "x")

    def test_id_out_of_range(self) -> None:
        good = make_trace(n_experts=16)
        for bad in (16, -1):
            experts = good.experts.copy()
            experts[2, 1, 0] = bad
            with pytest.raises(TraceError, match=rf"id {bad} out of range.*token 2, layer 1"):
                Trace(experts, good.weights, 16, "x")

    def test_repeated_id(self) -> None:
        good = make_trace(top_k=4)
        experts = good.experts.copy()
        experts[3, 2, 3] = experts[3, 2, 0]
        with pytest.raises(TraceError, match="repeated within token 3, layer 2"):
            Trace(experts, good.weights, good.n_experts, "x")

    def test_repeated_id_with_wide_rows(self) -> None:
        good = make_trace(n_experts=64, top_k=20)
        experts = good.experts.copy()
        experts[1, 0, 19] = experts[1, 0, 4]
        with pytest.raises(TraceError, match="repeated within token 1, layer 0"):
            Trace(experts, good.weights, 64, "x")

    @pytest.mark.parametrize(
        ("value", "match"), [(np.nan, "non-finite"), (np.inf, "non-finite"), (-0.1, "negative")]
    )
    def test_bad_weight(self, value: float, match: str) -> None:
        good = make_trace()
        weights = good.weights.copy()
        weights[1, 1, 1] = value
        with pytest.raises(TraceError, match=match):
            Trace(good.experts, weights, good.n_experts, "x")

    def test_weights_must_sum_to_one(self) -> None:
        good = make_trace()
        with pytest.raises(TraceError, match="sum to"):
            Trace(good.experts, good.weights * np.float32(2), good.n_experts, "x")

    def test_top_k_above_expert_count(self) -> None:
        good = make_trace(n_experts=16, top_k=4)
        with pytest.raises(TraceError, match="exceeds n_experts"):
            Trace(good.experts, good.weights, 3, "x")


class TestMalformedJsonl:
    """Every malformed JSON-lines trace is one TraceError line naming the file."""

    @pytest.mark.parametrize(
        ("header", "match"),
        [
            ({**good_header(), "format": "other"}, "format"),
            ({**good_header(), "version": 2}, "version"),
            ({k: v for k, v in good_header().items() if k != "n_layers"}, "n_layers"),
            ({**good_header(), "top_k": True}, "top_k"),
            ({**good_header(), "n_experts": 0}, "n_experts"),
            ({**good_header(), "preset": 3}, "preset"),
            ([1, 2], "JSON object"),
        ],
    )
    def test_bad_header(self, tmp_path: Path, header: Any, match: str) -> None:
        path = write_jsonl(tmp_path / "t.jsonl", header, [good_row()])
        assert_one_line_error(path, match)

    def test_not_json(self, tmp_path: Path) -> None:
        path = tmp_path / "t.jsonl"
        path.write_text("{not json\n")
        assert_one_line_error(path, "not JSON")

    def test_empty_and_header_only(self, tmp_path: Path) -> None:
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        assert_one_line_error(empty, "neither")
        header_only = write_jsonl(tmp_path / "h.jsonl", good_header(), [])
        assert_one_line_error(header_only, "no tokens")

    def test_truncated(self, tmp_path: Path) -> None:
        trace = make_trace(tokens=6, layers=2, n_experts=8, top_k=2)
        path = tmp_path / "t.jsonl"
        save_trace(trace, path)
        text = path.read_bytes()
        path.write_bytes(text[: len(text) - 20])
        assert_one_line_error(path, "truncated")

    @pytest.mark.parametrize(
        ("row", "match"),
        [
            ({**good_row(), "experts": [[0, 8], [2, 3]]}, "out of range"),
            ({**good_row(), "experts": [[0, -1], [2, 3]]}, "out of range"),
            ({**good_row(), "experts": [[1, 1], [2, 3]]}, "repeated"),
            ({**good_row(), "experts": [[0, 1.5], [2, 3]]}, "integers"),
            ({**good_row(), "experts": [[0, 1], [2, 3], [4, 5]]}, "shape"),
            ({**good_row(), "experts": [[0, 1], [2]]}, "ragged|shape"),
            ({**good_row(), "weights": [[0.5], [0.25, 0.75]]}, "ragged|shape"),
            ({**good_row(), "weights": [[-0.5, 1.5], [0.25, 0.75]]}, "negative"),
            ({**good_row(), "weights": [["a", "b"], [0.25, 0.75]]}, "numbers"),
            ({**good_row(), "token": 5}, "expected token 0"),
            ({"token": 0, "experts": [[0, 1], [2, 3]]}, "weights"),
            ([0, 1], "JSON object"),
        ],
    )
    def test_bad_row(self, tmp_path: Path, row: Any, match: str) -> None:
        path = write_jsonl(tmp_path / "t.jsonl", good_header(), [row])
        assert_one_line_error(path, match)

    def test_non_finite_literal(self, tmp_path: Path) -> None:
        path = tmp_path / "t.jsonl"
        row = '{"token": 0, "experts": [[0, 1], [2, 3]], "weights": [[NaN, 1], [0.5, 0.5]]}'
        path.write_text(json.dumps(good_header()) + "\n" + row + "\n")
        assert_one_line_error(path, "non-finite")

    def test_huge_id(self, tmp_path: Path) -> None:
        row = {**good_row(), "experts": [[0, 2**70], [2, 3]]}
        path = write_jsonl(tmp_path / "t.jsonl", good_header(), [row])
        assert_one_line_error(path, "integers|int32")


class _Touch:
    """Unpickling this would create a file: proof that loading never unpickles."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


class TestMalformedNpz:
    """Every malformed .npz trace is one TraceError line naming the file, never unpickled."""

    def save(self, path: Path, **arrays: Any) -> Path:
        trace = make_trace()
        fields: dict[str, Any] = {
            "format": np.array(TRACE_FORMAT),
            "version": np.array(TRACE_VERSION),
            "n_experts": np.array(trace.n_experts),
            "preset": np.array("hand"),
            "experts": trace.experts,
            "weights": trace.weights,
        }
        fields.update(arrays)
        with open(path, "wb") as out:
            np.savez(out, **{k: v for k, v in fields.items() if v is not None})
        return path

    def test_pickled_object_array_is_refused(self, tmp_path: Path) -> None:
        marker = tmp_path / "unpickled"
        payload = np.empty(1, dtype=object)
        payload[0] = _Touch(marker)
        pickle.dumps(payload)  # the payload really is a pickle that would touch the marker
        path = self.save(tmp_path / "t.npz", experts=payload)
        assert_one_line_error(path, "unreadable")
        assert not marker.exists()

    def test_truncated(self, tmp_path: Path) -> None:
        path = tmp_path / "t.npz"
        save_trace(make_trace(tokens=50), path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        assert_one_line_error(path, "truncated or corrupt|unreadable")

    @pytest.mark.parametrize("missing", ["experts", "weights", "n_experts", "format", "preset"])
    def test_missing_member(self, tmp_path: Path, missing: str) -> None:
        path = self.save(tmp_path / "t.npz", **{missing: None})
        assert_one_line_error(path, f"lacks '{missing}'")

    @pytest.mark.parametrize(
        ("arrays", "match"),
        [
            ({"format": np.array("other")}, "not a moestream-trace"),
            ({"version": np.array(9)}, "version"),
            ({"n_experts": np.array([16, 16])}, "scalar"),
            ({"experts": np.zeros((5, 3, 4), dtype=np.float32)}, "integers"),
            ({"weights": np.zeros((5, 3, 4), dtype=np.bool_)}, "numbers"),
            ({"weights": np.full((5, 3, 2), 0.5, dtype=np.float32)}, "differs"),
            ({"n_experts": np.array(4)}, "out of range|exceeds"),
            ({"experts": np.zeros((5, 3, 4), dtype=np.int32)}, "repeated"),
        ],
    )
    def test_bad_content(self, tmp_path: Path, arrays: dict[str, Any], match: str) -> None:
        path = self.save(tmp_path / "t.npz", **arrays)
        assert_one_line_error(path, match)

    def test_zip_that_is_not_npz(self, tmp_path: Path) -> None:
        path = tmp_path / "t.npz"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("experts.npy", b"garbage")
        assert_one_line_error(path, "lacks|unreadable|corrupt")


class TestOtherFiles:
    """Missing files and foreign content are TraceErrors too."""

    def test_missing_file(self, tmp_path: Path) -> None:
        assert_one_line_error(tmp_path / "absent.npz", "cannot read")

    def test_foreign_bytes(self, tmp_path: Path) -> None:
        path = tmp_path / "t.npz"
        path.write_bytes(b"\x00\x01binary")
        assert_one_line_error(path, "neither")


class TestCheckFits:
    """check_fits refuses traces asking for more layers or experts, or another top_k."""

    def test_fits(self) -> None:
        trace = make_trace(layers=3, n_experts=16, top_k=4)
        trace.check_fits(3, 16, 4)
        trace.check_fits(43, 256, 4)  # fewer layers and experts than the model is fine

    def test_more_layers(self) -> None:
        with pytest.raises(TraceError, match="3 MoE layers, the model has 2"):
            make_trace(layers=3).check_fits(2, 16, 4)

    def test_more_experts(self) -> None:
        with pytest.raises(TraceError, match=r"16 experts per layer.*the model has 8"):
            make_trace(n_experts=16).check_fits(3, 8, 4)

    def test_other_top_k(self) -> None:
        with pytest.raises(TraceError, match="top-4, the model routes top-6"):
            make_trace(top_k=4).check_fits(3, 16, 6)

    def test_message_names_the_file(self, tmp_path: Path) -> None:
        path = tmp_path / "t.npz"
        save_trace(make_trace(layers=3), path)
        with pytest.raises(TraceError, match=str(path)) as info:
            load_trace(path).check_fits(1, 16, 4)
        assert "\n" not in str(info.value)
        assert info.value.exit_code == 2
