"""
PyTorch's FSDP2 as a sharding backend (:mod:`.backend`): each :class:`~tango_fairscale.FSDPConfig`
field mapped onto ``fully_shard`` (:mod:`.sharding`), checkpoints through DCP loaded safely
(:mod:`.checkpoint`), and the ring collectives of units on CPU meshes (:mod:`.collectives`).

Nothing is imported here, so that naming the package does not import FSDP2 and DCP.
"""
