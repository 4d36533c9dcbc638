"""The `hf-zero` command: `hf-zero consolidate CKPT OUT [--dtype bf16] [--max-shard-size 5GB]`."""

from __future__ import annotations

import argparse
import sys


def _consolidate(args: argparse.Namespace) -> int:
    from .checkpoint.consolidate import consolidate

    files = consolidate(
        args.checkpoint, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
        verify=not args.no_verify, progress=not args.quiet,
    )
    print(f"wrote {len(files)} weight file(s) to {args.output}: {', '.join(files)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero command-line tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "consolidate",
        help="write a sharded hf_zero checkpoint as a from_pretrained directory (offline, bounded memory)",
    )
    c.add_argument("checkpoint", help="checkpoint directory written by hf_zero.save_checkpoint")
    c.add_argument("output", help="output directory for the Hugging Face model")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the written weights (default: the saved master dtype, fp32)")
    c.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB, 500MB (default 5GB)")
    c.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the checkpoint files")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_consolidate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"hf-zero {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
