"""The package's shape: no import cycle, one seam between the engine and the backends, one set of defaults."""

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from scripts import import_graph
from tango_fairscale import CheckpointError, FairScaleTrainingEngine
from tango_fairscale.backends.base import Backend
from tango_fairscale.backends.lookup import BACKENDS, backend_class, backend_of
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
    assert (
        "0 cycle(s), 0 import(s) across the backends' boundary, 0 use(s) of a backend's name" in result.stdout
    )


#: The most lines a module of the package may have (CONTRIBUTING.md: one concern to a module).
MAX_MODULE_LINES = 800


def test_no_module_is_over_800_lines() -> None:
    modules = sorted((REPO / "tango_fairscale").rglob("*.py"))
    lengths = {path.relative_to(REPO): len(path.read_text().splitlines()) for path in modules}
    print(f"{len(lengths)} modules, the longest {max(lengths.values())} lines")
    assert len(lengths) > 100  # the whole package, its subfolders included
    assert {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_only_the_backends_and_compat_import_fairscale_or_fsdp() -> None:
    # From the whole package's import graph: every module, every import (inside functions too).
    assert import_graph.boundary_violations() == []


def test_the_boundary_check_finds_every_kind_of_crossing(tmp_path: Path) -> None:
    sources = {
        "__init__.py": "",
        # Allowed: compat patches FairScale; a backend imports its own library, base and lookup.
        "compat.py": "from fairscale.nn import checkpoint\n",
        "backends/__init__.py": "",
        "backends/lookup.py": "import importlib\nM = 'tango_fairscale.backends.torch_fsdp2.backend'\n",
        "backends/fairscale_fsdp/__init__.py": "",
        "backends/fairscale_fsdp/backend.py": "import fairscale.nn\nfrom ..base import Backend\n",
        "backends/torch_fsdp2/__init__.py": "",
        "backends/torch_fsdp2/backend.py": "from torch.distributed.fsdp import fully_shard\n",
        # Crossings: at module level, inside a function, by importlib, by parts.
        "config.py": "def wrap():\n    from fairscale.nn.data_parallel import FSDP  # when called\n",
        "materialize.py": "import torch.distributed.fsdp._fully_shard as f\n",
        "multihost.py": "import importlib\nimportlib.import_module('fairscale.nn')\n",
        "plan.py": "from torch.distributed import fsdp\n",
        "backends/fairscale_fsdp/resharding.py": "from ..torch_fsdp2 import sharding\n",
        "backends/torch_fsdp2/checkpoint.py": "from tango_fairscale.backends import fairscale_fsdp\n",
    }
    for name, source in sources.items():
        path = tmp_path / "tango_fairscale" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    found = import_graph.boundary_violations(tmp_path)
    assert [line.split(" imports ")[0] for line in found] == [
        "tango_fairscale/backends/fairscale_fsdp/resharding.py:1",
        "tango_fairscale/backends/torch_fsdp2/checkpoint.py:1",
        "tango_fairscale/config.py:2",
        "tango_fairscale/materialize.py:1",
        "tango_fairscale/multihost.py:2",
        "tango_fairscale/plan.py:1",
    ], found
    assert "a backend does not import another backend" in found[0] and "fairscale_fsdp" in found[1]
    assert "only backends/ and compat/ may import fairscale" in found[2]
    assert "may import torch.distributed.fsdp" in found[3] and "may import torch.distributed.fsdp" in found[5]


def test_no_module_outside_the_backends_names_a_backend() -> None:
    # The whole package: no comparison with, or default of, a backend's name, and no import of a
    # backend's folder, outside backends/ (where lookup.py chooses one).
    found, exempt = import_graph.backend_knowledge_outside_backends()
    assert found == []
    assert exempt == len(list((REPO / "tango_fairscale" / "backends").rglob("*.py")))


def test_the_backend_name_rule_finds_every_kind_of_use(tmp_path: Path) -> None:
    sources = {
        "__init__.py": "",
        "backends/__init__.py": "",
        "backends/lookup.py": "_IMPLEMENTATIONS: dict = {'fairscale': 'a:A', 'torch': 'b:B'}\n",
        # Allowed: a backend names itself, lookup chooses one, the engine type "fairscale" is no backend.
        "backends/fairscale_fsdp/__init__.py": "",
        "backends/fairscale_fsdp/backend.py": "name = 'fairscale'\nif backend == 'fairscale': pass\n",
        "engine.py": "if engine_type == 'fairscale': pass\nfrom .backends.lookup import backend_class\n",
        # Uses: compared, in a tuple, defaulted by get, a dataclass default, an argument default,
        # a keyword, an import of a backend's folder inside a function.
        "plan.py": (
            "if plan.backend == 'fairscale': pass\n"
            "if options['backend'] in ('torch', 'x'): pass\n"
            "backend = engine.get('backend', 'fairscale')\n"
            "class P:\n    backend: str = 'torch'\n"
            "def f(x, backend='fairscale'): pass\n"
            "make(backend='torch')\n"
            "def g():\n    from .backends.fairscale_fsdp import bucketing\n"
        ),
    }
    for name, source in sources.items():
        path = tmp_path / "tango_fairscale" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    found, exempt = import_graph.backend_knowledge_outside_backends(tmp_path)
    lines = [1, 2, 3, 5, 6, 7, 9]  # 4 and 8 open a class and a function
    assert [line.split(" ")[0] for line in found] == [f"tango_fairscale/plan.py:{n}" for n in lines]
    assert exempt == 4
    assert "imports tango_fairscale.backends.fairscale_fsdp" in found[-1]


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_implements_the_interface_in_its_own_folder(name: str) -> None:
    implementation = backend_class(name)
    assert issubclass(implementation, Backend) and implementation.name == name
    assert not inspect.isabstract(implementation)
    folder = {"fairscale": "fairscale_fsdp", "torch": "torch_fsdp2"}[name]
    assert implementation.__module__ == f"tango_fairscale.backends.{folder}.backend"


@pytest.mark.parametrize(
    "marker, owner",
    [
        ({"world_size": 2, "files": ["model"]}, "fairscale"),
        ({"world_size": 2, "backend": "torch", "format": "dcp"}, "torch"),
        ({"world_size": 2, "backend": "deepspeed", "format": "zero"}, None),
        ({"world_size": 2, "backend": "torch"}, None),
    ],
)
def test_the_backend_that_owns_a_marker_says_so(marker: dict, owner: Optional[str]) -> None:
    # Exactly one backend owns a marker it wrote, none one it did not: nothing outside them decides.
    owners = [name for name in BACKENDS if backend_class(name).owns(marker)]
    assert owners == ([owner] if owner else [])
    if owner is None:
        with pytest.raises(CheckpointError, match="written by none of this version's backends"):
            backend_of(marker)
    else:
        assert backend_of(marker).name == owner


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
