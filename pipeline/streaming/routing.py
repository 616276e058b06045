"""The model's own router, as the public ``Session.router`` hands it out (``LiveRouter``).

``LiveRouter`` routes like the model: it applies each MoE layer's router
(``blk.N.ffn_gate_inp.weight``) to the hidden state flowing through the MoE layers (an
FFN-only decode proxy; the token's row of ``token_embd.weight`` starts it), top-k with
softmax weights. Hash-routed layers (their router, where the file has one as ds4's do,
unused) pick experts from the token id: by the file's own table where it has one (ds4's
``blk.N.ffn_gate_tid2eid.weight``, I32 ``[vocab, top_k]``), else by a seeded draw. Its
guess of layer L+1 applies L+1's router to the hidden state *before* layer L runs (the
Mixtral-offloading technique), so the loads of L+1 can overlap L's compute. The proxy
run's replays of a trace are its own (``pipeline.proxy.routing``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from moestream.gpu.backend import Backend
from moestream.pipeline.foundation.errors import ExpertLayoutError
from moestream.pipeline.foundation.table import ExpertTable, TensorInfo

__all__ = ["LiveRouter"]


_FLOAT_TYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
_EMBEDDINGS = ("token_embd.weight", "model.embed_tokens.weight")


def _floats(table: ExpertTable, info: TensorInfo, offset: int,
            count: int) -> npt.NDArray[np.float32]:
    """``count`` values of ``info`` (F32, F16 or BF16) from ``offset``, as float32."""
    dtype = _FLOAT_TYPES.get(info.type_name)
    if dtype is None:
        raise ExpertLayoutError(table.path, f"{info.name} is {info.type_name}; the live "
                                "router reads F32, F16 and BF16 tensors")
    size = np.dtype(dtype).itemsize
    if (offset - info.offset) + count * size > info.nbytes:
        raise ExpertLayoutError(table.path, f"{info.name} is cut short")
    data = np.frombuffer(table.read_bytes(offset, count * size), dtype=dtype)
    if info.type_name == "BF16":  # the high half of a float32
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _hash_tables(table: ExpertTable) -> dict[int, TensorInfo]:
    """The hash-routed layers' token -> experts tables the file has (ds4's I32
    ``tid2eid``, ``top_k`` ids a token), by layer; one of another shape is refused."""
    hashed = set(table.moe_layers[: table.hash_routed])
    tables = {}
    for info in table.non_routed:
        layer, _, rest = info.name.removeprefix("blk.").partition(".")
        if rest != "ffn_gate_tid2eid.weight" or not layer.isdigit() or int(layer) not in hashed:
            continue
        if info.type_name != "I32" or info.nbytes % (4 * table.top_k):
            raise ExpertLayoutError(table.path, f"{info.name} is {info.type_name} of "
                                    f"{info.nbytes} bytes, not I32 rows of {table.top_k} ids")
        tables[int(layer)] = info
    return tables


class LiveRouter:
    """Routes with the model's own router tensors.

    Args:
        table: the model (router tensors, token embeddings, shape).
        backend: where the routers live (device arrays on CuPy).
        seed: seeds the hash-routed layers' choice.
    """

    def __init__(self, table: ExpertTable, backend: Backend, seed: int = 0) -> None:
        self._table = table
        self._layers = table.moe_layers
        self._k = table.top_k
        self._seed = seed
        self._xp: Any = np
        if backend.name == "cupy":
            import cupy

            self._xp = cupy
        self._routers: dict[int, Any] = {}
        for i, layer in enumerate(self._layers):
            info = table.layers[layer].router
            # ds4's hash-routed layers carry a router too (its scores weight the experts
            # the token id picks), but the token id picks: no top-k there
            if info is not None and i >= table.hash_routed:
                w = _floats(table, info, info.offset, table.n_experts * table.hidden)
                self._routers[layer] = self._xp.asarray(w.reshape(table.n_experts, table.hidden))
        if not self._routers and table.hash_routed < len(self._layers):
            raise ExpertLayoutError(table.path, "no router tensors (ffn_gate_inp) to route live")
        self._embed = next((t for t in table.non_routed if t.name in _EMBEDDINGS), None)
        # each hash table read once here (a few MB a layer), not a row per token and layer
        self._hash_tables = {layer: (info, np.frombuffer(
            table.read_bytes(info.offset, info.nbytes), dtype="<i4").reshape(-1, self._k))
            for layer, info in _hash_tables(table).items()}

    def embedding(self, token: int) -> Any:
        """The hidden state a token starts with: its row of the token embedding (F32, F16 or
        BF16), normalized; a seeded random vector when the model has no such embedding."""
        h = self._table.hidden
        emb = self._embed
        if emb is not None and emb.type_name in _FLOAT_TYPES:
            row = h * np.dtype(_FLOAT_TYPES[emb.type_name]).itemsize
            x = _floats(self._table, emb, emb.offset + (token % (emb.nbytes // row)) * row, h)
        else:
            x = np.random.default_rng([self._seed, token]).standard_normal(h).astype(np.float32)
        x /= float(np.sqrt(np.mean(x * x))) + 1e-6
        return self._xp.asarray(x)

    def _top_k(self, layer: int, token: int, hidden: Any) -> tuple[list[int], list[float]]:
        router = self._routers.get(layer)
        hashed = self._hash_tables.get(layer)
        if router is None and hashed is not None:  # ds4's hash layer: its table's row
            return self._hash_row(*hashed, token), [1.0 / self._k] * self._k
        if router is None:  # hash-routed: the token id picks
            rng = np.random.default_rng([self._seed, token, layer])
            experts = rng.choice(self._table.n_experts, self._k, replace=False)
            return [int(e) for e in experts], [1.0 / self._k] * self._k
        logits = router @ hidden
        if self._xp is not np:
            logits = self._xp.asnumpy(logits)
        top = np.argpartition(-logits, self._k - 1)[: self._k]
        top = top[np.argsort(-logits[top])]
        z = np.exp(logits[top] - logits[top].max())
        return [int(e) for e in top], (z / z.sum()).astype(np.float32).tolist()

    def _hash_row(self, ids: TensorInfo, rows: np.ndarray, token: int) -> list[int]:
        """Token ``token``'s experts in a hash table (its row, the token id modulo the
        table's rows), each checked to be an expert of the layer."""
        row = rows[token % len(rows)]
        n = self._table.n_experts
        if row.min() < 0 or row.max() >= n:
            raise ExpertLayoutError(self._table.path, f"{ids.name}: token {token}'s experts "
                                    f"{row.tolist()} outside 0..{n - 1}")
        return [int(e) for e in row]

    def route(self, token: int, i: int, hidden: Any) -> tuple[list[int], list[float]]:
        return self._top_k(self._layers[i], token, hidden)

    def predict(self, token: int, i: int, hidden: Any) -> list[int]:
        return self._top_k(self._layers[i], token, hidden)[0]
