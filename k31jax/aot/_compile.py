"""Ahead-of-time compilation of the engine's programs for a TPU slice, on any host.

`libtpu` (the `tpu` extra) carries XLA's TPU compiler; `jax.experimental.topologies` describes
a slice without one attached, so `jit(f).lower(<ShapeDtypeStructs with NamedShardings>)
.compile()` runs the real compiler on abstract shapes: nothing is allocated, and what comes
back (per-device memory, the optimized HLO) is what the slice would run. `compile_program`
does that for the engine's decode step (with its donated cache), its speculative verify step
(`draft` tokens per row and the last one, every position's KDA state kept), one prefill chunk
and the trainer's step, and sets the compiler's figures beside the planner's (`k31jax.distributed.plan_memory`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..config import ModelConfig
from ..distributed import DEVICES, abstract_cache, abstract_state, cache_shardings, plan_memory, plan_training
from ..generate import abstract_decode_inputs, engine_program
from ..nn import expert_words, out_major_projections
from ..kernels import target_tpu
from ..ops import Backends, tpu_kernel_layout
from ..sharding import activate, get_rules, logical_to_spec, parse_mesh, rules_for_mesh, rules_name, shard_factor
from ..train import OptimConfig, StepProgram, abstract_train_step
from ._hlo import HloReport, analyse, peak_breakdown

GB = 1e9
STEPS = ("decode", "verify", "prefill", "train")
# HBM per device (one JAX device: a chip, or one of the two TensorCores a TPU7x chip shows as
# devices), in the planner's units (GB = 1e9): the planner's own entries where it has the chip
# (`distributed.DEVICES`), else the vendor's spec sheets; the topology description carries no
# memory size.
HBM_PER_DEVICE = {"TPU v4": 32 * GB, "TPU v5 lite": 16 * GB, "TPU v5": DEVICES["v5p"][1],
                  "TPU v6 lite": DEVICES["v6e"][1], "TPU7x": 96 * GB}
# Named slices count TensorCores: two per chip on these generations.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "tpu7x": 2, "v5e": 1, "v6e": 1}
_TWO_D = ("v5e", "v6e")


class CompileError(RuntimeError):
    """The TPU compiler is missing, a topology is unknown, or the program does not compile."""


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def topology_name(topology: str) -> str:
    """A libtpu topology ("v5p:4x4x4", "tpu7x:2x2x2") from itself or a named slice ("v5p-128":
    128 TensorCores, i.e. 64 chips as 4x4x4; "v5e-16": 16 chips as 4x4)."""
    if ":" in topology:
        return topology
    m = re.fullmatch(r"(v4|v5p|v5e|v6e|tpu7x)-(\d+)", topology)
    if not m:
        raise CompileError(f"--topology {topology!r}: expected a libtpu topology such as v5p:4x4x4 or tpu7x:2x2x2, "
                           "or a named slice such as v5p-128, v5e-16 or tpu7x-64")
    gen, cores = m.group(1), int(m.group(2))
    chips = cores // _CORES_PER_CHIP[gen]
    if chips < 1 or chips & (chips - 1):
        raise CompileError(f"--topology {topology!r}: {cores} cores is not a power-of-two number of chips")
    n = chips.bit_length() - 1
    dims = [1, 1] if gen in _TWO_D else [1, 1, 1]
    for i in range(n):  # near-square / near-cube: grow the smallest side
        dims[dims.index(min(dims))] *= 2
    return f"{gen}:{'x'.join(map(str, sorted(dims)))}"


def tpu_devices(topology: str, slices: int = 1) -> list:
    """Compile-only devices of a TPU slice, or of `slices` such slices joined by the data-center
    network (multi-slice; each device's `slice_index` says which), with no TPU needed."""
    if not libtpu_available():
        raise CompileError("the TPU compiler is not installed: pip install 'k31jax[tpu]' (brings libtpu)")
    # libtpu takes a machine-wide lock meant for processes driving real chips; compiling needs none.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    name = topology_name(topology)
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                            chips_per_host_bounds=(2, 2, 1), num_slices=slices)
    except Exception as exc:  # libtpu's message names the bad part
        raise CompileError(f"--topology {name!r}: {str(exc).splitlines()[0]}") from None
    return list(desc.devices)


