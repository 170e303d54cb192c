"""
Install PyTorch into the running interpreter's environment, the way ``make`` needs it:

- a torch already installed is kept (nothing is installed) when it is in the range that
  ``pyproject.toml`` requires; one outside that range is an error, because ``pip install -e .``
  would otherwise silently replace it with PyPI's default build;
- on a machine without an NVIDIA GPU, the CPU build from PyTorch's CPU wheel index: a bare
  ``pip install torch`` on Linux pulls the multi-GB CUDA build and its ``nvidia-*`` wheels;
- with an NVIDIA GPU, the default (CUDA) build from the default index;
- ``--index-url`` (``TORCH_INDEX_URL``) and ``--spec`` (``TORCH_SPEC``) override the choice.

When the CPU index cannot be reached (a firewall, an offline mirror), it says so and installs
the pinned spec from the default index instead, so that ``make`` still works wherever pip does.
``--dry-run`` prints the decision and the exact pip command without running it.

Standard library only: it runs in a fresh virtualenv that has nothing but pip.
"""

import argparse
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

CPU_INDEX_URL = "https://download.pytorch.org/whl/cpu"
DEFAULT_SPEC = "torch==2.13.0"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def say(message: str) -> None:
    print(f"install_torch: {message}", flush=True)


def torch_requirement(pyproject: Path = PYPROJECT) -> str:
    """The version specifier of torch in ``pyproject.toml``'s dependencies, e.g. ``>=2.13,<2.14``."""
    match = re.search(r'^\s*"torch\s*([<>=!~][^";]*)"', pyproject.read_text(), flags=re.MULTILINE)
    if match is None:
        raise SystemExit(f"install_torch: no torch requirement found in {pyproject}")
    return match.group(1).replace(" ", "")


def _release(version: str) -> Tuple[int, ...]:
    # The numeric release only: "2.13.0+cpu" and "2.13.0" are the same release for the range
    # check (the local label names the build, not the version).
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def satisfies(version: str, specifier: str) -> bool:
    """
    Whether ``version`` meets every clause of ``specifier`` (``>=``, ``>``, ``<=``, ``<``,
    ``==``, ``!=``; no wildcards). Enough for the bounds pyproject.toml uses, without needing
    ``packaging`` in a fresh virtualenv.
    """
    release = _release(version)
    for clause in filter(None, specifier.split(",")):
        match = re.fullmatch(r"(>=|<=|==|!=|>|<)(\d+(?:\.\d+)*)", clause.strip())
        if match is None:
            raise ValueError(f"unsupported version clause {clause!r}")
        operator, bound_text = match.groups()
        bound = _release(bound_text)
        width = max(len(release), len(bound))
        left = release + (0,) * (width - len(release))
        right = bound + (0,) * (width - len(bound))
        ok = {
            ">=": left >= right,
            "<=": left <= right,
            "==": left == right,
            "!=": left != right,
            ">": left > right,
            "<": left < right,
        }[operator]
        if not ok:
            return False
    return True


def installed_torch() -> Optional[str]:
    """The version of the torch distribution installed for this interpreter, without importing it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_gpu(proc_gpus: Path = NVIDIA_PROC_GPUS) -> Tuple[bool, str]:
    """Whether this machine has an NVIDIA GPU, and how that was found out."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is not None:
        try:
            result = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            result = None
        if result is not None and result.returncode == 0 and "GPU" in result.stdout:
            return True, f"`nvidia-smi -L` lists {result.stdout.count('GPU ')} GPU(s)"
    # The driver lists one entry per GPU here even where nvidia-smi is not on PATH (containers).
    if proc_gpus.is_dir() and any(proc_gpus.iterdir()):
        return True, f"{proc_gpus} lists a GPU"
    return False, "no NVIDIA GPU found (`nvidia-smi -L` lists none, no GPUs in /proc/driver/nvidia)"


def reachable(index_url: str, timeout: float = 10.0) -> Tuple[bool, str]:
    """Whether the simple index at ``index_url`` answers for torch (a bounded probe, no download)."""
    url = index_url.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return True, f"{url} answered {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return False, f"{url} is unreachable ({reason})"


def _is_path_or_url(spec: str) -> bool:
    return spec.endswith(".whl") or "/" in spec or spec.startswith(".")


