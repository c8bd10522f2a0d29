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

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import keras

from tfrecompute.layers.recompute_block import RecomputeBlock

__all__ = ["PrecisionFinding", "block_precision_findings", "check_precision"]

Severity = Literal["error", "warning", "info"]

_SIXTEEN_BIT = ("float16", "bfloat16")
_WIDE = ("float32", "float64")
_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclasses.dataclass(frozen=True)
class PrecisionFinding:
    """One precision problem found by `check_precision`.

    Attributes:
        severity: `"error"` (training will go wrong, e.g. float16 without loss
            scaling), `"warning"` (wasted memory or a precision mismatch) or
            `"info"` (worth knowing, nothing to fix).
        path: the layer concerned, as names from the model down, e.g.
            `"model/recompute_block/dense_3"`.
        message: what is wrong.
        fix: how to fix it.

    Example:

    ```python
    for finding in tfrecompute.check_precision(model):
        print(finding.severity, finding.path, finding.message, finding.fix)
    ```
    """

    severity: Severity
    path: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} Fix: {self.fix}"


# ------------------------------------------------------------------ helpers


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (of type {type(value).__name__})"


def _children(layer: Any) -> list[Any]:
    if isinstance(layer, RecomputeBlock):
        return layer.layers
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _is_input(layer: Any) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def _walk(root: Any, root_path: str) -> list[tuple[Any, str]]:
    """Every layer under `root` once (depth first, call order), with its path."""
    entries: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def visit(layer: Any, path: str) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        entries.append((layer, path))
        for child in _children(layer):
            visit(child, f"{path}/{child.name}")

    visit(root, root_path)
    return entries


def _leaves(root: Any, root_path: str) -> list[tuple[Any, str]]:
    """The layers under `root` that compute themselves (no sublayers, no inputs)."""
    return [
        (layer, path)
        for layer, path in _walk(root, root_path)[1:]
        if not _is_input(layer) and not _children(layer)
    ]


def _compute_dtype(layer: Any) -> str:
    return str(keras.backend.standardize_dtype(layer.dtype_policy.compute_dtype))


def _names(items: list[tuple[Any, str]], limit: int = 3) -> str:
    names = [f"'{layer.name}'" for layer, _ in items[:limit]]
    return ", ".join(names) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _output_leaf(layer: Any) -> Any:
    """The layer that computes the output of `layer` (through blocks and models)."""
    for _ in range(100):  # nesting depth; guards against cycles
        if isinstance(layer, RecomputeBlock):
            layer = layer.layers[-1]
        elif isinstance(layer, keras.Sequential) and layer.layers:
            layer = layer.layers[-1]
        elif isinstance(layer, keras.Model) and len(getattr(layer, "outputs", None) or []) == 1:
            producer = layer.outputs[0]._keras_history.operation
            if producer is layer or _is_input(producer):
                return layer
            layer = producer
        else:
            return layer
    return layer


