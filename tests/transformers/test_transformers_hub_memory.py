"""transformers' memory and hub words as a transformers user passes them: ``max_memory``
(the experts get what it leaves once the dense weights are counted), a hub id found in the
local hub cache at its ``revision`` (never downloaded), a budget of nothing refused naming
the model's least, a budget the device cannot hold said as a warning."""

from __future__ import annotations

import os
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moestream  # noqa: E402
from moestream import transformers as mt  # noqa: E402
from moestream.pipeline.foundation.errors import (  # noqa: E402
    ModelFileError,
    UsageError,
    UsageTypeError,
)
from tests.transformers.test_transformers_trust import CONFIG, IDS, _save  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LEAST = 2 * CONFIG["num_experts_per_tok"]
"""The smallest budget docs/TRANSFORMERS.md states: top-k for each of 2 layers in flight."""

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-moe"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("hubmem") / "qwen3_moe", seed=0)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection attempt fails the test: nothing is downloaded."""
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refused)


def write_hub_cache(checkpoint: Path, hub: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``checkpoint`` as huggingface_hub's cache ``hub`` keeps a download of ``REPO``:
    blobs, a snapshot of links to them at ``COMMIT``, ``refs/main`` naming it;
    ``HF_HUB_CACHE`` points there."""
    repo = hub / f"models--{REPO.replace('/', '--')}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(checkpoint.iterdir())):
        shutil.copyfile(file, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    # HF_HUB_CACHE as a user sets it before Python starts; huggingface_hub read it at import
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    return hub


@pytest.fixture
def hub_cache(tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return write_hub_cache(checkpoint, tmp_path / "hub", monkeypatch)


def _dense_bytes(model: Any) -> int:
    """The weights the model holds on its device besides the experts (which stay meta);
    not the buffers it makes itself (rotary frequencies), which the docs leave out."""
    return sum(t.numel() * t.element_size() for t in model.parameters()
               if t.device.type != "meta")


def _refusal(error: type[Exception], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(error) as caught:
        mt.from_pretrained(*args, **kwargs)
    text = str(caught.value)
    assert "\n" not in text
    return text


class TestMaxMemory:
    """``max_memory`` for the model's device bounds the dense weights and the experts'
    cache together."""

    @pytest.mark.parametrize("limit", ["2MiB", 3 << 20])
    def test_the_experts_get_what_the_dense_weights_leave(self, checkpoint: Path,
                                                          limit: Any) -> None:
        nbytes = limit if isinstance(limit, int) else 2 << 20
        with mt.from_pretrained(checkpoint, device="cpu", max_memory={"cpu": limit}) as model:
            budget = model.moestream.session.counters().budget_bytes
            dense = _dense_bytes(model)
            assert budget > 0 and budget + dense <= nbytes
            assert budget + dense > nbytes * 0.99  # the dense weights counted, not guessed
            with torch.no_grad():
                model.generate(torch.tensor(IDS), max_new_tokens=2, do_sample=False)

    def test_other_devices_entries_are_not_used(self, checkpoint: Path) -> None:
        with mt.from_pretrained(checkpoint, device="cpu",
                                max_memory={0: "1KiB", "cpu": "2MiB", "disk": "1TiB"}) as model:
            assert model.moestream.session.counters().budget_bytes < 2 << 20

    def test_too_small_names_what_it_needs(self, checkpoint: Path) -> None:
        text = _refusal(UsageError, checkpoint, device="cpu", max_memory={"cpu": "64KiB"})
        assert "max_memory 64.00 KiB" in text and "give at least" in text
        assert "KiB" in text and "bytes (" not in text

    def test_no_entry_for_the_device(self, checkpoint: Path) -> None:
        text = _refusal(UsageError, checkpoint, device="cpu", max_memory={0: "20GiB"})
        assert "no size for cpu" in text and "'cpu'" in text

    def test_with_a_budget(self, checkpoint: Path) -> None:
        _refusal(UsageError, checkpoint, device="cpu", budget=8, max_memory={"cpu": "1GiB"})

    @pytest.mark.parametrize(("max_memory", "error"), [("20GiB", UsageTypeError),
                                                        ({"cpu": "lots"}, UsageError),
                                                        ({"cpu": -5}, UsageError)])
    def test_not_a_size(self, checkpoint: Path, max_memory: Any,
                        error: type[Exception]) -> None:
        _refusal(error, checkpoint, device="cpu", max_memory=max_memory)


class TestHubIds:
    """A hub id is read from the local hub cache, at its revision; never downloaded."""

    def test_hub_id(self, hub_cache: Path, no_network: None) -> None:
        with mt.from_pretrained(REPO, budget=LEAST, device="cpu") as model:
            assert model.moestream.session.model.path.parent.name == "snapshots"
            with torch.no_grad():
                model.generate(torch.tensor(IDS), max_new_tokens=2, do_sample=False)

    @pytest.mark.parametrize("revision", ["main", COMMIT])
    def test_revision(self, hub_cache: Path, no_network: None, revision: str) -> None:
        with mt.from_pretrained(REPO, revision=revision, budget=LEAST, device="cpu") as model:
            assert model.moestream.session.model.path.name == COMMIT

    def test_cache_dir(self, hub_cache: Path, no_network: None,
                       monkeypatch: pytest.MonkeyPatch) -> None:
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache.parent))
        with mt.from_pretrained(REPO, cache_dir=str(hub_cache), local_files_only=True,
                                budget=LEAST, device="cpu") as model:
            assert model.moestream.session.model.path.name == COMMIT

    def test_revision_not_there(self, hub_cache: Path, no_network: None) -> None:
        text = _refusal(ModelFileError, REPO, revision="v2", budget=LEAST, device="cpu")
        assert "downloads nothing" in text and "snapshot_download" in text

    def test_not_in_the_cache(self, hub_cache: Path, no_network: None) -> None:
        text = _refusal(ModelFileError, "acme/other", budget=LEAST, device="cpu")
        assert "local hub cache" in text

    def test_revision_of_a_local_directory(self, checkpoint: Path) -> None:
        assert "local directory" in _refusal(UsageError, checkpoint, revision="main")

    def test_a_missing_file(self, tmp_path: Path) -> None:
        text = _refusal(ModelFileError, tmp_path / "model.safetensors")
        assert "no such checkpoint" in text


class TestLeastBudget:
    """A budget of nothing names the model's true least (top-k for each of 2 layers in
    flight), before the session opens."""

    @pytest.mark.parametrize("budget", [0, -1, "0", "-1", "0.0", "0GiB",
                                        moestream.Budget(experts=0)])
    def test_names_the_least(self, checkpoint: Path, budget: Any) -> None:
        text = _refusal(UsageError, checkpoint, budget=budget, device="cpu")
        assert f"at least {LEAST} experts" in text and "at least 1 expert" not in text

    def test_one_below(self, checkpoint: Path) -> None:
        text = _refusal(UsageError, checkpoint, budget=LEAST - 1, device="cpu")
        assert text.endswith(f"at least {LEAST} experts")

    def test_the_least_works(self, checkpoint: Path) -> None:
        with mt.from_pretrained(checkpoint, budget=str(LEAST), device="cpu") as model, \
                torch.no_grad():
            model.generate(torch.tensor(IDS), max_new_tokens=2, do_sample=False)

    @pytest.mark.parametrize(("budget", "words"), [("4.5", "a bare number is experts"),
                                                   ("lots", "a number of experts")])
    def test_unreadable(self, checkpoint: Path, budget: str, words: str) -> None:
        assert words in _refusal(UsageError, checkpoint, budget=budget, device="cpu")


class TestBudgetTooLarge:
    """A budget the device's free memory cannot hold is cut to it, and a warning says so
    without any logging configured."""

    def test_warns(self, checkpoint: Path) -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model = mt.from_pretrained(checkpoint, budget="1000TiB", device="cpu")
        try:
            said = [w for w in seen if issubclass(w.category, UserWarning)
                    and "free memory" in str(w.message)]
            assert len(said) == 1 and "the experts' cache holds" in str(said[0].message)
            assert said[0].filename == __file__  # pointed at the caller's line
        finally:
            model.moestream.close()

    def test_a_budget_that_fits_is_quiet(self, checkpoint: Path) -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model = mt.from_pretrained(checkpoint, budget=LEAST, device="cpu")
        model.moestream.close()
        assert not [w for w in seen if "free memory" in str(w.message)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
class TestOnTheGpu:
    """``max_memory`` keyed as transformers keys a GPU, and the device left to its default."""

    @pytest.mark.parametrize("key", [0, "cuda:0"])
    def test_max_memory_for_the_gpu(self, checkpoint: Path, key: Any) -> None:
        limit = 2 << 20
        with mt.from_pretrained(checkpoint, max_memory={key: limit, "cpu": "1KiB"}) as model:
            assert model.device.type == "cuda"
            budget = model.moestream.session.counters().budget_bytes
            assert budget > 0 and budget + _dense_bytes(model) <= limit
            with torch.no_grad():
                model.generate(torch.tensor(IDS, device=model.device), max_new_tokens=2,
                               do_sample=False)
            assert model.moestream.last_generate.misses > 0
