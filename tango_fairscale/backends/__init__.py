"""
Sharding backends other than FairScale's FSDP.

- :mod:`tango_fairscale.backends.torch_fsdp`: PyTorch's own FSDP2
  (:func:`torch.distributed.fsdp.fully_shard`): how each :class:`~tango_fairscale.FSDPConfig`
  field maps onto it, sharding a model by a :class:`~tango_fairscale.WrapPlan`, gradient
  clipping, loss scaling and gradient accumulation for DTensor gradients.
- :mod:`tango_fairscale.backends.torch_fsdp_checkpoint`: checkpoints of FSDP2 models through
  ``torch.distributed.checkpoint`` (DCP), loaded without unpickling anything but DCP's own
  metadata classes, and consolidated without a process group.

The engine's ``backend: "torch"`` option (:class:`~tango_fairscale.FairScaleTrainingEngine`)
selects this backend; see ``docs/torch-backend.md``.
"""
