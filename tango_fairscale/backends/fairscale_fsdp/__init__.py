"""
FairScale's FSDP as a sharding backend (:mod:`.backend`): checkpoints of flat per-unit shards
and their resharding arithmetic (:mod:`.resharding`), the reduce-scatter bucket's size
(:mod:`.bucketing`) and what a step holds (:mod:`.memory_model`). What it changes in FairScale
is :mod:`tango_fairscale.compat`'s (F1-F10).
"""