def slice_mesh(devices, mesh: str | dict) -> Mesh:
    """A Mesh over `devices` with the axes of `mesh` ("expert=8,tensor=8"; the rest data=...).
    Devices of several slices (`tpu_devices(..., slices=n)`) split the `data` axis: its outer
    factor of n runs across the slices, so only data parallelism (one gradient reduction per
    step) crosses the slower network between them, and every other axis stays in a slice."""
    shape = parse_mesh(mesh)
    names = tuple(shape)
    if math.prod(shape.values()) != len(devices):
        raise CompileError(f"--mesh {mesh}: {math.prod(shape.values())} devices, but the slices have {len(devices)}")
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if shape.get("data", 1) % slices:
        raise CompileError(f"--mesh {mesh}: data={shape.get('data', 1)} is not a multiple of the {slices} slices "
                           "(data parallelism runs across slices; every other axis stays inside one)")
    # slice-major order: the data axis (outermost) steps through the slices first
    ordered = sorted(devices, key=lambda d: getattr(d, "slice_index", 0))
    return Mesh(np.asarray(ordered).reshape(tuple(shape.values())), names)


def _placed(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _replicated(tree, mesh):
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)


def _rows(tree, mesh, rules):
    """Per-row arrays placed as the engine's programs pin them (the sampler state: rows sharded
    like the cache's `batch` axis), so a donated one is aliased as it is in the engine."""
    def place(a):
        spec = logical_to_spec(("batch",) + (None,) * (len(a.shape) - 1), a.shape, dict(mesh.shape), rules)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(place, tree)


def expected_local_experts(cfg: ModelConfig, tokens: int, expert_shards: int) -> float:
    """Expected distinct experts one device's rows choose, for `tokens` tokens routed uniformly
    (each picks k distinct experts of E): n_local * (1 - C(E-1, k) / C(E, k))^tokens, i.e. the
    chance a given expert is chosen by at least one token."""
    e, k = cfg.num_experts, cfg.num_experts_per_token
    n_local = e / expert_shards
    return n_local * (1 - (1 - k / e) ** tokens)


