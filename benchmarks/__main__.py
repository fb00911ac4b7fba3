"""`python -m benchmarks NAME ...` from the repository root: one sub-command per research
harness, each module adding its own arguments."""

from __future__ import annotations

import argparse
import sys

from benchmarks import decode, grounding, kv, media, speech
from streamgrok.cli.entry import process_defaults
from streamgrok.cli.options import DEFAULTS
from streamgrok.errors import StreamgrokError

HARNESSES = (decode, kv, media, speech, grounding)


def build_parser() -> argparse.ArgumentParser:
    """Argument parser with one sub-command per harness."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=DEFAULTS)
    benches = parser.add_subparsers(dest="bench", required=True)
    for harness in HARNESSES:
        harness.register(benches)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the harness they name; errors are one line, exit 2."""
    process_defaults()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (StreamgrokError, ValueError) as exc:
        print(f"benchmarks: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
