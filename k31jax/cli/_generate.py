"""`k31jax generate` and `k31jax chat`: K3 chat-format generation from a checkpoint or the
embedded default model (trained on Python sources without chat data, so `generate` completes
raw text with it unless `--chat` is given), or a preset with seeded random weights (`--config`).

Output: reasoning dimmed (labelled ``[thinking]`` when stdout is not a terminal), then the
answer; tool calls as JSON lines; a timing line (prefill tok/s, decode tok/s) on stderr. Without
`--stream`, a terminal's stderr shows what `generate` is doing meanwhile (prefill and compiling,
then tokens so far), erased before the answer.

Thinking: on with effort `max` unless `--effort low|high|max` says otherwise; `--effort none` (or
`--no-think`) turns it off. Raw completion has no chat format, so no thinking: `--effort` and
`--thinking-budget` are refused there (exit 2).

`chat` reads lines with readline on a terminal (editing, Up / Down through earlier lines).
Ctrl-C during an answer stops that answer (what was shown stays in the history); Ctrl-C or
Ctrl-D at the prompt ends the chat.

Images: `generate --image PATH` (repeatable) and the chat command `/image PATH` put images
before the prompt text (JPEG, PNG, WebP). A checkpoint's own vision tower reads them; the
embedded default model and presets have none trained, so they get a small tower with SEEDED
RANDOM weights (a stderr line says so): the plumbing runs, the model cannot see the image.
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from pathlib import Path


from ..chat import (THINKING_EFFORTS, ContentDelta, ReasoningDelta, Segment, ToolCallArgsDelta, ToolCallEnd,
                    ToolCallStart, apply_chat_template, collect_events)
from ..config import preset_names
from ..generate import DEFAULT_MODEL, ChatSession, Engine, Request, SamplingParams, heal_prompt, plan_prefill
from ..train import load_generation_model
from ..vision import ImageError, decode_image
from ._common import (StatusLine, UsageError, add_distributed_arguments, add_speculation_arguments, check_int,
                      check_mesh_args, cli_context, enable_compile_cache, install, speculation_from)

DIM, RESET, BOLD = "\x1b[2m", "\x1b[0m", "\x1b[1m"


def _printable(text: str) -> str:
    """Control characters (random weights emit any byte) shown escaped, not executed."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}"
                   for c in text)


class EventPrinter:
    """Writes parser events: reasoning dimmed, content plain, tool calls as JSON lines."""

    def __init__(self, out, color: bool):
        self.out, self.color = out, color
        self.section = None
        self._calls: dict[int, list] = {}

    def _enter(self, section: str) -> None:
        if section == self.section:
            return
        if self.section == "reasoning" and self.color:
            self.out.write(RESET)
        if self.section is not None:
            self.out.write("\n")
        if section == "reasoning":
            self.out.write(DIM if self.color else "[thinking] ")
        elif section == "content" and not self.color:
            self.out.write("[answer] ")
        self.section = section

    def event(self, ev) -> None:
        if isinstance(ev, ReasoningDelta):
            self._enter("reasoning")
            self.out.write(_printable(ev.text))
        elif isinstance(ev, ContentDelta):
            self._enter("content")
            self.out.write(_printable(ev.text))
        elif isinstance(ev, ToolCallStart):
            self._calls[ev.index] = [ev.id, ev.name, ""]
        elif isinstance(ev, ToolCallArgsDelta):
            self._calls[ev.index][2] += ev.arguments
        elif isinstance(ev, ToolCallEnd):
            cid, name, args = self._calls.pop(ev.index)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
            self._enter("tools")
            line = json.dumps({"tool_call": {"id": cid, "name": name, "arguments": args}},
                              ensure_ascii=False)
            self.out.write((BOLD + line + RESET if self.color else line) + "\n")
            self.section = "tools_done"
        self.out.flush()

    def end(self) -> None:
        if self.section == "reasoning" and self.color:
            self.out.write(RESET)
        if self.section not in (None, "tools_done"):
            self.out.write("\n")
        self.section = None
        self.out.flush()