def _pinned_version(spec: str) -> Optional[str]:
    match = re.fullmatch(r"torch\s*==\s*([0-9][^\s,;]*)", spec.strip())
    return match.group(1) if match else None


def pip_install(python: str, spec: str, index_url: Optional[str]) -> List[str]:
    command = [python, "-m", "pip", "install", "--quiet"]
    if index_url:
        command += ["--index-url", index_url]
    return command + [spec]


def decide(
    *,
    python: str,
    spec: str,
    index_url: Optional[str],
    installed: Optional[str],
    requirement: str,
    gpu: Tuple[bool, str],
    cpu_index_url: str,
    probe: "Optional[Tuple[bool, str]]" = None,
) -> Tuple[Optional[List[str]], List[str]]:
    """
    The pip command to run (``None``: install nothing) and the lines that explain why. Raises
    ``SystemExit`` with a message for a torch, or a requested spec, outside ``requirement``.
    ``probe`` is the reachability of ``cpu_index_url``; it is only looked at (and only needs to
    be given) when the CPU index is the choice.
    """
    if installed is not None:
        if not satisfies(installed, requirement):
            raise SystemExit(
                f"install_torch: torch {installed} is installed, but tango-fairscale needs "
                f"torch{requirement} (pyproject.toml), so `pip install -e .` would replace it with "
                "PyPI's default build. "
                f"Uninstall it (`{python} -m pip uninstall torch`) or install a torch{requirement} first."
            )
        return None, [
            f"torch {installed} is already installed (needs torch{requirement}): installing nothing."
        ]
    pinned = _pinned_version(spec)
    if pinned is not None and not satisfies(pinned, requirement):
        raise SystemExit(
            f"install_torch: {spec} is outside torch{requirement}, which pyproject.toml requires."
        )
    if index_url:
        return pip_install(python, spec, index_url), [
            f"installing {spec} from {index_url} (TORCH_INDEX_URL)."
        ]
    if _is_path_or_url(spec):
        return pip_install(python, spec, None), [f"installing {spec} (TORCH_SPEC)."]
    has_gpu, how = gpu
    if has_gpu:
        return pip_install(python, spec, None), [f"{how}: installing {spec}, the default (CUDA) build."]
    assert probe is not None, "the CPU index choice needs its reachability"
    ok, probe_note = probe
    if ok:
        return pip_install(python, spec, cpu_index_url), [
            f"{how}: installing the CPU build of {spec} from {cpu_index_url}."
        ]
    return pip_install(python, spec, None), [
        f"{how}, but {probe_note}.",
        f"Falling back to {spec} from the default index. On Linux that is the multi-GB CUDA build "
        "unless the index (or pip's find-links) serves a CPU wheel; to choose another source, set "
        "TORCH_INDEX_URL or TORCH_SPEC (a wheel file), or install torch into the virtualenv first.",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--spec", default=DEFAULT_SPEC, help=f"what to install (default: {DEFAULT_SPEC})")
    parser.add_argument("--index-url", default="", help="install from this index, whatever the machine")
    parser.add_argument("--gpu", choices=["auto", "yes", "no"], default="auto", help="whether there is a GPU")
    parser.add_argument("--cpu-index-url", default=CPU_INDEX_URL, help="PyTorch's CPU wheel index")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    args = parser.parse_args(argv)

    installed = installed_torch()
    gpu = detect_gpu() if args.gpu == "auto" else (args.gpu == "yes", f"--gpu {args.gpu}")
    # Only the CPU-index choice needs the network probe.
    needs_probe = installed is None and not args.index_url and not _is_path_or_url(args.spec) and not gpu[0]
    command, notes = decide(
        python=sys.executable,
        spec=args.spec,
        index_url=args.index_url or None,
        installed=installed,
        requirement=torch_requirement(),
        gpu=gpu,
        cpu_index_url=args.cpu_index_url,
        probe=reachable(args.cpu_index_url) if needs_probe else None,
    )
    for note in notes:
        say(note)
    if command is None:
        return 0
    if args.dry_run:
        say(f"would run: {shlex.join(command)}")
        return 0
    say(f"running: {shlex.join(command)}")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
