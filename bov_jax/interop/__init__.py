"""Interop with the authors' PyTorch code: their checkpoints and .npz files (`checkpoints`),
the torch .pt zip format read without torch (`torch_format`) and the restricted unpickler it
and the tiktoken tokenizer use (`safe_pickle`). `python -m bov_jax.interop import|export`."""
