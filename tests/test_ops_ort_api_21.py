"""The ops read each input's type and shape through ONNX Runtime's
GetTensorElementTypeAndShapeDataReference (C API 24, a pointer to the dims) where the runtime
has it, else the API 21 way (an info object, copied and released). The installed runtime takes
the first way in every other test; here the shape, error and value tests of each op run again
with ORT_LORA_ORT_API=21, the second way, which older runtimes take."""

from __future__ import annotations

from pathlib import Path

import pytest
from rerun_with import assert_passes_with

HERE = Path(__file__).parent
CASES = {
    "test_lora_sgmv.py": "heterogeneous_shapes or optional_inputs or bad_input or bad_inputs "
    "or without_adapter_rows or row_types_of",
    "test_lora_sgmv_modules.py": "three_modules or bad_module_inputs or checks_every_y",
    "test_paged_attention.py": "mixed_batch or sizes",
    "test_paged_attention_errors.py": "named or refused",
    "test_quant_matmul.py": "shapes or leading_dims or splits or bad_inputs or empty_rows",
}


@pytest.mark.parametrize("test_file", sorted(CASES))
def test_shapes_read_the_api_21_way(test_file):
    assert_passes_with(str(HERE / test_file), CASES[test_file], "ORT_LORA_ORT_API", "21")