# ------------------------------------------------------------- block checks


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
    for finding in tfrecompute.precision.block_precision_findings(block):
        print(finding)
    ```
    """
    if not isinstance(block, RecomputeBlock):
        raise TypeError(
            "block_precision_findings: `block` must be a RecomputeBlock. Received: "
            f"block={_describe(block)}. Pass a tfrecompute.RecomputeBlock, or call "
            "tfrecompute.check_precision(model) for a whole model."
        )
    path = path or block.name
    leaves = _leaves(block, path)
    if not leaves:
        return []
    by_dtype: dict[str, list[tuple[Any, str]]] = {}
    for layer, layer_path in leaves:
        by_dtype.setdefault(_compute_dtype(layer), []).append((layer, layer_path))
    findings = []
    if len(by_dtype) > 1:
        summary = "; ".join(f"{dtype}: {_names(items)}" for dtype, items in by_dtype.items())
        findings.append(
            PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"the layers inside block '{block.name}' compute in different dtypes "
                    f"({summary}). Parts of the block run in another precision than the "
                    "rest, and every cast between them runs twice (forward and recompute)."
                ),
                fix=(
                    "Give every layer in the block the same dtype policy, and keep layers "
                    "that must run in float32 (e.g. a final softmax) outside the block."
                ),
            )
        )
    own = _compute_dtype(block)
    if own not in by_dtype:
        inner = ", ".join(by_dtype)
        policies = sorted({layer.dtype_policy.name for layer, _ in leaves})
        findings.append(
            PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"block '{block.name}' has the dtype policy "
                    f"'{block.dtype_policy.name}' (compute dtype {own}) but its layers "
                    f"compute in {inner}. Keras builds the layers from {own} inputs and "
                    f"reports the block's outputs as {own}, which is not what runs."
                ),
                fix=(
                    f"Create the block with its layers' policy, e.g. "
                    f"RecomputeBlock(layers, dtype='{policies[0]}'), or call "
                    "keras.config.set_dtype_policy(...) before creating both."
                ),
            )
        )
    return findings


# ------------------------------------------------------------- model checks


class _Graph:
    """Where the inputs of each block come from, in Functional and Sequential models."""

    def __init__(self, entries: list[tuple[Any, str]], root: Any) -> None:
        self.paths = {id(layer): path for layer, path in entries}
        self.root = root
        # InputLayer -> (model it feeds, index among the model's inputs).
        self.input_owner: dict[int, tuple[Any, int]] = {}
        # Layer -> the layer applied just before it (lists in blocks, Sequential).
        self.previous: dict[int, Any] = {}
        for layer, _ in entries:
            if isinstance(layer, keras.Model):
                for index, tensor in enumerate(self._model_inputs(layer)):
                    producer = tensor._keras_history.operation
                    if _is_input(producer):
                        self.input_owner[id(producer)] = (layer, index)
            sequence = None
            if isinstance(layer, RecomputeBlock) and isinstance(layer.unwrap(), list):
                sequence = layer.layers
            elif isinstance(layer, keras.Sequential):
                sequence = layer.layers
            for before, after in zip(sequence or [], (sequence or [])[1:]):
                self.previous.setdefault(id(after), before)

    @staticmethod
    def _model_inputs(model: Any) -> list[Any]:
        try:
            return list(keras.tree.flatten(model.inputs or []))
        except (AttributeError, ValueError):  # a subclassed or unbuilt model
            return []

    def path(self, layer: Any) -> str:
        return self.paths.get(id(layer), getattr(layer, "name", str(layer)))

    def sources(self, block: RecomputeBlock) -> Iterator[tuple[Any, str, bool]]:
        """(producer, dtype, is_model_input) for each tensor fed to `block`."""
        seen: set[int] = set()
        for node in getattr(block, "_inbound_nodes", []):
            for tensor in node.arguments.keras_tensors:
                yield from self._resolve(tensor, seen, depth=0)
        before = self.previous.get(id(block))
        if before is not None and id(before) not in seen:
            seen.add(id(before))
            leaf = _output_leaf(before)
            yield leaf, _compute_dtype(leaf), False

    def _resolve(self, tensor: Any, seen: set[int], depth: int) -> Iterator[tuple[Any, str, bool]]:
        history = getattr(tensor, "_keras_history", None)
        if history is None or depth > 50:
            return
        producer = history.operation
        if _is_input(producer):
            owner = self.input_owner.get(id(producer))
            nodes = getattr(owner[0], "_inbound_nodes", []) if owner else []
            if owner is not None and owner[0] is not self.root and nodes:
                # The input of a nested model: follow it to the outer graph.
                for node in nodes:
                    outer = node.arguments.keras_tensors
                    if owner[1] < len(outer):
                        yield from self._resolve(outer[owner[1]], seen, depth + 1)
                return
            if id(producer) not in seen:
                seen.add(id(producer))
                yield producer, str(keras.backend.standardize_dtype(tensor.dtype)), True
            return
        if id(producer) in seen:
            return
        seen.add(id(producer))
        if isinstance(producer, (RecomputeBlock, keras.Model)):
            # Keras reports a container's output dtype from its own policy;
            # the layer computing the output knows the real one.
            leaf = _output_leaf(producer)
            yield leaf, _compute_dtype(leaf), False
        else:
            yield producer, str(keras.backend.standardize_dtype(tensor.dtype)), False


def _checkpoint_findings(
    block: RecomputeBlock, path: str, graph: _Graph
) -> Iterator[PrecisionFinding]:
    leaves = _leaves(block, path)
    if not leaves:
        return
    inner = _compute_dtype(leaves[0][0])
    if inner not in _SIXTEEN_BIT:
        return
    for producer, dtype, is_model_input in graph.sources(block):
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
            producer_path = graph.path(producer)
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


def _loss_scale_findings(
    model: Any, path: str, leaves: list[tuple[Any, str]], optimizer: Any, compiled: bool
) -> Iterator[PrecisionFinding]:
    float16 = [(layer, p) for layer, p in leaves if _compute_dtype(layer) == "float16"]
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    global_policy = keras.config.dtype_policy().name
    if not float16:
        if global_policy.startswith("mixed_") and not any(
            _compute_dtype(layer) in _SIXTEEN_BIT for layer, _ in leaves
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
        return
    where = f"{len(float16)} layer(s) compute in float16 (e.g. {_names(float16)})"
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
        if _is_input(layer):
            continue
        if not _children(layer) and not layer.built:
            unbuilt.append((layer, path))
        own = list(layer._trainable_variables) + list(layer._non_trainable_variables)
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
                f"{len(unbuilt)} layer(s) are not built yet (e.g. {_names(unbuilt)}), so "
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
        raise TypeError(
            "check_precision: `model` must be a Keras model or layer. Received: "
            f"model={_describe(model)}. Pass a keras.Model (or a keras.layers.Layer)."
        )
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "check_precision: `optimizer` must be a Keras optimizer or None. Received: "
            f"optimizer={_describe(optimizer)}. Pass an instance such as "
            "keras.optimizers.Adam(), or None to use the compiled model's optimizer."
        )
    compiled = False
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        compiled = optimizer is not None

    root_path = model.name
    entries = _walk(model, root_path)
    leaves = [
        (layer, p) for layer, p in entries[1:] if not _is_input(layer) and not _children(layer)
    ]
    if not leaves and not _is_input(model):
        leaves = [(model, root_path)]
    graph = _Graph(entries, model)

    findings: list[PrecisionFinding] = []
    findings += _loss_scale_findings(model, root_path, leaves, optimizer, compiled)
    for layer, path in entries:
        if isinstance(layer, RecomputeBlock):
            findings += block_precision_findings(layer, path=path)
            findings += _checkpoint_findings(layer, path, graph)
    mixed = keras.config.dtype_policy().name.startswith("mixed_") or any(
        layer.dtype_policy.name.startswith("mixed_") for layer, _ in entries
    )
    if mixed:
        findings += _variable_findings(entries)

    unique = list(dict.fromkeys(findings))
    return sorted(unique, key=lambda finding: _ORDER[finding.severity])
