"""Reading a compiled program's optimized HLO text: per-step HBM bytes and FLOPs with loop trip
counts, collectives by kind, and the largest buffers an instruction makes.

XLA's `cost_analysis()` counts a `while` body once, whatever its trip count, so a model whose
layers run in a scanned loop is undercounted by the layer count. This walks the module's
computations from the entry, multiplying each loop body by its trip count (read from the
loop's condition, `i < N`), and counts every instruction that is not inside a fusion:

- bytes: its operands and its result that live in HBM (memory space 0; TPU layouts mark VMEM
  and other on-chip spaces `S(n)`), where a slice-like use of an operand (dynamic-slice,
  slice, gather) reads only the slice and an in-place update (dynamic-update-slice) writes
  only the update;
- FLOPs: 2 x output elements x contraction length of every dot and convolution, inside
  fusions too;
- collectives: all-gather, all-reduce, reduce-scatter, all-to-all, ragged-all-to-all and
  collective-permute (async starts counted once), with the bytes of their results;
- cross-slice transfers: in a program for several slices the TPU compiler keeps the
  collectives above inside one slice and carries the part between slices (over the
  data-center network) as host-transfer sends marked `_xla_megascale_transfer_type`; each
  is counted by that type with the bytes it sends;
- buffers: the results instructions make, except in-place updates (a dynamic-update-slice
  writes into its operand's buffer, e.g. the donated cache);
- traffic by source: the bytes summed per `op_name` (the JAX operation an instruction came
  from), the largest first: what dominates the traffic.

A loop whose bound is not a constant (a data-dependent loop, e.g. the selected-experts loop)
has no trip count: it is counted `dynamic_trips[name]` times when the caller says how many
(by a substring of its `op_name` metadata), else once, and listed in `dynamic_loops`. A
`conditional` counts its costliest branch. These are estimates of traffic, not a simulation:
the compiler's own `memory_analysis()` is the authority on memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8,
         "f8e5m2": 8, "f8e4m3": 8, "f8e8m0fnu": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8,
         "f8e3m4": 8, "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32, "s32": 32, "u32": 32,
         "f64": 64, "s64": 64, "u64": 64, "c64": 64, "c128": 128, "token": 0}
FLOAT_TYPES = frozenset({"f4e2m1fn", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "bf16", "f16", "f32", "f64"})
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                   "call", "after-all", "partition-id", "replica-id", "iota", "copy-done", "all-gather-done",
                   "all-reduce-done", "collective-permute-done", "async-done", "send-done", "recv-done",
                   "opt-barrier", "custom-call-done", "call-done"})  # an async call's work is its call-update's
_SLICE_USES = frozenset({"dynamic-slice", "slice", "gather"})
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]+?)(?:_\d+)?"')

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*)$")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int

    @property
    def bytes(self) -> int:
        return math.prod(self.dims) * _BITS.get(self.dtype, 32) // 8

    @property
    def hbm_bytes(self) -> int:
        return self.bytes if self.memory_space == 0 else 0

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass
class Instruction:
    name: str
    shape: list[Array]          # one array, or a tuple's arrays
    opcode: str
    operands: list[str]
    args: str                   # the text inside the opcode's parentheses
    attrs: str

    @property
    def integer(self) -> int | None:
        """A scalar integer constant's value, or a parameter's number."""
        if self.opcode in ("constant", "parameter") and re.fullmatch(r"\s*-?\d+\s*", self.args):
            return int(self.args)
        return None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    def called(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%([^\s,}}]+)", self.attrs)
        return m.group(1) if m else None


def _split_top(s: str) -> tuple[str, str]:
    """(the text inside the bracket that opens s, the rest after it)."""
    depth = 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return s[1:i], s[i + 1:]
    return s[1:], ""


def _arrays(shape: str) -> list[Array]:
    out = []
    for dt, dims, layout in _ARRAY.findall(shape):
        if dt not in _BITS:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dt, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
    return out


def parse(text: str) -> tuple[dict[str, list[Instruction]], str, set[str]]:
    """(computation -> instructions, the entry's name, the fused computations' names)."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        name, rest = m.group(2), m.group(3)
        if rest.startswith("("):
            inner, rest = _split_top(rest)
            shape = _arrays(inner)
        else:
            shape_str, _, rest = rest.partition(" ")
            shape = _arrays(shape_str)
        rest = rest.lstrip()
        op = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
        if not op:
            continue
        args, attrs = _split_top(rest[len(op.group(1)):])
        operands = re.findall(r"%([^\s,()]+)", args)
        comps[current].append(Instruction(name, shape, op.group(1), operands, args, attrs))
    fused = set()
    for instrs in comps.values():
        for ins in instrs:
            if ins.opcode == "fusion":
                fused.add(ins.called("calls"))
    return comps, entry, fused


