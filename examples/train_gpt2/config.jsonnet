// A small GPT-2 trained from scratch, byte by byte, on "Alice's Adventures in Wonderland",
// with FairScale Fully Sharded Data Parallel: each transformer block is its own FSDP unit,
// with activation checkpointing. Runs as is on 2 CPU workers; see README.md for GPUs.
//
//   cd examples/train_gpt2
//   tango run config.jsonnet -w ../../workspace/train_gpt2                      # about 2 minutes on 2 CPU cores
//   tango run config.jsonnet -w ../../workspace/train_gpt2 --ext-var size=tiny  # a smoke test, under 30 s
//
// `size` picks one of the presets below. tango.yml in this directory sets it to "default"
// (Tango passes environment variables to jsonnet as external variables); --ext-var wins.
local size = std.extVar("size");

// Workers: one per GPU (NCCL) when the machine has at least device_count GPUs, else CPU
// processes (gloo). On GPUs: set device_count to the number of GPUs (1 included), amp to true.
local device_count = 2;
local amp = false;

local presets = {
  // Enough to see a falling validation loss; what the tests run.
  tiny: {
    n_layer: 2, n_embd: 64, n_head: 2, block_size: 64,
    batch_size: 8, lr: 0.003, train_steps: 40, validate_every: 10, log_every: 10,
  },
  // About 0.8M parameters: the validation loss falls from 2.7 after 100 steps to 1.86 nats
  // per byte after 600 (5.55 is a uniform guess); about 2 minutes on 2 CPU cores.
  default: {
    n_layer: 4, n_embd: 128, n_head: 4, block_size: 64,
    batch_size: 16, lr: 0.002, train_steps: 600, validate_every: 100, log_every: 50,
  },
};
assert std.objectHas(presets, size) :
  "Unknown size '%s': use one of %s, e.g. --ext-var size=tiny" % [size, std.objectFields(presets)];
local p = presets[size];

{
  steps: {
    text: {
      type: "gpt2::read_text",
      // A .txt file or a directory of them; relative to the directory tango runs in.
      path: "data",
      validation_fraction: 0.1,
    },
    tokenized: {
      type: "gpt2::tokenize_bytes",
      dataset_dict: { type: "ref", ref: "text" },
      block_size: p.block_size,
      // Overlapping training blocks: twice the examples from a small book.
      train_stride: p.block_size / 2,
    },
    train: {
      type: "torch::train",
      model: {
        type: "fairscale::with_wrapped_modules",
        model: {
          type: "gpt2::from_config",
          vocab_size: 257,  // 256 byte values and an end-of-document token
          n_positions: p.block_size,
          n_embd: p.n_embd,
          n_layer: p.n_layer,
          n_head: p.n_head,
          // No dropout: a few hundred steps over the book are far from overfitting it.
          dropout: 0.0,
        },
        // Every transformer block (transformer.h.0, transformer.h.1, ...) becomes its own FSDP
        // unit, so only one block's full parameters exist at a time. The same selection by
        // class: wrap_module_classes: ["GPT2Block"].
        modules_to_wrap: ["transformer\\.h\\.[0-9]+"],
        fsdp_config: { reshard_after_forward: true },
        // Recompute each block's activations in backward instead of keeping them.
        activation_checkpointing: true,
      },
      training_engine: {
        type: "fairscale",
        optimizer: { type: "torch::AdamW", lr: p.lr, weight_decay: 0.01 },
        lr_scheduler: { type: "torch::CosineAnnealingLR", T_max: p.train_steps },
        // The root unit: the embeddings, the final layer norm and the (tied) output layer.
        fsdp_config: { reshard_after_forward: true },
        max_grad_norm: 1.0,
        amp: amp,
      },
      dataset_dict: { type: "ref", ref: "tokenized" },
      // batch_size is per worker: each step trains on batch_size * device_count blocks.
      train_dataloader: {
        batch_size: p.batch_size,
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      validation_split: "validation",
      validation_dataloader: {
        batch_size: p.batch_size * 2,
        sampler: { type: "torch::DistributedSampler", shuffle: false, drop_last: true },
      },
      train_steps: p.train_steps,
      validate_every: p.validate_every,
      checkpoint_every: p.validate_every,
      log_every: p.log_every,
      device_count: device_count,
      callbacks: [
        // Per-worker peak memory and samples/s, and a summary table at the end.
        { type: "fairscale::memory" },
        // Each validation loss, logged and appended to validation.jsonl in the work directory.
        { type: "gpt2::log_validation" },
      ],
    },
  },
}
