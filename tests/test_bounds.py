"""Memory bounded by design, not by input; hostile inputs refused on one line (issue 17).

Each CLI case runs in a subprocess under a 2 GiB address-space limit (``RLIMIT_AS``): a
command that sized its memory from its input (the whole synthetic trace of ``-n``, an
``.npy`` header's claim, a zip bomb's expansion, an index range, a log line without end)
dies there with a ``MemoryError``; a bounded one runs, or refuses with one line and exit 2.
"""

from __future__ import annotations

import hashlib
import io
import json
import resource
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from numpy.lib import format as npy_format

import moestream.pipeline.foundation.trace
from moestream.pipeline.foundation.errors import TraceError
from moestream.pipeline.foundation.trace import TraceRecorder, load_trace
from moestream.pipeline.proxy.routing import BlockRouting
from moestream.pipeline.proxy.synthetic import BLOCK_TOKENS, synthetic_blocks, synthetic_trace
from moestream.pipeline.run import main as run_main
from moestream.pipeline.runlog.read import MAX_LINE_BYTES, read_log
from moestream.tools.analyze.cli import main as analyze_main
from moestream.tools.warmup.cli import main as warmup_main
from tests.gguf_files import finish_gguf

REPO = Path(__file__).resolve().parents[1]
AS_LIMIT = 2 << 30
"""The address space each CLI subprocess gets: 2 GiB."""

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m ARGV`` under the address-space limit."""
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True,
                          text=True, preexec_fn=_limited, check=False)


def _refused(done: subprocess.CompletedProcess[str], match: str) -> str:
    """Exit 2, no traceback, one line saying ``match``, last on stderr."""
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert match in err[-1], err[-1]
    assert sum(match in line for line in err) == 1, err
    return err[-1]


# --- synthetic routing: per block, never the whole run ---------------------------------------


class TestSyntheticRouting:
    """Routing is made block by block; the expert choices are those made before the change."""

    def test_expert_choices_unchanged(self) -> None:
        """sha256 of the ids as the whole-trace generator made them before blocks."""
        trace = synthetic_trace("ds4-flash", 2500, seed=3, n_layers=3, n_experts=16, top_k=4)
        digest = hashlib.sha256(trace.experts.tobytes()).hexdigest()
        assert digest == "e324460e6256274779178b3cd8f6e7fcac870c576cbecb22c88f6b510d94c3c0"

    def test_blocks_are_the_trace(self) -> None:
        trace = synthetic_trace("qwen3.5-35b-a3b", 2500, seed=2, n_layers=5, n_experts=40,
                                top_k=3)
        blocks = synthetic_blocks("qwen3.5-35b-a3b", seed=2, n_layers=5, n_experts=40, top_k=3)
        made = [next(blocks) for _ in range(3)]
        ids = np.concatenate([m[0] for m in made])[:2500]
        weights = np.concatenate([m[1] for m in made])[:2500]
        np.testing.assert_array_equal(ids, trace.experts)
        np.testing.assert_array_equal(weights, trace.weights)

    def test_weights_of_a_prefix_are_a_prefix(self) -> None:
        short = synthetic_trace("ds4-flash", 300, seed=5, n_layers=2, n_experts=16, top_k=4)
        long = synthetic_trace("ds4-flash", 3000, seed=5, n_layers=2, n_experts=16, top_k=4)
        np.testing.assert_array_equal(short.weights, long.weights[:300])

    def test_block_routing_replays_and_drops_old_blocks(self) -> None:
        args: dict[str, Any] = {"seed": 1, "n_layers": 2, "n_experts": 16, "top_k": 4}
        trace = synthetic_trace("ds4-flash", 3 * BLOCK_TOKENS, **args)
        routing = BlockRouting(synthetic_blocks("ds4-flash", **args), BLOCK_TOKENS, 1)
        for token in (0, 5, BLOCK_TOKENS - 1, BLOCK_TOKENS, 2 * BLOCK_TOKENS + 7):
            experts, weights = routing.route(token, 1, None)
            assert experts == trace.experts[token, 1].tolist()
            assert weights == trace.weights[token, 1].tolist()
            if token:
                assert routing.predict(token, 0, None) == trace.experts[token - 1, 0].tolist()
        with pytest.raises(LookupError, match="dropped"):  # block 0 is gone
            routing.route(3, 0, None)

    @pytest.mark.parametrize("tokens", ["100000000", "1000000000000"])
    def test_huge_token_count_runs_in_bounded_memory(self, tiny_model: Path, tmp_path: Path,
                                                     tokens: str) -> None:
        """Past two blocks under the limit, then SIGTERM stops it cleanly (exit 143)."""
        log = tmp_path / "run.jsonl"
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.run", "-m", str(tiny_model), "-n", tokens,
             "--backend", "host", "--compute", "fixed:0", "--log", str(log)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_limited)
        try:
            while _tokens_logged(log) < 2 * BLOCK_TOKENS + 10:
                if proc.poll() is not None:
                    pytest.fail(f"exit {proc.returncode}: {proc.stderr.read()[-2000:]}")
                time.sleep(0.1)
            peak = _peak_rss(proc.pid)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 143, err[-2000:]
        assert json.loads(log.read_text().splitlines()[-1])["event"] == "run_end"
        assert peak < AS_LIMIT

    def test_record_trace_of_a_huge_run_is_refused_before_work(self, tiny_model: Path,
                                                                tmp_path: Path) -> None:
        out = tmp_path / "rec.npz"
        done = _cli("pipeline.run", "-m", str(tiny_model), "-n", "100000000", "--backend",
                    "host", "--compute", "fixed:0", "--record-trace", str(out))
        _refused(done, "record at most")
        assert not out.exists()

    def test_make_trace_of_a_huge_count_is_refused(self, tmp_path: Path) -> None:
        out = tmp_path / "t.npz"
        done = _cli("moestream.tools.make_trace", str(out), "--tokens", "1000000000")
        _refused(done, "1000000000 tokens x 43 layers x top-6 is 258000000000 entries")
        assert not out.exists()

    def test_recorder_cap(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(moestream.pipeline.foundation.trace, "MAX_TRACE_ENTRIES", 40)
        TraceRecorder(10, 2, 2, 8)  # 40 entries: the cap itself is fine
        with pytest.raises(TraceError, match="record at most 10 tokens"):
            TraceRecorder(11, 2, 2, 8)


def _tokens_logged(log: Path) -> int:
    if not log.exists():
        return 0
    with log.open("rb") as lines:
        return sum(b'"event":"token"' in line or b'"event": "token"' in line for line in lines)


def _peak_rss(pid: int) -> int:
    """VmHWM of a running process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# --- hostile traces ---------------------------------------------------------------------------


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _npy_header(shape: tuple[int, ...], descr: str) -> bytes:
    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False,
                                            "shape": shape})
    return buf.getvalue()


