"""`streamgrok chat`: stream an answer from the model, or a prompt of questions."""

from __future__ import annotations

import argparse
import sys

from streamgrok.cli.options import CHAT_KV_DTYPES, DEFAULTS, add_model_options, load_from_args


def add_chat_command(commands) -> None:
    """The `chat` command's arguments."""
    chat = commands.add_parser("chat", formatter_class=DEFAULTS,
                               help="stream an answer (interactive without a question)")
    chat.add_argument("question", nargs="?", help="the question; omit for an interactive prompt")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    chat.add_argument("--seed", type=int, default=None, help="sampling seed")
    chat.add_argument("--max-tokens", type=int, default=256, help="longest answer")
    chat.add_argument("--repetition-penalty", type=float, default=1.0,
                      help="> 1 discourages repeated tokens")
    chat.add_argument("--kv-dtype", default="auto", choices=CHAT_KV_DTYPES,
                      help="K/V cache dtype: auto is bfloat16 for the quantized formats where "
                           "the CPU has native bfloat16, else the model's compute dtype; int8 "
                           "keeps a scale per token and head (half bfloat16's bytes)")
    add_model_options(chat)


def cmd_chat(args: argparse.Namespace) -> int:
    from streamgrok.model.compiled_decode import CompiledDecode
    from streamgrok.model.generate import Generator, kv_cache_dtype
    from streamgrok.model.quantized import Int4Linear, wait_native_int4
    from streamgrok.model.sampling import SamplingParams

    loaded = load_from_args(args)
    # an int4 model answers once its native kernels are ready: the first run on a CPU builds
    # them (added while the PyTorch path's bfloat16 head answered wrongly on AVX2; the head
    # is exact at the top now, `Int8Linear._exact_top`, so this wait only saves speed)
    if not wait_native_int4(loaded.model, timeout=1.0) and any(
            isinstance(m, Int4Linear) and m.unpacks for m in loaded.model.modules()):
        print("preparing the native int4 kernels for this CPU (the first run builds them: a "
              "few minutes on two cores)...", file=sys.stderr, flush=True)
        wait_native_int4(loaded.model)
    if args.question:  # one answer: a decode compilation (seconds) would not pay for itself
        loaded.model.compiled_decode = CompiledDecode(enabled=False)
    generator = Generator(loaded, kv_dtype=None if args.kv_dtype == "auto" else
                          kv_cache_dtype(args.kv_dtype))
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
    )
    questions = [args.question] if args.question else _interactive_questions()
    for question in questions:
        for delta in generator.stream(generator.chat_prompt(question, args.system), params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _interactive_questions():
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return
        if line in ("exit", "quit"):
            return
        if line:
            yield line

