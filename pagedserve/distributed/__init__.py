"""The tensor-parallel process group the model's layers talk in (`group.py`), on torch.distributed.
The worker processes are in `worker/tp_worker.py`, the executor that drives them in
`executor/tensor_parallel.py`."""
