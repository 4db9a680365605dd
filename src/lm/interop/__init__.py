"""The model's interfaces to other tools: Hugging Face Llama (export, import, init_from), lm-evaluation-harness, generation."""
