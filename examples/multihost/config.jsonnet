// The toy regression of examples/toy, trained across hosts: run this same file with one
// `tango run` per host (see docs/multihost.md and train.sbatch here). device_count is the number
// of workers on EACH host: 2 hosts x 2 workers train as one host with 4 workers would.
//
//   torchrun --nnodes=2 --nproc-per-node=1 --node-rank=R --master-addr=HOST0 --master-port=29500 \
//     -m tango run examples/multihost/config.jsonnet -i tango_fairscale -i examples.toy.components -w WORKSPACE
local device_count = 2;  // workers per host: GPUs per host on GPU nodes, else CPU processes
local train_steps = 60;

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
      },
      training_engine: {
        type: "fairscale",
        optimizer: { type: "torch::AdamW", lr: 0.003 },
        lr_scheduler: { type: "torch::CosineAnnealingLR", T_max: train_steps },
        fsdp_config: { reshard_after_forward: true },
        // Seconds any collective may wait for the other workers (default 300).
        collective_timeout: 300,
      },
      dataset_dict: { type: "ref", ref: "data" },
      train_dataloader: {
        batch_size: 16,
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      train_steps: train_steps,
      checkpoint_every: 20,
      log_every: 5,
      device_count: device_count,
    },
  },
}
