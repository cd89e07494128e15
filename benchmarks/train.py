"""Training on CPU: k31jax vs transformers' `kimi_linear` + torch AdamW, the streamed loss's
memory, and Muon vs AdamW on a short run.

    .venv/bin/python benchmarks/train.py [--batch 2] [--seq-len 128] [--repeats 3] [--compare-optimizers] [--record]

Sections (each can be skipped):

1. Throughput (`--skip-throughput` skips it). One Kimi-Linear-shaped config (the `forward.py`
   config: hidden 256, 8 layers, 32 experts top-4, vocab 2048), built from one HF config dict
   on both sides, float32, the same `[batch, seq_len]` of random tokens, one document per row
   (no packing: k31jax gets `segment_ids` all ones), AdamW with the same learning rate, betas,
   eps and weight decay (on the same tensors: matrices, not vectors), constant learning rate,
   no gradient clipping on either side.
   - k31jax: `k31jax.train._steps.train_step` jitted as `Trainer` jits it (no router bias
     update, no z-loss / balance loss), on batches `[1, B, T]`; the streamed
     `chunked_cross_entropy` (vocab chunk 4096) over T targets per row.
   - transformers: `benchmarks/_torch_train_runner.py` in the torch venv ($K31JAX_TORCH_PYTHON
     or ./.torchvenv/bin/python): `model(input_ids, labels).loss.backward(); opt.step()`, eager
     attention, `--torch-experts` experts; its full-vocabulary loss over T - 1 targets per row.
   - Method (`benchmarks/_harness.py`): warm-up steps excluded (k31jax's compile included
     there); `--repeats` timed rounds of `--steps-per-repeat` steps per side, the sides
     alternating; median / min / max per side and the ratio of medians; tokens/s = B * T *
     steps / time. Both sides get the same thread count (`--threads`, default: the CPUs this
     process may run on): `torch.set_num_threads` + OMP_NUM_THREADS on the torch side; XLA:CPU
     runs with `--xla_cpu_multi_thread_eigen=true` and sizes its intra-op pool from the same CPU
     count (jax 0.12 has no XLA flag to set that pool's size). The header gives the load
     average before and after and the CPU other processes used (the torch runner is this
     process's child, so it counts as ours); `--record` refuses a loaded run.
   - Memory: k31jax's compiled step `memory_analysis()` (temp + argument + output bytes;
     donated inputs alias outputs), and each process's peak RSS (`getrusage`), with its RSS
     after imports, since the two runtimes differ in their fixed cost.
2. Loss memory (`--skip-loss-memory` skips it): compiled `memory_analysis()` temp bytes of
   `value_and_grad` (w.r.t. hidden and lm_head) of `chunked_cross_entropy` vs
   `full_cross_entropy` at `--loss-vocab` (K3's 163,840) x `--loss-tokens` x `--loss-dim`,
   float32; lowered and compiled from abstract shapes only, nothing is allocated or run.
3. `--compare-optimizers`: `Trainer` on the `tiny` preset (byte tokenizer) for
   `--opt-steps` steps of `--opt-batch` x `--opt-seq-len`, from the same seed and data order,
   with `OptimConfig(optimizer="adamw")` and `"muon"` at each learning rate of `--adamw-lrs` /
   `--muon-lrs` (warm-up 10 steps, cosine to 0.1x, weight decay 0.1, clip 1.0), on
   `--opt-files` files of the Python standard library (every k-th `*.py` of 8-48 KB, in sorted
   order) with the next `--opt-heldout-files` such files held out. Reports the mean train loss
   of the last 10 steps, the last step's, and the held-out loss (`k31jax.train.evaluate`) over
   the first `--opt-eval-batches` held-out batches (file order; 0: all of them).

Writes nothing into the repository unless `--record` is given: then what it printed goes into
benchmarks/RESULTS.md as the block `train` of its section (`_harness.record`), only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Session, add_record_arguments, alternate, ratio, record, torch_python  # noqa: E402

# The forward.py config (a small Kimi Linear: MLA at 1-indexed 4 and 8, KDA elsewhere).
CONFIG = {
    "model_type": "kimi_linear", "vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 8,
    "intermediate_size": 768, "moe_intermediate_size": 128, "hidden_act": "silu",
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7],
                           "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4},
    "num_experts": 32, "num_experts_per_token": 4, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "num_nextn_predict_layers": 0,
}
MiB = 1 << 20


class Report:
    """Prints lines and keeps them (for --record)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def rss_now_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def peak_rss_mb() -> float:
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 2**20


