"""Kernel launches of a compiled program, counted from its optimized HLO -- for a GPU the
machine does not have.

On a GPU a DARTS supernet step is launch-bound: tens of thousands of small kernels, each
a few microseconds of work and as many of launch and scheduling. How many a program
launches is visible before it runs: XLA's optimized HLO (``compiled.as_text()``) lists
every kernel of every computation, and XLA can compile for a GPU it does not have
(deviceless compilation, :func:`gpu_target_sharding`). :func:`count_kernels` reads that
text:

* each ``fusion`` is one kernel (a loop, reduction, transpose or Triton GEMM fusion);
  each ``custom-call`` one library call (cuDNN convolutions, cuBLAS GEMMs: counted by
  target); each top-level ``copy`` one device copy; any other instruction that does work
  outside a fusion (a ``sort``, a collective) one launch, named by its opcode;
* a ``while`` body counts ``known_trip_count`` times (its condition once more: a loop
  also costs a predicate read-back per iteration, counted as ``loop_iterations``); a
  loop whose trip count XLA does not know counts once and is reported
  (``unknown_trip_loops``);
* a ``conditional`` counts every branch (an upper bound: one branch runs), reported as
  ``conditionals``; ``call`` and ``async-start`` count what they call; an asynchronous
  pair (``fusion-start`` / ``fusion-done``, ``copy-start`` / ``copy-done``) counts once.

It is a proxy for time, not a measurement: a launch costs ~2-10 microseconds on a
current card, kernels differ in size, and XLA may replay parts of a program as CUDA
graphs (command buffers) after this stage. Time on a GPU to know.

    >>> text = '''
    ... %fused_add (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %a = f32[4]{0} add(%p, %p)
    ... }
    ... %body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
    ...   %t = (s32[], f32[4]{0}) parameter(0)
    ...   %x = f32[4]{0} get-tuple-element(%t), index=1
    ...   %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
    ...   %i = s32[] get-tuple-element(%t), index=0
    ...   ROOT %r = (s32[], f32[4]{0}) tuple(%i, %f)
    ... }
    ... %cond (t: (s32[], f32[4])) -> pred[] {
    ...   %t = (s32[], f32[4]{0}) parameter(0)
    ...   %i = s32[] get-tuple-element(%t), index=0
    ...   ROOT %c = pred[] compare(%i, %i), direction=LT
    ... }
    ... ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
    ...   %x = f32[4]{0} parameter(0)
    ...   %y = f32[4]{0} copy(%x)
    ...   %z = s32[] constant(0)
    ...   %t = (s32[], f32[4]{0}) tuple(%z, %y)
    ...   ROOT %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
    ... }
    ... '''
    >>> c = count_kernels(text)
    >>> c.kernels, c.fusions, c.copies, c.other, c.loop_iterations
    (12, 5, 1, 6, 5)
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["KernelCount", "count_kernels", "gpu_target_sharding", "scope_of", "H100_TARGET"]

H100_TARGET = Path(__file__).with_name("h100_gpu_target.pbtxt")
"""XLA's description of an NVIDIA H100 80GB (SXM) for deviceless compilation (an H200
differs in memory size and bandwidth, not in the kernels XLA emits)."""

# instructions that launch nothing on their own (views, tuples, constants, control flow
# whose cost is counted through what it calls)
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain", "get-dimension-size", "iota",
})
_CALLS = ("while", "conditional", "call", "async-start")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")


@dataclass
class KernelCount:
    """Launches of one program (see the module docstring for what counts)."""

    fusions: int = 0
    copies: int = 0
    custom_calls: dict[str, int] = field(default_factory=Counter)  # by custom_call_target
    fusion_kinds: dict[str, int] = field(default_factory=Counter)  # kLoop, kInput, kCustom, ...
    others: dict[str, int] = field(default_factory=Counter)  # other launching opcodes
    loop_iterations: int = 0  # while-loop iterations (a predicate read-back each)
    conditionals: int = 0  # conditionals executed (every branch counted)
    unknown_trip_loops: int = 0
    scopes: dict[str, int] = field(default_factory=Counter)  # launches by source scope (:func:`scope_of`)

    @property
    def other(self) -> int:
        return sum(self.others.values())

    @property
    def library_calls(self) -> int:
        return sum(self.custom_calls.values())

    @property
    def kernels(self) -> int:
        """All launches (fusions, library calls, copies and other launching instructions)."""
        return self.fusions + self.library_calls + self.copies + self.other

    @property
    def convolutions(self) -> dict[str, int]:
        """cuDNN convolution calls by kind (forward, backward-input, backward-filter, ...)."""
        return Counter({k.split("$", 1)[1]: v for k, v in self.custom_calls.items() if k.startswith("__cudnn$conv")})

    @property
    def gemms(self) -> int:
        """cuBLAS calls plus Triton GEMM fusions."""
        return (sum(v for k, v in self.custom_calls.items() if "cublas" in k)
                + self.fusion_kinds.get("kCustom", 0))

    def add(self, other: KernelCount, times: int = 1) -> None:
        self.fusions += times * other.fusions
        self.copies += times * other.copies
        for mine, theirs in ((self.custom_calls, other.custom_calls), (self.fusion_kinds, other.fusion_kinds),
                             (self.others, other.others)):
            for k, v in theirs.items():
                mine[k] += times * v
        self.loop_iterations += times * other.loop_iterations
        self.conditionals += times * other.conditionals
        self.unknown_trip_loops += times * other.unknown_trip_loops
        for k, v in other.scopes.items():
            self.scopes[k] += times * v

    def scaled(self, divisor: float) -> dict:
        """The main counts divided by ``divisor`` (e.g. client-steps of the program)."""
        return {"kernels": self.kernels / divisor, "fusions": self.fusions / divisor,
                "library_calls": self.library_calls / divisor, "copies": self.copies / divisor,
                "convolutions": {k: v / divisor for k, v in sorted(self.convolutions.items())},
                "gemms": self.gemms / divisor, "loop_iterations": self.loop_iterations / divisor}

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "fusions": self.fusions, "copies": self.copies,
                "custom_calls": dict(self.custom_calls), "fusion_kinds": dict(self.fusion_kinds),
                "others": dict(self.others), "loop_iterations": self.loop_iterations,
                "conditionals": self.conditionals, "unknown_trip_loops": self.unknown_trip_loops}


def _split_type(rest: str) -> tuple[str, str]:
    """``rest`` after ``=``: its result type (a tuple type may hold spaces) and the rest."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m["name"]
                comps[current] = []
                if m["entry"]:
                    entry = current
            continue
        if line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    if not entry:
        raise ValueError("not an HLO module's text: no ENTRY computation")
    return comps, entry