# ---- shared setup ---------------------------------------------------------------------
def _engine(args, vision: bool | None = False):
    """(Engine, the loaded model's `raw_completion`, the `LoadedModel`). `vision` as in
    `load_model`: True loads (or builds a seeded random) vision tower now."""
    enable_compile_cache()
    loaded = load_generation_model(args.ckpt, config=args.config, seed=args.seed, dtype=args.dtype,
                                   tokenizer=args.tokenizer, vision=vision,
                                   expert_activations="mxfp8" if args.mxfp8_activations else None, lora=args.lora)
    if loaded.banner:
        print(f"[k31jax] {loaded.banner}", file=sys.stderr)
    if loaded.vision_banner:
        print(f"[k31jax] {loaded.vision_banner}", file=sys.stderr)
    model = args.sharding.place(loaded.model) if getattr(args, "sharding", None) else loaded.model
    engine = Engine(model, loaded.tokenizer, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    vision=loaded.vision, speculation=speculation_from(args))
    loaded.model = None  # the engine holds the weights (on CPU split into per-layer rows): free the stacks
    return engine, loaded.raw_completion, loaded


def image_part(path: str) -> dict:
    """An OpenAI image part for a local file."""
    return {"type": "image_url", "image_url": {"url": str(path)}}


def _params(args):
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def _color(args, stream) -> bool:
    if args.color == "auto":
        return stream.isatty() and os.environ.get("NO_COLOR") is None
    return args.color == "always"


def _timing(result) -> None:
    print(f"[k31jax] {result.timing_line()}", file=sys.stderr)


def _check_room(engine: Engine, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt (padded to its prefill bucket) and `max_new_tokens` fit the cache: a
    `UsageError` naming the CLI's flags (the engine's own error names its Python argument)."""
    padded, _ = plan_prefill(prompt_tokens, engine.prefill_chunk, engine.min_bucket)
    if padded + max_new_tokens > engine.max_len:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: with the prompt ({prompt_tokens} tokens, prefilled "
                         f"as {padded}) that needs {padded + max_new_tokens} cache positions, more than --max-len "
                         f"{engine.max_len}; raise --max-len or lower --max-new-tokens")


def _thinking(args) -> bool:
    return not (args.no_think or args.effort == "none")


def _effort(args) -> str | None:
    """The effort message's level when thinking is on (`max` unless --effort says otherwise)."""
    return None if not _thinking(args) else args.effort or "max"


def _refuse_raw_thinking_flags(args, why: str) -> None:
    """Raw completion renders no chat format, so there is no thinking to set or cap."""
    for flag, value in (("--effort", args.effort), ("--thinking-budget", args.thinking_budget)):
        if value is not None and value != "none":
            raise UsageError(f"{flag} {value}: {why}, which has no thinking (--chat uses the chat format)")


# ---- generate -------------------------------------------------------------------------
def _cmd_generate(args) -> int:
    engine, raw_model, _ = _engine(args, vision=bool(args.image))
    tok = engine.tokenizer
    thinking = _thinking(args)
    if raw_model and not args.chat and not args.raw:
        _refuse_raw_thinking_flags(args, "this model completes raw text by default (it saw no chat data)")
        args.raw = True
        print("[k31jax] raw completion (this model saw no chat data; --chat wraps the prompt in the chat format)",
              file=sys.stderr)
    media = engine.image_prompts() if args.image else None
    healed = b""
    if args.raw:  # [BOS] + one media block per image + the prompt text
        blocks = [Segment(media(image_part(path)), True) for path in args.image]
        prompt = tok.encode_segments(blocks + [Segment(args.prompt, False)])
        if tok.bos_id is not None:
            prompt = [tok.bos_id] + prompt
        if not args.no_heal:
            prompt, healed = heal_prompt(tok, prompt)
    else:
        content = [image_part(p) for p in args.image] + [{"type": "text", "text": args.prompt}] if args.image \
            else args.prompt
        prompt = apply_chat_template(tok, [{"role": "user", "content": content}],
                                     thinking=thinking, thinking_effort=_effort(args), media_prompt=media)
    _check_room(engine, len(prompt), args.max_new_tokens)
    if media is not None:
        sizes = ", ".join(f"{im.width}x{im.height} -> {im.num_tokens} tokens" for im in media.images)
        print(f"[k31jax] images: {sizes}", file=sys.stderr)
    out = sys.stdout
    printer = EventPrinter(out, _color(args, out))
    request = Request(prompt, _params(args), args.max_new_tokens, None, tuple(args.stop),
                      args.thinking_budget if thinking and not args.raw else None, parse=not args.raw,
                      images=media.images if media is not None else (), healed_prefix=healed)
    if args.stream:
        for delta in engine.stream([request]):
            if args.raw:
                out.write(_printable(delta.text))
                out.flush()
            for ev in delta.events:
                printer.event(ev)
        result = engine.last_result
    else:
        with StatusLine("prefill (and compiling, on first use)") as status:
            for n, _ in enumerate(engine.stream([request]), 1):
                status.set(f"generating: {n} of at most {args.max_new_tokens} tokens")
        result = engine.last_result
        comp = result.completions[0]
        if args.raw:
            out.write(_printable(comp.text))
        else:
            _print_parsed(printer, comp.parsed)
    if args.raw:
        out.write("\n")
    printer.end()
    comp = result.completions[0]
    extra = f", thinking {comp.thinking_tokens} tok" if comp.thinking_tokens is not None else ""
    print(f"[k31jax] finish: {comp.finish_reason}, {len(comp.tokens)} new tokens{extra}",
          file=sys.stderr)
    _timing(result)
    return 0