def _scalars(n_experts: int = 16) -> dict[str, bytes]:
    return {"format.npy": _npy(np.array("moestream-trace")), "version.npy": _npy(np.array(1)),
            "n_experts.npy": _npy(np.array(n_experts)), "preset.npy": _npy(np.array("hostile"))}


def _write_zip(path: Path, members: list[tuple[str, bytes, int, int]]) -> Path:
    """A zip written by hand: ``(name, payload, method, uncompressed size)``; the CRC of a
    deflated member is not computed (0), the sizes are what the member claims."""
    body, directory = bytearray(), bytearray()
    for name, payload, method, size in members:
        offset, raw = len(body), name.encode()
        crc = zlib.crc32(payload) if method == 0 else 0
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(payload),
                            size, len(raw), 0) + raw + payload
        directory += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc,
                                 len(payload), size, len(raw), 0, 0, 0, 0, 0, offset) + raw
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members),
                      len(directory), len(body), 0)
    path.write_bytes(bytes(body + directory + end))
    return path


def _stored(members: dict[str, bytes]) -> list[tuple[str, bytes, int, int]]:
    return [(name, data, 0, len(data)) for name, data in members.items()]


def _bomb(path: Path, data_bytes: int) -> Path:
    """``experts.npy`` deflated: a valid header for ``data_bytes`` of int32 zeros (3 x 4 per
    token), about 1 KB per MiB. Each 1 MiB of zeros is compressed once and repeated (a full
    flush makes the pieces independent)."""
    per_token = 3 * 4 * 4
    tokens = data_bytes // per_token
    header = _npy_header((tokens, 3, 4), "<i4")
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = packer.compress(header) + packer.flush(zlib.Z_FULL_FLUSH)
    piece = 1 << 20
    zeros = packer.compress(bytes(piece)) + packer.flush(zlib.Z_FULL_FLUSH)
    count, rest = divmod(tokens * per_token, piece)
    stream += zeros * count + packer.compress(bytes(rest)) + packer.flush(zlib.Z_FINISH)
    weights = _npy(np.full((1, 3, 4), 0.25, np.float32))
    return _write_zip(path, [*_stored({**_scalars(), "weights.npy": weights}),
                             ("experts.npy", stream, 8, len(header) + tokens * per_token)])


