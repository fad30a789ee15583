"""The ops read each input's type and shape through ONNX Runtime's
GetTensorElementTypeAndShapeDataReference (C API 24, a pointer to the dims) where the runtime
has it, else the API 21 way (an info object, copied and released). The installed runtime takes
the first way in every other test; here the shape, error and value tests of each op run again
with ORT_LORA_ORT_API=21, the second way, which older runtimes take."""

from __future__ import annotations

from pathlib import Path

from rerun_with import assert_passes_with

HERE = Path(__file__).parent
FILES = [
    "test_lora_sgmv.py",
    "test_lora_sgmv_modules.py",
    "test_paged_attention.py",
    "test_paged_attention_errors.py",
    "test_quant_matmul.py",
]
# each op's input checks (shapes, ranks, types, the errors that name them) and value tests on
# several shapes: LoraSGMV of one and of three modules, PagedAttention, QuantMatMul
CASES = (
    "heterogeneous_shapes or optional_inputs or bad_input or bad_inputs or without_adapter_rows"
    " or row_types_of or three_modules or bad_module_inputs or checks_every_y or mixed_batch"
    " or test_sizes or named or refused or test_shapes or leading_dims or splits or empty_rows"
)


def test_shapes_read_the_api_21_way():
    """One subprocess for every file (each start imports ORT and the tests' helpers)."""
    assert_passes_with([str(HERE / f) for f in FILES], CASES, "ORT_LORA_ORT_API", "21")
