// Fine-tuning a pretrained Hugging Face model with FSDP, and the result out again as a directory
// transformers loads: the GPT-2 that make_pretrained.py pretrained on chapters I-VI of "Alice's
// Adventures in Wonderland" goes on with chapters VII-XII, on 2 CPU workers (2 GPUs where there
// are). See README.md.
//
//   cd examples/finetune_pretrained
//   python make_pretrained.py                                    # ../../workspace/pretrained-gpt2
//   tango run config.jsonnet -w ../../workspace/finetune_pretrained
//   python generate.py ../../workspace/finetune_pretrained/latest/train/work/hf
//
// tango.yml in this directory sets the external variables `size` (a preset below) and `pretrained`
// (the directory make_pretrained.py wrote; relative to the directory tango runs in); --ext-var wins.
local size = std.extVar("size");
local pretrained = std.extVar("pretrained");
// LoRA (--ext-var lora=true, `make demo-finetune-lora`): peft's adapters on the attention, the
// pretrained weights frozen; the adapter is exported instead of the whole model.
local lora = std.extVar("lora") == "true";

// Workers: one per GPU (NCCL) when the machine has at least device_count GPUs, else CPU processes.
local device_count = 2;

local presets = {
  // A few steps: what the tests run.
  tiny: { batch_size: 4, lr: 0.003, train_steps: 12, validate_every: 6, log_every: 6 },
  // About 2 minutes on 2 CPU cores: the validation loss on the held-out end of the book falls
  // below the pretrained model's.
  default: { batch_size: 8, lr: 0.001, train_steps: 150, validate_every: 25, log_every: 25 },
};
assert std.objectHas(presets, size) :
  "Unknown size '%s': use one of %s, e.g. --ext-var size=tiny" % [size, std.objectFields(presets)];
local p = presets[size];

{
  steps: {
    // The chapters the pretrained model has not seen, read as its pretraining read the book.
    text: {
      type: "finetune::book_text",
      path: "../train_gpt2/data/alice_in_wonderland.txt",
      start: "CHAPTER VII.",
      // Hashed into the step's id: a new pretrained model at this path trains again.
      pretrained: pretrained,
    },
    // The package's data step: tokenized with the pretrained model's own tokenizer (read from its
    // directory) into blocks of input_ids and labels.
    data: {
      type: "fairscale::tokenize_text",
      documents: { type: "ref", ref: "text" },
      tokenizer: pretrained,
      block_size: 128,  // the model's n_positions
      stride: 64,  // overlapping training blocks; validation blocks never overlap
      // The last 10 % of the text (cut at a line break) is held out for validation.
      validation_fraction: 0.1,
      split_by: "tail",
    },
    train: {
      type: "torch::train",
      model: {
        type: "fairscale::with_wrapped_modules",
        // In: the pretrained model. Under the engine's init_on_meta it is built on `meta` from its
        // config.json, and each FSDP unit reads its own tensors from model.safetensors as it is
        // sharded: no worker holds the whole model.
        local base = {
          type: "fairscale::from_pretrained",
          pretrained_model_name_or_path: pretrained,
          auto_class: "AutoModelForCausalLM",
        },
        // Frozen and trainable parameters share each block's unit: the frozen ones hold no
        // gradient and no optimizer state.
        model: if lora then { type: "fairscale::with_lora", model: base, r: 8, target_modules: ["c_attn"] } else base,
        // Each transformer block its own FSDP unit.
        wrap_module_classes: ["GPT2Block"],
        fsdp_config: { reshard_after_forward: true },
      },
      training_engine: {
        type: "fairscale",
        // backend: "torch",   // PyTorch's FSDP2 instead of FairScale's FSDP: the same run
        // LoRA trains few parameters from zero: a larger learning rate.
        optimizer: { type: "torch::AdamW", lr: if lora then 10 * p.lr else p.lr, weight_decay: 0.01 },
        lr_scheduler: { type: "torch::CosineAnnealingLR", T_max: p.train_steps },
        max_grad_norm: 1.0,
        init_on_meta: true,
        // Out: WORK_DIR/hf, written after weights.pt (the best checkpoint's weights), is a directory
        // AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load; with LoRA,
        // WORK_DIR/adapter is the adapter PeftModel.from_pretrained(base, dir) loads.
        export_hf: if lora then "adapter" else "hf",
      },
      dataset_dict: { type: "ref", ref: "data" },
      // batch_size is per worker: each step trains on batch_size * device_count blocks.
      train_dataloader: {
        batch_size: p.batch_size,
        sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
      },
      validation_split: "validation",
      validation_dataloader: {
        batch_size: p.batch_size,
        sampler: { type: "torch::DistributedSampler", shuffle: false, drop_last: true },
      },
      train_steps: p.train_steps,
      validate_every: p.validate_every,
      checkpoint_every: p.validate_every,
      log_every: p.log_every,
      device_count: device_count,
      // Validates once before the first step too: the pretrained model's validation loss, the
      // baseline of the run, is the line of step 0 in metrics.jsonl.
      callbacks: [{ type: "fairscale::validate_first" }],
    },
    // The fine-tuned model (the step's result: the best validation's weights) on every block of
    // the held-out split, in this process: the mean loss over the predicted tokens, and perplexity.
    evaluate: {
      type: "fairscale::evaluate",
      model: { type: "ref", ref: "train" },
      dataset_dict: { type: "ref", ref: "data" },
      split: "validation",
      batch_size: p.batch_size,
    },
  },
}
