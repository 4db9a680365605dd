"""lm: pretrain Llama-style language models for the least money per unit of loss."""

__version__ = "0.1.0"
