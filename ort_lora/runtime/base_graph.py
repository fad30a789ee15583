"""The base graph: the export without its LoraSGMV nodes, for steps in which no row has an
adapter.

A LoraSGMV node whose rows have no adapter passes its y input through (in place), but ONNX
Runtime still dispatches it and the op still reads its inputs: ~3 us a node, 120 nodes in a
SmolLM2 step, ~9 % of a one-request int4 decode step. The base graph wires each node's y input
to wherever its output was read, so its logits are the export's bit for bit on such steps.

    model = without_lora_nodes(onnx.load(path, load_external_data=False))
    reads_weights_in_place(model)   # True: a second session maps the same weights file

ONNX Runtime maps an export's external weights file into memory rather than copying it, so a
second session over the same file shares the weights' pages with the first. Kernels that
prepack their weights (MLAS's float MatMul, MatMulNBits) copy them per session instead: a base
graph over such weights would hold them twice, so the engine builds one by default only where
every large weight is read in place (the int4 QuantMatMul exports).
"""

from __future__ import annotations

from ort_lora import contract as C

# ONNX Runtime's ops whose CPU kernels read their weight initializers where they lie (no
# prepacked copy); the ort_lora ops never prepack (custom ops have no PrePack).
READ_IN_PLACE = frozenset({"GatherBlockQuantized", "Gather"})


def without_lora_nodes(model):
    """`model` (an onnx ModelProto, changed in place and returned) without LoraSGMV nodes:
    wherever a node's output m was read, its input y_m is read instead
    (C.lora_sgmv_module_inputs), and the graph inputs nothing reads any more are dropped."""
    graph, through = model.graph, {}
    for node in graph.node:
        if node.op_type == "LoraSGMV":
            for m, out in enumerate(node.output):
                through[out] = node.input[C.lora_sgmv_module_inputs(m)[0]]

    def source(name: str) -> str:
        while name in through:  # a node's y may be another node's output
            name = through[name]
        return name

    kept = [n for n in graph.node if n.op_type != "LoraSGMV"]
    for node in kept:
        node.input[:] = [source(name) for name in node.input]
    for out in graph.output:
        out.name = source(out.name)
    read = {name for n in kept for name in n.input}
    inputs = [i for i in graph.input if i.name in read]
    del graph.node[:], graph.input[:]
    graph.node.extend(kept)
    graph.input.extend(inputs)
    return model


def reads_weights_in_place(model) -> bool:
    """True if every weight matrix (initializer of two or more dimensions; norms' vectors and
    scalars are copied cheaply) is read only by ort_lora ops and READ_IN_PLACE ones, so that a
    second session over the same weights file holds no copy of them."""
    weights = {t.name for t in model.graph.initializer if len(t.dims) >= 2}
    return all(
        node.domain == C.OPS_DOMAIN or node.op_type in READ_IN_PLACE
        for node in model.graph.node
        if any(name in weights for name in node.input)
    )