def _print_parsed(printer: EventPrinter, parsed) -> None:
    if parsed.reasoning_content:
        printer.event(ReasoningDelta(parsed.reasoning_content))
    if parsed.content:
        printer.event(ContentDelta(parsed.content))
    for i, c in enumerate(parsed.tool_calls):
        for ev in (ToolCallStart(i, c.id, c.name), ToolCallArgsDelta(i, c.arguments), ToolCallEnd(i)):
            printer.event(ev)


# ---- chat -----------------------------------------------------------------------------
CHAT_HELP = """commands: /exit, /reset, /history (messages as JSON), /effort low|high|max|none
(none: thinking off), /image PATH (attach an image to your next message), /help
After a turn with tool calls, type each result (JSON or text) at its prompt; an empty line
skips the rest and returns to the user prompt. Ctrl-C stops an answer (what was shown stays in
the history); Ctrl-C or Ctrl-D at the prompt ends the chat."""
EFFORT_USAGE = f"/effort {'|'.join((*THINKING_EFFORTS, 'none'))}"


def load_tools(path: str | None):
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of tools (OpenAI form) or {{\"tools\": [...]}}")
    return [t if "function" in t else {"type": "function", "function": t} for t in data]


def _stopped_message(events) -> dict:
    """The assistant message of a turn stopped by Ctrl-C: the reasoning and content shown so far.
    Its tool calls are dropped: one cut short has no complete arguments, and none can be answered."""
    parsed = collect_events(events)
    message = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content:
        message["reasoning_content"] = parsed.reasoning_content
    return message


def run_chat(session, inp, out, *, color: bool = False, prompts: bool = False, err=None,
             load_vision=None) -> int:
    """The REPL over `session` (a `ChatSession`), reading lines from `inp`, or with `inp=None`
    from the terminal through `input()` (readline's editing and history once `readline` is
    imported). `load_vision()` returns a vision model for the engine when the first `/image`
    needs one (None: images are refused unless the engine has one)."""
    err = err or sys.stderr
    printer = EventPrinter(out, color)
    images: list[str] = []  # attached to the next user message

    def attach(path: str) -> None:
        if not path:
            out.write("(usage: /image PATH)\n")
            return
        try:
            decode_image(path)
            if session.engine.vision is None:
                if load_vision is None:
                    raise ValueError("this model has no vision tower")
                session.engine.set_vision(load_vision())
        except (ValueError, OSError) as e:
            print(f"[k31jax] error: /image {path}: {e}", file=err)
            return
        images.append(path)
        out.write(f"(image attached to your next message: {path})\n")

    def set_effort(level: str) -> None:
        if level == "none":
            session.thinking = False
        elif level in THINKING_EFFORTS:
            session.thinking, session.effort = True, level
        elif level:
            print(f"[k31jax] error: {EFFORT_USAGE}, not {level!r}", file=err)
            return
        out.write(f"(effort: {session.effort})\n" if session.thinking else "(effort: none, thinking off)\n")

    def ask(label: str) -> str | None:
        """The next line; None at the end of the input, or on Ctrl-C at a terminal's prompt."""
        if inp is None:
            try:
                return input(label)
            except (EOFError, KeyboardInterrupt):
                out.write("\n")
                return None
        if prompts:
            out.write(label)
            out.flush()
        line = inp.readline()
        return None if line == "" else line.rstrip("\n")

    def turn(content) -> bool:
        """One assistant turn; False when it did not end normally (an error, or Ctrl-C)."""
        n = len(session.messages)
        if content is not None:
            session.add_user(content)
        shown = []
        try:
            _check_room(session.engine, len(session.prompt_ids()), session.max_new_tokens)
            for ev in session.stream():
                shown.append(ev)
                printer.event(ev)
        except (ValueError, UsageError) as e:  # e.g. the history outgrew the cache: say so, keep going
            printer.end()
            del session.messages[n:]
            print(f"[k31jax] error: {e}", file=err)
            return False
        except KeyboardInterrupt:
            printer.end()
            if shown:
                session.messages.append(_stopped_message(shown))
                print("[k31jax] stopped (Ctrl-C): the answer so far is kept in the history (/reset clears it)",
                      file=err)
            else:  # stopped while prefilling (or compiling): no answer, so the message is not kept either
                del session.messages[n:]
                print("[k31jax] stopped (Ctrl-C) before the answer began: that message is not in the history",
                      file=err)
            return False
        printer.end()
        t = session.last
        print(f"[k31jax] finish: {t.completion.finish_reason}; {t.result.timing_line()}", file=err)
        return True

    while True:
        line = ask("you> ")
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.messages = [m for m in session.messages[:1] if m["role"] == "system"]
                out.write("(history cleared)\n")
            elif cmd == "/history":
                out.write(json.dumps(session.messages, ensure_ascii=False, indent=1) + "\n")
            elif cmd == "/effort":
                set_effort(arg.strip())
            elif cmd == "/image":
                attach(arg.strip())
            else:
                out.write(CHAT_HELP + "\n")
            continue
        if images:
            text = [image_part(p) for p in images] + [{"type": "text", "text": text}]
            images = []
        if not turn(text):
            continue
        while session.pending_tool_calls():
            stop = False
            for call in session.pending_tool_calls():
                res = ask(f"tool {call['function']['name']} ({call['id']}) result> ")
                if res is None or not res.strip():
                    stop = True
                    break
                session.add_tool_result(call["id"], res.strip())
            if stop or session.pending_tool_calls() or not turn(None):
                break
    return 0


def _cmd_chat(args) -> int:
    engine, raw_model, loaded = _engine(args, vision=None)
    if raw_model:
        print("[k31jax] note: this model saw no chat data; its answers continue text rather than follow "
              "instructions", file=sys.stderr)
    session = ChatSession(engine, system=args.system, tools=args.tool_list,
                          effort=_effort(args) or "max", thinking=_thinking(args), params=_params(args),
                          max_new_tokens=args.max_new_tokens,
                          thinking_budget=args.thinking_budget, stop=tuple(args.stop))
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401 - importing it gives input() line editing and history

        print(CHAT_HELP, file=sys.stderr)

    def load_vision():
        vision = loaded.load_vision()
        if loaded.vision_banner:
            print(f"[k31jax] {loaded.vision_banner}", file=sys.stderr)
        return vision

    return run_chat(session, None if interactive else sys.stdin, sys.stdout, color=_color(args, sys.stdout),
                    prompts=interactive, load_vision=load_vision)


# ---- argparse -------------------------------------------------------------------------
def _common(p, *, max_new_tokens: int) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint folder: Orbax (from `k31jax convert`), safetensors, or a "
                                    "training run's --out (its final export, else its newest checkpoint)")
    src.add_argument("--config", default=None,
                     help=f"a preset with seeded RANDOM weights instead of the trained embedded default model "
                          f"({DEFAULT_MODEL}): {', '.join(preset_names())}")
    p.add_argument("--effort", choices=[*THINKING_EFFORTS, "none"], default=None,
                   help="thinking effort of the chat format (default: max); none: thinking off, as --no-think")
    p.add_argument("--no-think", action="store_true", help="thinking off (no think channel)")
    p.add_argument("--thinking-budget", type=int, default=None,
                   help="hard cap on thinking tokens; then the close-thinking marker is forced")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="longest answer, in tokens (thinking included)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalty on tokens already in the context (1: none)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and the random weights' seed)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-len", type=int, default=4096, help="cache length (prompt + output)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="longest prefill call")
    p.add_argument("--tokenizer", default=None,
                   help="folder with tiktoken.model (default: the --ckpt folder)")
    p.add_argument("--dtype", default=None, help="parameter/activation dtype (Orbax default: bfloat16)")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a LoRA adapter folder (a LoRA run's final/adapter) applied to the model: merged into its "
                        "float weights, beside its packed routed experts")
    p.add_argument("--mxfp8-activations", action="store_true", help="round the routed experts' GEMM inputs to MXFP8 (E4M3, one scale per 32; K3.1's deployment: MXFP4 "
                        "weights, MXFP8 activations), as QAT's fake-quant does")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="auto: when stdout is a terminal and NO_COLOR is not set")
    add_speculation_arguments(p)
    _sharding_flags(p)


