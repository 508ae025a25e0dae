"""N local jax.distributed processes running one bertjax command: `bertjax launch local`, from a checkout.

    python launch/local.py --processes 2 -- pretrain --config bert-tiny --workdir runs/mp ...
"""
import sys

from bertjax.cloud.local import main

if __name__ == "__main__":
    sys.exit(main())
