"""
``consolidate``: one full state dict of a sharded checkpoint (``--format pt``), or a directory
``from_pretrained`` (or peft's ``PeftModel.from_pretrained``) loads (``--format hf``).
"""

import argparse
import math
from pathlib import Path
from typing import Any, Dict, Optional

from tqdm import tqdm

from .. import checkpointing, output_paths
from ..backends.base import ADAPTER_FIELD
from ..checkpointing import consolidation
from ..checkpointing.placing import identity
from ..finetune.hf_export import (
    export_hf,
    export_merged_adapter,
    export_peft_adapter,
    model_class_of,
    model_source_tensors,
)
from .common import UsageError


def check_output(
    output: Path, kind: str, checkpoint_dir: Path, given: Path, *, force: bool
) -> Optional[Path]:
    """
    Raise unless ``consolidate`` may write ``output`` (:func:`tango_fairscale.output_paths.check_output`:
    a new path, or with ``force`` an earlier output of the same kind) from ``checkpoint_dir``, the
    checkpoint ``given`` resolved to. Returns the work directory ``given`` was, if it was one.
    """
    work_dir = given if given.resolve() != checkpoint_dir.resolve() else None
    output_paths.check_output(
        output, kind, replace=force, work_dir=work_dir, sources=[checkpoint_dir], running_step=False
    )
    return work_dir


def consolidate_hf(
    checkpoint_dir: Path,
    output: Path,
    hf_config: Optional[Path],
    *,
    force: bool = False,
    merge: bool = False,
) -> None:
    """
    Write the model of ``checkpoint_dir`` as a directory ``from_pretrained`` loads, with the
    config (and tokenizer files) of ``hf_config``: one tensor at a time, atomically. A checkpoint
    of a peft model (its marker records the adapter's config) is written as the adapter directory
    ``PeftModel.from_pretrained(base, output)`` loads, ``hf_config`` being the base model's
    directory; with ``merge``, as the base model with the adapter merged into it.
    """
    checkpoint_dir, output = Path(checkpoint_dir), Path(output)
    if hf_config is None:
        raise UsageError(
            "--format hf needs --hf-config DIR, a directory with the model's config.json "
            "(e.g. the pretrained model it was fine-tuned from)"
        )
    if not (Path(hf_config) / "config.json").is_file():
        given = Path(hf_config)
        found = (
            "does not exist"
            if not given.exists()
            else "is a file"
            if given.is_file()
            else "holds no config.json"
        )
        raise UsageError(
            f"--hf-config {hf_config} {found}: give the directory of the model's config.json "
            "(e.g. the pretrained model it was fine-tuned from)"
        )
    if not checkpoint_dir.exists():
        raise UsageError(f"checkpoint directory {checkpoint_dir} does not exist")
    given, checkpoint_dir = checkpoint_dir, checkpointing.resolve_checkpoint(checkpoint_dir)
    work_dir = check_output(output, output_paths.HF_EXPORT, checkpoint_dir, given, force=force)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_config))
    source = model_source_tensors(consolidation.model_source(checkpoint_dir))
    adapter = (checkpointing.read_marker(checkpoint_dir) or {}).get(ADAPTER_FIELD)
    if merge and adapter is None:
        raise UsageError(f"--merge is for the checkpoint of a peft model; {checkpoint_dir} is not one")
    try:
        if adapter is not None:
            _consolidate_adapter(
                source, output, config, adapter, Path(hf_config), merge, work_dir, checkpoint_dir
            )
            return
        export_hf(
            source,
            output,
            config,
            tokenizer_from=Path(hf_config),
            work_dir=work_dir,
            sources=[checkpoint_dir],
        )
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
    except Exception as error:  # noqa: BLE001 - a base of another model: peft's or the export's words, one line
        mismatch = type(error).__module__.startswith("peft") or "not of this model class" in str(error)
        if not mismatch:
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(
            f"--hf-config {hf_config} is not the model the checkpoint trained ({type(error).__name__}: "
            f"{first}): give the directory of its base model's config.json"
        ) from None
    print(f"Wrote {output} (from_pretrained loads it)")


def _consolidate_adapter(
    source: Any,
    output: Path,
    config: Any,
    adapter: Dict[str, Any],
    base_directory: Path,
    merge: bool,
    work_dir: Optional[Path],
    checkpoint_dir: Path,
) -> None:
    """:func:`consolidate_hf` of a peft model's checkpoint: the adapter directory, or the merged model."""
    import tempfile

    import torch
    from peft import PeftConfig, get_peft_model

    # The adapter's names come from peft, asked with the model's skeleton (on meta: no memory).
    with torch.device("meta"):
        skeleton = get_peft_model(model_class_of(config)(config), PeftConfig.from_peft_type(**adapter))
    try:
        if not merge:
            export_peft_adapter(
                source,
                output,
                skeleton,
                base_directory=base_directory,
                work_dir=work_dir,
                sources=[checkpoint_dir],
            )
            print(f"Wrote {output} (PeftModel.from_pretrained(base, {output}) loads it)")
            return
        output_paths.check_output(
            output, output_paths.HF_EXPORT, work_dir=work_dir, sources=[checkpoint_dir], running_step=False
        )
        with tempfile.TemporaryDirectory(prefix=".adapter-", dir=Path(output).resolve().parent) as scratch:
            adapter_dir = Path(scratch) / "adapter"
            export_peft_adapter(source, adapter_dir, skeleton, base_directory=base_directory)
            export_merged_adapter(adapter_dir, output, work_dir=work_dir, sources=[checkpoint_dir])
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
    print(f"Wrote {output} (the base with the adapter merged; from_pretrained loads it)")