@dataclasses.dataclass
class CompileReport:
    """One program compiled for a slice: the compiler's memory and traffic beside the planner's."""

    step: str
    config: str
    topology: str
    devices: int
    device_kind: str
    mesh: dict
    rules: str
    batch: int
    context: int
    tokens: int                    # tokens per call (batch x width)
    lower_seconds: float
    compile_seconds: float
    memory: dict                   # the compiler's per-device bytes
    hbm_per_device: int
    planner: dict                  # the planner's per-device terms (bytes)
    hlo: HloReport
    xla_cost: dict                 # XLA's own totals (loop bodies counted once)
    floor_bytes: int               # the planner's per-call HBM floor (see `step_floor`)
    floor_note: str
    peak: list                     # what the compiler holds at its memory peak: (bytes, source), largest first
    versions: dict
    # train: how many donated state leaves the step returns in other formats than it takes them
    # in (each would be re-laid out before the next step; `train.StepProgram`), or None
    state_formats_changed: int | None = None
    slices: int = 1                # TPU slices the devices span (`tpu_devices`)

    @property
    def total(self) -> int:
        """Per-device peak: arguments + outputs - aliased + temporaries + generated code."""
        m = self.memory
        return m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["generated_code"]

    @property
    def buffers(self) -> int:
        """What the planner plans: the total less the program's generated code (a few MB, which
        the planner does not model; it matters only at toy sizes)."""
        return self.total - self.memory["generated_code"]

    @property
    def planner_ratio(self) -> float:
        """The planner's total over the compiler's buffers."""
        return self.planner["total"] / self.buffers if self.buffers else float("nan")

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm_per_device

    def as_dict(self) -> dict:
        return {"step": self.step, "config": self.config, "topology": self.topology, "devices": self.devices,
                "device_kind": self.device_kind, "mesh": self.mesh, "rules": self.rules, "batch": self.batch,
                "context": self.context, "tokens": self.tokens, "lower_seconds": self.lower_seconds,
                "compile_seconds": self.compile_seconds, "memory": self.memory, "total": self.total,
                "buffers": self.buffers, "planner_ratio": self.planner_ratio,
                "hbm_per_device": self.hbm_per_device, "fits": self.fits, "planner": self.planner,
                "hlo": self.hlo.as_dict(), "xla_cost": self.xla_cost, "floor_bytes": self.floor_bytes,
                "floor_note": self.floor_note, "peak": [[b, name] for b, name in self.peak],
                "versions": self.versions, "state_formats_changed": self.state_formats_changed,
                "slices": self.slices}

    def state_formats_note(self) -> str | None:
        """train: whether the step returns its donated state in the formats it takes it in."""
        if self.state_formats_changed is None:
            return None
        if not self.state_formats_changed:
            return "returned as taken"
        return f"{self.state_formats_changed} leaves returned in other formats (re-laid out every step)"

    def table(self) -> str:
        m, p = self.memory, self.planner
        across = f" x {self.slices} slices" if self.slices > 1 else ""
        lines = [f"k31jax compile: {self.step} of {self.config} on {self.topology}{across} ({self.devices} x "
                 f"{self.device_kind}), mesh {','.join(f'{k}={v}' for k, v in self.mesh.items())} "
                 f"(rules {self.rules}), batch {self.batch}, context {self.context:,}, {self.tokens:,} tokens per call",
                 f"jax {self.versions['jax']}, libtpu {self.versions['libtpu']}: lower {self.lower_seconds:.1f} s, "
                 f"compile {self.compile_seconds:.1f} s", "",
                 f"{'per device':<34}{'compiler GB':>12}{'planner GB':>12}"]
        rows = [("arguments (weights, cache, inputs)", m["arguments"], p["weights"] + p["cache"] + p["inputs"]),
                ("outputs", m["outputs"], None), ("aliased (donated arguments)", m["aliased"], p["donated"]),
                ("temporaries", m["temporaries"], p["activations"]), ("generated code", m["generated_code"], None),
                ("total", self.total, None), ("total less generated code", self.buffers, p["total"])]
        for label, a, b in rows:
            lines.append(f"{label:<34}{a / GB:>12.2f}{'' if b is None else f'{b / GB:>12.2f}'}")
        lines.append(f"HBM per device {self.hbm_per_device / GB:.1f} GB: {'fits' if self.fits else 'DOES NOT FIT'}; "
                     f"planner / compiler (less generated code) {self.planner_ratio:.2f}")
        if self.state_formats_changed is not None:
            lines.append(f"donated state in the layouts the compiler chose: {self.state_formats_note()}")
        h = self.hlo
        lines += ["", f"per call, with loop trip counts: HBM traffic {h.hbm_bytes / GB:.2f} GB, "
                  f"{h.flops / 1e12:.3f} TFLOP (XLA's own totals, loop bodies once: "
                  f"{self.xla_cost.get('bytes accessed', 0) / GB:.2f} GB, {self.xla_cost.get('flops', 0) / 1e12:.3f} TFLOP)",
                  f"planner floor {self.floor_bytes / GB:.2f} GB ({self.floor_note}); traffic / floor "
                  f"{h.hbm_bytes / max(self.floor_bytes, 1):.2f}"]
        if h.dynamic_loops:
            lines.append(f"data-dependent loops: {len(h.dynamic_loops)} (counted as the report says: "
                         f"{sorted(set(c for n, t, c in h.loops if t is None))})")
        lines.append("collectives per call: " + (", ".join(
            f"{k} {c:,} ({b / GB:.3f} GB)" for k, (c, b) in h.collectives.items()) or "none"))
        if self.slices > 1:
            lines += self._cross_slice_lines()
        lines.append(f"largest float buffer: {h.largest_float[1]} {h.largest_float[0] / GB:.3f} GB "
                     f"({h.largest_float[2] or 'no op_name'})")
        if self.peak:
            lines += ["", "held at the compiler's memory peak, by argument path or the op that made it:"]
            lines += [f"  {b / GB:>8.3f} GB  {name[-90:]}" for b, name in self.peak]
        lines += ["", "largest buffers made by one instruction:"]
        for nbytes, shape, opcode, op_name in h.largest:
            lines.append(f"  {nbytes / GB:>8.3f} GB  {shape:<28} {opcode:<22} {op_name[-70:]}")
        if h.traffic:
            lines += ["", "HBM traffic per call by the op that moves it (trip counts):"]
            lines += [f"  {b / GB:>9.2f} GB  {name[-100:]}" for b, name in h.traffic]
        return "\n".join(lines)

    def _cross_slice_lines(self, top: int = 8) -> list[str]:
        h, planned = self.hlo, self.planner.get("cross_slice")
        lines = ["across slices (data-center network), per call and device: " + (", ".join(
            f"{k} {c:,} ({b / GB:.4f} GB)" for k, (c, b) in h.cross_slice.items()) or "nothing")]
        if planned is not None:
            lines[-1] += f"; planner: the trained gradients' shard, {planned / GB:.4f} GB"
        lines += [f"  {b / GB:>9.4f} GB  {shape:<24} {what}" + (f" x {n}" if n > 1 else "")
                  for b, shape, what, n in h.cross_slice_sends[:top]]
        if len(h.cross_slice_sends) > top:
            lines.append(f"  ... and {len(h.cross_slice_sends) - top} smaller")
        return lines


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        libtpu = version("libtpu")
    except PackageNotFoundError:
        libtpu = "?"
    return {"jax": jax.__version__, "libtpu": libtpu}