def _trip_count(while_ins: Instruction, comps, by_name) -> int | None:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_ins.attrs)
    if known:
        return int(known.group(1))
    cond = comps.get(while_ins.called("condition") or "", [])
    root = next((i for i in cond if i.opcode == "compare"), None)
    if root is None or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    local = {i.name: i for i in cond}
    bound = local.get(root.operands[1])
    while bound is not None and bound.opcode in ("copy", "convert", "bitcast") and bound.operands:
        bound = local.get(bound.operands[0])
    if bound is None or bound.opcode != "constant":
        return None
    n = bound.integer
    induction = local.get(root.operands[0])
    start = 0
    if induction is not None and induction.opcode == "get-tuple-element":
        index = re.search(r"index=(\d+)", induction.attrs)
        init = by_name.get(while_ins.operands[0]) if while_ins.operands else None
        if index and init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
            first = by_name.get(init.operands[int(index.group(1))])
            if first is not None and first.integer is not None:
                start = first.integer
    return max(0, n - start) if n is not None else None


def _operand_read_bytes(ins: Instruction, k: int, by_name, comps) -> int:
    """HBM bytes instruction `ins` reads of its operand `k`."""
    src = by_name.get(ins.operands[k])
    if src is None or len(src.shape) != 1:
        return 0
    full = src.shape[0].hbm_bytes
    if ins.opcode in _SLICE_USES and k == 0:
        return min(full, sum(a.hbm_bytes for a in ins.shape) or full)
    if ins.opcode == "dynamic-update-slice" and k == 0:
        return 0
    if ins.opcode == "fusion":
        return _fused_read(comps, ins.called("calls") or "", k, full)
    if ins.opcode == "call-update":  # operands (the call-start, then the call's own arguments)
        called = _async_called(ins, by_name)
        return 0 if k == 0 or called is None else _fused_read(comps, called, k - 1, full)
    return full


def _async_called(ins: Instruction, by_name) -> str | None:
    """The computation an asynchronous call (`call-start` -> `call-update`s -> `call-done`, e.g.
    a gather the compiler offloads to a SparseCore) runs: the `to_apply` of its call-start."""
    start = by_name.get(ins.operands[0]) if ins.operands else None
    while start is not None and start.opcode == "call-update":
        start = by_name.get(start.operands[0]) if start.operands else None
    return start.called("to_apply") if start is not None and start.opcode == "call-start" else None


def _fused_read(comps, body_name: str, k: int, full: int) -> int:
    """Bytes a fused computation reads of its parameter `k` (`full` bytes): slices read their
    slice, in-place updates nothing, nested fusions what they read; any other use all of it."""
    body = comps.get(body_name, [])
    param = next((i for i in body if i.opcode == "parameter" and i.integer == k), None)
    if param is None:
        return full
    read = _read_through(body, comps, param.name, param.shape[0].bytes if param.shape else full)
    return full if read is None else min(full, read)


