"""How repeatable is activation_checkpointing=auto's trial step? The same probe, called again and again in one
process: peak reserved (what the probe returns) and peak allocated, per call."""

import torch

from lm.engine.activation_checkpointing import cuda_trial_probe
from lm.model import ModelConfig

cfg = ModelConfig(vocab_size=32000, n_layer=4, d_model=512, n_head=8, max_seq_len=1024)
probe = cuda_trial_probe(
    cfg, batch_size=8, seq_len=1024, precision="bf16-mixed", liger=False, device=torch.device("cuda")
)
for every in (0, 0, 1, 0, 1, 0):
    reserved = probe(every)
    allocated = torch.cuda.max_memory_allocated()
    print(
        f"every={every} peak reserved {reserved / 2**30:.3f} GiB  peak allocated {allocated / 2**30:.3f} GiB"
    )
