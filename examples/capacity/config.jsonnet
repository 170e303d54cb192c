// A GPT-2 that does not fit in 1.4 GiB per worker under Tango's DDP engine, trained on the same two
// CPU workers and the same budget with this plugin's FSDP. See README.md.
//
//   cd examples/capacity
//   tango run config.jsonnet -w ../../workspace/capacity                    # FSDP: trains
//   tango run config.jsonnet -w ../../workspace/capacity --ext-var engine=ddp  # DDP: out of memory
//
// tango.yml sets the two external variables (Tango passes environment variables to jsonnet as
// external variables); --ext-var wins.
local engine = std.extVar("engine");
// Per worker: the worker's RLIMIT_DATA (its private memory: heap and anonymous mappings), set
// by the engine before the model is built. "none" for no limit.
local memory_limit = std.extVar("memory_limit");
assert engine == "fsdp" || engine == "ddp" : "engine: 'fsdp' or 'ddp', got '%s'" % engine;

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

local models = {
  // DDP: every worker holds the whole model, its gradients and AdamW's two moments.
  ddp: gpt2,
  // FSDP: each block is its own unit; a worker holds a shard of everything, and one block's
  // full parameters while it computes.
  fsdp: {
    type: "fairscale::with_wrapped_modules",
    model: gpt2,
    wrap_module_classes: ["GPT2Block"],
    fsdp_config: {},
  },
};
local engines = {
  // Tango's "torch" engine, with the per-worker limit.
  ddp: { type: "benchmark::torch_limited" },
  // This plugin's "fairscale" engine, with the same limit; init_on_meta: no worker ever
  // builds the whole model.
  fsdp: { type: "benchmark::fairscale_limited", init_on_meta: true },
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
        memory_limit: if memory_limit == "none" then null else memory_limit,
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
        // Each worker's limit and peak private memory, in capacity_worker<N>.json there.
        { type: "benchmark::capacity_record" },
      ],
    },
  },
}