def _sharding_flags(p) -> None:
    """--coordinator / --num-processes / --process-id / --mesh ... (k31jax.sharding)."""
    add_distributed_arguments(p)


def _sharded(run):
    """Run a command under `jax.distributed` settings and the --mesh, if given."""
    def entry(args) -> int:
        with cli_context(args) as ctx:
            args.sharding = ctx
            return run(args)
    return entry


def register(sub) -> None:
    """`k31jax generate`."""
    gen = sub.add_parser("generate", help="generate one answer (raw completion for the embedded model, "
                                          "else the K3 chat format)")
    _common(gen, max_new_tokens=32)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image (JPEG, PNG, WebP) before the prompt (repeatable); the embedded model and "
                          "presets read it with a seeded RANDOM vision tower")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--raw", action="store_true",
                      help="no chat template: BOS + prompt text (the default for the embedded model)")
    mode.add_argument("--chat", action="store_true", help="wrap the prompt in the K3 chat format even for a "
                                                          "model trained without chat data")
    gen.add_argument("--no-heal", action="store_true",
                     help="raw mode: keep the prompt's last token (by default it is backed off and the first "
                          "generated token must start with its text: token healing, so a prompt ending inside "
                          "a usual token such as `):` + newline continues as in training)")
    install(gen, "generate", _sharded(_cmd_generate), validate=_check_args)