def step_floor(cfg: ModelConfig, plan, step: str, tokens: int, expert_shards: int) -> tuple[int, str]:
    """The per-call HBM bytes no implementation can go below: every local weight other than the
    routed experts read once; the routed experts' packed bytes for the experts this device's
    rows are expected to choose (decode) or all local ones (prefill); the cache read once (at
    decode with the indexer selecting, of the MLA latents only the `index_topk` rows a query
    selects: the indexer keys are all read, the latents gathered), and the KDA state and this
    call's new MLA rows written."""
    w = plan.weights
    few = step in ("decode", "verify")
    if few and cfg.moe_layers:
        chosen = expected_local_experts(cfg, tokens, expert_shards)
        n_local = cfg.num_experts / expert_shards
        experts = w["experts"] * chosen / n_local
        note = f"experts: the {chosen:.1f} of {n_local:.0f} local experts expected chosen, packed"
    else:
        experts = w["experts"]
        note = "experts: all local ones, packed"
    c = plan.cache
    cache = sum(c.values()) + c["kda_state"] + c["kda_conv"]
    if few and cfg.use_indexer and plan.context > cfg.index_topk:
        cache -= (c["mla_ckv"] + c["mla_kpe"]) * (1 - cfg.index_topk / plan.context)
        note += f"; MLA latents: the {cfg.index_topk:,} selected rows"
    return int(w["rest"] + experts + cache), note


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What `step="train"` compiles: the trainer's step with these settings (`k31jax train`'s
    flags of the same names); `batch` rows of `seq_len` tokens per micro-batch."""

    qat: bool = True
    lora_rank: int = 0
    lora_experts: bool = False
    remat: str = "full"
    optimizer: str = "adamw"
    trainable: str = "experts"
    master_dtype: str = "float32"
    seq_len: int = 4096
    grad_accum: int = 1


def compile_program(config: str | ModelConfig, topology: str, mesh: str | dict, *, step: str = "decode",
                    batch: int = 8, context: int = 4096, chunk: int = 2048, rules=None,
                    backends: Backends | None = None, dump: str | Path | None = None,
                    train: TrainSettings | None = None, draft: int = 8, slices: int = 1,
                    name: str | None = None) -> CompileReport:
    """Compile the engine's `step` program ("decode": one token per row with the donated cache;
    "verify": the speculative step over each row's last token and `draft` drafted ones;
    "prefill": one `chunk`-token call per row), or the trainer's step ("train", `train`
    settings, `batch` rows per micro-batch), of `config` for `topology` on `mesh`, from abstract
    shapes, and report (`CompileReport.table()`, `.as_dict()`); `dump` writes the optimized HLO.
    With `slices` > 1 the program is compiled for that many such slices joined by the data-center
    network, `mesh` spanning all their devices with its `data` axis across the slices
    (`slice_mesh`), and the report lists what crosses between slices. `name` labels the model in
    the report (default: the preset's name, or "model")."""
    if step not in STEPS:
        raise CompileError(f"--step {step!r}: expected one of {', '.join(STEPS)}")
    name = name or (config if isinstance(config, str) else "model")
    cfg = ModelConfig.preset(config) if isinstance(config, str) else config
    devices = tpu_devices(topology, slices)
    m = slice_mesh(devices, mesh)
    shape = dict(m.shape)
    rules = get_rules(rules) or rules_for_mesh(shape)
    # what the engine picks on a TPU host: XLA paths (Pallas TPU kernels are not in use) and
    # `ragged_all_to_all` for the expert exchange (`ops.default_exchange` reads the host's own
    # devices, the CPU here)
    backends = backends or Backends(kernels="xla", ep="ragged")
    if step == "train":
        return _compile_train(cfg, name, topology, devices, m, shape, rules, backends, batch, train or TrainSettings(),
                              dump, slices)
    graphdef, state = abstract_state(cfg, m, rules)
    with target_tpu():  # the layout the engine runs on a TPU: the kernel's when it runs the Pallas TPU one
        state = out_major_projections(expert_words(state, kernel=tpu_kernel_layout(backends)))
    cache = abstract_cache(cfg, batch, context)
    cache = _placed(cache, cache_shardings(cache, m, rules))
    program = engine_program(step)
    jitted = program.jitted
    if step == "decode":
        token, sampler, token_rules = abstract_decode_inputs(cfg.vocab_size, batch)
        token, token_rules = _replicated((token, token_rules), m)
        sampler = _rows(sampler, m, rules)
        args = (graphdef, backends, state, cache, token, sampler, token_rules)
        tokens = batch
    elif step == "verify":
        _, sampler, token_rules = abstract_decode_inputs(cfg.vocab_size, batch)
        fed = jax.ShapeDtypeStruct((batch, draft + 1), jnp.int32)
        lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
        fed, lengths, token_rules = _replicated((fed, lengths, token_rules), m)
        args = (graphdef, backends, state, cache, fed, lengths, _rows(sampler, m, rules), token_rules)
        tokens = batch * (draft + 1)
    else:
        tokens_in = jax.ShapeDtypeStruct((batch, chunk), jnp.int32)
        valid = jax.ShapeDtypeStruct((batch, chunk), jnp.bool_)
        args = (graphdef, backends, state, cache) + tuple(_replicated((tokens_in, valid), m))
        tokens = batch * chunk
    lower_s, compile_s, memory, text, xla, peak = _compile(
        jitted, args, m, rules, f"{step} of {name} on {topology}", dump and Path(dump) / f"{name}.{step}.hlo.txt",
        lambda lowered, options: program.compile(lowered, platform="tpu", options=options))
    expert_shards = _expert_shards(cfg, shape, rules)
    chosen = expected_local_experts(cfg, tokens, expert_shards) if cfg.moe_layers else 1
    hlo = analyse(text, {"selected_experts": chosen})
    width = {"decode": 1, "verify": draft + 1}.get(step, chunk)
    plan = plan_memory(cfg, shape, batch=batch, context=context, chunk=width, rules=rules)
    inputs = sum(_device_bytes(a) for a in jax.tree.leaves(args[4:]))
    # what the program donates: the cache, and at decode / verify the sampler state (`seen` [B, V])
    sampler_at = {"decode": 5, "verify": 6}
    donated = sum(_device_bytes(a) for a in jax.tree.leaves(
        (args[3], args[sampler_at[step]]) if step in sampler_at else args[3]))
    # a verify step holds every fed position's KDA state and conv window (`nn.KDATrail`)
    trail = width * (plan.cache["kda_state"] + plan.cache["kda_conv"]) if step == "verify" else 0
    planner = {"weights": plan.weight_total, "cache": plan.cache_total, "inputs": inputs, "donated": donated,
               "activations": plan.attn_res + plan.peak_activations + trail, "total": plan.total + trail}
    floor, note = step_floor(cfg, plan, step, tokens, expert_shards)
    kind = devices[0].device_kind
    return CompileReport(step, name, topology_name(topology), len(devices), kind, shape, rules_name(rules),
                         batch, context, tokens, lower_s, compile_s, memory, HBM_PER_DEVICE.get(kind, 0), planner,
                         hlo, xla, floor, note, peak, _versions(), slices=slices)


def _compile(jitted, args, mesh, rules, what: str, dump: Path | None, compile_lowered=None):
    """(lower s, compile s, the compiler's per-device memory, optimized HLO, XLA's cost totals,
    what it holds at its memory peak). Lowered for a TPU (`kernels.target_tpu`): "pallas"
    kernels are the Mosaic ones."""
    t0 = time.perf_counter()
    with activate(mesh, rules), target_tpu():
        lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compile_lowered = compile_lowered or (lambda lowered, options: lowered.compile(compiler_options=options))
    # the compiler's live-range dump names what it holds at its peak, also when it runs out of memory
    with tempfile.TemporaryDirectory(prefix="k31jax-aot-") as where:
        try:
            compiled = compile_lowered(lowered, {"xla_dump_to": where, "xla_dump_hlo_pass_re": "^$"})
        except Exception as exc:
            peak = _peak(where) if "RESOURCE_EXHAUSTED" in str(exc) else []
            held = "; at its peak: " + _peak_line(peak) if peak else ""
            raise CompileError(f"{what}: the TPU compiler failed: {str(exc).splitlines()[0][:400]}{held}") from None
        t2 = time.perf_counter()
        text = compiled.as_text()
        peak = _peak(where, text)
    ma = compiled.memory_analysis()
    memory = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
              "aliased": ma.alias_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
              "generated_code": ma.generated_code_size_in_bytes}
    if dump is not None:
        dump.parent.mkdir(parents=True, exist_ok=True)
        dump.write_text(text)
    xla = compiled.cost_analysis() or {}
    xla = {k: float(v) for k, v in (xla[0] if isinstance(xla, list) else xla).items()
           if k in ("flops", "bytes accessed", "optimal_seconds")}
    return t1 - t0, t2 - t1, memory, text, xla, peak


