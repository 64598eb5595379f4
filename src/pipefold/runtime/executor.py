"""One rank's side of a training step: run its action list, talk to its neighbours, record what happened.

The rank reads the schedule only through the IR: for each action in its list,

    F  (s, j)  input from stage s-1 (local, or received), run, send the output on to stage s+1
    B  (s, j)  gradient from stage s+1 (local, or received), input gradient only, send it to stage s-1
    W  (s, j)  weight gradient from what B kept
    BW (s, j)  both at once

Receives for the next few actions are posted before the current one runs, so
transfers overlap compute; each send is dropped as soon as it is delivered
(see :mod:`pipefold.runtime.comm`). Before each action the rank also waits
for the sends that the schedule says were received by then (an earlier
action of this rank depends on the action that received them), so the bytes
in flight on a link never exceed :func:`in_flight_bound` messages.
Gradients are scaled by 1/M on the loss, so after the step they equal the
gradients of the mean loss over the whole batch.

Each neighbour's receives are posted in the order that neighbour sends, which
the schedule fixes (its action list), not in the order this rank needs them:
NCCL pairs the messages between two ranks by order alone. A message this rank
needs late may so be received early; its buffer waits in the inbox.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipefold.errors import ConfigError
from pipefold.ir import KINDS, Action, Graph, Kind, Schedule, dependency_graph
from pipefold.plan.spb import receivers, ring_bytes
from pipefold.runtime import sharding
from pipefold.runtime.clock import ANCHOR
from pipefold.runtime.comm import (
    BACKWARD,
    FORWARD,
    HEADER,
    FlatAllReduce,
    Incoming,
    Links,
    Meta,
    ThenBroadcast,
    decode_header,
    metas_of,
)
from pipefold.runtime.experts import EXPERT, REPLICAS, Baton, ExpertLink, expert_link, exposed

if TYPE_CHECKING:
    from pipefold.runtime.partial import Reduction
    from pipefold.sim.network import Network
from pipefold.runtime.activation_offload import HostCopies
from pipefold.runtime.meter import MemoryMeter
from pipefold.runtime.precision import grad_holder
from pipefold.runtime.seqchunks import sequence_chunks
from pipefold.runtime.stage import Boundaries, StageRunner, Tensors
from pipefold.runtime.structure import decode_spec, encode_spec
from pipefold.runtime.vocab import EmbeddingPasses, VocabPasses, VocabShard
from pipefold.runtime.watch import Activity

LOOKAHEAD = 2  # actions whose receives are posted ahead of time: this one and the next
"""The kinds the runtime runs (an overlapped pair runs its parts on two streams of a GPU, elsewhere one after the
other; OPT with optimizers; other
kinds with a :class:`StepWork` that runs them)."""
COMPUTE_KINDS = frozenset(k for k, spec in KINDS.items() if spec.computes and not spec.composite)
"""The event kinds that are computation (busy time, K-FAC's work included); the rest is waiting and
communication."""


class StepWork(Protocol):
    """Work of kinds beyond the passes (K-FAC's: :class:`pipefold.runtime.curvature.RankCurvature`)."""

    kinds: frozenset[str]

    def begin(self, actions: Sequence[Action], meter: MemoryMeter) -> None:
        """A step of this rank starts, with these actions; what it keeps is shown to ``meter``."""

    def forward(self, action: Action) -> AbstractContextManager[Any]:
        """Entered around every forward this rank runs."""

    def run(self, action: Action) -> None:
        """Run one action of its kinds."""

    def state(self) -> list[torch.Tensor]:
        """The tensors it keeps from step to step, like an optimizer's state (not a step's memory)."""


@dataclass
class Event:
    """One interval of the measured timeline, in seconds from the step's start."""

    name: str
    kind: str
    start: float
    end: float
    cpu: float | None = None
    """An action's CPU seconds on the executor's thread (the operating system's count, ``time.thread_time``), on
    the CPU: beside ``end - start`` it says how long the action waited for a core, an account independent of the
    host clock. None on a GPU, and for waits."""


@dataclass
class StepStats:
    """What one rank measured during one step."""

    rank: int
    losses: dict[int, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    busy: float = 0.0
    wall: float = 0.0
    """Seconds of the schedule: from the step's start to its last action's end and its sends' delivery."""
    update: float = 0.0
    """Seconds after the schedule until the step is over: offloaded and tied weights home, the gradients' check,
    the optimizer step (and ZeRO-1's sharing of the stepped parameters). The step took ``wall + update``."""
    cpu: float = 0.0
    """CPU seconds the rank's process spent in the step, by the operating system's count (``time.process_time``,
    every thread): a check on ``busy`` that does not rely on the runtime's own events."""
    peak_activation_bytes: int = 0
    """The most bytes held at once, each storage counted once: tensors saved for backward, outputs, gradients
    kept for W, receive buffers and sends not yet delivered (see :mod:`pipefold.runtime.meter`)."""
    peak_by_kind: dict[str, int] = field(default_factory=dict)
    """What the bytes at the peak were, by kind ("saved", "output", "captured", "recv", "send", "kfac", "vocab")."""
    batch_bytes: int = 0
    """Bytes of the batch this rank reads (inputs and targets), which exist before the step: not in the peak."""
    memory_curve: list[tuple[float, int]] = field(default_factory=list)
    """(seconds from the step's start, bytes held from then on)."""
    started_at: float = 0.0
    """Wall-clock time of the step's start, the moment ``wall`` counts from (:mod:`pipefold.runtime.clock`), to
    line ranks up in a trace."""
    stage_memory: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """Per stage of this rank, the most bytes one microbatch held after its F, while its B ran, and between its
    B and its W (the last two 0 where the stage ran no B)."""
    offloaded: dict[int, int] = field(default_factory=dict)
    """Per stage of this rank that offloads activations (``OF``), the most bytes one microbatch's offload moved."""
    host_peak_bytes: int = 0
    """The most bytes of offloaded activations in host memory at once during the step."""
    state_bytes: tuple[int, int] | None = None
    """With model-state chunks: the bytes of optimizer state this rank's chunks held after the step on the device
    and in host memory (the host's with their float32 parameters and gradients)."""
    link_bytes: dict[int, int] = field(default_factory=dict)
    """Per peer this rank sends to, the most bytes in flight at once on that link."""
    link_message_bytes: dict[int, int] = field(default_factory=dict)
    """Per peer, the largest message (one microbatch's tensors) sent on that link."""
    sent: dict[int, int] = field(default_factory=dict)
    """Bytes this rank sent to each process-group rank in the step (activations and gradients; between meshes of
    several ranks, its pieces of them: :func:`pipefold.runtime.comm.routes`)."""
    gathered: int = 0
    """Bytes this rank received from its own mesh's ranks in the step, all-gathering what crossed in pieces."""
    dp_sent: Fraction = Fraction(0)
    """Bytes this rank sent in the step's data-parallel reduction of its gradients (``DP`` actions), by the closed
    form of :func:`pipefold.plan.spb.dp_bytes`: a ring all-reduce of ``S`` bytes among ``c`` ranks sends
    ``2 (c - 1) / c * S`` from each (exact, hence a fraction), a broadcast ``S`` from its source to each receiver."""
    dp_layer_bytes: dict[int, int] = field(default_factory=dict)
    """With structured partial backpropagation: per layer of this rank, the bytes of its gradients the step's
    data-parallel reduction moved (on a copy that did not compute it, received)."""
    memory_check: dict[str, int] = field(default_factory=dict)
    """In a step measured a second way (``Job.verify_memory_step``), by torch's MemTracker: the meter's and
    the tracker's largest level after an action, their largest difference there, the tracker's peak over
    the whole step (temporaries included), all on the rank's device; the tracker's largest level on other devices
    (on a GPU, the messages staged through host memory); on CUDA, the allocator's (see ``rank._tracked_step``)."""
    exchanges: dict[str, float] = field(default_factory=dict)
    """With expert parallelism: seconds of expert all-to-alls in each pass that ran some, by action (``2F5``)."""
    exchange_exposed: float = 0.0
    """... and the seconds of them that nothing computed under (all of them outside overlapped pairs)."""
    messages: list[tuple[str, int, int]] = field(default_factory=list)
    """With message logging on: every send and receive as posted, ("send" or "recv", peer, tag)."""
    link_samples: dict[int, list[tuple[int, int, float, float]]] = field(default_factory=dict)
    """Per peer this rank sends to, (tag, bytes, posted, delivered) of each message, wall-clock seconds."""
    recv_posted: dict[int, dict[int, float]] = field(default_factory=dict)
    """Per peer this rank receives from, when it posted the receive of each message, by tag (wall-clock)."""
    schedule: str = ""
    """The schedule that ran this step, as a spec (``kfkb:k=2``): it changes between steps with ``adaptive``."""
    predicted: float | None = None
    """What the policy that chose this step's schedule predicted its step time to be, seconds."""
    loss: float = math.nan
    """The mean loss of the step over every microbatch of every pipeline (all ranks agree on it: it comes with the
    global gradient check's all-reduce); NaN in a bad step."""
    grad_norm: float = 0.0
    """The global gradient norm of the step (every rank's gradients, each stage once), before any clipping;
    NaN or inf in a bad step."""
    skipped: bool = False
    """The loss or a gradient was NaN or inf: the optimizer did not step (see :mod:`pipefold.runtime.numerics`)."""
    clipped: bool = False
    """The gradients were scaled down to the clipping norm."""
    rolled_back: bool = False
    """The optimizer had stepped before the global check (post-validation, or a schedule's OPT actions) and the
    step was undone: to be skipped, or redone with clipped gradients."""
    loss_scale: float | None = None
    """The loss scale the step ran with (fp16 with a loss scale; None without one)."""
    checked: bool = False
    """The step ran checked as well: its memory measured a second way (``Job.verify_memory_step``: torch's
    MemTracker around every operation) or its gradients kept for ``--check`` (``Job.save_grads_of_step``). Such a
    step takes longer than a plain one, so no timing reads it (:meth:`pipefold.runtime.history.StepHistory.timed`)."""


def kind_times(steps: Sequence[StepStats]) -> dict[int, dict[str, float]]:
    """Per stage, the median seconds of each kind of computing action in ``steps`` (any ranks, any steps)."""
    seconds: dict[tuple[int, str], list[float]] = {}
    for st in steps:
        for e in st.events:
            if e.kind in COMPUTE_KINDS:
                seconds.setdefault((Action.parse(e.name).stage, e.kind), []).append(e.end - e.start)
    out: dict[int, dict[str, float]] = {}
    for (stage, kind), values in sorted(seconds.items()):
        out.setdefault(stage, {})[kind] = statistics.median(values)
    return out


def exchange_times(steps: Sequence[StepStats]) -> dict[int, tuple[float, float]]:
    """Per stage that exchanged with other ranks' experts, the median seconds of the exchanges of one forward and
    of one backward (B or BW) in ``steps``."""
    seconds: dict[tuple[int, bool], list[float]] = {}
    for st in steps:
        for name, spent in st.exchanges.items():
            action = Action.parse(name)
            seconds.setdefault((action.stage, action.kind != Kind.F), []).append(spent)
    return {stage: (statistics.median(seconds.get((stage, False), [0.0])),
                    statistics.median(seconds.get((stage, True), [0.0])))
            for stage in sorted({s for s, _ in seconds})}


@dataclass(frozen=True)
class _Message:
    """One message a neighbour sends: a header (the shapes of a stage's input) or one microbatch's tensors."""

    direction: int  # FORWARD (activations), BACKWARD (gradients) or HEADER
    stage: int  # the stage that receives it
    microbatch: int


def messages_between(schedule: Schedule, src: int, dst: int, *, headers: bool,
                     graph: Graph | None = None) -> list[_Message]:
    """What rank ``src`` sends rank ``dst`` in one step, in the order it sends it.

    Every input that crosses from ``src`` to ``dst`` (:meth:`pipefold.ir.Graph.transfers`) is a
    message: an activation (pass F) or a gradient (pass B), named by the stage that takes it. In a
    step whose shapes are new (``headers``), a header for that stage goes before its first activation.
    """
    return [msg for _, msg in _sends(schedule, src, dst, headers=headers, graph=graph)]


def _sends(schedule: Schedule, src: int, dst: int, *, headers: bool,
           graph: Graph | None = None) -> list[tuple[int, _Message]]:
    """:func:`messages_between`, each message with the position of the action of ``src`` that sends it."""
    graph = dependency_graph(schedule) if graph is None else graph
    out: list[tuple[int, _Message]] = []
    headed: set[int] = set()
    for t in graph.transfers():
        if (t.src, t.dst) != (src, dst):
            continue
        direction = FORWARD if t.pass_ == "F" else BACKWARD
        if direction == FORWARD and headers and t.to_stage not in headed:
            headed.add(t.to_stage)
            out.append((t.src_position, _Message(HEADER, t.to_stage, 0)))
        out.append((t.src_position, _Message(direction, t.to_stage, t.microbatch)))
    return out


def received_by(schedule: Schedule, rank: int, *, headers: bool,
                reach: list[int] | None = None, graph: Graph | None = None) -> dict[int, list[int]]:
    """For each peer ``rank`` sends to: before its i-th action, how many of those sends have surely arrived.

    A send has arrived once the peer's action that consumes it has started; any action of
    ``rank`` that depends on that one, through the schedule's own dependencies, starts later.
    So the count before position i is the longest run of first messages whose consumer is
    an ancestor of one of ``rank``'s actions before i (``rank``'s list has ``len + 1``
    positions: the last is the step's end). ``reach`` is :func:`_reach` of ``rank``, when known.
    """
    graph = dependency_graph(schedule) if graph is None else graph
    n = len(schedule.actions[rank])
    reach = _reach(graph, rank) if reach is None else reach
    consumer = {(t.pass_ == "F", t.to_stage, t.microbatch): graph.gid(t.dst, t.dst_position)
                for t in graph.transfers()}
    out: dict[int, list[int]] = {}
    for peer in sorted({t.dst for t in graph.transfers() if t.src == rank}):
        messages = messages_between(schedule, rank, peer, headers=headers, graph=graph)
        arrived = []
        for k, msg in enumerate(messages):
            nxt = messages[k + 1] if msg.direction == HEADER else msg  # a header arrives with its first message
            arrived.append(reach[consumer[nxt.direction == FORWARD, nxt.stage, nxt.microbatch]])
        counts = [0] * (n + 1)
        for k, position in enumerate(arrived):
            counts[position] = max(counts[position], k + 1)
        for i in range(1, n + 1):
            counts[i] = max(counts[i], counts[i - 1])
        out[peer] = counts
    return out


def _reach(graph: Graph, rank: int) -> list[int]:
    """For each action (by global number): the first position of ``rank`` that depends on it (``len``: none)."""
    rows = graph.schedule.actions
    n = len(rows[rank])
    consumers: list[list[int]] = [[] for _ in range(graph.schedule.num_actions)]
    for g, ins in enumerate(graph.inputs):
        for i in ins:
            consumers[i].append(g)
    reach = [n] * graph.schedule.num_actions
    computed = bytearray(graph.schedule.num_actions)

    def own(g: int) -> int:
        d, i = graph.where(g)
        if d == rank:
            return i
        best = reach[g + 1] if i + 1 < len(rows[d]) else n
        return min([best] + [reach[c] for c in consumers[g] if computed[c]])

    for g in reversed(graph.order):
        if computed[g]:
            continue
        group = graph.peers.get(g, (g,))  # a collective's members start together: each reaches what any does
        best = min(own(m) for m in group)
        for m in group:
            reach[m] = best if graph.where(m)[0] != rank else graph.where(m)[1]
            computed[m] = 1
    return reach


def in_flight_bound(schedule: Schedule, rank: int, *, headers: bool = False) -> dict[int, int]:
    """Per peer, the most messages ``rank`` can have in flight to it at once, from the schedule alone.

    During action i the sends posted so far, less those :func:`received_by` settles before i.
    """
    out: dict[int, int] = {}
    graph = dependency_graph(schedule)
    for peer, counts in received_by(schedule, rank, headers=headers, graph=graph).items():
        sent = [0] * len(schedule.actions[rank])
        for i, _ in _sends(schedule, rank, peer, headers=headers, graph=graph):
            sent[i] += 1
        out[peer] = max((total - counts[i] for i, total in enumerate(itertools.accumulate(sent))), default=0)
    return out


class _Inbox:
    """The receives from one neighbour in one step: posted strictly in its send order."""

    def __init__(self, src: int, messages: list[_Message]) -> None:
        self.src, self.messages = src, messages
        self.position = {msg: i for i, msg in enumerate(messages)}
        self.next = 0  # messages[:next] have been posted
        self.posted: dict[_Message, Incoming] = {}  # posted, not yet taken
        self.headers: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # stage -> its header's receive


class RankExecutor:
    """Runs one rank's actions of ``schedule`` on its stage modules, step after step."""

    def __init__(self, schedule: Schedule, rank: int, modules: Mapping[int, nn.Module],
                 loss_fn: Callable[..., torch.Tensor], device: torch.device, *,
                 recompute: Mapping[int, int] | None = None, log_messages: bool = False,
                 timeout: float | None = None, optimizers: Mapping[int, Callable[[], Any]] | None = None,
                 network: Network | None = None, origin: float = 0.0, work: StepWork | None = None,
                 pipelines: Sequence[Sequence[int | None]] | None = None, pipeline: int = 0,
                 meshes: Sequence[Sequence[int]] | None = None, tp_index: int = 0, tp_group: Any = None,
                 dp_group: Any = None, sharded: bool = False, activity: Activity | None = None, staged: bool = False,
                 overlap: bool = True, boundaries: Boundaries | None = None,
                 spb: Reduction | None = None,
                 new_group: Callable[[list[int]], Any] | None = None, autocast: torch.dtype | None = None,
                 vocab: VocabShard | None = None, embedding: VocabShard | None = None) -> None:
        self.schedule, self.rank, self.device = schedule, rank, device
        self.loss_scale = 1.0
        """What the last stage's loss is multiplied by before the backwards (an fp16 run's loss scale, set before
        each step: :mod:`pipefold.runtime.precision`)."""
        self.infer = schedule.is_forward_only
        """A forward-only schedule (evaluation, inference): its forwards run without autograd and keep nothing."""
        self.boundaries = boundaries if boundaries is not None else Boundaries()
        """The structure of each stage's input (:mod:`pipefold.runtime.structure`), shared with the runners."""
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda and overlap else None
        """On a GPU: the stream an overlapped pair's forward runs on while its backward runs on the compute stream
        (None: the parts run one after the other)."""
        if self._side is not None and any(a.parts for a in schedule.actions[rank]):
            _accumulate_across_streams()
        self._losses: dict[int, torch.Tensor] = {}  # the step's losses, by microbatch, read at its end
        self.outputs: dict[int, Any] = {}
        """A forward-only step's outputs of the last stage, by microbatch (on the rank that holds it)."""
        self.activity = activity if activity is not None else Activity(rank)
        """What the rank is doing, for the job's watch (:mod:`pipefold.runtime.watch`): each action, each wait."""
        self._experts: ExpertLink | None = expert_link(modules.values())
        """The expert exchanges of this rank's MoE layers where their experts are spread (expert parallelism)."""
        self._held: list[tuple[float, float]] = []
        """When the parts of this step's overlapped pairs computed (held the baton), by ``time.perf_counter``."""
        self.meter = MemoryMeter()
        self.host_copies = HostCopies(device)
        """The activations this rank's OF actions moved to host memory (:mod:`pipefold.runtime.activation_offload`)."""
        last = schedule.stages - 1
        recompute = recompute or {}
        self.actions = list(schedule.actions[rank])
        split = {a.stage for act in self.actions for a in act.passes if a.kind == Kind.B}
        self.runners = {
            s: StageRunner(m, loss_fn=loss_fn if s == last and not schedule.vocab else None, meter=self.meter,
                           recompute=recompute.get(s, 0),
                           input_grads=s > 0 or embedding is not None, split=s in split, stage=s,
                           boundaries=self.boundaries,
                           autocast=autocast)
            for s, m in modules.items()
        }
        if schedule.seq_chunks > 1:  # each stage's chunks share their keys and values
            for s, runner in self.runners.items():
                runner.chunks = sequence_chunks(modules[s], schedule.seq_chunks)
        self.optimizers = dict(optimizers or {})
        """Per stage, what its OPT action calls: its optimizer's step."""
        self.work = work
        self.dp_group = dp_group
        """The process group of this rank's stages' copies in the data-parallel pipelines (``DP`` actions)."""
        self.spb = spb
        """With structured partial backpropagation: how the ``DP`` actions reduce each gradient among the copies
        that computed its layer (None: every gradient over every copy)."""
        self.sharded = sharded
        """The stage modules are sharded across the data-parallel pipelines (FSDP: ``AG`` and ``RS`` actions)."""
        self._handlers = self._handler_table()
        """What runs each kind of simple action this rank can run (a kind is one entry here)."""
        runs = set(self._handlers)
        unknown = sorted({a.kind for act in self.actions for a in act.passes} - runs)
        if unknown:
            raise ConfigError(f"the runtime cannot run {', '.join(unknown)} actions ("
                              f"{'; '.join(KINDS[k].doc for k in unknown)}); it runs {', '.join(sorted(runs))}"
                              + ("" if self.optimizers else ", and OPT when given an optimizer per stage")
                              + ("" if work else ", and K-FAC's when training with K-FAC (--optimizer kfac)")
                              + ("" if dp_group is not None else ", and DP with data-parallel pipelines (--dp)")
                              + ("" if sharded else ", and AG and RS with sharded ones (--dp with --fsdp)"))
        graph = dependency_graph(schedule)
        # ``rank`` is this rank's device in its pipeline; ``pipelines`` give every pipeline's process-group ranks
        # (None on a device with fewer tensor-parallel ranks); ``meshes`` each device's ranks in this rank's copy.
        pipelines = pipelines or [list(range(schedule.devices))]
        self.links = Links(schedule.stages, schedule.microbatches, device, self.meter, log=log_messages,
                           timeout=timeout, network=network, rank=rank, origin=origin, meshes=meshes, index=tp_index,
                           group=tp_group, staged=staged)
        self._in_meta: dict[int, tuple[Meta, ...]] = {}  # stage -> metas of its input, when received
        self._out_meta: dict[int, tuple[Meta, ...]] = {}  # stage -> metas of its output
        self._last_shape: Any = None
        self._headers_sent: set[int] = set()  # stages whose input header went out this step
        neighbours = sorted({t.src for t in graph.transfers() if t.dst == rank})
        # What each neighbour sends, in its order: in a step with new shapes (headers first), and in any other.
        self._expected = {new: {src: messages_between(schedule, src, rank, headers=new, graph=graph)
                                for src in neighbours} for new in (True, False)}
        self._inboxes: dict[int, _Inbox] = {}
        # Which rank sends each message this rank's actions take in, and before each action the messages whose
        # receives are posted by then: this action's and the next ones' (the same every step).
        needs = [self._remote_messages(a) for a in self.actions]
        self._source = {(msg.direction, msg.stage, msg.microbatch): src for each in needs for src, msg in each}
        self._ahead = [[w for each in needs[i:i + LOOKAHEAD] for w in each] for i in range(len(needs))]
        # Before each action, how many sends to each peer have surely arrived (with and without headers).
        reach = _reach(graph, rank)  # the same dependencies in both kinds of step
        self._received = {new: received_by(schedule, rank, headers=new, reach=reach, graph=graph)
                          for new in (True, False)}
        # The replicas of a stage all-reduce their gradients in a group of their own (made in the same order on
        # every rank, as torch.distributed requires, even by ranks that are not in it).
        self._groups: dict[int, Any] = {}
        for q, ranks in enumerate(pipelines):
            for s in range(schedule.stages):
                holders = schedule.holders(s)
                if len(holders) > 1 and all(ranks[h] is not None for h in holders):  # holders share a degree
                    group = (new_group or dist.new_group)(sorted(r for h in holders if (r := ranks[h]) is not None))
                    if q == pipeline and rank in holders:
                        self._groups[s] = group
        # stage -> its reductions (all-reduces, SPB's broadcasts), until waited for
        self._reductions: dict[int, list[FlatAllReduce | ThenBroadcast]] = {}
        self.grads_moved = 0
        """Bytes of gradients this step moved into an all-reduce's buffer (new storages that are still theirs)."""
        self.dp_sent = Fraction(0)
        """Bytes this rank sent this step in the data-parallel reduction (:attr:`StepStats.dp_sent`)."""
        self.dp_layer_bytes: dict[int, int] = {}
        """With SPB: per layer, the bytes of its gradients this step's data-parallel reduction moved."""
        self._gathers: dict[int, Any] = {}  # stage -> its parameters' all-gather (AG), until its first forward
        self.gathered: dict[int, int] = {}
        """Per FSDP stage, the bytes of its parameters gathered whole and their gradients at its last ``RS``."""
        self.vocab: VocabPasses | None = None
        """With the output layer split by vocabulary (:attr:`Schedule.vocab`): this rank's shard and its passes."""
        self.embedding: EmbeddingPasses | None = None
        """With the input embedding split by vocabulary too: this rank's rows of it and their lookups."""
        if schedule.vocab:
            self.vocab = self._vocab_passes(vocab, pipelines, pipeline)
            if embedding is not None:
                members = [int(r) for r in pipelines[pipeline] if r is not None]
                self.embedding = EmbeddingPasses(embedding, rank=rank, ranks=members, first=schedule.device_of(0),
                                                 group=dist.new_group(members, use_local_synchronization=True),
                                                 meter=self.meter)
        elif embedding is not None:
            raise ConfigError(f"embedding= splits the input embedding by vocabulary, with the output layer: name a "
                              f"schedule with vocab=1 (e.g. '{schedule.name}:vocab=1'), or leave embedding= out")
        self._group_ranks = {s: tuple(dist.get_process_group_ranks(g)) for s, g in self._groups.items()}
        if dp_group is not None:
            self._dp_ranks = tuple(dist.get_process_group_ranks(dp_group))

    def parameters(self) -> list[nn.Parameter]:
        return [p for r in self.runners.values() for p in r.params]

    def modules(self) -> list[nn.Module]:
        """This rank's stage modules."""
        return [r.module for r in self.runners.values()]

    # -- one step

    def run_step(self, inputs: list[Tensors], targets: list[Any], shape_key: Any, *,
                 probe: Callable[[], None] | None = None) -> StepStats:
        """Run every action of this rank for one batch of microbatches.

        ``inputs`` and ``targets`` are per microbatch (only the ranks holding
        the first and the last stage use them); ``shape_key`` is the same on
        every rank and changes when the batch's shapes do. ``probe`` is called after every action.
        """
        new_shapes = shape_key != self._last_shape
        self._last_shape = shape_key
        self.grads_moved = 0
        self.dp_sent, self.dp_layer_bytes = Fraction(0), {}
        if new_shapes:
            self._in_meta.clear()
            self._headers_sent.clear()
            self.boundaries.new_shapes()
        self._inboxes = {src: _Inbox(src, msgs) for src, msgs in self._expected[new_shapes].items()}
        self._out_meta.clear()  # recorded afresh by this step's forwards
        stats = StepStats(self.rank)
        local: dict[tuple[int, int, int], Tensors] = {}  # (direction, stage, mb) -> tensors handed over locally
        for runner in self.runners.values():
            runner.memory_f = runner.memory_b = runner.memory_w = runner.memory_offloaded = 0
        self.host_copies.peak_host_bytes = self.host_copies.host_bytes
        self.links.new_step()
        if self.links.network is not None:  # the watch reads what this schedule's emulated links hold back
            self.activity.carrying = self.links.carrying
        # The batch exists before the step and after it: reported apart from what the step holds.
        self.meter.start(outside=[t for ts in (*inputs, *targets) for t in _tensors(ts)])
        if self.work is not None:
            self.work.begin(self.actions, self.meter)
        received = self._received[new_shapes]
        settled = dict.fromkeys(received, 0)
        self._losses = {}
        self.outputs = {}
        clock = _Clock(self.device, self.meter.t0)
        self.meter.t0 = clock.t0  # the memory curve counts from the same moment
        stats.started_at = ANCHOR + clock.t0  # the moment ``wall`` counts from, on the same clock
        cpu0 = time.process_time()

        if self.embedding is not None:  # each rank looks up its rows of the tokens, summed on the first stage's rank
            start = clock()
            self.activity.wait("the start of the step", "the embeddings' lookups", self.embedding.others, action=False)
            embedded = self.embedding.forward([x[0] if x else None for x in inputs], keep=not self.infer)
            if embedded is not None:
                inputs = [(e, *x[1:]) for e, x in zip(embedded, inputs, strict=True)]
            stats.events.append(Event("embedding", "comm", start, clock()))
        activity = self.activity
        step = _Step(inputs, targets, local, new_shapes, clock, stats)
        for idx, action in enumerate(self.actions):
            for peer, counts in received.items():
                if counts[idx] > settled[peer]:  # the schedule says these sends have arrived: let them go
                    activity.wait(str(action), "the delivery of its sends", self.links.peers(peer))
                    self.links.settle(peer, counts[idx])
                    settled[peer] = counts[idx]
            for src, msg in self._ahead[idx]:
                self._post_until(self._inboxes[src], msg, block=False)
            self._run_action(action, step)
            self.links.reap_sends()
            if probe is not None:
                probe()
        if self.vocab is not None:
            start = clock()
            self.vocab.end_step()
            stats.events.append(Event("wait vocab", "comm", start, clock()))
        if self.embedding is not None and not self.infer:
            start = clock()
            self.activity.wait("the end of the step", "the embeddings' gradient", self.embedding.others, action=False)
            self.embedding.end_step()
            stats.events.append(Event("embedding gradient", "comm", start, clock()))
        start = clock()
        for s, works in self._reductions.items():
            activity.wait("the end of the step", f"the all-reduce of stage {s}", self._reduce_ranks(s), action=False)
            for work in works:
                work.wait()
        self._reductions.clear()
        stats.events.append(Event("wait all-reduce", "comm", start, clock()))
        start = clock()
        activity.wait("the end of the step", "the delivery of its sends", self.links.sending_to(), action=False)
        self.links.wait_sends()
        activity.resume("the end of the step", action=False)
        stats.events.append(Event("wait sends", "send", start, clock()))
        clock.finish(stats.events)  # on a GPU: waits for it, then reads its events
        stats.losses = {mb: float(loss) for mb, loss in sorted(self._losses.items())}  # one sync, at the end
        stats.wall = clock()
        stats.cpu = time.process_time() - cpu0
        stats.busy = sum(e.end - e.start for e in stats.events if e.kind in COMPUTE_KINDS)
        stats.peak_activation_bytes = self.meter.peak
        stats.peak_by_kind = dict(self.meter.peak_by_kind)
        stats.batch_bytes = self.meter.outside_bytes
        stats.memory_curve = list(self.meter.curve)
        stats.stage_memory = {s: (r.memory_f, r.memory_b, r.memory_w) for s, r in self.runners.items()}
        stats.offloaded = {s: r.memory_offloaded for s, r in self.runners.items() if r.memory_offloaded}
        stats.host_peak_bytes = self.host_copies.peak_host_bytes
        stats.dp_sent, stats.dp_layer_bytes = self.dp_sent, dict(self.dp_layer_bytes)
        stats.link_bytes = self.links.link_bytes()
        stats.sent, stats.gathered = dict(self.links.sent), self.links.gathered
        stats.link_samples, stats.recv_posted = self.links.take_samples()
        if self._experts is not None:
            self._exchange_stats(stats)
        left = [(i.src, m) for i in self._inboxes.values() for m in [*i.messages[i.next:], *i.posted]]
        if left:
            raise RuntimeError(f"rank {self.rank} ended a step with messages not received: {left[:3]}")
        if self.links.log is not None:
            stats.messages = list(self.links.log)
            self.links.log.clear()
        return stats

    def _exchange_stats(self, stats: StepStats) -> None:
        """The step's expert exchanges, by pass, and the seconds of them nothing computed under (the parts of
        overlapped pairs compute while holding the baton)."""
        assert self._experts is not None
        records = self._experts.take()
        for label, start, end in records:
            if label is not None:
                stats.exchanges[label] = stats.exchanges.get(label, 0.0) + end - start
        stats.exchange_exposed = exposed([(a, b) for _, a, b in records], self._held)
        self._held = []

    def _run_action(self, action: Action, step: _Step) -> None:
        """Run one action. An overlapped pair (``FB``) on a GPU runs its forward on a side stream while its
        backward runs on the compute stream, so that one's kernels fill the other's gaps (DualPipe's overlap);
        with expert exchanges to overlap (:attr:`ExpertLink.overlap`) elsewhere, on two threads that take turns
        (:meth:`_run_overlapped`); else it runs its forward, then its backward."""
        parts = action.passes
        if len(parts) == 2 and self._side is None and self._experts is not None and self._experts.overlap:
            self._run_overlapped(action, step)
            return
        if len(parts) == 1 or self._side is None:
            for part in parts:
                self._run(part, step)
            return
        compute = torch.cuda.current_stream(self.device)
        forward, backward = parts
        self._side.wait_stream(compute)  # what the forward reads was made on the compute stream
        with torch.cuda.stream(self._side):
            # The forward's kernels are queued first, then the backward's on the other stream: the GPU runs them
            # side by side. Autograd runs this forward's own backward later on this same stream, and makes the
            # calling stream wait for it.
            self._run(forward, step)
        self._run(backward, step)
        compute.wait_stream(self._side)  # what comes next may read the forward's output

    def _run_overlapped(self, action: Action, step: _Step) -> None:
        """An overlapped pair whose expert exchanges hide under each other's compute (DualPipe's overlap, on a CPU
        where there is no second stream): both inputs are taken first (the pair starts once both are there, as
        the dependency graph has it), the forward then computes on a thread of its own and the backward on this
        one, taking turns on a :class:`~pipefold.runtime.experts.Baton` that each lets go of for the length of
        its exchanges, and the outputs are handed on in part order."""
        forward, backward = action.passes
        if forward.kind != Kind.F or backward.kind not in (Kind.B, Kind.BW):
            raise ConfigError(f"{action}: an overlapped pair runs a forward with a backward (F+B or F+BW)")
        link = self._experts
        assert link is not None
        self.activity.run(str(action))
        x = self._forward_in(forward, step)
        dy = self._backward_in(backward, step)
        baton = link.baton = Baton()
        done: dict[str, Any] = {}
        started = threading.Event()

        def run_forward() -> None:
            try:
                with baton, link.in_pass(str(forward)):
                    started.set()
                    done["out"] = self._forward_run(forward, step, x)
            except BaseException as exc:  # raised on the step's thread below
                done["error"] = exc
            finally:
                started.set()

        thread = threading.Thread(target=run_forward, name=f"pipefold-pair-{forward}", daemon=True)
        thread.start()
        started.wait()  # the forward first, as a pair runs one after the other elsewhere
        try:
            with baton, link.in_pass(str(backward)):
                dx = self._backward_run(backward, step, dy)
        finally:
            thread.join()
            link.baton = None
            self._held.extend(baton.held)
        if "error" in done:
            raise done["error"]
        self._forward_out(forward, step, done["out"])
        self._backward_out(backward, step, dx)

    def _run(self, action: Action, step: _Step) -> None:
        """Run one simple action (not a composite) on its stage, by its kind's handler."""
        self.activity.run(str(action))
        if self._experts is None:
            self._handlers[action.kind](action, step)
            return
        with self._experts.in_pass(str(action)):
            self._handlers[action.kind](action, step)

    def _handler_table(self) -> dict[str, Callable[[Action, _Step], None]]:
        """Each kind this rank runs, and its handler: the passes always; OPT with an optimizer per stage; K-FAC's
        work with K-FAC; DP between data-parallel pipelines, or AG and RS where they are sharded."""
        table: dict[str, Callable[[Action, _Step], None]] = {
            Kind.F: self._forward, Kind.B: self._backward, Kind.BW: self._backward, Kind.W: self._weight,
            Kind.R: self._reduce_replicas,
        }
        if self.optimizers:
            table[Kind.OPT] = self._optimize
        if self.work is not None:
            table.update(dict.fromkeys(self.work.kinds, self._work))
        if self.dp_group is not None and not self.sharded:
            table[Kind.DP] = self._reduce_pipelines
        if self.sharded:
            table.update({Kind.AG: self._gather, Kind.RS: self._reduce_scatter})
        if not self.infer:
            table.update({Kind.OF: self._offload, Kind.RL: self._reload})
        if self.schedule.vocab:
            table.update({Kind.S: self._vocab_forward, Kind.T: self._vocab_backward})
        return table

    def _vocab_passes(self, shard: VocabShard | None, pipelines: Sequence[Sequence[int | None]],
                      pipeline: int) -> VocabPasses:
        """This rank's vocabulary passes, with three process groups of its pipeline's ranks."""
        schedule = self.schedule
        if shard is None:
            raise ConfigError(f"{schedule.name} splits the output layer by vocabulary over every device: give each "
                              "rank its shard of the output projection (Pipeline(..., vocab=VocabShard.of(weight, "
                              "rank, devices)))")
        if any(r is None for ranks in pipelines for r in ranks):
            raise ConfigError("the output layer split by vocabulary runs over pipelines of one rank per device: "
                              "tensor-parallel meshes do not take it yet")
        last = schedule.device_of(schedule.stages - 1)
        s_order = [a.microbatch for a in schedule.actions[self.rank] if a.kind == Kind.S]
        f_order = [a.microbatch for row in schedule.actions for act in row for a in act.passes
                   if a.kind == Kind.F and a.stage == schedule.stages - 1]
        if f_order != s_order:
            raise ConfigError(f"{schedule.name}: the last stage runs its forwards in microbatch order "
                              f"{f_order[:4]}..., the vocabulary passes in {s_order[:4]}...: the runtime sends the "
                              "last stage's outputs to the shards in one order; give both the same")
        ranks = [int(r) for r in pipelines[pipeline] if r is not None]
        # Three groups of their own, one per kind of collective, each pairing up by microbatch order: on one group
        # a rank's broadcast (after its last stage's forward) could come before another rank's reduce (after its
        # T) and after it on a third. Made anew (not the pipeline's cached groups), by the pipeline's ranks alone.
        groups = [dist.new_group(ranks, use_local_synchronization=True) for _ in range(3)]
        return VocabPasses(shard, rank=self.rank, ranks=ranks, last=last, groups=groups, meter=self.meter)

    def _vocab_forward(self, action: Action, step: _Step) -> None:
        """S: this rank's shard of the output layer for a microbatch (in a forward-only step, its loss too)."""
        assert self.vocab is not None
        start = step.clock.mark()
        mb = action.microbatch
        loss = self.vocab.forward(mb, step.targets[mb], infer=self.infer)
        if loss is not None and self.schedule.stages - 1 in self.runners:
            self._losses[mb] = loss
        step.clock.interval(step.stats.events, str(action), Kind.S, start)

    def _vocab_backward(self, action: Action, step: _Step) -> None:
        """T: this rank's shard's softmax, its weight gradient and its part of the last stage's output gradient."""
        assert self.vocab is not None
        start = step.clock.mark()
        loss = self.vocab.backward(action.microbatch, self.loss_scale / self.schedule.microbatches)
        if self.schedule.stages - 1 in self.runners:
            self._losses[action.microbatch] = loss
        step.clock.interval(step.stats.events, str(action), Kind.T, start)

    def _forward(self, action: Action, step: _Step) -> None:
        self._forward_out(action, step, self._forward_run(action, step, self._forward_in(action, step)))

    def _forward_in(self, action: Action, step: _Step) -> Any:
        """A forward's input: the batch's, or what the stage before sent (waited for); its stage's gather too."""
        s, clock, stats = action.stage, step.clock, step.stats
        x = step.inputs[action.microbatch] if s == 0 else self._take(FORWARD, action, step.local, clock, stats)
        if (gathering := self._gathers.pop(s, None)) is not None:
            start = clock()
            gathering.wait()
            stats.events.append(Event(f"wait {s}{Kind.AG}", "comm", start, clock()))
        return x

    def _forward_run(self, action: Action, step: _Step, x: Any) -> Any:
        """A forward's compute, from its input to its output."""
        S, M, s, mb = self.schedule.stages, self.schedule.microbatches, action.stage, action.microbatch
        runner, clock = self.runners[s], step.clock
        start = clock.mark()
        target = step.targets[mb] if s == S - 1 else None
        if self.infer:
            out = runner.infer(mb, x, target)
        else:
            with self.work.forward(action) if self.work is not None else contextlib.nullcontext():
                out = runner.forward(mb, x, target, scale=self.loss_scale / M)
        del x
        clock.interval(step.stats.events, str(action), "F", start)
        return out

    def _forward_out(self, action: Action, step: _Step, out: Any) -> None:
        """A forward's output handed on: to the next stage, to the vocabulary shards, or kept (the loss)."""
        S, s, mb = self.schedule.stages, action.stage, action.microbatch
        runner, stats = self.runners[s], step.stats
        if s < S - 1:
            self._hand_on(FORWARD, s + 1, mb, out, step.local, step.new_shapes, stats)
        elif self.vocab is not None:  # the output goes to every rank's shard of the output layer
            if len(out) != 1:
                raise ConfigError(f"with the output layer split by vocabulary the last stage returns one tensor, "
                                  f"its hidden states (got {len(out)} tensors)")
            if not (self.infer and step.targets[mb] is None):  # without targets an evaluation has no loss to compute
                self.vocab.send_hidden(mb, out[0])
            if self.infer:
                self.outputs[mb] = out[0]
        else:
            # Read after the step (no wait for the GPU here); a copy: the loss may share a larger storage.
            if mb in runner.losses:
                self._losses[mb] = runner.losses.pop(mb).clone()
            if mb in runner.outputs:
                self.outputs[mb] = runner.outputs.pop(mb)
        del out

    def _backward(self, action: Action, step: _Step) -> None:
        """B (the input's gradient, W later) or BW (both at once), handing the input's gradient on."""
        self._backward_out(action, step, self._backward_run(action, step, self._backward_in(action, step)))

    def _backward_in(self, action: Action, step: _Step) -> Any:
        """A backward's output gradient: what the next stage sent (waited for), the vocabulary shards' sum, or
        none (the loss)."""
        s, mb, clock = action.stage, action.microbatch, step.clock
        if s < self.schedule.stages - 1:
            return self._take(BACKWARD, action, step.local, clock, step.stats)
        if self.vocab is not None:
            start = clock()
            dy = (self.vocab.grad(mb),)  # every shard's part of it, summed
            step.stats.events.append(Event(f"wait {mb} vocab grad", "comm", start, clock()))
            return dy
        return None

    def _backward_run(self, action: Action, step: _Step, dy: Any) -> Any:
        """A backward's compute: the input's gradient (and with BW the weights')."""
        runner, mb, clock = self.runners[action.stage], action.microbatch, step.clock
        start = clock.mark()
        dx = runner.backward_input(mb, dy) if action.kind == Kind.B else runner.backward(mb, dy)
        del dy
        clock.interval(step.stats.events, str(action), action.kind, start)
        return dx

    def _backward_out(self, action: Action, step: _Step, dx: Any) -> None:
        """The input's gradient handed on to the stage before (or kept for the embedding's shards)."""
        s, mb = action.stage, action.microbatch
        if s > 0 and dx is not None:
            self._hand_on(BACKWARD, s - 1, mb, dx, step.local, step.new_shapes, step.stats)
        elif s == 0 and self.embedding is not None:  # the embeddings' gradient, sent to the shards at the end
            assert dx is not None
            self.embedding.keep_grad(mb, dx[0])
        del dx

    def _weight(self, action: Action, step: _Step) -> None:
        start = step.clock.mark()
        self.runners[action.stage].backward_weight(action.microbatch)
        step.clock.interval(step.stats.events, str(action), "W", start)

    def _offload(self, action: Action, step: _Step) -> None:
        """OF: the microbatch's saved activations to host memory (on a GPU started on the copy stream)."""
        start = step.clock.mark()
        self.runners[action.stage].offload(action.microbatch, self.host_copies)
        step.clock.interval(step.stats.events, str(action), Kind.OF, start)

    def _reload(self, action: Action, step: _Step) -> None:
        """RL: them back to the device for the microbatch's backward (on a GPU started on the copy stream)."""
        start = step.clock.mark()
        self.runners[action.stage].reload(action.microbatch, self.host_copies)
        step.clock.interval(step.stats.events, str(action), Kind.RL, start)

    def _reduce_replicas(self, action: Action, step: _Step) -> None:
        """R: start the all-reduce of the stage's gradients among its replicas in this pipeline."""
        s, start = action.stage, step.clock.mark()
        # Started now, waited for by the stage's OPT or at the step's end: it overlaps what comes next.
        self._reductions.setdefault(s, []).append(self._all_reduce(self._grads(s), self._groups[s]))
        step.clock.interval(step.stats.events, str(action), "R", start)

    def _reduce_pipelines(self, action: Action, step: _Step) -> None:
        """DP: start the all-reduce of the stage's gradients among the data-parallel pipelines (their mean)."""
        s, where, start = action.stage, str(action), step.clock.mark()
        if s in self._reductions:
            self.activity.wait(where, f"the all-reduce of stage {s}", self._group_ranks.get(s, ()))
        for work in self._reductions.pop(s, ()):
            work.wait()  # the all-reduce between replicas first: both write the same gradients
        self.activity.resume(where)
        # The mean over the pipelines, each having averaged over its own shard. A tensor-parallel rank's part of a
        # split gradient: the copies of that part are its dp group.
        grads = self._grads(s)
        works = self._reductions.setdefault(s, [])
        if self.spb is None:
            n = dist.get_world_size(self.dp_group)
            # An expert spread over the copies (expert parallelism) is not averaged with the other copies' (they
            # hold other experts): its gradient, the sum over its group's tokens, is summed over the copies that hold
            # the same expert (its replicas, where there are some) and takes the mean's 1/copies.
            params = self.runners[s].params
            own = [getattr(p, EXPERT, False) for p in params]
            experts = [g for g, mine in zip(grads, own, strict=True) if mine]
            replicas = next((getattr(p, REPLICAS) for p in params if hasattr(p, REPLICAS)), None)
            if replicas is None:
                for g in experts:
                    g.mul_(1.0 / n)
            elif experts:
                works.append(self._all_reduce(experts, replicas, scale=1.0 / n))
                self.dp_sent += ring_bytes(sum(g.numel() * g.element_size() for g in experts),
                                           dist.get_world_size(replicas))
            grads = [g for g, mine in zip(grads, own, strict=True) if not mine]
            works.append(self._all_reduce(grads, self.dp_group, scale=1.0 / n))
            self.dp_sent += ring_bytes(sum(g.numel() * g.element_size() for g in grads), n)
        else:
            for computed, part, sizes in self.spb.parts(s, grads):
                for layer, size in sizes.items():
                    self.dp_layer_bytes[layer] = self.dp_layer_bytes.get(layer, 0) + size
                started = self._reduce_among(computed, part, sum(sizes.values()))
                if started is not None:
                    works.append(started)
        step.clock.interval(step.stats.events, str(action), "DP", start)

    def _reduce_among(self, computed: tuple[int, ...], grads: list[torch.Tensor],
                      size: int) -> FlatAllReduce | ThenBroadcast | None:
        """Start the reduction of gradients (``size`` bytes) that the copies ``computed`` computed (SPB): their
        mean, by an all-reduce among them; the copies that did not compute them receive it from the first that did
        (a broadcast, which starts when the step waits for the reduction). None on a copy with nothing to do."""
        assert self.spb is not None
        n, c, me = len(self.spb.ranks), len(computed), self.spb.copy
        if c == n:
            self.dp_sent += ring_bytes(size, n)
            return self._all_reduce(grads, self.dp_group, scale=1.0 / n)
        reduction = None
        if me in computed and c > 1:
            self.dp_sent += ring_bytes(size, c)
            reduction = self._all_reduce(grads, self.spb.groups[computed], scale=1.0 / c)
        members = receivers(computed, n)
        if me not in members:
            return reduction
        if me == computed[0]:
            self.dp_sent += (n - c) * size
        group = self.dp_group if len(members) == n else self.spb.groups[members]
        return ThenBroadcast(grads, self.spb.ranks[computed[0]], group, reduction)

    def _all_reduce(self, grads: list[torch.Tensor], group: Any, *, scale: float = 1.0) -> FlatAllReduce:
        """Start one all-reduce of ``grads`` (each times ``scale``); they move into its buffer (:attr:`grads_moved`
        counts the bytes)."""
        reduction = FlatAllReduce(grads, group, scale=scale)
        self.grads_moved += reduction.moved
        return reduction

    def _grads(self, s: int) -> list[torch.Tensor]:
        """Stage ``s``'s gradients, this rank's part of each (zeros where a parameter got none)."""
        out = []
        for p in self.runners[s].params:
            holder = grad_holder(p)  # a float32 master's, with master weights
            if holder.grad is None:
                holder.grad = torch.zeros_like(holder)
            out.append(sharding.local(holder.grad))
        return out

    def _gather(self, action: Action, step: _Step) -> None:
        start = step.clock.mark()
        self._gathers[action.stage] = sharding.gather(self.runners[action.stage].module)
        step.clock.interval(step.stats.events, str(action), Kind.AG, start)

    def _reduce_scatter(self, action: Action, step: _Step) -> None:
        start = step.clock.mark()
        for work in self._reductions.pop(action.stage, ()):
            work.wait()
        self.gathered[action.stage] = sharding.gathered_bytes(self.runners[action.stage].module)
        sharding.reduce_scatter(self.runners[action.stage].module)
        step.clock.interval(step.stats.events, str(action), Kind.RS, start)

    def _optimize(self, action: Action, step: _Step) -> None:
        s, where, start = action.stage, str(action), step.clock.mark()
        if s in self._reductions:
            self.activity.wait(where, f"the all-reduce of stage {s}", self._reduce_ranks(s))
        for work in self._reductions.pop(s, ()):
            work.wait()
        self.activity.resume(where)
        self.optimizers[s]()
        step.clock.interval(step.stats.events, str(action), "OPT", start)

    def _work(self, action: Action, step: _Step) -> None:
        """K-FAC's work (KA, KG, KI, KP)."""
        assert self.work is not None
        if action.kind == Kind.KP and action.stage in self._reductions:
            # The gradient it preconditions is the all-reduced one, which the reduction writes back as it ends.
            self.activity.wait(str(action), f"the all-reduce of stage {action.stage}", self._reduce_ranks(action.stage))
            for work in self._reductions.pop(action.stage, ()):
                work.wait()
            self.activity.resume(str(action))
        start = step.clock.mark()
        self.work.run(action)
        step.clock.interval(step.stats.events, str(action), action.kind, start)

    # -- moving tensors

    def _remote_messages(self, action: Action) -> list[tuple[int, _Message]]:
        """The ranks and messages that bring this action's inputs from other ranks (a pass's needs that cross
        stages, :data:`pipefold.ir.KINDS`)."""
        out = []
        for a in action.passes:
            for name, offset in KINDS[a.kind].needs if a.microbatch >= 0 else ():
                t = a.stage + offset
                if offset == 0 or not 0 <= t < self.schedule.stages:
                    continue
                src = self.schedule.device_of(t, a.microbatch)
                if src != self.rank:
                    out.append((src, _Message(FORWARD if name == "F" else BACKWARD, a.stage, a.microbatch)))
        return out

    def _post_until(self, inbox: _Inbox, until: _Message, *, block: bool) -> None:
        """Post the inbox's receives in send order, up to and including ``until``.

        A receive needs the shapes of what comes: a forward's from its stage's header, a
        gradient's from what this rank sent on. Without ``block`` posting stops at the first
        message whose shapes are not known yet (its header has not arrived); with it, it
        waits for the header, as the caller needs a message behind it now.
        """
        while inbox.next <= inbox.position[until]:
            msg = inbox.messages[inbox.next]
            if msg.direction == HEADER:
                inbox.headers[msg.stage] = self.links.post_header_recv(msg.stage, inbox.src)
            else:
                metas = self._metas(inbox, msg, block=block)
                if metas is None:
                    return
                inbox.posted[msg] = self.links.recv(msg.direction, msg.stage, msg.microbatch, metas, inbox.src)
            inbox.next += 1

    def _metas(self, inbox: _Inbox, msg: _Message, *, block: bool) -> tuple[Meta, ...] | None:
        s = msg.stage
        if msg.direction == FORWARD:
            if s not in self._in_meta:
                work, header = inbox.headers[s]
                if not (block or work.is_completed()):
                    return None
                work.wait()
                del inbox.headers[s]
                self._in_meta[s], spec = decode_header(header)
                self.boundaries.specs[s] = decode_spec(spec)
            return self._in_meta[s]
        if s not in self._out_meta:
            # A gradient comes only after this rank's forward sent what it is the gradient of.
            assert not block, f"rank {self.rank}: {msg} needed before stage {s} sent anything this step"
            return None
        # The gradient of what this stage sent on has the shapes of what it sent.
        return tuple(m for m in self._out_meta[s] if m.dtype.is_floating_point)

    def _take(self, direction: int, action: Action, local: dict[tuple[int, int, int], Tensors],
              clock: _Clock, stats: StepStats) -> Tensors:
        s, mb = action.stage, action.microbatch
        key = (direction, s, mb)
        if key in local:
            return local.pop(key)
        msg = _Message(direction, s, mb)
        inbox = self._inboxes[self._source[key]]
        start = clock()
        where = str(action)
        self.activity.wait(where, "an activation" if direction == FORWARD else "a gradient",
                           self.links.peers(inbox.src))
        self._post_until(inbox, msg, block=True)
        tensors = inbox.posted.pop(msg).wait()
        self.activity.resume(where)
        stats.events.append(Event(f"recv {action}", "recv", start, clock()))
        return tensors

    def _hand_on(self, direction: int, stage: int, mb: int, tensors: Tensors,
                 local: dict[tuple[int, int, int], Tensors], new_shapes: bool, stats: StepStats) -> None:
        """Give ``tensors`` to ``stage`` (the receiving stage): locally, or by a posted send."""
        if direction == FORWARD:
            self._out_meta[stage - 1] = metas_of(tensors)
        peer = self.schedule.device_of(stage, mb)
        if peer == self.rank:
            local[(direction, stage, mb)] = tensors
            return
        if direction == FORWARD and new_shapes and stage not in self._headers_sent:
            spec = encode_spec(self.boundaries.specs.get(stage), f"stage {stage - 1}")
            self.links.send_header(stage, metas_of(tensors), peer, spec)
            self._headers_sent.add(stage)
        self.links.send(direction, stage, mb, tensors, peer)
        size = sum(t.untyped_storage().nbytes() for t in tensors)
        stats.link_message_bytes[peer] = max(stats.link_message_bytes.get(peer, 0), size)

    def _reduce_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of the all-reduce a stage waits for: across the data-parallel pipelines (after its DP action), or
        among its replicas."""
        if self.dp_group is not None and any(a.kind == Kind.DP and a.stage == stage for act in self.actions
                                             for a in act.passes):
            return self._dp_ranks
        return self._group_ranks.get(stage, ())

    def close(self) -> None:
        """Stop the links' threads (every send has been delivered at the end of a step)."""
        self.links.close()


@dataclass
class _Step:
    """What the actions of one step share: the batch's microbatches and targets, the tensors handed between
    stages on this rank, whether shapes are new (headers go with the first messages), the clock and the stats."""

    inputs: list[Tensors]
    targets: list[Any]
    local: dict[tuple[int, int, int], Tensors]
    new_shapes: bool
    clock: _Clock
    stats: StepStats


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a microbatch's input or target (a tensor, or a tuple of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)] if isinstance(x, (tuple, list)) else []


def _accumulate_across_streams() -> None:
    """Let a parameter's gradients come from both streams without a warning. An overlapped pair's forward runs on
    the side stream, so autograd runs that microbatch's backward there too, while the parameter's gradient
    accumulates on the stream its AccumulateGrad node was made on, whichever of the two used the parameter first;
    the engine orders the two with an event, as it must. torch 2.11 warns of that mismatch once per process, taking
    it for an autograd graph kept from an earlier step (on the GPU each rank of a DualPipe run printed it); here it
    is the design."""
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)


class _Clock:
    """The step's times, in seconds from its start.

    On the CPU every interval is read from the host's clock. On a GPU the host only queues kernels, so an
    action's interval is bounded by CUDA events recorded on the stream it runs on, read once the step is
    over (:meth:`finish`): the intervals are when the GPU ran them. Waits (for a receive, an all-reduce)
    are the host's; the step starts after the GPU finished what came before, so both count from the same
    moment.
    """

    def __init__(self, device: torch.device, t0: float) -> None:
        self.t0 = t0
        self.cuda = device.type == "cuda"
        self._zero: Any = None
        self._pending: list[tuple[Event, Any, Any]] = []
        if self.cuda:
            torch.cuda.synchronize(device)
            self._zero = torch.cuda.Event(enable_timing=True)
            self._zero.record()
            self.t0 = time.perf_counter()

    def __call__(self) -> float:
        """Host seconds since the step's start."""
        return time.perf_counter() - self.t0

    def mark(self) -> Any:
        """The start of an action: the host time and the thread's CPU time, or an event on the current stream."""
        if not self.cuda:
            return self(), time.thread_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def interval(self, events: list[Event], name: str, kind: str, start: Any) -> None:
        """Record an action that began at ``start`` (:meth:`mark`) and ends now."""
        if not self.cuda:
            cpu = time.thread_time()
            events.append(Event(name, kind, start[0], self(), cpu - start[1]))
            return
        event = Event(name, kind, 0.0, 0.0)
        events.append(event)
        self._pending.append((event, start, self.mark()))

    def finish(self, events: list[Event]) -> None:
        """Wait for the GPU and fill in the actions' intervals from their events."""
        if not self.cuda:
            return
        torch.cuda.synchronize()
        for event, start, end in self._pending:
            event.start = self._zero.elapsed_time(start) / 1e3
            event.end = self._zero.elapsed_time(end) / 1e3
        self._pending.clear()
        events.sort(key=lambda e: e.start)
