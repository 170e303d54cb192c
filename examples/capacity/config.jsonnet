// A GPT-2 that does not fit in 1.4 GiB per process under Tango's DDP engine, trained on the same
// two CPU workers and the same budget with this plugin's FSDP, either backend. See README.md.
//
//   cd examples/capacity
//   ulimit -d 1468006   # 1.4 GiB of private memory for tango run and every worker it spawns
//   tango run config.jsonnet -w ../../workspace/capacity                      # FSDP: trains
//   tango run config.jsonnet -w ../../workspace/capacity-fsdp2 --ext-var engine=fsdp2
//   tango run config.jsonnet -w ../../workspace/capacity-ddp --ext-var engine=ddp  # out of memory
//
// tango.yml sets the external variable (Tango passes environment variables to jsonnet as
// external variables); --ext-var wins.
local engine = std.extVar("engine");
assert engine == "fsdp" || engine == "fsdp2" || engine == "ddp" : "engine: 'fsdp', 'fsdp2' or 'ddp', got '%s'" % engine;

local device_count = 2;
// GPT-2 small's width and heads, 9 blocks: 64.0 M parameters.
local gpt2 = {
  type: "gpt2::from_config",
  vocab_size: 257,  // 256 byte values and an end-of-document token
  n_positions: 32,
  n_embd: 768,
  n_layer: 9,
  n_head: 12,
  dropout: 0.0,
};
local train_steps = 12;
local validate_every = 4;
local batch_size = 2;

// FSDP: each block is its own unit; a worker holds a shard of everything, and one block's full
// parameters while it computes.
local fsdp_model = {
  type: "fairscale::with_wrapped_modules",
  model: gpt2,
  wrap_module_classes: ["GPT2Block"],
  fsdp_config: {},
};
local models = {
  // DDP: every worker holds the whole model, its gradients and AdamW's two moments.
  ddp: gpt2,
  fsdp: fsdp_model,
  fsdp2: fsdp_model,
};
// The engines record each worker's peak memory (benchmarks/components.py); the budget itself is
// the ulimit on the whole run.
local engines = {
  // Tango's "torch" engine.
  ddp: { type: "benchmark::torch_limited" },
  // This plugin's "fairscale" engine; init_on_meta: no worker ever builds the whole model.
  fsdp: { type: "benchmark::fairscale_limited", init_on_meta: true },
  // The same with PyTorch's FSDP2 doing the sharding.
  fsdp2: { type: "benchmark::fairscale_limited", init_on_meta: true, backend: "torch" },
};

{
  steps: {
    text: { type: "gpt2::read_text", path: "../train_gpt2/data", validation_fraction: 0.1 },
    tokenized: {
      type: "gpt2::tokenize_bytes",
      dataset_dict: { type: "ref", ref: "text" },
      block_size: gpt2.n_positions,
    },
    train: {
      type: "torch::train",
      model: models[engine],
      training_engine: engines[engine] {
        optimizer: { type: "torch::AdamW", lr: 0.0006 },
      },
      dataset_dict: { type: "ref", ref: "tokenized" },
      train_dataloader: {
        batch_size: batch_size,
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      validation_split: "validation",
      validation_dataloader: {
        batch_size: batch_size * 2,
        sampler: { type: "torch::DistributedSampler", shuffle: false, drop_last: true },
      },
      validation_steps: 2,
      train_steps: train_steps,
      validate_every: validate_every,
      checkpoint_every: train_steps,
      log_every: validate_every,
      device_count: device_count,
      callbacks: [
        // Each validation loss, logged and appended to validation.jsonl in the work directory.
        { type: "gpt2::log_validation" },
        // Each worker's limit (RLIMIT_DATA) and peak private memory, in capacity_worker<N>.json there.
        { type: "benchmark::capacity_record" },
      ],
    },
  },
}
