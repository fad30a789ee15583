"""A small ONNX graph builder: declared inputs/outputs, nodes with stable names, and
initializers converted from torch tensors and streamed to the external-data file."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ort_lora.export.external_data import ONNX_TYPES, ExternalDataWriter

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def to_numpy(tensor, dtype: str, transpose: bool = False) -> np.ndarray:
    """A torch tensor as a contiguous numpy array in `dtype` (bfloat16 as uint16 bits)."""
    import torch

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    t = tensor.detach().to(torch_dtype[dtype])
    if transpose:
        t = t.t()
    t = t.contiguous()
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class GraphBuilder:
    """Collects the nodes, inputs, outputs and initializers of one ONNX graph."""

    def __init__(self, writer: ExternalDataWriter, name: str):
        self.writer, self.name = writer, name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[TensorProto] = []

    def input(self, name: str, elem_type: str, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, ONNX_TYPES[elem_type], shape))
        return name

    def output(self, name: str, elem_type: str, shape: list) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, ONNX_TYPES[elem_type], shape))
        return name

    def initializer(self, name: str, data: np.ndarray, elem_type: str) -> str:
        """Register `data` (already in its final dtype) as initializer `name`."""
        self.initializers.append(self.writer.tensor(name, data, elem_type))
        return name

    def alias(self, name: str, source: str) -> str:
        """Initializer `name` holding the same bytes as initializer `source`: both point at one
        region of the external-data file (nothing is written twice)."""
        proto = TensorProto()
        proto.CopyFrom(next(t for t in self.initializers if t.name == source))
        proto.name = name
        self.initializers.append(proto)
        return name

    def constant_i64(self, name: str, values: list[int]) -> str:
        return self.initializer(name, np.asarray(values, dtype=np.int64), "int64")

    def node(
        self, op: str, inputs: list[str], name: str, *, domain: str = "", n_out: int = 1, **attrs
    ) -> list[str]:
        """Append node `name`; its outputs are named `{name}/output_{i}`."""
        outputs = [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(
            helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs)
        )
        return outputs

    def rename_output(self, node_output: str, graph_output: str) -> None:
        """Make the graph output `graph_output` be produced by the node that wrote `node_output`."""
        for node in self.nodes:
            for i, out in enumerate(node.output):
                if out == node_output:
                    node.output[i] = graph_output
                    return
        raise KeyError(node_output)

    def model(self, opsets: dict[str, int]) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers
        )
        imports = [helper.make_opsetid(domain, v) for domain, v in opsets.items()]
        model = helper.make_model(graph, opset_imports=imports, producer_name="ort-lora")
        model.ir_version = 8
        return model
