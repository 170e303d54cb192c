"""The plan for people: the units as a tree, the model state beside DDP's, a step's peak and the verdict."""

from typing import List, Optional

from .estimate import PEAK_PARTS, Plan, Unit, total_of
from .model import BUILT_ON
from .text import human

#: How much a CPU worker's resident memory grew beyond the tensors' peak in docs/plan.md's 2-worker
#: runs (the engine's 16 MiB mmap threshold: freed memory stays in glibc's heap, partly unused).
CPU_RESIDENT_FACTORS = (1.3, 1.9)


def _dtype_line(plan: Plan) -> str:
    """What the parameters are built in, held (updated) in and computed in: the byte counts below follow."""
    held = f"Parameters held and updated in {plan.parameter_dtype}"
    if plan.built_dtype != plan.parameter_dtype:
        held += f" (built in {plan.built_dtype}, upcast before sharding)"
    elif plan.sharded and plan.parameter_dtype in ("bfloat16", "float16"):
        held += " (training_engine.param_dtype: pure low precision)"
    return f"{held}; gathered and computed in {plan.compute_dtype}."


def render(plan: Plan) -> str:
    """The plan as a text tree and tables, for people."""
    states = plan.states_per_parameter
    state_text = "unknown state" if states is None else f"{states:g} state tensor(s) per parameter"
    where, meaning = BUILT_ON[plan.built_on]
    workers = "on meta too, allocating one unit at a time" if plan.init_on_meta else "whole on their devices"
    lines = [
        f'Wrap plan of step "{plan.step}": {plan.model_class}, {plan.total_numel:,} parameters, '
        f"world size {plan.world_size}, optimizer {plan.optimizer} ({state_text}); built on {where}",
        f"Built on {where}: {meaning}. The workers build it {workers} (init_on_meta: "
        f"{'true' if plan.init_on_meta else 'false'}).",
    ]
    lines.append(_dtype_line(plan))
    for directory in plan.from_config_only:
        lines.append(
            f"Planned from {directory}/config.json alone (it holds no model.safetensors): the shapes are "
            "the model's, no weight was read. Training reads the weights from there: put the model's "
            "save_pretrained files beside its config.json before `tango run`."
        )
    if plan.trainable_numel != plan.total_numel:
        lines.append(
            f"{plan.trainable_numel:,} of the parameters train; the frozen ones get no gradient "
            "and no optimizer state."
        )
    if not plan.sharded:
        lines.append(
            f'The training engine "{plan.engine}" does not shard: every worker holds the whole model '
            '(use the "fairscale" engine to shard it).'
        )
    lines += ["", f"{'FSDP unit':<52} {'parameters':>14} {'per worker':>14}  checkpointed"]

    def visit(unit: Unit, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└── " if last else "├── ")
        label = f"{prefix}{branch}{unit.name or '<root>'} ({unit.class_name})"
        lines.append(
            f"{label:<52} {unit.numel:>14,} {unit.shard_numel:>14,}  {'yes' if unit.checkpointed else ''}"
        )
        child_prefix = prefix + ("" if depth == 0 else ("    " if last else "│   "))
        for index, child in enumerate(unit.children):
            visit(child, child_prefix, index == len(unit.children) - 1, depth + 1)

    visit(plan.root, "", True, 0)
    fsdp, ddp = plan.bytes_per_worker(), plan.ddp_bytes_per_worker()
    lines += ["", f"{'model state per worker':<24} {'this config':>14} {'DDP':>14} {'ratio':>8}"]
    for key in ("parameters", "gradients", "optimizer_state"):
        lines.append(_state_row(key.replace("_", " "), fsdp[key], ddp[key]))
    lines.append(_state_row("total", total_of(fsdp), total_of(ddp)))
    largest = plan.largest_unit
    lines.append(
        f"plus, while a unit runs, its full parameters: largest is {largest.name or '<root>'} "
        f"({human(largest.numel * plan.compute_element_size)})"
    )
    if plan.optimizer_note:
        lines.append(f"optimizer state: {plan.optimizer_note}")
    return "\n".join(lines + [""] + _render_peak(plan))


def _size(value: Optional[int]) -> str:
    return "unknown" if value is None else human(value)


def _state_row(label: str, ours: Optional[int], ddp: Optional[int]) -> str:
    ratio = f"{ours / ddp:>8.3f}" if ours is not None and ddp else f"{'':>8}"
    return f"{label:<24} {_size(ours):>14} {_size(ddp):>14} {ratio}"


def _render_peak(plan: Plan) -> List[str]:
    phase, parts = plan.peak_components()
    peak = total_of(parts)
    acts = plan.activations
    batch = plan.batch.describe() if plan.batch else f"unknown ({plan.batch_note})"
    lines = [
        f"Peak of one worker in a training step (estimated; it comes in the {phase}):",
        f"  batch: {batch}",
    ]
    labels = dict(PEAK_PARTS)
    if plan.fsdp_sharded:
        labels.update(parameters="parameters (shards)", gradients="gradients (shards)")
        if plan.memory is not None and plan.memory.reduce_scatter_bucket:
            # With few trainable parameters (LoRA) the reduce-scatter bucket is most of it.
            labels.update(gathered_gradients="units' whole gradients, bucket")
    else:
        labels.update(
            parameters="parameters (whole)", gradients="gradients (whole)", gathered_gradients="DDP's buckets"
        )
    for key, value in parts.items():
        if value or key in ("parameters", "optimizer_state", "activations"):
            why = ""
            if value is None and key == "activations":
                why = f"  ({acts.note})" if acts and acts.note and plan.batch else "  (the batch is unknown)"
            elif value is None and key == "optimizer_state":
                why = "  (see above)"
            lines.append(f"  {labels[key]:<30} {_size(value):>12}{why}")
    lines.append(f"  {'total':<30} {_size(peak):>12}")
    if acts is not None and acts.configured is not None:
        measured = [
            f"{human(found.activations_alone)} {label}"
            for label, found in (
                ("with activation checkpointing", acts.with_checkpointing),
                ("without", acts.without_checkpointing),
            )
            if found is not None
        ]
        lines.append(f"  the activations' own peak, measured: {'; '.join(measured)}")
        if acts.alternative is not None:
            other = "without" if acts.checkpointing else "with"
            total = _size(plan.peak(checkpointing=not acts.checkpointing))
            lines.append(f"  the step's peak {other} activation checkpointing: {total}")
    if plan.device_memory is not None:
        memory = plan.device_memory
        if peak is None:
            lines.append(f"Against {human(memory)} per device: cannot say, part of the estimate is unknown.")
        elif peak <= memory:
            headroom = memory - peak
            lines.append(
                f"Against {human(memory)} per device: fits, {human(headroom)} "
                f"({headroom / memory:.0%}) to spare."
            )
        else:
            lines.append(f"Against {human(memory)} per device: does not fit, {human(peak - memory)} over.")
            lines.append("To fit, any of:")
            lines += [f"  - {suggestion}" for suggestion in plan.suggestions()]
    lines.append(
        "Tensors only, as the allocator counts them (CUDA's max_memory_allocated): the process's runtime and "
        "what the allocator keeps besides come on top (docs/plan.md)."
    )
    if plan.device == "cpu" and peak is not None:
        # docs/plan.md: the resident growth of 2-worker CPU runs against this estimate.
        low, high = (round(peak * factor) for factor in CPU_RESIDENT_FACTORS)
        least, most = CPU_RESIDENT_FACTORS
        lines.append(
            f"On CPU workers the resident memory grew {least:g} to {most:g} times the tensors in "
            f"docs/plan.md's runs ({human(low)} to {human(high)} here; glibc's heap keeps what is "
            "freed), besides about 300 MiB of runtime per worker."
        )
    return lines
