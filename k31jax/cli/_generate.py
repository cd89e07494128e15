"""`k31jax generate` and `k31jax chat`: K3 chat-format generation from a checkpoint or the
embedded default model (trained on Python sources without chat data, so `generate` completes
raw text with it unless `--chat` is given), or a preset with seeded random weights (`--config`).

Output: reasoning dimmed (labelled ``[thinking]`` when stdout is not a terminal), then the
answer; tool calls as JSON lines; a timing line (prefill tok/s, decode tok/s) on stderr.

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


from ..chat import (ContentDelta, ReasoningDelta, Segment, ToolCallArgsDelta, ToolCallEnd, ToolCallStart,
                    apply_chat_template)
from ..config import preset_names
from ..generate import DEFAULT_MODEL, ChatSession, Engine, Request, SamplingParams, heal_prompt, load_model
from ..vision import ImageError, decode_image
from ._common import (UsageError, add_distributed_arguments, check_int, check_mesh_args, cli_context,
                      enable_compile_cache, install)

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
    loaded = load_model(args.ckpt, config=args.config, seed=args.seed, dtype=args.dtype,
                        tokenizer=args.tokenizer, vision=vision)
    if loaded.banner:
        print(f"[k31jax] {loaded.banner}", file=sys.stderr)
    if loaded.vision_banner:
        print(f"[k31jax] {loaded.vision_banner}", file=sys.stderr)
    model = args.sharding.place(loaded.model) if getattr(args, "sharding", None) else loaded.model
    engine = Engine(model, loaded.tokenizer, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                    vision=loaded.vision)
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


# ---- generate -------------------------------------------------------------------------
def _cmd_generate(args) -> int:
    engine, raw_model, _ = _engine(args, vision=bool(args.image))
    tok = engine.tokenizer
    thinking = not args.no_think
    args.raw = args.raw or (raw_model and not args.chat)
    if args.raw and raw_model and not args.chat:
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
        result = engine.generate([request])
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
CHAT_HELP = """commands: /exit, /reset, /history (messages as JSON), /effort low|high|max|none,
/image PATH (attach an image to your next message), /help
After a turn with tool calls, type each result (JSON or text) at its prompt; an empty line
skips the rest and returns to the user prompt."""


def load_tools(path: str | None):
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of tools (OpenAI form) or {{\"tools\": [...]}}")
    return [t if "function" in t else {"type": "function", "function": t} for t in data]


def run_chat(session, inp, out, *, color: bool = False, prompts: bool = False, err=None,
             load_vision=None) -> int:
    """The REPL over `session` (a `ChatSession`), reading lines from `inp`. `load_vision()`
    returns a vision model for the engine when the first `/image` needs one (None: images are
    refused unless the engine has one)."""
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

    def ask(label: str) -> str | None:
        if prompts:
            out.write(label)
            out.flush()
        line = inp.readline()
        return None if line == "" else line.rstrip("\n")

    def turn(content) -> bool:
        n = len(session.messages)
        try:
            for ev in session.stream(content):
                printer.event(ev)
        except ValueError as e:  # e.g. the history outgrew the cache: say so, keep going
            printer.end()
            del session.messages[n:]
            print(f"[k31jax] error: {e}", file=err)
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
                session.effort = None if arg.strip() in ("", "none") else arg.strip()
                out.write(f"(effort: {session.effort})\n")
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
                          effort=_effort(args), thinking=not args.no_think, params=_params(args),
                          max_new_tokens=args.max_new_tokens,
                          thinking_budget=args.thinking_budget, stop=tuple(args.stop))
    interactive = sys.stdin.isatty()
    if interactive:
        print(CHAT_HELP, file=sys.stderr)

    def load_vision():
        vision = loaded.load_vision()
        if loaded.vision_banner:
            print(f"[k31jax] {loaded.vision_banner}", file=sys.stderr)
        return vision

    return run_chat(session, sys.stdin, sys.stdout, color=_color(args, sys.stdout),
                    prompts=interactive, load_vision=load_vision)


# ---- argparse -------------------------------------------------------------------------
def _common(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint folder: Orbax (from `k31jax convert`) or safetensors")
    src.add_argument("--config", default=None,
                     help=f"preset with seeded random weights instead of the embedded default model "
                          f"({DEFAULT_MODEL}, trained); e.g. tiny")
    p.add_argument("--effort", choices=["low", "high", "max", "none"], default="max",
                   help="thinking effort message (default: max; none: no effort message)")
    p.add_argument("--no-think", action="store_true", help="thinking off (no think channel)")
    p.add_argument("--thinking-budget", type=int, default=None,
                   help="hard cap on thinking tokens; then the close-thinking marker is forced")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and the random weights' seed)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--max-len", type=int, default=4096, help="cache length (prompt + output)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="longest prefill call")
    p.add_argument("--tokenizer", default=None,
                   help="folder with tiktoken.model (default: the --ckpt folder)")
    p.add_argument("--dtype", default=None, help="parameter/activation dtype (Orbax default: bfloat16)")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
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
    gen = sub.add_parser("generate", help="generate one answer (K3 chat format)")
    _common(gen)
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
    gen.set_defaults(max_new_tokens_default=32)
    install(gen, "generate", _sharded(_cmd_generate_entry), validate=_check_args)


def register_chat(sub) -> None:
    """`k31jax chat`."""
    chat = sub.add_parser("chat", help="interactive chat (history, tools, tool results)")
    _common(chat)
    chat.add_argument("--tools", help="JSON file: a list of tools in OpenAI form")
    chat.add_argument("--system", help="system prompt")
    chat.set_defaults(max_new_tokens_default=256)
    install(chat, "chat", _sharded(_cmd_chat_entry), validate=_check_args)


def _check_args(args) -> None:
    """Every argument of generate / chat checked before anything is loaded or compiled
    (`UsageError`: exit 2); a --tools file is read here too."""
    try:
        _params(args)
    except ValueError as e:
        raise UsageError(str(e).replace("invalid SamplingParams: ", "sampling: ")) from None
    check_int("--thinking-budget", args.thinking_budget, low=0, optional=True)
    check_int("--max-new-tokens", args.max_new_tokens, low=1, optional=True)
    check_int("--max-len", args.max_len, low=1)
    check_int("--prefill-chunk", args.prefill_chunk, low=1)
    if args.dtype is not None and args.dtype not in ("bfloat16", "float32", "float16"):
        raise UsageError(f"--dtype {args.dtype!r}: expected bfloat16, float32 or float16")
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


def _defaults(args):
    if args.max_new_tokens is None:
        args.max_new_tokens = args.max_new_tokens_default
    return args


def _cmd_generate_entry(args) -> int:
    return _cmd_generate(_defaults(args))


def _effort(args):
    return None if args.effort == "none" else args.effort


def _cmd_chat_entry(args) -> int:
    return _cmd_chat(_defaults(args))
