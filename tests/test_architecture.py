"""The package's shape: no import cycle, one seam between the engine and the backends, one set of defaults."""

import ast
import inspect
import subprocess
import sys

import pytest

from scripts import import_graph
from tango_fairscale import FairScaleTrainingEngine
from tango_fairscale.backends.base import Backend
from tango_fairscale.backends.lookup import BACKENDS, backend_class
from tango_fairscale.checkpointing.commit import merge_digests
from tango_fairscale.options import EngineOptions
from tango_fairscale.topology import Topology
from tests.helpers import REPO


def test_no_import_cycle() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "import_graph.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 cycle(s)" in result.stdout


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_the_engine_has_no_backend_branch() -> None:
    source = (REPO / "tango_fairscale" / "engine.py").read_text()
    assert "backend ==" not in source and "backend !=" not in source
    # Nothing of either implementation is imported: the engine reaches them through the interface.
    imported = [
        node.module or "" if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    for module in imported:
        assert not module.startswith(
            ("fairscale", "torch.distributed.fsdp", "backends.torch_fsdp2", "backends.fairscale_fsdp")
        ), module


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_implements_the_interface_in_its_own_folder(name: str) -> None:
    implementation = backend_class(name)
    assert issubclass(implementation, Backend) and implementation.name == name
    assert not inspect.isabstract(implementation)
    folder = {"fairscale": "fairscale_fsdp", "torch": "torch_fsdp2"}[name]
    assert implementation.__module__ == f"tango_fairscale.backends.{folder}.backend"


def test_no_subpackage_is_named_like_an_importable_package() -> None:
    # Tango's include_package walks the package with pkgutil.walk_packages, which imports each
    # subpackage by its bare name to walk into it: one called "torch" or "fairscale" made Tango
    # import (and walk) the real torch or fairscale, whose fairscale.experimental.wgit exits.
    import importlib.util

    root = REPO / "tango_fairscale"
    packages = [path.parent.name for path in root.rglob("__init__.py") if path.parent != root]
    assert "fairscale_fsdp" in packages and "torch_fsdp2" in packages
    shadowing = sorted(name for name in packages if importlib.util.find_spec(name) is not None)
    assert not shadowing, shadowing


def test_engine_defaults_are_the_options_defaults() -> None:
    signature = inspect.signature(FairScaleTrainingEngine.__init__).parameters
    defaults = EngineOptions()
    for name in EngineOptions.field_names():
        assert signature[name].default == getattr(defaults, name), name
    own = set(signature) - {"self", "train_config", "model", "optimizer", "lr_scheduler"}
    assert own == set(EngineOptions.field_names())


def test_every_engine_option_has_a_docstring() -> None:
    source = inspect.getsource(EngineOptions)
    for name in EngineOptions.field_names():
        assert "#: " in source.split(f"    {name}: ")[0].rsplit("\n", 2)[-2], name


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"collective_timeout": 0}, "collective_timeout: must be positive"),
        ({"collective_timeout": "300"}, "collective_timeout: must be a number of seconds"),
        ({"verify_checkpoints": "yes"}, "verify_checkpoints: expected true or false, got 'yes'"),
        ({"init_on_meta": 1}, "init_on_meta: expected true or false, got 1"),
        ({"backend": "deepspeed"}, r"backend: must be one of \['fairscale', 'torch'\], got 'deepspeed'"),
    ],
)
def test_options_checked_in_one_place(changes: dict, message: str) -> None:
    from tango.common.exceptions import ConfigurationError

    options = EngineOptions.from_config({"type": "fairscale", **changes})
    with pytest.raises(ConfigurationError, match=f"training_engine.{message}"):
        options.check(distributed=True, device_count=2, on_cpu=True, warn=False)


def test_topology_leaders() -> None:
    two_hosts = Topology(world_size=6, workers_per_host=3)
    assert two_hosts.num_hosts == 2
    assert [two_hosts.is_leader(rank) for rank in range(6)] == [True, False, False, True, False, False]
    assert two_hosts.leader_of(two_hosts.host_of(4)) == 3
    assert list(two_hosts.ranks_of(1)) == [3, 4, 5]
    assert Topology.one_host(4).num_hosts == 1
    with pytest.raises(ValueError, match="cannot be split"):
        Topology(world_size=5, workers_per_host=2)


def test_each_host_lists_its_own_copy_of_a_shared_file() -> None:
    topology = Topology(world_size=4, workers_per_host=2)
    meta = [{"size": 1, "sha256": "h0"}, None, {"size": 1, "sha256": "h1"}, None]
    gathered = [
        {
            f"worker{rank}.pt": {"size": rank, "sha256": str(rank)},
            **({"dcp/.metadata": meta[rank]} if meta[rank] else {}),
        }
        for rank in range(4)
    ]
    host0, host1 = merge_digests(gathered, topology, 1), merge_digests(gathered, topology, 3)
    assert host0["dcp/.metadata"]["sha256"] == "h0" and host1["dcp/.metadata"]["sha256"] == "h1"
    assert {name for name in host0 if name.startswith("worker")} == {f"worker{r}.pt" for r in range(4)}
