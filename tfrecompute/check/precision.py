"""Mixed precision checks for models with recompute blocks: `check_precision`.

NOTE [ What precision means for a recompute block ]
A `RecomputeBlock` keeps only its inputs (the checkpoints) and runs its layers
again during backprop. Under a mixed policy (`mixed_float16`,
`mixed_bfloat16`) that is only worth its memory if:

1. the checkpoints are 16-bit. A block keeps its input tensor as it receives it
   (the block itself does not cast: it is built with `autocast=False`), so a
   float32 layer in front of a block whose layers compute in bfloat16 makes
   that checkpoint twice as large. Measured here (tensorflow 2.21, keras 3.15,
   CPU): 32 `Dense(256, tanh)` at batch 8192 in 6 blocks under
   `mixed_bfloat16` added 52 MiB per step against 88.5 MiB under float32, and
   76 MiB once a float32 layer fed each block (6 checkpoints x 4 MiB more).
   A float32 *model input* feeding a block costs nothing extra: the step holds
   the batch anyway (52.0 against 52.5 MiB with a bfloat16 input).
2. the layers of one block agree on a precision, so the recompute runs the
   same casts as the forward and Keras's view of the block (its own policy,
   from which it reports the block's output dtype) matches what runs.
3. float16 gradients are loss-scaled (`keras.optimizers.LossScaleOptimizer`);
   without it small gradients underflow to zero. bfloat16 needs no scaling.
4. variables stay float32 under a mixed policy (a layer created with
   `dtype="bfloat16"` instead of `"mixed_bfloat16"` keeps bfloat16 weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras

from tfrecompute._keras_internals import is_functional, keras_history_operation, own_variables
from tfrecompute._messages import fail
from tfrecompute.graph.layer_graph import LayerGraph
from tfrecompute.layers import RecomputeBlock
from tfrecompute.layers.dtypes import (
    PrecisionFinding,
    block_dtype_findings,
    compute_dtype,
    name_list,
)
from tfrecompute.layers.tree import children, is_input, leaves, walk

__all__ = ["PrecisionFinding", "block_precision_findings", "check_precision"]

_SIXTEEN_BIT = ("float16", "bfloat16")
_WIDE = ("float32", "float64")
_ORDER = {"error": 0, "warning": 1, "info": 2}


def block_precision_findings(
    block: RecomputeBlock, *, path: str | None = None
) -> list[PrecisionFinding]:
    """Checks the dtype policies inside one `RecomputeBlock`.

    Warns when the layers inside the block compute in different dtypes, and
    when the block's own policy differs from its layers'. It reads policies
    only, so it works before the block is built; `RecomputeBlock` runs it when
    it is built. `check_precision` runs it for every block of a model, and
    also checks the checkpoints' dtypes, the optimizer and the variables.

    Args:
        block: the block to check.
        path: the block's path in its model; the block's name by default.

    Returns:
        The findings, all of severity `"warning"`; empty when the block is
        consistent.

    Example:

    ```python
    block = tfrecompute.RecomputeBlock(
        [keras.layers.Dense(64, dtype="mixed_bfloat16"), keras.layers.Dense(64)]
    )
    for finding in tfrecompute.check.precision.block_precision_findings(block):
        print(finding)
    ```
    """
    if not isinstance(block, RecomputeBlock):
        fail(
            "block_precision_findings",
            "`block` must be a RecomputeBlock",
            "block",
            block,
            "Pass a tfrecompute.RecomputeBlock, or call tfrecompute.check_precision(model) "
            "for a whole model",
            error=TypeError,
        )
    return block_dtype_findings(block, path or block.name)


# ------------------------------------------------------------- model checks


def _output_leaf(layer: Any) -> Any:
    """The layer that computes the output of `layer` (through blocks and models)."""
    for _ in range(100):  # nesting depth; guards against cycles
        if isinstance(layer, (RecomputeBlock, keras.Sequential)) and layer.layers:
            layer = layer.layers[-1]
        elif isinstance(layer, keras.Model) and len(getattr(layer, "outputs", None) or []) == 1:
            producer = keras_history_operation(layer.outputs[0])
            if producer is layer or is_input(producer):
                return layer
            layer = producer
        else:
            return layer
    return layer


def _graph(layer: Any) -> LayerGraph | None:
    """The layer graph of a built Functional or Sequential model; None for other layers."""
    if not isinstance(layer, keras.Model) or not is_functional(layer) or not layer.built:
        return None
    try:
        return LayerGraph.of(layer)
    except (AttributeError, TypeError, ValueError):  # e.g. a Sequential built without inputs
        return None


class _Sources:
    """Where the inputs of each block come from, read from the models' layer graphs.

    A block called in a Functional or Sequential model takes tensors of that
    model's `LayerGraph`; an input of a nested model is followed to the
    tensors its callers pass. A block inside a list (another block's layers,
    or a Sequential not built yet) takes the output of the layer before it.
    """

    def __init__(self, entries: list[tuple[Any, str]], root: Any) -> None:
        self.paths = {id(layer): path for layer, path in entries}
        self.root = root
        self.graphs: list[LayerGraph] = []
        # Layer -> the layer applied just before it, in a list of layers.
        self.previous: dict[int, Any] = {}
        for layer, _ in entries:
            graph = _graph(layer)
            if graph is not None:
                self.graphs.append(graph)
            elif isinstance(layer, (RecomputeBlock, keras.Sequential)):
                sequence = list(layer.layers)
                for before, after in zip(sequence, sequence[1:]):
                    self.previous.setdefault(id(after), before)
        # A layer -> the (graph, call) pairs that call it.
        self.callers: dict[int, list[tuple[LayerGraph, Any]]] = {}
        for graph in self.graphs:
            for call in graph.calls:
                self.callers.setdefault(id(call.layer), []).append((graph, call))

    def path(self, layer: Any) -> str:
        return self.paths.get(id(layer), getattr(layer, "name", str(layer)))

    def of(self, block: RecomputeBlock) -> Iterator[tuple[Any, str, bool]]:
        """(producer, dtype, is_model_input) for each tensor fed to `block`."""
        seen: set[int] = set()
        for graph, call in self.callers.get(id(block), []):
            for tensor in call.tensor_args:
                yield from self._resolve(graph, tensor, seen, depth=0)
        before = self.previous.get(id(block))
        if before is not None and id(before) not in seen:
            seen.add(id(before))
            leaf = _output_leaf(before)
            yield leaf, compute_dtype(leaf), False

    def _resolve(
        self, graph: LayerGraph, tensor: Any, seen: set[int], depth: int
    ) -> Iterator[tuple[Any, str, bool]]:
        info = graph.tensors.get(id(tensor))
        if info is None or depth > 50:
            return
        if info.producer < 0:
            yield from self._model_input(graph, tensor, seen, depth)
            return
        producer = graph.calls[info.producer].layer
        if id(producer) in seen:
            return
        seen.add(id(producer))
        if isinstance(producer, (RecomputeBlock, keras.Model)):
            # Keras reports a container's output dtype from its own policy;
            # the layer computing the output knows the real one.
            leaf = _output_leaf(producer)
            yield leaf, compute_dtype(leaf), False
        else:
            yield producer, str(keras.backend.standardize_dtype(tensor.dtype)), False

    def _model_input(
        self, graph: LayerGraph, tensor: Any, seen: set[int], depth: int
    ) -> Iterator[tuple[Any, str, bool]]:
        """An input of `graph`'s model: followed to its callers' tensors if it is nested."""
        inputs = [id(t) for t in keras.tree.flatten(graph.model.inputs)]
        callers = self.callers.get(id(graph.model), []) if graph.model is not self.root else []
        if id(tensor) in inputs and callers:
            index = inputs.index(id(tensor))
            for outer, call in callers:
                if index < len(call.inputs):
                    outer_tensor = outer.tensors[call.inputs[index]].tensor
                    yield from self._resolve(outer, outer_tensor, seen, depth + 1)
            return
        producer = keras_history_operation(tensor)
        if producer is not None and id(producer) not in seen:
            seen.add(id(producer))
            yield producer, str(keras.backend.standardize_dtype(tensor.dtype)), True


def _checkpoint_findings(
    block: RecomputeBlock, path: str, sources: _Sources
) -> Iterator[PrecisionFinding]:
    inside = leaves(block, path)
    if not inside:
        return
    inner = compute_dtype(inside[0][0])
    if inner not in _SIXTEEN_BIT:
        return
    for producer, dtype, is_model_input in sources.of(block):
        if dtype not in _WIDE:
            continue
        if is_model_input:
            yield PrecisionFinding(
                severity="info",
                path=path,
                message=(
                    f"block '{block.name}' keeps the model input '{producer.name}' "
                    f"({dtype}) as its checkpoint while its layers compute in {inner}. "
                    "This costs no extra memory (the training step holds the batch "
                    "anyway); the first layer inside casts it in the forward and again "
                    "in the recompute."
                ),
                fix=(
                    "Nothing to do for memory. To feed the block 16-bit data, declare "
                    f"keras.Input(..., dtype='{inner}') and cast the data before training."
                ),
            )
        else:
            producer_path = sources.path(producer)
            policy = getattr(producer, "dtype_policy", None)
            what = f"policy '{policy.name}'" if policy is not None else "an op, not a layer"
            yield PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"block '{block.name}' keeps its input in {dtype}, produced by "
                    f"'{producer_path}' ({what}), while its layers compute in {inner}: "
                    f"this checkpoint takes twice the memory of a {inner} one."
                ),
                fix=(
                    f"Give '{producer.name}' the mixed policy of the block's layers, or move "
                    "it into the block (its output is then recomputed, not kept)."
                    if policy is not None
                    else f"Produce {inner} there (e.g. cast to '{inner}'), or move the op "
                    "into the block."
                ),
            )


def _no_float16_findings(
    model: Any, path: str, leaves: list[tuple[Any, str]], scaled: bool
) -> Iterator[PrecisionFinding]:
    """Findings without float16 layers: an unused mixed policy, needless loss scaling."""
    global_policy = keras.config.dtype_policy().name
    if global_policy.startswith("mixed_") and not any(
        compute_dtype(layer) in _SIXTEEN_BIT for layer, _ in leaves
    ):
        yield PrecisionFinding(
            severity="warning",
            path=path,
            message=(
                f"the global dtype policy is '{global_policy}' but every layer of "
                f"'{model.name}' computes in 32-bit (created before the policy was set, "
                "or with an explicit dtype), so the model trains in full precision."
            ),
            fix=(
                f"Call keras.config.set_dtype_policy('{global_policy}') before creating "
                "the layers, or pass dtype='<policy>' to each layer."
            ),
        )
    if scaled:
        yield PrecisionFinding(
            severity="info",
            path=path,
            message=(
                "the optimizer is a LossScaleOptimizer but no layer computes in "
                "float16; bfloat16 and float32 gradients do not need loss scaling."
            ),
            fix="Use the inner optimizer directly (optimizer.inner_optimizer).",
        )


def _loss_scale_findings(
    model: Any, path: str, leaves: list[tuple[Any, str]], optimizer: Any, compiled: bool
) -> Iterator[PrecisionFinding]:
    float16 = [(layer, p) for layer, p in leaves if compute_dtype(layer) == "float16"]
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if not float16:
        yield from _no_float16_findings(model, path, leaves, scaled)
        return
    where = f"{len(float16)} layer(s) compute in float16 (e.g. {name_list(float16)})"
    if optimizer is None:
        if model.dtype_policy.name == "mixed_float16":
            yield PrecisionFinding(
                severity="info",
                path=path,
                message=(
                    f"{where} and the model is not compiled yet; model.compile will wrap "
                    "its optimizer in a LossScaleOptimizer because the model's own policy "
                    "is 'mixed_float16' (auto_scale_loss=True, the default)."
                ),
                fix="Keep auto_scale_loss=True in model.compile, or pass a LossScaleOptimizer.",
            )
        else:
            yield PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"{where}, but the model's own policy is '{model.dtype_policy.name}', "
                    "so model.compile will not wrap its optimizer in a LossScaleOptimizer: "
                    "small float16 gradients would underflow to zero."
                ),
                fix=("Compile with optimizer=keras.optimizers.LossScaleOptimizer(<optimizer>)."),
            )
        return
    if not scaled:
        source = "the model's optimizer" if compiled else "the optimizer"
        yield PrecisionFinding(
            severity="error",
            path=path,
            message=(
                f"{where}, but {source} ({type(optimizer).__name__}) is not a "
                "LossScaleOptimizer: small float16 gradients underflow to zero and large "
                "ones overflow without the step being skipped."
            ),
            fix=(
                "Wrap it: keras.optimizers.LossScaleOptimizer(optimizer), or compile with "
                "auto_scale_loss=True under a 'mixed_float16' model policy."
            ),
        )


def _variable_findings(entries: list[tuple[Any, str]]) -> Iterator[PrecisionFinding]:
    unbuilt = []
    for layer, path in entries:
        if is_input(layer):
            continue
        if not children(layer) and not layer.built:
            unbuilt.append((layer, path))
        own = own_variables(layer)
        wrong = [
            v
            for v in own
            if keras.backend.is_float_dtype(v.dtype)
            and keras.backend.standardize_dtype(v.dtype) != "float32"
        ]
        if wrong:
            listed = ", ".join(
                f"{v.name} ({keras.backend.standardize_dtype(v.dtype)})" for v in wrong
            )
            yield PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"layer '{layer.name}' (policy '{layer.dtype_policy.name}') has variables "
                    f"that are not float32 under a mixed policy: {listed}. Updates smaller "
                    "than their precision are lost."
                ),
                fix=(
                    "Create the layer with a mixed policy (e.g. dtype='mixed_bfloat16', not "
                    "'bfloat16'), which keeps float32 variables and computes in 16-bit."
                ),
            )
    if unbuilt:
        yield PrecisionFinding(
            severity="info",
            path=entries[0][1],
            message=(
                f"{len(unbuilt)} layer(s) are not built yet (e.g. {name_list(unbuilt)}), so "
                "their variables could not be checked."
            ),
            fix="Call the model on a batch (model(x[:1])) before checking.",
        )


def check_precision(model: keras.layers.Layer, *, optimizer: Any = None) -> list[PrecisionFinding]:
    """Inspects a model's dtype policies for mixed precision with recompute blocks.

    Pure inspection: nothing runs. It walks the model and every nested model
    and block, and reports:

    - `"error"`: layers computing in float16 trained by an optimizer that is
      not a `keras.optimizers.LossScaleOptimizer`. (Keras 3 `model.compile`
      wraps the optimizer itself only when the *model's* policy is
      `mixed_float16`, i.e. the global policy was set before the model was
      created, and `auto_scale_loss=True`.)
    - `"warning"`: layers inside one `RecomputeBlock` computing in different
      dtypes, or a block whose own policy differs from its layers'; a block
      whose input (its checkpoint) arrives in float32 from a layer while its
      layers compute in 16-bit, which doubles that checkpoint's memory (the
      producing layer is named; found from the graph of Functional and
      Sequential models); variables that are not float32 under a mixed
      policy; a global mixed policy that the model's layers do not use.
    - `"info"`: things worth knowing, e.g. a block fed directly by a float32
      model input (no extra memory), or layers not built yet.

    Args:
        model: a Keras model (any nesting), or a single layer or block.
        optimizer: the optimizer to check for loss scaling; by default the
            model's, if it is compiled.

    Returns:
        The findings, errors first, then warnings, then infos; empty when
        nothing was found.

    Example:

    ```python
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((784,)), tfrecompute.RecomputeBlock(...), ...])
    model.compile(optimizer="adam", loss="mse")  # wrapped in a LossScaleOptimizer
    for finding in tfrecompute.check_precision(model):
        print(f"{finding.severity}: {finding.path}: {finding.message} {finding.fix}")
    ```
    """
    if not isinstance(model, keras.layers.Layer):
        fail(
            "check_precision",
            "`model` must be a Keras model or layer",
            "model",
            model,
            "Pass a keras.Model (or a keras.layers.Layer)",
            error=TypeError,
        )
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        fail(
            "check_precision",
            "`optimizer` must be a Keras optimizer or None",
            "optimizer",
            optimizer,
            "Pass an instance such as keras.optimizers.Adam(), or None to use the compiled "
            "model's optimizer",
            error=TypeError,
        )
    compiled = False
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        compiled = optimizer is not None

    root_path = model.name
    entries = walk(model, root_path)
    leaves = [(layer, p) for layer, p in entries[1:] if not is_input(layer) and not children(layer)]
    if not leaves and not is_input(model):
        leaves = [(model, root_path)]
    sources = _Sources(entries, model)

    findings: list[PrecisionFinding] = []
    findings += _loss_scale_findings(model, root_path, leaves, optimizer, compiled)
    for layer, path in entries:
        if isinstance(layer, RecomputeBlock):
            findings += block_precision_findings(layer, path=path)
            findings += _checkpoint_findings(layer, path, sources)
    mixed = keras.config.dtype_policy().name.startswith("mixed_") or any(
        layer.dtype_policy.name.startswith("mixed_") for layer, _ in entries
    )
    if mixed:
        findings += _variable_findings(entries)

    unique = list(dict.fromkeys(findings))
    return sorted(unique, key=lambda finding: _ORDER[finding.severity])
