"""Tensor parallelism across processes on torch.distributed: the group a model's layers talk in
(`group.py`), the worker processes (`worker.py`) and the executor that drives them (`executor.py`)."""
