"""Apache Beam job: text corpus -> masked pretraining TFRecords, the same records format and metadata as
`bertjax data create` (the transforms are bertjax/data/beam_create.py, installed with bertjax so that remote
workers import them). Equivalent to `bertjax data create --runner beam ...`:

    python pipelines/beam_create.py --input 'gs://bucket/wiki/*.txt' --vocab gs://bucket/vocab.txt \
        --out gs://bucket/records --max-seq-length 128 --max-predictions 20 --dupe-factor 10 --shards 256 \
        --beam-runner DataflowRunner --beam-option project=P --beam-option region=us-central1 \
        --beam-option temp_location=gs://bucket/tmp --beam-option requirements_file=requirements-beam.txt
"""
from __future__ import annotations

import argparse
import sys

from bertjax.data import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "create", "--runner", "beam", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"beam_create: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
