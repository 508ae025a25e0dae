"""Offline job: text corpus -> masked pretraining TFRecords in google-research/bert's format.

A thin wrapper around `bertjax data create` (same flags), for running the job where only this file is
invoked (a batch scheduler, one worker per machine with --worker-index/--num-workers):

    python pipelines/create_pretraining_data.py --input 'gs://bucket/wiki/*.txt' --vocab vocab.txt \
        --out gs://bucket/records --max-seq-length 128 --max-predictions 20 --dupe-factor 10 --shards 256
"""
from __future__ import annotations

import argparse
import sys

from bertjax.data import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "create", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"create_pretraining_data: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
