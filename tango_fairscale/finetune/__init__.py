"""
What is built on the engine for fine-tuning a language model: a pretrained ``transformers`` model
read unit by unit (:mod:`.pretrained`), LoRA adapters (:mod:`.lora`), text tokenized into blocks
(:mod:`.text_data`), evaluation (:mod:`.evaluate`, :mod:`.validate_first`) and the export back to
``from_pretrained`` (:mod:`.hf_export`).
"""