class TestHostileTraces:
    """Trace sizes are checked against what headers declare before anything is allocated."""

    def test_header_declaring_a_huge_shape(self, tiny_model: Path, tmp_path: Path) -> None:
        lie = _npy_header((10**9, 3, 4), "<i4") + bytes(48)  # 48 GB claimed, 48 bytes held
        weights = _npy(np.full((1, 3, 4), 0.25, np.float32))
        path = _write_zip(tmp_path / "lie.npz", _stored(
            {**_scalars(), "experts.npy": lie, "weights.npy": weights}))
        done = _cli("pipeline.run", "-m", str(tiny_model), "--backend", "host", "--trace",
                    str(path), "-n", "2")
        _refused(done, "declares shape (1000000000, 3, 4)")

    def test_zip_bomb(self, tiny_model: Path, tmp_path: Path) -> None:
        path = _bomb(tmp_path / "bomb.npz", int(2.1 * 2**30))
        assert path.stat().st_size < 4 << 20  # a few MB that would expand to 2.1 GB
        done = _cli("pipeline.run", "-m", str(tiny_model), "--backend", "host", "--trace",
                    str(path), "-n", "2")
        _refused(done, "more than the 134217728 entries")

    def test_member_over_the_cap(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(moestream.pipeline.foundation.trace, "MAX_TRACE_ENTRIES", 40)
        experts = np.tile(np.arange(4, dtype=np.int32), (5, 3, 1))  # 60 entries
        weights = np.full((5, 3, 4), 0.25, np.float32)
        path = _write_zip(tmp_path / "t.npz", _stored(
            {**_scalars(), "experts.npy": _npy(experts), "weights.npy": _npy(weights)}))
        with pytest.raises(TraceError, match=r"more than the 40 entries"):
            load_trace(path)

    def test_zip_directory_larger_than_a_trace(self, tmp_path: Path) -> None:
        members = {**_scalars(), "experts.npy": _npy(np.tile(np.arange(4, dtype=np.int32),
                                                             (1, 3, 1))),
                   "weights.npy": _npy(np.full((1, 3, 4), 0.25, np.float32))}
        members.update({f"pad{i}": b"" for i in range(5000)})
        path = _write_zip(tmp_path / "t.npz", _stored(members))
        with pytest.raises(TraceError, match="zip directory"):
            load_trace(path)

    def test_jsonl_line_without_end(self, tmp_path: Path) -> None:
        header = {"format": "moestream-trace", "version": 1, "n_layers": 2, "n_experts": 8,
                  "top_k": 2, "preset": "x"}
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps(header) + "\n" + '{"token": 0, "experts": [' + "0," * 2**20)
        with pytest.raises(TraceError, match=r"t.jsonl:2: line longer than"):
            load_trace(path)

    def test_jsonl_over_the_cap(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(moestream.pipeline.foundation.trace, "MAX_TRACE_ENTRIES", 40)
        header = {"format": "moestream-trace", "version": 1, "n_layers": 2, "n_experts": 8,
                  "top_k": 2, "preset": "x"}
        row = {"experts": [[0, 1], [2, 3]], "weights": [[0.5, 0.5], [0.5, 0.5]]}
        lines = [json.dumps(header)] + [json.dumps({"token": t, **row}) for t in range(11)]
        path = tmp_path / "t.jsonl"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(TraceError, match=r"t.jsonl:12: more than the 40 entries"):
            load_trace(path)


# --- warm-up index ranges ---------------------------------------------------------------------


class TestWarmupRanges:
    """Index ranges are checked against the model before they are expanded."""

    @pytest.mark.parametrize(("option", "match"), [
        ("--layers", "layer 99999999999 in '0-99999999999' is out of range"),
        ("--experts", "expert 99999999999 in '0-99999999999' is out of range"),
    ])
    def test_huge_range(self, tiny_model: Path, option: str, match: str) -> None:
        done = _cli("moestream.tools.warmup", str(tiny_model), "--report", option, "0-99999999999")
        _refused(done, match)


# --- logs: line-length cap, ids, sizes ---------------------------------------------------------


@pytest.fixture(scope="module")
def run_log(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real log of 4 tokens of the tiny model."""
    log = tmp_path_factory.mktemp("bounds") / "run.jsonl"
    argv = ["-m", str(tiny_model), "-n", "4", "--backend", "host", "--compute", "fixed:0",
            "--log", str(log)]
    assert run_main(argv) == 0
    return log


def _edited(log: Path, out: Path, edit: Any) -> Path:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    out.write_text("".join(json.dumps(edit(e)) + "\n" for e in events))
    return out


class TestHostileLogs:
    """Logs are read line by line with a cap; ids int32 cannot hold and zero sizes refused."""

    def test_file_of_zeros_without_newline(self, tmp_path: Path) -> None:
        path = tmp_path / "zeros.jsonl"
        with path.open("wb") as f:
            f.truncate(4 << 30)  # sparse: no disk used
        _refused(_cli("moestream.tools.analyze", str(path)), "longer than 1048576 bytes")

    def test_hot_log_of_zeros(self, tiny_model: Path, tmp_path: Path) -> None:
        path = tmp_path / "zeros.jsonl"
        with path.open("wb") as f:
            f.truncate(4 << 30)
        _refused(_cli("moestream.tools.warmup", str(tiny_model), "--report", "--hot", str(path)),
                 "not a moestream run log")

    def test_overlong_line_is_skipped_not_held(self, run_log: Path, tmp_path: Path) -> None:
        lines = run_log.read_text().splitlines(keepends=True)
        path = tmp_path / "long.jsonl"
        path.write_text(lines[0] + "x" * (MAX_LINE_BYTES * 3) + "\n" + "".join(lines[1:]))
        whole, cut = read_log(run_log), read_log(path)
        assert cut.counts.malformed == 1
        assert len(cut.tokens) == len(whole.tokens) == 4

    @pytest.mark.parametrize("command", ["analyze", "warmup"])
    def test_expert_id_above_int32(self, run_log: Path, tiny_model: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str], command: str) -> None:
        def edit(event: dict[str, Any]) -> dict[str, Any]:
            if event["event"] == "token" and event["token"] == 2:
                event["experts"][0][0] = 2**40
            return event

        path = _edited(run_log, tmp_path / "big.jsonl", edit)
        line = next(n for n, text in enumerate(path.read_text().splitlines(), 1)
                    if '"token": 2' in text and str(2**40) in text)
        if command == "analyze":
            code = analyze_main([str(path)])
        else:
            code = warmup_main([str(tiny_model), "--report", "--hot", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert f"big.jsonl:{line}: token 2 has an expert id outside int32" in err[-1]

    def test_what_if_with_zero_expert_bytes(self, run_log: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
        def edit(event: dict[str, Any]) -> dict[str, Any]:
            if event["event"] == "run_start":
                event["model"]["expert_bytes"] = [0] * len(event["model"]["expert_bytes"])
            return event

        path = _edited(run_log, tmp_path / "zero.jsonl", edit)
        assert analyze_main([str(path), "--what-if"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "expert_bytes 0: an expert's size must be positive" in err[-1]


# --- models whose layers mix expert types ------------------------------------------------------

HIDDEN, FFN, EXPERTS = 64, 32, 8


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MoE layer 1 of F16 experts, layer 2 of Q8_1 experts (a type real compute does not
    dequantize), both with F32 routers."""
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "deepseek2")
    writer.add_uint32("deepseek2.block_count", 3)
    writer.add_uint32("deepseek2.expert_used_count", 2)
    writer.add_embedding_length(HIDDEN)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, HIDDEN)).astype(np.float16))
    q8_1 = GGMLQuantizationType.Q8_1
    for layer in (1, 2):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                          rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32))
        for matrix, (rows, cols) in (("gate", (FFN, HIDDEN)), ("up", (FFN, HIDDEN)),
                                     ("down", (HIDDEN, FFN))):
            name = f"blk.{layer}.ffn_{matrix}_exps.weight"
            if layer == 1:
                writer.add_tensor(name, rng.standard_normal((EXPERTS, rows, cols))
                                  .astype(np.float16))
            else:  # Q8_1: blocks of 32 values in 40 bytes
                raw = rng.integers(0, 255, (EXPERTS, rows, cols // 32 * 40), dtype=np.uint8)
                writer.add_tensor(name, raw, raw_dtype=q8_1)
    return finish_gguf(writer, path, {})


class TestMixedExpertTypes:
    """Real compute checks every layer's type up front; digest runs any mix."""

    @pytest.mark.parametrize("extra", [["--compute", "real"], ["--router", "live"]])
    def test_real_compute_is_refused(self, mixed_model: Path, extra: list[str],
                                     capsys: pytest.CaptureFixture[str]) -> None:
        code = run_main(["-m", str(mixed_model), "-n", "3", "--backend", "host", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert sum("error:" in line for line in err) == 1
        assert ("real compute cannot run layer 2's Q8_1/Q8_1 experts (layer 1 is F16/F16; "
                "it dequantizes IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, " in err[-1])

    def test_digest_compute_runs(self, mixed_model: Path) -> None:
        assert run_main(["-m", str(mixed_model), "-n", "3", "--backend", "host", "--router",
                         "live", "--compute", "digest"]) == 0
