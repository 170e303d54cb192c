"""
The step telemetry: one record per training step per worker and one route to the workers that
write, read by the metrics log (``fairscale::metrics``), the memory table (``fairscale::memory``)
and the loggers (``fairscale::wandb``, ``fairscale::tensorboard``).

- :mod:`.core`: :class:`~.core.WorkerTelemetry`, which measures each step once, makes its
  :class:`~.record.StepRecord` and sends it through the rendezvous store (:mod:`.route`), and why
  the store;
- :mod:`.callback`: :class:`~.callback.TelemetryCallback`, what the reading callbacks share;
- :mod:`.record`: the record, and what a step's records of all workers add up to;
- :mod:`.figures`: the arithmetic (:class:`~.figures.Window`, :func:`~.figures.combine`, MFU);
- :mod:`.peaks`: a worker's peak FLOP/s (the table of GPUs, the CPU matmul);
- :mod:`.tokens`: a batch's samples and tokens;
- :mod:`.flops`: the model FLOPs of a step (:class:`~torch.utils.flop_counter.FlopCounterMode`).
"""
