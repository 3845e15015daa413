"""loraplex.kernels: the multi-LoRA term of a batch whose rows use different adapters.

    batch = LoRABatch.build(token_slots, num_slots)   # once per forward step
    add_lora(y, x, lora_a, lora_b, scaling, batch)     # after each base matmul
"""

from .add_lora import add_lora
from .batch import LoRABatch
from .reference import add_lora_reference

__all__ = ["LoRABatch", "add_lora", "add_lora_reference"]
