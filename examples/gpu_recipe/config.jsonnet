// Fine-tuning an 8-billion-parameter Llama-style model (Llama 3.1 8B's shapes) on N nodes of 8
// GPUs each: one `tango run` per node under SLURM (train.sbatch here; docs/gpu-recipe.md says what
// each setting is for and what has been run). Every value a cluster changes is an external variable:
//
//   tango run examples/gpu_recipe/config.jsonnet -i tango_fairscale -w WORKSPACE \
//     --ext-var pretrained=/models/llama-3.1-8b --ext-var text=/data/corpus \
//     --ext-var gpus_per_node=8 --ext-var lora=false
//
// `pretrained` is a save_pretrained directory with safetensors files (nothing is downloaded on the
// nodes); `text` a text file or a directory of *.txt files.
local pretrained = std.extVar("pretrained");
local text = std.extVar("text");
local gpus_per_node = std.parseInt(std.extVar("gpus_per_node"));
local lora = std.extVar("lora") == "true";
local train_steps = 2000;

local base = { type: "fairscale::from_pretrained", pretrained_model_name_or_path: pretrained };

{
  steps: {
    data: {
      type: "fairscale::tokenize_text",
      path: text,
      tokenizer: pretrained,
      block_size: 2048,
      // The last 1 % of every document (cut at a line break) validates: one large file works too.
      validation_fraction: 0.01,
      split_by: "tail",
      // A corpus too large to hash at every `tango run`: give changed contents a new path.
      hash_contents: false,
    },
    train: {
      type: "torch::train",
      model: {
        type: "fairscale::with_wrapped_modules",
        // LoRA: peft's adapters on the attention projections, the base frozen (it holds no gradient
        // and no optimizer state); full fine-tuning otherwise.
        model: if lora then {
          type: "fairscale::with_lora",
          model: base,
          r: 16,
          target_modules: ["q_proj", "k_proj", "v_proj", "o_proj"],
        } else base,
        // One FSDP unit per decoder layer: a worker gathers one layer (218 M parameters, 0.4 GB in
        // bfloat16) at a time.
        wrap_module_classes: ["LlamaDecoderLayer"],
        // Recompute each layer's activations in backward: 2048-token sequences would otherwise keep
        // every layer's activations until backward.
        activation_checkpointing: true,
        fsdp_config: { mixed_precision: true, compute_dtype: "bfloat16" },
      },
      training_engine: {
        type: "fairscale",
        // backend: "torch",          // FSDP2 instead: the same run
        // hybrid_sharding: true,     // with the torch backend: shard within a node, replicate across
        optimizer: { type: "torch::AdamW", lr: if lora then 2e-4 else 2e-5, weight_decay: 0.0 },
        lr_scheduler: { type: "torch::CosineAnnealingLR", T_max: train_steps },
        amp: true,
        amp_use_bfloat16: true,
        max_grad_norm: 1.0,
        // The root unit (embeddings, final norm, head) in bfloat16 too.
        fsdp_config: { mixed_precision: true, compute_dtype: "bfloat16" },
        // Build on `meta` and read each layer from the safetensors files as it is sharded: no
        // worker ever holds the 16 GB of bfloat16 weights (32 GB in float32) at once.
        init_on_meta: true,
        collective_timeout: 600,
        export_hf: "hf",
      },
      dataset_dict: { type: "ref", ref: "data" },
      train_dataloader: {
        batch_size: 4,  // per GPU: 4 x 2048 tokens
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      validation_split: "validation",
      validation_dataloader: {
        batch_size: 4,
        sampler: { type: "torch::DistributedSampler", shuffle: false, drop_last: true },
      },
      grad_accum: 4,
      train_steps: train_steps,
      validate_every: 200,
      checkpoint_every: 200,
      log_every: 10,
      // GPUs on EACH node: the world is nodes x gpus_per_node workers.
      device_count: gpus_per_node,
      callbacks: [{ type: "fairscale::metrics" }],
    },
  },
}