def register_chat(sub) -> None:
    """`k31jax chat`."""
    chat = sub.add_parser("chat", help="interactive chat (history, tools, tool results)")
    _common(chat, max_new_tokens=256)
    chat.add_argument("--tools", help="JSON file: a list of tools in OpenAI form")
    chat.add_argument("--system", help="system prompt")
    install(chat, "chat", _sharded(_cmd_chat), validate=_check_args)


def _check_thinking_args(args) -> None:
    """--effort, --no-think and --thinking-budget agree (with --raw: none of them applies)."""
    if getattr(args, "raw", False):
        _refuse_raw_thinking_flags(args, "--raw renders no chat format")
    if args.no_think and args.effort not in (None, "none"):
        raise UsageError(f"--effort {args.effort}: thinking is off (--no-think)")
    if not _thinking(args) and args.thinking_budget is not None:
        off = "--no-think" if args.no_think else "--effort none"
        raise UsageError(f"--thinking-budget {args.thinking_budget}: thinking is off ({off}), so there is "
                         "nothing to cap")


def _check_args(args) -> None:
    """Every argument of generate / chat checked before anything is loaded or compiled
    (`UsageError`: exit 2); a --tools file is read here too."""
    try:
        _params(args)
    except ValueError as e:
        raise UsageError(str(e).replace("invalid SamplingParams: ", "sampling: ")) from None
    check_int("--thinking-budget", args.thinking_budget, low=0, optional=True)
    check_int("--max-new-tokens", args.max_new_tokens, low=1)
    check_int("--max-len", args.max_len, low=1)
    check_int("--prefill-chunk", args.prefill_chunk, low=1)
    if args.max_new_tokens >= args.max_len:  # the prompt takes at least one position
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: does not fit --max-len {args.max_len} "
                         "(the cache holds the prompt and the answer); raise --max-len or lower --max-new-tokens")
    _check_thinking_args(args)
    if args.dtype is not None and args.dtype not in ("bfloat16", "float32", "float16"):
        raise UsageError(f"--dtype {args.dtype!r}: expected bfloat16, float32 or float16")
    if args.ckpt is not None and Path(args.ckpt).is_file():
        raise UsageError(f"--ckpt {args.ckpt}: a file, not a folder (a checkpoint is a folder: Orbax from "
                         "`k31jax convert`, or release safetensors with config.json)")
    if args.ckpt is not None and not Path(args.ckpt).is_dir():
        raise UsageError(f"--ckpt {args.ckpt}: no such checkpoint folder")
    if args.config is not None and args.config not in preset_names():
        raise UsageError(f"--config {args.config!r}: not a preset (presets: {', '.join(preset_names())})")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such folder")
    if any(not s for s in args.stop):
        raise UsageError("--stop: an empty stop string would end every answer at once")
    check_mesh_args(args)
    for path in getattr(args, "image", None) or ():
        try:
            decode_image(path)
        except ImageError as e:
            raise UsageError(f"--image {e}") from None
    tools = getattr(args, "tools", None)
    try:
        args.tool_list = load_tools(tools)
    except OSError as e:
        raise UsageError(f"--tools {tools}: {e.strerror or e}") from None
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not a list of tool objects
        raise UsageError(f"--tools {tools}: {' '.join(str(e).split())}") from None