def _peak(dump_dir: str, hlo_text: str | None = None) -> list[tuple[int, str]]:
    """`peak_breakdown` of the module's live-range dump in `dump_dir` ([] if none), with its
    optimized HLO `hlo_text` (the compiled program's), else the one dumped beside it (a
    program the compiler gave up on)."""
    found = sorted(Path(dump_dir).glob("*after_optimizations-live-range.txt"), key=lambda f: -f.stat().st_size)
    if not found:
        return []
    if hlo_text is None:
        hlo = found[0].with_name(found[0].name.replace("-live-range.txt", ".txt"))
        hlo_text = hlo.read_text() if hlo.exists() else ""
    return peak_breakdown(found[0].read_text(), hlo_text)


def _peak_line(peak: list[tuple[int, str]], n: int = 5) -> str:
    return ", ".join(f"{name[-70:]} {b / GB:.2f} GB" for b, name in peak[:n])


def _compile_train(cfg, name, topology, devices, mesh, shape, rules, backends, batch, t: TrainSettings, dump,
                   slices: int):
    optim = OptimConfig(optimizer=t.optimizer, trainable=t.trainable)
    jitted, args = abstract_train_step(cfg, mesh, rules, optim=optim, qat=t.qat, master_dtype=t.master_dtype,
                                       remat=t.remat, lora_rank=t.lora_rank, lora_experts=t.lora_experts,
                                       micro_batch=batch,
                                       grad_accum=t.grad_accum, seq_len=t.seq_len, backends=backends)
    relaid = []

    def compile_lowered(lowered, options):  # the state's formats in and out, as `StepProgram` places it
        compiled = lowered.compile(compiler_options=options)
        relaid.append(StepProgram.relaid(compiled, args[3:6]))
        return compiled

    lower_s, compile_s, memory, text, xla, peak = _compile(jitted, args, mesh, rules,
                                                           f"train step of {name} on {topology}",
                                                           dump and Path(dump) / f"{name}.train.hlo.txt",
                                                           compile_lowered)
    hlo = analyse(text)
    donated = sum(_device_bytes(a) for a in jax.tree.leaves(args[3:6]))
    inputs = sum(_device_bytes(a) for a in jax.tree.leaves(args[6]))
    # params come back unchanged but for the router bias: JAX forwards those, so the compiler
    # aliases the optimizer state and the trained leaves, not every donated byte
    updated = sum(_device_bytes(a) for a in jax.tree.leaves(args[4:6]))
    planner = {"weights": donated, "cache": 0, "inputs": inputs, "donated": donated, "updated": updated,
               "activations": 0, "total": 0}
    floor = donated
    note = "params, optimizer state and trainable read once"
    plan = plan_training(cfg, shape, trainable=t.trainable, optimizer=t.optimizer, master_dtype=t.master_dtype,
                         remat=t.remat, seq_len=t.seq_len, micro_batch=batch, grad_accum=t.grad_accum,
                         rules=rules, slices=slices, lora_rank=t.lora_rank, lora_experts=t.lora_experts)
    planner.update(total=plan.total, activations=plan.total - donated)
    if slices > 1:
        planner["cross_slice"] = plan.cross_slice_bytes
    kind = devices[0].device_kind
    return CompileReport("train", name, topology_name(topology), len(devices), kind, shape, rules_name(rules),
                         batch, t.seq_len, batch * t.seq_len * t.grad_accum, lower_s, compile_s, memory,
                         HBM_PER_DEVICE.get(kind, 0), planner, hlo, xla, floor, note, peak, _versions(), relaid[0],
                         slices)


def _device_bytes(a: jax.ShapeDtypeStruct) -> int:
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    return math.prod(shape) * a.dtype.itemsize


def _expert_shards(cfg: ModelConfig, shape: dict, rules) -> int:
    if not cfg.moe_layers:
        return 1
    spec = logical_to_spec(("expert",), (cfg.num_experts,), shape, rules)
    return shard_factor(spec, shape)


