// A small causal LM with its output head tied to the token embedding, each block its own unit,
// built on `meta` (init_on_meta), 10 steps on 2 CPU workers with one checkpoint. The run that
// scripts/repeat_run.py repeats to count exit codes:
//
//   python scripts/repeat_run.py scripts/configs/tied_lm.jsonnet -n 50 -D backend=torch \
//       -i tango_fairscale -i tests.components
local backend = std.extVar("backend");

{
  steps: {
    data: { type: "test::token_data" },
    train: {
      type: "torch::train",
      model: {
        type: "fairscale::with_wrapped_modules",
        model: { type: "test::tied_lm" },
        modules_to_wrap: ["blocks\\.[0-9]+"],
      },
      training_engine: {
        type: "fairscale",
        backend: backend,
        init_on_meta: true,
        optimizer: { type: "torch::AdamW", lr: 0.003 },
      },
      dataset_dict: { type: "ref", ref: "data" },
      train_dataloader: {
        batch_size: 8,
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      train_steps: 10,
      checkpoint_every: 5,
      log_every: 5,
      device_count: 2,
    },
  },
}