def _tok_s(stats) -> str:
    return f"{stats.median:10.1f} {stats.low:10.1f} {stats.high:10.1f}"


# ---------------------------------------------------------------------------- 1. throughput
class TorchSide:
    """The torch runner subprocess: one warm-up at start, then one timed repeat per `run()`."""

    def __init__(self, args, threads: int):
        py = torch_python()
        if py is None:
            raise FileNotFoundError("no torch venv (make one with scripts/make_torch_venv.sh, or set "
                                    "K31JAX_TORCH_PYTHON); pass --no-torch to time k31jax alone")
        self._config = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(CONFIG, self._config)
        self._config.close()
        cmd = [py, str(ROOT / "benchmarks" / "_torch_train_runner.py"), "--config-json", self._config.name,
               "--batch", str(args.batch), "--seq-len", str(args.seq_len),
               "--steps-per-repeat", str(args.steps_per_repeat), "--warmup-steps", str(args.warmup_steps),
               "--threads", str(threads), "--lr", str(args.lr), "--b1", str(args.b1), "--b2", str(args.b2),
               "--eps", str(args.eps), "--weight-decay", str(args.weight_decay),
               "--experts-implementation", args.torch_experts]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info: dict | None = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the torch runner exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def wait_ready(self) -> dict:
        if self.info is None:
            self.info = self._read()
        return self.info

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> dict:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        done = self._read()
        self.proc.wait()
        os.unlink(self._config.name)
        return done