_TRANSFORMS = re.compile(r"^(jit|pjit|jvp|transpose|vmap|checkpoint|remat|cond|switch|while|body|branch_\d+_fun|"
                         r"eval_jaxpr|shard_map|custom_jvp_call|custom_vjp_call)(\(.*\))?$")


def scope_of(line: str, depth: int = 3) -> str:
    """The source scope of an HLO instruction: its ``op_name`` metadata less JAX's
    transformation wrappers (``jit(..)``, ``jvp()``, ``transpose(..)``, ``while/body``,
    ...), its first ``depth`` parts (Flax module paths show up here when the model is
    traced under ``jax.named_scope`` s or ``nn.Module`` names), then the primitive."""
    m = re.search(r'op_name="([^"]*)"', line)
    if not m:
        return "?"
    parts = [p for p in m.group(1).split("/") if p and not _TRANSFORMS.match(p)]
    if not parts:
        return "?"
    return "/".join(parts[:-1][:depth] + [parts[-1]])


def _attr(line: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", line)
    return m.group(1) if m else None


def count_kernels(hlo_text: str, scope_depth: int | None = None) -> KernelCount:
    """The launches of the program whose optimized HLO is ``hlo_text`` (for a compiled
    program: ``compiled.as_text()``), counted as the module docstring says; with
    ``scope_depth``, also by source scope (``KernelCount.scopes``, :func:`scope_of`)."""
    if not isinstance(hlo_text, str):
        raise TypeError(f"count_kernels: hlo_text must be the HLO module's text (str; for a compiled program "
                        f"compiled.as_text()), got {type(hlo_text).__name__}")
    if scope_depth is not None and (isinstance(scope_depth, bool) or not isinstance(scope_depth, int)
                                    or scope_depth < 0):
        raise ValueError(f"count_kernels: scope_depth must be None or an int >= 0, got {scope_depth!r:.40}")
    comps, entry = _computations(hlo_text)
    memo: dict[str, KernelCount] = {}

    def count(name: str, stack: tuple = ()) -> KernelCount:
        if name in memo:
            return memo[name]
        if name not in comps or name in stack:
            raise ValueError(f"HLO text: computation {name!r} is missing or recursive")
        total = KernelCount()
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            _, rest = _split_type(m["rest"])
            opcode = rest.split("(", 1)[0].strip()
            if opcode in _FREE or opcode.endswith(("-done", "-update")):  # an asynchronous op's wait
                continue
            if scope_depth is not None and opcode not in ("while", "conditional") + _CALLS:
                total.scopes[scope_of(line, scope_depth)] += 1
            if opcode == "fusion":
                total.fusions += 1
                total.fusion_kinds[_attr(line, "kind") or "?"] += 1
            elif opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                total.custom_calls[target.group(1) if target else "?"] += 1
            elif opcode == "copy":
                total.copies += 1
            elif opcode == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                n = int(trip.group(1)) if trip else 1
                total.unknown_trip_loops += trip is None
                total.add(count(_attr(line, "body"), stack + (name,)), n)
                total.add(count(_attr(line, "condition"), stack + (name,)), n + 1)
                total.loop_iterations += n
            elif opcode == "conditional":
                total.conditionals += 1
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                         [_attr(line, "true_computation"), _attr(line, "false_computation")])
                for b in names:
                    total.add(count(b, stack + (name,)))
            elif opcode in _CALLS:
                called = _attr(line, "to_apply") or _attr(line, "calls")
                if called:
                    total.add(count(called, stack + (name,)))
            else:
                total.others[opcode] += 1
        memo[name] = total
        return total

    return count(entry)


def gpu_target_sharding(target_config: str | Path = H100_TARGET):
    """A sharding on one GPU described by ``target_config`` (XLA's ``GpuTargetConfig``
    text) without the GPU: give it to ``jax.ShapeDtypeStruct`` arguments and
    ``jax.jit(f).lower(*args).compile()`` compiles for that GPU on this machine
    (deviceless compilation). Needs the CUDA plugin (``pip install "jax[cuda13]"``; no
    driver) and ``JAX_PLATFORMS=cpu`` so that JAX does not look for a device."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    text = Path(target_config).read_text()
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=text, topology="1x1x1")
    except Exception as e:  # no CUDA plugin, or one that cannot read the description
        raise RuntimeError(f"deviceless GPU compilation is not available here ({type(e).__name__}: {e}); "
                           "it needs the CUDA plugin: pip install 'jax[cuda13]'") from e
    return NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
