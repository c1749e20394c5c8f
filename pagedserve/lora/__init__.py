"""Multi-LoRA serving: PEFT adapters on one base model, requests for different adapters (and the
base) in the same step.

- `request.py`: LoRARequest, which names an adapter (vLLM's fields);
- `slots.py`: which adapter each of the model's `max_loras` slots holds, least recently used first out;
- `weights.py`: reading and checking a PEFT adapter directory, cut for a tensor-parallel rank;
- `layers.py`: the slots' stacked A/B on each fused linear, and the batched delta they add;
- `manager.py`: a runner's adapters: loaded off the step loop into host memory, copied into slots.
"""
