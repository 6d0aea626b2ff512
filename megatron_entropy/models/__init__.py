"""Megatron GPT models built from HF configs and the HF <-> Megatron weights between them.
Nothing is imported here: the torch-free parts (``arch``, ``tokenizer_files``, ``lora_settings``)
load without Megatron."""
