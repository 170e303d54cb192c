// The quick demo: a small regression model trained with FairScale FSDP on 2 CPU workers
// (or 2 GPUs where there are). Each feed-forward block is its own FSDP unit, with
// activation checkpointing.
//
//   tango run examples/toy/config.jsonnet -i tango_fairscale -i examples.toy.components
local device_count = 2;
local train_steps = 40;

{
  steps: {
    data: {
      type: "toy::regression_data",
      in_features: 16,
    },
    train: {
      type: "torch::train",
      model: {
        type: "fairscale::with_wrapped_modules",
        model: { type: "toy::regressor", in_features: 16, width: 64, num_blocks: 4 },
        modules_to_wrap: ["blocks\\.[0-9]+"],
        fsdp_config: { reshard_after_forward: true },
        activation_checkpointing: true,
      },
      training_engine: {
        type: "fairscale",
        optimizer: { type: "torch::AdamW", lr: 0.003 },
        lr_scheduler: { type: "torch::CosineAnnealingLR", T_max: train_steps },
        fsdp_config: { reshard_after_forward: true },
        max_grad_norm: 1.0,
      },
      dataset_dict: { type: "ref", ref: "data" },
      train_dataloader: {
        batch_size: 16,
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      validation_split: "validation",
      validation_dataloader: {
        batch_size: 32,
        sampler: { type: "torch::DistributedSampler", shuffle: false, drop_last: true },
      },
      train_steps: train_steps,
      validate_every: 20,
      checkpoint_every: 20,
      log_every: 5,
      device_count: device_count,
    },
  },
}