def k31jax_step(args):
    """(run_repeat, facts): a jitted `train_step` on one random `[1, B, T]` batch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import k31jax
    from k31jax.ops import Backends
    from k31jax.train import OptimConfig, StepSettings, decay_mask, split_for_training, train_step

    rss_after_import = rss_now_mb()
    cfg = k31jax.ModelConfig.from_hf(CONFIG, dtype="float32")
    model = k31jax.K31ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    optim = OptimConfig(optimizer="adamw", learning_rate=args.lr, warmup_steps=0, total_steps=10**6,
                        min_lr_ratio=1.0, weight_decay=args.weight_decay, b1=args.b1, b2=args.b2, eps=args.eps,
                        clip_norm=None)
    # as `Trainer` does: the frozen rest (the router bias) and the trained leaves, apart
    rest, trained, tx = split_for_training(state, optim)
    decayed = sum(int(np.prod(leaf.shape)) for leaf, d in zip(
        jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))),
        jax.tree.leaves(decay_mask(nnx.state(model, nnx.Param)))) if d)
    opt_state = jax.jit(tx.init)(trained)
    settings = StepSettings(backends=Backends(), vocab_chunk=args.vocab_chunk)
    rng = np.random.default_rng(args.seed)
    b, t = args.batch, args.seq_len
    ones = np.ones((1, b, t))
    batch = {"tokens": rng.integers(3, cfg.vocab_size, (1, b, t)), "targets": rng.integers(3, cfg.vocab_size, (1, b, t)),
             "loss_mask": ones.astype(np.float32), "target_bytes": ones.astype(np.int32),
             "segment_ids": ones.astype(np.int32), "positions": np.broadcast_to(np.arange(t), (1, b, t))}
    batch = {k: jnp.asarray(v, jnp.float32 if k == "loss_mask" else jnp.int32) for k, v in batch.items()}
    t0 = time.perf_counter()
    step = jax.jit(train_step, static_argnums=(0, 1, 2), donate_argnums=(3, 4, 5))
    compiled = step.lower(graphdef, tx, settings, rest, opt_state, trained, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state_box = [rest, opt_state, trained]

    def run_steps(n: int) -> float:
        metrics = None
        for _ in range(n):
            rest_, opt_state_, trained_, metrics = compiled(*state_box, batch)
            state_box[:] = [rest_, opt_state_, trained_]
        jax.block_until_ready(state_box)
        return float(metrics["loss"])

    t0 = time.perf_counter()
    run_steps(args.warmup_steps)
    facts = dict(compile_s=compile_s, warmup_s=time.perf_counter() - t0,
                 n_params=k31jax.count_params(cfg).total, n_params_decayed=decayed, cfg=cfg,
                 temp=mem.temp_size_in_bytes, argument=mem.argument_size_in_bytes,
                 output=mem.output_size_in_bytes, alias=mem.alias_size_in_bytes,
                 rss_after_import_mb=rss_after_import, jax=jax.__version__)
    return run_steps, facts


def throughput(args, threads: int, out: Report) -> dict:
    torch_side = None if args.no_torch else TorchSide(args, threads)  # warms up while k31jax compiles
    run_steps, facts = k31jax_step(args)
    info = torch_side.wait_ready() if torch_side else None
    tokens = args.batch * args.seq_len * args.steps_per_repeat
    last = {}

    def ours():
        t0 = time.perf_counter()
        last["k31jax"] = run_steps(args.steps_per_repeat)
        return {"tok/s": tokens / (time.perf_counter() - t0)}

    def theirs():
        r = torch_side.run()
        last["torch"] = r["loss"]
        return {"tok/s": tokens / r["seconds"]}

    sides = {"k31jax": ours, **({"transformers": theirs} if torch_side else {})}
    stats = alternate(sides, args.repeats, warmup=0)  # both sides warmed up above (their warm-up steps)
    k31jax_peak = peak_rss_mb()
    done = torch_side.close() if torch_side else None
    cfg = facts["cfg"]
    out(f"config: Kimi Linear shape (forward.py's), hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
        f"(MLA {[i + 1 for i in cfg.mla_layers]}), {cfg.num_experts} experts top-{cfg.num_experts_per_token}, "
        f"vocab {cfg.vocab_size}; float32; batch {args.batch} x seq_len {args.seq_len}, one document per row")
    out(f"AdamW lr {args.lr} (constant), betas ({args.b1}, {args.b2}), eps {args.eps}, weight decay "
        f"{args.weight_decay} on {facts['n_params_decayed']:,} of {facts['n_params']:,} k31jax params"
        + (f" / {info['n_params_decayed']:,} of {info['n_params']:,} torch params" if info else "")
        + "; no clipping")
    out(f"threads: {threads} per side (torch.set_num_threads({info['threads'] if info else threads}); XLA "
        f"--xla_cpu_multi_thread_eigen=true, intra-op pool = {threads} CPUs)")
    out(f"{args.repeats} repeats x {args.steps_per_repeat} steps, alternating k31jax / torch; excluded: k31jax "
        f"compile {facts['compile_s']:.1f} s and {args.warmup_steps} warm-up step(s) {facts['warmup_s']:.1f} s"
        + (f", torch {args.warmup_steps} warm-up step(s) {info['warmup_s']:.1f} s" if info else ""))
    out()
    out(f"{'tokens/s':28}{'median':>10} {'min':>10} {'max':>10}")
    out(f"{'k31jax (jit)':28}{_tok_s(stats['k31jax']['tok/s'])}")
    if torch_side:
        out(f"{'transformers + torch AdamW':28}{_tok_s(stats['transformers']['tok/s'])}")
        speedup = ratio(stats["k31jax"]["tok/s"], stats["transformers"]["tok/s"])
        out(f"ratio of medians (k31jax / transformers): {speedup:.2f}x   (target >= 2x)")
    else:
        speedup = None
        out("transformers not run (--no-torch)")
    out()
    out("memory                                    MiB")
    out(f"k31jax compiled step: temp                {facts['temp'] / MiB:10.1f}")
    out(f"k31jax compiled step: arguments           {facts['argument'] / MiB:10.1f}")
    out(f"k31jax compiled step: outputs             {facts['output'] / MiB:10.1f}   "
        f"({facts['alias'] / MiB:.1f} aliased to donated arguments)")
    out(f"k31jax compiled step: temp + args + outs  {(facts['temp'] + facts['argument'] + facts['output']) / MiB:10.1f}")
    out(f"k31jax process: RSS after imports         {facts['rss_after_import_mb']:10.1f}")
    out(f"k31jax process: peak RSS                  {k31jax_peak:10.1f}   (includes compilation)")
    if info:
        out(f"torch process: RSS after imports          {info['rss_after_import_mb']:10.1f}")
        out(f"torch process: peak RSS                   {done['peak_rss_mb']:10.1f}")
        out(f"# transformers {info['transformers']}, torch {info['torch']}, experts {info['experts_implementation']}, "
            f"attention {info['attn_implementation']}, fla installed: {info['fla_installed']}, "
            f"causal_conv1d installed: {info['causal_conv1d_installed']}")
    out(f"# final train loss on the fixed batch: k31jax {last['k31jax']:.4f}"
        + (f", torch {last['torch']:.4f}" if torch_side else ""))
    return dict(ratio=speedup, jax=facts["jax"], torch=info["torch"] if info else None)


# ---------------------------------------------------------------------------- 2. loss memory
def loss_memory(args, out: Report) -> None:
    import jax
    import jax.numpy as jnp

    from k31jax.train import chunked_cross_entropy, full_cross_entropy

    v, n, d = args.loss_vocab, args.loss_tokens, args.loss_dim
    hidden = jax.ShapeDtypeStruct((1, n, d), jnp.float32)
    head = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((1, n), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, n), jnp.float32)
    losses = {"chunked_cross_entropy": lambda h, w, t, m: chunked_cross_entropy(h, w, t, m, vocab_chunk=args.vocab_chunk)[0],
              "full_cross_entropy": lambda h, w, t, m: full_cross_entropy(h, w, t, m)[0]}
    out(f"value_and_grad w.r.t. (hidden, lm_head), float32, vocab {v:,}, {n:,} tokens, D {d} "
        f"(compiled from abstract shapes, not run); the [N, V] fp32 logits alone are {n * v * 4 / MiB:,.0f} MiB")
    out(f"{'loss':36}{'temp MiB':>10}{'args MiB':>10}{'outs MiB':>10}{'compile s':>10}")
    temps = {}
    for name, fn in losses.items():
        t0 = time.perf_counter()
        mem = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, head, targets, mask).compile().memory_analysis()
        temps[name] = mem.temp_size_in_bytes
        label = name + (f" (chunk {args.vocab_chunk})" if name.startswith("chunked") else "")
        out(f"{label:36}{mem.temp_size_in_bytes / MiB:10.1f}{mem.argument_size_in_bytes / MiB:10.1f}"
            f"{mem.output_size_in_bytes / MiB:10.1f}{time.perf_counter() - t0:10.1f}")
    out(f"full / chunked temp: {temps['full_cross_entropy'] / max(temps['chunked_cross_entropy'], 1):.1f}x")


# ---------------------------------------------------------------------------- 3. optimizers
def stdlib_files(n_train: int, n_heldout: int) -> tuple[list[str], list[str]]:
    """Every k-th `*.py` of 8-48 KB at the top of the standard library, sorted: `n_train` for
    training, the next `n_heldout` held out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pool = sorted(p for p in stdlib.glob("*.py") if 8_000 <= p.stat().st_size <= 48_000)
    want = n_train + n_heldout
    if len(pool) < want:
        raise ValueError(f"{stdlib}: only {len(pool)} *.py files of 8-48 KB, need {want}")
    picked = [str(p) for p in pool[:: len(pool) // want][:want]]
    return picked[:n_train], picked[n_train:]


def compare_optimizers(args, out: Report) -> None:
    from k31jax.train import DataConfig, OptimConfig, TrainConfig, Trainer, evaluate

    train_files, heldout_files = stdlib_files(args.opt_files, args.opt_heldout_files)
    data = DataConfig(paths=tuple(train_files), seq_len=args.opt_seq_len, batch_size=args.opt_batch,
                      holdout_fraction=0.0)
    heldout = DataConfig(paths=tuple(heldout_files), seq_len=args.opt_seq_len, batch_size=args.opt_batch,
                         holdout_fraction=0.0)
    stdlib = sysconfig.get_paths()["stdlib"]
    out(f"corpus: {stdlib}; train ({len(train_files)}): {' '.join(Path(f).name for f in train_files)}")
    out(f"held out ({len(heldout_files)}): {' '.join(Path(f).name for f in heldout_files)}")
    out(f"tiny preset (byte tokenizer), {args.opt_steps} steps of {args.opt_batch} x {args.opt_seq_len} packed "
        f"tokens, seed 0; warm-up 10, cosine to 0.1x, weight decay 0.1, clip 1.0; held-out loss over "
        f"{'all' if not args.opt_eval_batches else f'the first {args.opt_eval_batches}'} batches")
    out(f"{'optimizer':10}{'lr':>9}{'train loss (last 10)':>22}{'last step':>11}{'held-out loss':>15}"
        f"{'bits/byte':>11}{'run s':>8}")
    runs = [("adamw", lr) for lr in args.adamw_lrs] + [("muon", lr) for lr in args.muon_lrs]
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lr in runs:
            optim = OptimConfig(optimizer=optimizer, learning_rate=lr, warmup_steps=10, total_steps=args.opt_steps)
            cfg = TrainConfig(out=f"{tmp}/{optimizer}-{lr}", data=data, optim=optim, steps=args.opt_steps,
                              model="tiny", save_every=10**9)
            t0 = time.perf_counter()
            trainer = Trainer(cfg, progress=False)
            losses = [float(m["loss"]) for m in trainer.train_steps(args.opt_steps)]
            ev = evaluate(trainer.model(), trainer.tokenizer, heldout, split="all", max_batches=args.opt_eval_batches or None)
            trainer.manager.close()
            out(f"{optimizer:10}{lr:9.0e}{statistics.mean(losses[-10:]):22.4f}{losses[-1]:11.4f}{ev.loss:15.4f}"
                f"{ev.bits_per_byte:11.4f}{time.perf_counter() - t0:8.0f}")


# ---------------------------------------------------------------------------- main
def machine_line(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = next((int(line.split()[1]) / (1 << 20) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return f"{cpu}, {os.cpu_count()} cores ({threads} used), {ram:.0f} GiB RAM, {platform.system()} {platform.release()}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2, help="throughput: rows per step")
    ap.add_argument("--seq-len", type=int, default=128, help="throughput: tokens per row")
    ap.add_argument("--repeats", type=int, default=3, help="throughput: timed repeats per side (>= 3)")
    ap.add_argument("--steps-per-repeat", type=int, default=2, help="throughput: optimizer steps per repeat")
    ap.add_argument("--warmup-steps", type=int, default=1, help="throughput: untimed steps per side")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads per side (default: the CPUs this process may run on)")
    ap.add_argument("--lr", type=float, default=1e-3, help="throughput: AdamW learning rate (both sides)")
    ap.add_argument("--b1", type=float, default=0.9)
    ap.add_argument("--b2", type=float, default=0.95)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--vocab-chunk", type=int, default=4096, help="k31jax chunked_cross_entropy vocabulary chunk")
    ap.add_argument("--torch-experts", default="grouped_mm",
                    help="transformers experts implementation: eager | grouped_mm | batched_mm")
    ap.add_argument("--no-torch", action="store_true", help="time k31jax alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-loss-memory", action="store_true")
    ap.add_argument("--loss-vocab", type=int, default=163_840)
    ap.add_argument("--loss-tokens", type=int, default=2048)
    ap.add_argument("--loss-dim", type=int, default=1024)
    ap.add_argument("--compare-optimizers", action="store_true", help="also run the Muon vs AdamW comparison")
    ap.add_argument("--opt-steps", type=int, default=60)
    ap.add_argument("--opt-batch", type=int, default=8)
    ap.add_argument("--opt-seq-len", type=int, default=128)
    ap.add_argument("--opt-files", type=int, default=30, help="standard-library files to train on")
    ap.add_argument("--opt-heldout-files", type=int, default=6, help="standard-library files held out")
    ap.add_argument("--opt-eval-batches", type=int, default=24, help="held-out batches (0: all)")
    ap.add_argument("--adamw-lrs", type=float, nargs="*", default=[3e-3, 1e-2],
                    help="learning rates to run AdamW at (none: skip it)")
    ap.add_argument("--muon-lrs", type=float, nargs="*", default=[3e-3, 1e-2],
                    help="learning rates to run Muon at (none: skip it)")
    add_record_arguments(ap)
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error(f"--repeats {args.repeats}: the project standard is at least 3")
    threads = args.threads
    # before jax is imported: XLA reads its flags once
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true").strip()
    os.environ["OMP_NUM_THREADS"] = str(threads)

    session = Session()
    out = Report()
    out(f"# {machine_line(threads)}")
    versions = {}
    if not args.skip_throughput:
        out("\n## throughput: k31jax train_step vs transformers kimi_linear + torch AdamW")
        versions = throughput(args, threads, out)
    if not args.skip_loss_memory:
        out("\n## loss memory: chunked vs full-vocabulary cross entropy (k31jax)")
        loss_memory(args, out)
    if args.compare_optimizers:
        out("\n## Muon vs AdamW (k31jax Trainer)")
        compare_optimizers(args, out)
    session.finish()
    if versions.get("torch"):
        out(f"\n# torch {versions['torch']}")
    print("# train benchmark  " + session.header())
    if args.record:
        record("train", out.lines, session, force=args.force)


if __name__ == "__main__":
    main()