def _read_through(body: list[Instruction], comps, name: str, size: int) -> int | None:
    """Bytes the uses of value `name` (`size` bytes) inside a fused computation read: slices
    their slice, in-place updates nothing, nested fusions what they read, and a pad or bitcast
    what its own uses read (the compiler pads an operand to window it, then slices the window:
    only the windows are read); None where some use reads all of it."""
    total = 0
    for user in (u for u in body if name in u.operands):
        first = user.operands[0] == name
        if user.opcode in _SLICE_USES and first:
            total += sum(a.bytes for a in user.shape)
        elif user.opcode == "dynamic-update-slice" and first:
            continue
        elif user.opcode in ("fusion", "call-start", "call"):
            called = user.called("calls") or user.called("to_apply") or ""
            read = _fused_read(comps, called, user.operands.index(name), size)
            if read >= size and _same_elements(user, body, name):
                # a relayout or convert of the whole value, fused into its users: the emitter
                # makes only the windows they read (a dynamic-slice of a layer of a stack)
                inner = _read_through(body, comps, user.name, user.shape[0].bytes)
                read = size if inner is None else min(size, inner * size // max(user.shape[0].bytes, 1))
            total += read
        elif user.opcode in ("pad", "bitcast") and first and user.shape:
            inner = _read_through(body, comps, user.name, user.shape[0].bytes)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total


def _same_elements(user: Instruction, body: list[Instruction], name: str) -> bool:
    """Whether nested fusion `user` makes one array of as many elements as value `name`."""
    src = next((i for i in body if i.name == name), None)
    return (user.opcode == "fusion" and len(user.shape) == 1 and src is not None and len(src.shape) == 1
            and math.prod(user.shape[0].dims) == math.prod(src.shape[0].dims))


def _result_write_bytes(ins: Instruction, by_name, comps) -> int:
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        upd = by_name.get(ins.operands[1])
        return sum(a.hbm_bytes for a in upd.shape) if upd is not None else 0
    if ins.opcode == "fusion":
        body = comps.get(ins.called("calls") or "", [])
        root = body[-1] if body else None
        roots = [root] if root is not None and root.opcode != "tuple" else \
            [next((i for i in body if i.name == o), None) for o in (root.operands if root else [])]
        total = 0
        for arr, r in zip(ins.shape, roots if len(roots) == len(ins.shape) else [None] * len(ins.shape)):
            if r is not None and r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
                upd = next((i for i in body if i.name == r.operands[1]), None)
                total += sum(a.bytes for a in upd.shape) if upd is not None and arr.memory_space == 0 else 0
            else:
                total += arr.hbm_bytes
        return total
    return sum(a.hbm_bytes for a in _made(ins))


def _made(ins: Instruction) -> list[Array]:
    """The arrays an instruction makes: its result, less the operands an asynchronous start
    or update carries in its result tuple (`call-update`: ((its arguments), its result,
    context); `copy-start`: (destination, source, context))."""
    if ins.opcode == "call-update":
        return ins.shape[len(ins.operands) - 1:]
    if ins.opcode == "copy-start":
        return ins.shape[:1]
    return ins.shape


def _updates_in_place(ins: Instruction, comps) -> bool:
    """A dynamic-update-slice, or a fusion whose result is one: it writes into its operand."""
    if ins.opcode == "dynamic-update-slice":
        return True
    if ins.opcode == "fusion":
        body = comps.get(ins.called("calls") or "", [])
        return bool(body) and body[-1].opcode == "dynamic-update-slice"
    return False


def kernel_cost(ins: Instruction) -> tuple[int, int] | None:
    """(flops, bytes) a Pallas TPU kernel (a `tpu_custom_call`) declares in its
    `pl.CostEstimate`, computed from its grid and BlockSpecs; None for other instructions. Its
    operands are whole arrays (a layer stack, say) of which the kernel's DMAs read only blocks,
    so their sizes would overcount it."""
    if ins.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
        return None
    m = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"', ins.attrs)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _flops(ins: Instruction, by_name) -> int:
    cost = kernel_cost(ins)
    if cost is not None:
        return cost[0]
    out = sum(math.prod(a.dims) for a in ins.shape[:1])
    if ins.opcode == "dot":
        lhs = by_name.get(ins.operands[0]) if ins.operands else None
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        if lhs is None or not dims or not lhs.shape:
            return 0
        k = math.prod(lhs.shape[0].dims[int(d)] for d in dims.group(1).split(",") if d)
        return 2 * out * k
    if ins.opcode == "convolution":
        rhs = by_name.get(ins.operands[1]) if len(ins.operands) > 1 else None
        labels = re.search(r"dim_labels=[^_]*_([^-]*)->", ins.attrs)
        if rhs is None or not labels or not rhs.shape:
            return 0
        spec, dims = labels.group(1), rhs.shape[0].dims
        k = dims[spec.index("i")] if "i" in spec and len(spec) == len(dims) else 1
        window = re.search(r"window=\{([^}]*)\}", ins.attrs)
        if window:
            sizes = re.search(r"size=([0-9x]+)", window.group(1))
            dil = re.search(r"lhs_dilate=([0-9x]+)", window.group(1))
            s = [int(v) for v in sizes.group(1).split("x")] if sizes else []
            d = [int(v) for v in dil.group(1).split("x")] if dil else [1] * len(s)
            k *= math.prod(-(-a // b) for a, b in zip(s, d))
        return 2 * out * k  # grouped convolutions: the rhs input-feature dim is already per group
    return 0


@dataclasses.dataclass
class HloReport:
    """What one optimized HLO module does per call (see the module docstring)."""

    hbm_bytes: int
    flops: int
    collectives: dict[str, tuple[int, int]]        # kind -> (count per call, bytes per call)
    largest: list[tuple[int, str, str, str]]        # (bytes, shape, opcode, op_name)
    largest_float: tuple[int, str, str]             # (bytes, shape, op_name) of the largest float buffer
    loops: list[tuple[str, int | None, int]]        # (op_name, trip count or None, times counted)
    dynamic_loops: list[str]
    traffic: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (bytes per call, op_name)
    cross_slice: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # kind -> (count, bytes)
    # each cross-slice send: (bytes per call, shape, the collective it carries, times per call)
    cross_slice_sends: list[tuple[int, str, str, int]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {"hbm_bytes": self.hbm_bytes, "flops": self.flops,
                "collectives": {k: {"count": c, "bytes": b} for k, (c, b) in self.collectives.items()},
                "largest_buffers": [{"bytes": b, "shape": s, "opcode": o, "op_name": n}
                                    for b, s, o, n in self.largest],
                "traffic_by_source": [{"bytes": b, "op_name": n} for b, n in self.traffic],
                "largest_float_buffer": {"bytes": self.largest_float[0], "shape": self.largest_float[1],
                                         "op_name": self.largest_float[2]},
                "loops": [{"op_name": n, "trip_count": t, "counted": c} for n, t, c in self.loops],
                "dynamic_loops": self.dynamic_loops,
                "cross_slice": {k: {"count": c, "bytes": b} for k, (c, b) in self.cross_slice.items()},
                "cross_slice_sends": [{"bytes": b, "shape": s, "collective": c, "times": t}
                                      for b, s, c, t in self.cross_slice_sends]}


def analyse(text: str, dynamic_trips: dict[str, float] | None = None, top: int = 10) -> HloReport:
    """The per-call figures of one optimized HLO module (`compiled.as_text()`)."""
    comps, entry, fused = parse(text)
    by_name: dict[str, Instruction] = {}
    for instrs in comps.values():
        for ins in instrs:
            by_name[ins.name] = ins
    dynamic_trips = dynamic_trips or {}
    mult: dict[str, float] = defaultdict(float)
    loops, dynamic = [], []

    def visit(comp: str, times: float):
        mult[comp] += times
        for ins in comps.get(comp, []):
            if ins.opcode == "while":
                trips = _trip_count(ins, comps, by_name)
                counted = trips
                if trips is None:
                    counted = next((v for key, v in dynamic_trips.items() if key in ins.op_name), 1)
                    dynamic.append(ins.op_name)
                loops.append((ins.op_name, trips, counted))
                visit(ins.called("body"), times * counted)
                visit(ins.called("condition"), times * (counted + 1))
            elif ins.opcode == "conditional":
                branches = re.findall(r"(?:true_computation|false_computation)=%([^\s,]+)", ins.attrs)
                branches += re.findall(r"%([^\s,{}]+)", (re.search(r"branch_computations=\{([^}]*)\}",
                                                                    ins.attrs) or [None, ""])[1])
                if branches:
                    visit(max(branches, key=_comp_bytes), times)
            elif ins.opcode in ("call", "async-start"):
                target = ins.called("to_apply") or ins.called("calls")
                if target and target not in fused:
                    visit(target, times)

    def _comp_bytes(comp: str) -> int:
        return sum(_instruction_bytes(ins) for ins in comps.get(comp, []) if ins.opcode not in _FREE)

    def _instruction_bytes(ins: Instruction) -> int:
        cost = kernel_cost(ins)
        if cost is not None:
            return cost[1]
        return _result_write_bytes(ins, by_name, comps) + sum(
            _operand_read_bytes(ins, k, by_name, comps) for k in range(len(ins.operands)))

    visit(entry, 1)
    hbm = flops = 0
    coll: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    cross: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    sends = []
    traffic: dict[str, int] = defaultdict(int)
    buffers = []
    for comp, times in mult.items():
        for ins in comps.get(comp, []):
            f = _flops(ins, by_name)
            if ins.opcode == "fusion":
                for inner in comps.get(ins.called("calls") or "", []):
                    f += _flops(inner, by_name)
                    kind = inner.opcode.removesuffix("-start")
                    if kind in COLLECTIVES:
                        coll[kind][0] += times
                        coll[kind][1] += times * sum(a.bytes for a in inner.shape)
            flops += int(times * f)
            kind = ins.opcode.removesuffix("-start")
            if kind in COLLECTIVES:
                coll[kind][0] += times
                # an async start's tuple repeats its operands first, then its results (and context)
                out = ins.shape[len(ins.operands):] if ins.opcode.endswith("-start") else ins.shape
                coll[kind][1] += times * sum(a.bytes for a in out[:1] or out)
            transfer = _MEGASCALE.search(ins.attrs) if ins.opcode in ("send", "send-start") else None
            if transfer:  # the shape is (data, context, token)
                kind = transfer.group(1).lower().replace("_", "-")
                cross[kind][0] += times
                cross[kind][1] += times * ins.shape[0].bytes
                carried = _RENDEZVOUS.search(ins.attrs)
                sends.append((int(times * ins.shape[0].bytes), str(ins.shape[0]),
                              f"{kind} ({carried.group(1) if carried else ins.name})", int(times)))
            if ins.opcode in _FREE:
                continue
            moved = int(times * _instruction_bytes(ins))
            hbm += moved
            traffic[ins.op_name or ins.opcode] += moved
            if _updates_in_place(ins, comps):
                continue  # its result is its operand's buffer, not a new one
            for arr in _made(ins):
                if arr.memory_space == 0:
                    buffers.append((arr.bytes, str(arr), ins.opcode, ins.op_name, arr.dtype))
    buffers.sort(key=lambda r: -r[0])
    floats = [b for b in buffers if b[4] in FLOAT_TYPES]
    largest_float = (floats[0][0], floats[0][1], floats[0][3]) if floats else (0, "", "")
    return HloReport(hbm, flops, {k: (int(c), int(b)) for k, (c, b) in sorted(coll.items())},
                     [b[:4] for b in buffers[:top]], largest_float, loops, dynamic,
                     sorted(((b, name) for name, b in traffic.items()), reverse=True)[:top],
                     {k: (int(c), int(b)) for k, (c, b) in sorted(cross.items())},
                     sorted(sends, key=lambda r: (-r[0], r[2])))


_PEAK_HEAD = re.compile(r"Live ranges at \d+ \(peak\):")
_LIVE = re.compile(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes")  # a value: instruction{tuple index}


def peak_breakdown(live_range: str, hlo_text: str, top: int = 8) -> list[tuple[int, str]]:
    """What the compiler holds at its memory peak, largest first: `(bytes, source)`, from the
    values its live-range dump lists as live at the peak (`*after_optimizations-live-range.txt`
    under `xla_dump_to`), named by the `op_name` of the instruction that made them in the
    optimized module `hlo_text` (a parameter's is its argument path, e.g. `state['moe']...`),
    summed per source. A value updated in place (a dynamic-update-slice, or a fusion ending in
    one) shares its operand's buffer: while both are live the dump lists both, and the buffer
    is counted once, under the first of the chain. Empty if the dump has no peak section."""
    lines = live_range.splitlines()
    start = next((i for i, line in enumerate(lines) if _PEAK_HEAD.search(line)), None)
    if start is None:
        return []
    live: dict[str, int] = defaultdict(int)
    for line in lines[start + 1:]:
        m = _LIVE.match(line)
        if m is None:
            break
        live[m.group(1)] += int(m.group(2))
    comps, _, _ = parse(hlo_text)
    by_name = {ins.name: ins for instrs in comps.values() for ins in instrs}
    held: dict[str, int] = defaultdict(int)
    for name, nbytes in live.items():
        ins = by_name.get(name)
        if ins is None:
            held[name] += nbytes
            continue
        if _updates_in_place(ins, comps) and any(live.get(o) == nbytes for o in ins.operands):
            continue  # the same buffer as a live operand
        held[ins.op_name.replace("\\'", "'") or name] += nbytes
    return sorted(((b, name) for name, b in held.items() if b), key=lambda r: -r[0])[:top]