def consolidate(
    checkpoint_dir: Path, output: Path, *, with_optimizer: bool = False, force: bool = False
) -> None:
    """
    Write the full (unsharded) model state dict of ``checkpoint_dir`` to ``output``; with
    ``with_optimizer``, write ``{"model": ..., "optimizer": ...}`` instead, the optimizer state
    keyed by parameter name. ``output`` must be a new path, or with ``force`` a file an earlier
    ``consolidate`` wrote (:mod:`tango_fairscale.output_paths`).
    """
    checkpoint_dir, output = Path(checkpoint_dir), Path(output)
    if not checkpoint_dir.exists():
        raise UsageError(f"checkpoint directory {checkpoint_dir} does not exist")
    given, checkpoint_dir = checkpoint_dir, checkpointing.resolve_checkpoint(checkpoint_dir)
    check_output(output, output_paths.CONSOLIDATED, checkpoint_dir, given, force=force)
    checked = identity(output)  # what the check found: the only thing the write may replace
    marker = checkpointing.read_marker(checkpoint_dir)
    assert marker is not None  # resolve_checkpoint checked that the checkpoint is complete
    world_size = marker["world_size"]
    if with_optimizer:
        # The optimizer state is consolidated whole (it is only read offline, for inspection).
        total = consolidation.files_to_read(marker, with_optimizer)
        with tqdm(total=total, desc="Reading shards", unit="file") as progress:
            result = consolidation.consolidate(
                checkpoint_dir, with_optimizer=with_optimizer, progress=lambda: progress.update()
            )
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            consolidation.save_consolidated(result, output, checked=checked)
        except OSError as error:
            raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
        shapes = [tuple(t.shape) for t in result["model"].values()]
    else:
        # The model one tensor at a time: no more memory than its largest tensor.
        source = consolidation.model_source(checkpoint_dir)
        tensors = [entry for entry in source.entries if entry.alias_of is None]
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            with tqdm(total=len(tensors), desc="Writing tensors", unit="tensor") as progress:
                consolidation.save_model(source, output, progress=lambda: progress.update(), checked=checked)
        except OSError as error:
            raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
        shapes = [entry.shape for entry in source.entries]
    numel = sum(math.prod(shape) for shape in shapes)
    print(
        f"Wrote {output} from {world_size} shards of {checkpoint_dir}: {len(shapes)} tensors, "
        f"{numel:,} elements{', with optimizer state' if with_optimizer else ''}."
    )


def add_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    """The ``consolidate`` command's arguments."""
    consolidate_parser = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into one full state dict",
        description="Turn a sharded checkpoint (or a step's work directory: its latest checkpoint) "
        "into one full state dict that loads into the plain model. Needs no process group and no GPU.",
    )
    consolidate_parser.add_argument(
        "checkpoint_dir", type=Path, help="checkpoint_state_step<N> directory or work dir"
    )
    consolidate_parser.add_argument(
        "output",
        type=Path,
        help="the .pt file to write, or with --format hf the directory (not inside a checkpoint directory)",
    )
    consolidate_parser.add_argument(
        "--optimizer",
        action="store_true",
        help='also consolidate the optimizer state; the file is then {"model": ..., "optimizer": ...}',
    )
    consolidate_parser.add_argument(
        "--force",
        action="store_true",
        help="replace an output an earlier consolidate wrote (of the same --format); any other existing "
        "path is refused",
    )
    consolidate_parser.add_argument(
        "--format",
        choices=["pt", "hf"],
        default="pt",
        help="pt: one torch.save'd state dict (default); hf: OUTPUT is a directory that transformers' "
        "from_pretrained loads (config.json, safetensors, tokenizer files), with --hf-config",
    )
    consolidate_parser.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="with --format hf: the directory of the model's config.json (e.g. the pretrained model "
        "it was fine-tuned from); its tokenizer files are copied too. For a peft (LoRA) model's "
        "checkpoint OUTPUT is the adapter directory, and this is the base model's directory",
    )
    consolidate_parser.add_argument(
        "--merge",
        action="store_true",
        help="with --format hf, for a peft (LoRA) model's checkpoint: write the base model with the "
        "adapter merged into it (from_pretrained loads it) instead of the adapter directory",
    )


def run(args: argparse.Namespace) -> None:
    """``consolidate`` with the parsed ``args``: the options that go together checked first."""
    if args.format == "hf":
        if args.optimizer:
            raise UsageError("--optimizer has no place in a --format hf directory: leave one of them out")
        consolidate_hf(args.checkpoint_dir, args.output, args.hf_config, force=args.force, merge=args.merge)
    else:
        if args.hf_config is not None or args.merge:
            raise UsageError(
                f"{'--hf-config' if args.hf_config is not None else '--merge'} goes with --format hf"
            )
        consolidate(args.checkpoint_dir, args.output, with_optimizer=args.optimizer, force=args.force)
