"""LoRARequest: vLLM's fields, checked when made, and a msgspec struct that crosses to the core."""

import msgspec
import pytest

from pagedserve import LoRARequest
from pagedserve.core.messages import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams


def test_fields_by_position_and_name_as_vllm_takes_them():
    a = LoRARequest("sql", 1, "/adapters/sql")
    assert a == LoRARequest(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    assert hash(a) == hash(LoRARequest("sql", 1, "/adapters/sql"))


@pytest.mark.parametrize("args, message", [
    (("", 1, "/p"), "lora_name"), (("a", 0, "/p"), "lora_int_id"), (("a", -3, "/p"), "lora_int_id"),
    (("a", True, "/p"), "lora_int_id"), (("a", 1, ""), "lora_path"), (("a", 1.5, "/p"), "lora_int_id"),
])
def test_bad_fields_are_value_errors_naming_them(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_a_request_carries_its_adapter_over_the_wire():
    request = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=3), LoRARequest("sql", 2, "/a"))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.lora_request == LoRARequest("sql", 2, "/a")
    base = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreRequest("r2", [1], SamplingParams())),
                                  type=EngineCoreRequest)
    assert base.lora_request is None
