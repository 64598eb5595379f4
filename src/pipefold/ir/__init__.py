"""The schedule IR: actions, kinds, placements, per-device action lists, their file formats, validation.

An action is one pass of one microbatch through one stage, or work of a whole stage::

    0F3      forward of stage 0, microbatch 3
    2B3      backward of stage 2 for its input only (the input gradient)
    2W3      backward of stage 2 for its weights only
    1BW0     fused full backward (B and W at once)
    0F3+5B1  an overlapped pair: 0F3 and 5B1 run together (DualPipe's F&B overlap)
    3R       all-reduce of stage 3's gradients between the devices holding a replica of it
    3OPT     optimizer step of stage 3
    3DP      all-reduce of stage 3's gradients across the data-parallel copies of the whole pipeline
    3AG      all-gather of stage 3's parameters from its sharded data-parallel copies (FSDP), before its forwards
    3RS      reduce-scatter of stage 3's gradients to its sharded copies (FSDP); frees the gathered parameters
    1KA2     K-FAC curvature of stage 1 from microbatch 2's layer inputs (the A factors)
    1KG2     K-FAC curvature of stage 1 from microbatch 2's output gradients (the G factors)
    1KI      K-FAC inversion of stage 1's factors
    1KP      K-FAC preconditioning of stage 1's gradient, before its optimizer step
    0OF3     offload of microbatch 3's activations of stage 0 to host memory (after its forward)
    0RL3     reload of them to the device (before its backward)
    2S5      vocabulary forward of device 2's shard of the output layer for microbatch 5 (Vocabulary Parallelism)
    2T5      vocabulary backward of device 2's shard of the output layer for microbatch 5

What each kind waits for, what it completes, what it costs and how it changes
memory is written once, in :data:`KINDS`; validation, the simulator, the
runtime and the block expansion all read it there. :func:`register_kind` adds
a kind (custom work such as K-FAC's curvature) without touching any of them.

A schedule lists, for each **device**, the actions it runs in order. The
model is cut into **stages** 0 -> 1 -> ... -> S-1. The placement says which
device holds which stage; with several **replicas** (Chimera, DualPipe) a stage
lives on several devices, each replica with its own copy of the parameters,
and each microbatch is routed through one replica.

The package is read through this module; its parts: :mod:`.kinds` (the kind table and actions),
:mod:`.schedule` (placements, the schedule and its forms), :mod:`.formats` (one ``load``, ``dumps`` and ``save``
for every file format, torch's CSV included), :mod:`.graph` (dependencies, validation, the error grid),
:mod:`.interop` (torch.distributed.pipelining's orders) and :mod:`.ref` (a schedule's name with its options).
"""

from pipefold.ir.formats import FORMATS, dumps, format_of, load, read_schedule_text, save
from pipefold.ir.graph import Graph, Transfer, dependency_graph, render_grid, validate
from pipefold.ir.kinds import (
    AG,
    BW,
    DP,
    KA,
    KG,
    KI,
    KINDS,
    KP,
    MAX_DEVICES,
    MAX_STAGE_MICROBATCHES,
    NO_MICROBATCH,
    OF,
    OPT,
    PASSES,
    RL,
    RS,
    Action,
    B,
    F,
    Kind,
    KindSpec,
    R,
    S,
    T,
    W,
    check_size,
    overlap,
    register_kind,
)
from pipefold.ir.schedule import (
    SEQ_CHUNKS,
    VOCAB,
    ActionRows,
    Schedule,
    describe_placement,
    linear_placement,
    looped_placement,
    parse_placement,
    reversed_placement,
    v_placement,
)

__all__ = [
    "AG", "B", "BW", "DP", "F", "FORMATS", "KA", "KG", "KI", "KINDS", "KP", "MAX_DEVICES", "MAX_STAGE_MICROBATCHES",
    "NO_MICROBATCH", "OF", "OPT", "PASSES", "RL", "RS", "S", "SEQ_CHUNKS", "T", "VOCAB", "W", "Action", "ActionRows",
    "Graph", "Kind",
    "KindSpec", "R",
    "Schedule",
    "Transfer", "check_size", "dependency_graph", "describe_placement", "dumps", "format_of", "linear_placement",
    "load", "looped_placement", "overlap", "parse_placement", "read_schedule_text", "register_kind", "render_grid",
    "reversed_placement", "save", "v_placement", "validate",
]
